"""Compile the Hopper verify kernel (or variants of it) for sm_90a without a GPU, and print
registers, spills, shared memory, partition barriers and whether ptxas serialised the wgmmas; a kernel
that waits for the grid before it (PDL) fails if a global access can run before that wait.

    PYTHONPATH=src python scripts/hopper_sm90_compile.py [VARIANT.py ...] [--page-size 64,1] [--heads 64]
        [--stamped] [--in-kernel] [--sass DIR]

``VARIANT.py``: a whole ``verify/hopper.py`` of another branch, as ``scripts/ab_hopper.py`` takes
(default: this tree's). ``--stamped``: the copy ``scripts/hopper_timeline.py`` runs (its clock
stamps added), whose timeline means something only if ptxas did not serialise its wgmmas (infos C7514,
C7515: printed as ``WGMMAS SERIALIZED``). ``--sass DIR``: each case's SASS written to DIR, and the
innermost loops that issue wgmmas (the two consumers' steps) printed with their instruction counts
and fixed-stall cycles (``sass_loops.wgmma_loops``; static: the mask's branch is counted in full).
Check a change to the kernel here before a GPU call: docs/hopper.md says which figures matter (a few
bytes of spills is fine, serialised wgmmas are not).

Pointers are taken as 16-byte aligned, q's, kv's and out's strides as multiples of 16 elements, the
other integer arguments as unspecialised; the constexprs are the ones ``verify/hopper.prepare`` passes. Needs a Triton with the NVIDIA backend and Gluon (3.6 seen
working; no GPU, no CUDA driver); exit status 1 if one fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ddtree_sm90_compile import report  # noqa: E402
from hopper_timeline import module_from_source, stamped_source  # noqa: E402

from kdtree_engine.verify import combine, hopper  # noqa: E402

POINTERS = dict(q="*bf16", kv="*bf16", out="*bf16", lse="*fp32", partial_out="*fp32", partial_lse="*fp32",
                trace="*i64")
# strides a call passes as multiples of 16 elements (hopper.supports requires the q and kv ones: the
# cp.async copies are 16-byte vectors; out is [T, H, 512]); the other integers unspecialised
DIVISIBLE = frozenset({"stride_qt", "stride_qh", "stride_kvp", "stride_kvs", "stride_ot", "stride_oh"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="*", help="whole verify/hopper.py files (default: this tree's)")
    ap.add_argument("--page-size", default="64,1")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--stamped", action="store_true", help="the timeline's stamped copy")
    ap.add_argument("--in-kernel", action="store_true", help="the variant that schedules a one-sequence step "
                    "itself (IN_KERNEL; a kernel without that parameter compiles as it is)")
    ap.add_argument("--sass", type=Path, help="a folder for each case's SASS (case<i>.sass); also print the "
                    "sizes of the loops that issue wgmmas (the consumers' steps)")
    a = ap.parse_args()
    cases = []
    for path in a.variants or [hopper.__file__]:
        src = Path(path).read_text()
        if a.stamped:
            src = stamped_source(96, src)
        mod = module_from_source(src, f"compiled_{Path(path).stem}{'_stamped' if a.stamped else ''}")
        fn = mod._hopper_verify_kernel
        types = {n: POINTERS.get(n, "*i32" if not n.startswith(("stride_", "mask_words", "merge_splits")) else "i32")
                 for n in fn.arg_names}
        types["scale_log2"] = "fp32"
        for page_size in (int(v) for v in a.page_size.split(",")):
            consts = dict(mod.kernel_constexprs(a.heads, page_size), FUSE_COMBINE=True,
                          BLOCK_S=combine.SPLITS_PER_ROUND, BLOCK_R=combine.ROWS_PER_ITEM)
            if "IN_KERNEL" in fn.arg_names:
                consts["IN_KERNEL"] = a.in_kernel
            cases.append((f"{path}{' (stamped)' if a.stamped else ''}{' (in kernel)' if a.in_kernel else ''}, "
                          f"H {a.heads}, page size {page_size}", fn, types, consts, 4))
    if a.sass:
        a.sass.mkdir(parents=True, exist_ok=True)
    return 1 if report(cases, sass_dir=a.sass, divisible_ints=DIVISIBLE) else 0


if __name__ == "__main__":
    sys.exit(main())
