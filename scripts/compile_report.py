"""Compiler report of the flash verify kernel, on any machine (no GPU needed).

    PYTHONPATH=src python scripts/compile_report.py [--cc 90] [--configs 64x64x8x2,64x32x8x3] [--page-size 1]

Compiles ``_verify_flash_kernel`` with Triton for a CUDA target (default sm_90) the way a launch
would specialise it (16-byte aligned pointers, strides divisible by 16), runs the bundled ptxas on
the PTX and prints, per tile config: shared memory, registers, spill bytes, the wgmma instruction
shapes and count, and the MMA layouts of the two dots (warpsPerCTA, instrShape) from the TTGIR.
``--dump DIR`` writes the TTGIR and PTX of each config.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kdtree_engine.verify import plan, triton_flash

POINTERS = {"q": "*bf16", "kv": "*bf16", "out": "*bf16", "lse": "*fp32", "partial_out": "*fp32", "partial_lse": "*fp32"}
# strides a launch passes as multiples of 16 (head dims 576 / 512): Triton marks them divisible
DIVISIBLE = ("stride_qt", "stride_qh", "stride_kvp", "stride_kvs", "stride_ot", "stride_oh", "stride_lt")


def compile_config(cfg: plan.FlashConfig, cc: int, heads: int, page_size: int):
    kern = triton_flash._verify_flash_kernel
    constexprs = dict(H=heads, PAGE_SIZE=page_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      D_LATENT=512, D_ROPE=64, DOT_FP32=False, FUSE_COMBINE=True, BLOCK_S=4, BLOCK_R=4,
                      IN_KERNEL=False)
    sig = {}
    for name in kern.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name == "scale_log2":
            sig[name] = "fp32"
        elif name.startswith("stride") or name in ("mask_words", "merge_splits"):
            sig[name] = "i32"
        else:
            sig[name] = "*i32"  # page table, lengths, mask, plan tables
    aligned = [n for n, t in sig.items() if t.startswith("*")] + list(DIVISIBLE)
    src = ASTSource(
        kern, sig,
        constexprs={(kern.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs={(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def ptxas_report(ptx: str, cc: int) -> str:
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    ptxas = bin_dir / "ptxas-blackwell" if cc >= 100 and (bin_dir / "ptxas-blackwell").exists() else bin_dir / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ptx)
        arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
        r = subprocess.run([str(ptxas), "-v", f"--gpu-name={arch}", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                           capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    if not regs:
        return f"ptxas: {r.stderr.strip()[:200] or 'no report'}"
    return f"regs {regs.group(1)}, spill stores/loads {spills.group(1)}/{spills.group(2)} B" if spills else f"regs {regs.group(1)}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cc", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 120")
    p.add_argument("--configs", default=",".join(f"{c.block_m}x{c.block_n}x{c.num_warps}x{c.num_stages}" for c in plan.CONFIGS))
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--dump", type=Path, help="write <config>.ttgir / .ptx here")
    a = p.parse_args()
    for text in a.configs.split(","):
        bm, bn, w, s = (int(x) for x in text.split("x"))
        cfg = plan.FlashConfig(bm, bn, w, s)
        try:
            ck = compile_config(cfg, a.cc, a.heads, a.page_size)
        except Exception as exc:  # report and go on: a config may not compile for this target
            print(f"{text}: does not compile: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        ptx, ttgir = ck.asm["ptx"], ck.asm["ttgir"]
        shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
        layouts = sorted(set(re.findall(r"nvidia_mma<\{versionMajor = (\d), versionMinor = \d, warpsPerCTA = (\[[^\]]*\])"
                                        r"(?:, instrShape = (\[[^\]]*\]))?", ttgir)))
        print(f"{text}: smem {ck.metadata.shared} B (estimate {cfg.shared_bytes()}), {ptxas_report(ptx, a.cc)}, "
              f"wgmma {len(re.findall('wgmma.mma_async', ptx))} {shapes}, mma layouts "
              + "; ".join(f"v{v} warps {wp} instr {ins or '-'}" for v, wp, ins in layouts))
        if a.dump:
            a.dump.mkdir(parents=True, exist_ok=True)
            (a.dump / f"{text}.ttgir").write_text(ttgir)
            (a.dump / f"{text}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
