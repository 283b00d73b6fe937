"""The loops of a kernel's SASS that issue a step's wgmmas, with what bounds a step's issue: instructions,
fixed-stall cycles (from the encoding's control bits) and the opcodes that tell builds apart. Read from
``cuobjdump -sass`` text; no GPU. Used by ``hopper_sm90_compile.py --sass`` (the Gluon kernel, through
``ddtree_sm90_compile.compile_sm90``) and ``hopper_cuda_compile.py`` (the CUDA C++ kernel and the spike).
"""

from __future__ import annotations

import re
import subprocess
from itertools import groupby
from pathlib import Path

# an instruction and the two 64-bit words of its encoding (cuobjdump prints the second on the next line)
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]{16} \*/\s*/\* 0x([0-9a-f]{16}) \*/")
BRANCH = re.compile(r"\bBRA(?:\.\S+)?\s+.*?0x([0-9a-f]+)")  # a branch to an address (`BRA P1, 0x..` too)
ORDER_OPS = ("HGMMA", "MUFU", "FMUL", "STS", "STSM", "LDS", "SYNCS", "BAR")  # the ops of a step's order line
LOOP_OPS = ("HGMMA", "MUFU", "FMUL", "FFMA", "BAR", "SYNCS")  # counted in every loop line
RARE_OPS = ("UTMALDG", "MEMBAR", "FENCE", "LDL", "STL", "R2UR", "LDG")  # counted where a loop has them


def disassemble(cubin: Path) -> str:
    """``cuobjdump -sass`` of ``cubin``, by the cuobjdump bundled with Triton's NVIDIA backend."""
    import triton  # (only here: reading SASS text needs no Triton)

    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    return subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def fixed_stall(high_word: int) -> int:
    """The cycles a warp waits after issuing an sm_90 instruction before it issues the next: the
    stall count of its control bits (bits 41-44 of the encoding's second word; Nsight Compute's
    ``wait`` stall reason counts these)."""
    return (high_word >> 41) & 0xF


def wgmma_loops(sass: str) -> list[str]:
    """The innermost loops of ``sass`` (``cuobjdump -sass`` text) that issue wgmmas (HGMMA), two lines
    each: addresses, instructions in the body, the sum of their fixed stalls (:func:`fixed_stall`:
    issue cycles a warp spends whatever it waits on) and the counts of the opcodes that bound a
    softmax step (:data:`LOOP_OPS`, then those of :data:`RARE_OPS` it has; a static count: a branch
    inside the body, e.g. around a mask, is counted in full); then the order in which ptxas placed
    the :data:`ORDER_OPS` (runs of one opcode as ``OPxN``; SYNCS: mbarrier waits and arrives), which
    says e.g. whether register arithmetic moved ahead of a store or an arrive."""
    code = [(int(m.group(1), 16), m.group(2), int(m.group(3), 16)) for m in SASS_LINE.finditer(sass)]
    index = {a: k for k, (a, _, _) in enumerate(code)}
    opcode = [text.split()[1 if text.startswith("@") else 0].split(".")[0] for _, text, _ in code]
    wgmmas, exits = [0], [0]  # how many of each stand before instruction k
    for op in opcode:
        wgmmas.append(wgmmas[-1] + (op == "HGMMA"))
        exits.append(exits[-1] + (op in ("EXIT", "RET")))
    back = [(index[t], k) for k, (a, text, _) in enumerate(code)
            if (m := BRANCH.search(text)) and (t := int(m.group(1), 16)) < a and t in index]
    # a back edge whose range holds an EXIT comes from a cold block placed after the code's end (an
    # mbarrier wait's retry, branching back to the wait), not from a loop
    issuing = [(i, k) for i, k in back if wgmmas[k + 1] > wgmmas[i] and exits[k] == exits[i]]
    lines = []
    for i, k in issuing:
        if any(i <= i0 and k0 <= k for i0, k0 in issuing if (i0, k0) != (i, k)):
            continue  # holds another loop that issues wgmmas (one that does not, e.g. an elected
            # thread's TMA issue, is part of the step)
        ops = opcode[i:k + 1]
        counts = ", ".join([f"{op} {ops.count(op)}" for op in LOOP_OPS]
                           + [f"{op} {ops.count(op)}" for op in RARE_OPS if op in ops])
        stall = sum(fixed_stall(high) for _, _, high in code[i:k + 1])
        lines.append(f"loop {code[i][0]:#x}-{code[k][0]:#x}: {len(ops)} instructions, {stall} fixed-stall cycles "
                     f"({counts})")
        runs = [(op, len(list(run))) for op, run in groupby(  # (@!PT: never runs, fence padding)
            op for op, (_, text, _) in zip(ops, code[i:k + 1]) if op in ORDER_OPS and not text.startswith("@!PT"))]
        lines.append("  order: " + " ".join(f"{op}x{n}" if n > 1 else op for op, n in runs))
    return lines
