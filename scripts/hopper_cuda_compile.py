"""Compile the CUDA C++ Hopper kernel (``verify/hopper_cuda.cu``) for sm_90a without a GPU, one build a
flag set, and print for each kernel instance ptxas's registers and spills and the loops that issue a
step's wgmmas (the two math warpgroups' steps): instructions, fixed-stall cycles and the opcodes that
tell builds apart (``sass_loops.wgmma_loops``).

    PYTHONPATH=src python scripts/hopper_cuda_compile.py [--source FILE.cu] [--sass DIR] [-- FLAGS ...]

``FLAGS``: one build's nvcc flags each (``-D`` variants of the ``KD_*`` macros), after ``--``, e.g.
``-- "" -DKD_FENCE_TMA=0 "-DKD_CONSUMER_TMA=1 -DKD_FENCE_TMA=0"`` (``""``: the default build); default:
the default build alone.
``--source``: another file built the same way, e.g. the step spike ``scripts/hopper_cuda_step.cu``.
``--sass DIR``: each build's SASS written there (``build<i>.sass``, in the order printed). The
perf log's static tables (fixed-stall cycles, ``UTMALDG`` and ``MEMBAR`` a step) come from here; a
build whose step loops match a measured build's instruction for instruction needs no new timing of
its steps. Needs nvcc (as the kernel's build at first use finds it) and a Triton with the NVIDIA
backend (its bundled cuobjdump); no GPU. Exit status 1 if a build fails.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sass_loops import disassemble, wgmma_loops

from kdtree_engine.verify import hopper_cuda

PTXAS_FUNCTION = re.compile(r"Compiling entry function '(\w+)'")
PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_figures(stderr: str) -> dict[str, str]:
    """``{mangled kernel name: "N registers, S B spill stores, L B spill loads"}`` from ``ptxas -v``."""
    found: dict[str, dict[str, str]] = {}
    name = None
    for line in stderr.splitlines():
        if m := PTXAS_FUNCTION.search(line):
            name = m.group(1)
            found[name] = {}
        elif name is not None and (m := PTXAS_REGISTERS.search(line)):
            found[name]["registers"] = m.group(1)
        elif name is not None and (m := PTXAS_SPILLS.search(line)):
            found[name]["spills"] = f"{m.group(1)} B spill stores, {m.group(2)} B spill loads"
    return {name: f"{f.get('registers', '?')} registers, {f.get('spills', 'spills ?')}" for name, f in found.items()}


def demangled(name: str) -> str:
    """``name`` as c++filt reads it, where there is one."""
    cxxfilt = shutil.which("c++filt")
    return subprocess.run([cxxfilt, name], capture_output=True, text=True).stdout.strip() if cxxfilt else name


def build(nvcc: str, source: Path, flags: str, sass_path: Path | None) -> int:
    """Print one build's lines; returns 1 if nvcc failed."""
    label = f"{source.name} {flags!r}" if flags else f"{source.name} (default build)"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d, "k.cubin")
        r = subprocess.run([nvcc, *hopper_cuda.NVCC_TARGET, "-cubin", "-Xptxas", "-v", *flags.split(),
                            "-o", str(cubin), str(source)], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL {label}: {r.stderr[-2000:]}", flush=True)
            return 1
        sass = disassemble(cubin)
    if sass_path is not None:
        sass_path.write_text(sass)
    figures = ptxas_figures(r.stderr)
    print(f"OK   {label}", flush=True)
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        name = function.split(None, 1)[0]
        print(f"  {demangled(name)}: {figures.get(name, '?')}")
        for loop in wgmma_loops(function):
            print(f"     {loop}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("flags", nargs="*", help="after --: one build's nvcc flags each (default: the default build)")
    ap.add_argument("--source", type=Path, default=hopper_cuda.SOURCE)
    ap.add_argument("--sass", type=Path, help="a folder for each build's SASS (build<i>.sass)")
    a = ap.parse_args()
    nvcc = hopper_cuda.compiler()
    if nvcc is None:
        print("no nvcc found (set KDTREE_NVCC or CUDA_HOME, or put nvcc on PATH)", file=sys.stderr)
        return 1
    if a.sass:
        a.sass.mkdir(parents=True, exist_ok=True)
    failed = sum(build(nvcc, a.source, flags, a.sass and a.sass / f"build{i}.sass")
                 for i, flags in enumerate(a.flags or [""]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
