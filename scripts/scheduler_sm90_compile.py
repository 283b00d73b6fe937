"""Compile the device scheduler's kernel (:mod:`kdtree_engine.verify.scheduler`) for sm_90a
without a GPU, and print registers, spills and shared memory.

    PYTHONPATH=src python scripts/scheduler_sm90_compile.py [--max-batch 1,4,64] [--programs 132] [--block-s 32]
        [--num-warps 8]

The kernel is compiled with the constexprs and warps a :class:`DeviceScheduler` picks for a plan
of ``max_batch`` sequences of up to 65 nodes at 128 heads on the H200's config (64 x 64 tiles) and
grid (``--programs``), at ``--block-s`` pieces per program; pointers 16-byte aligned, integer
arguments unspecialised. Needs a Triton with the NVIDIA backend (no GPU, no CUDA driver); exit
status 1 if one fails.
"""

from __future__ import annotations

import argparse
import sys

from ddtree_sm90_compile import report

from kdtree_engine.verify import scheduler
from kdtree_engine.verify.plan import CONFIGS, MIN_SPLIT_TILES, VerifyPlan


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-batch", default="1,4,64")
    ap.add_argument("--programs", type=int, default=132)
    ap.add_argument("--block-s", type=int, default=scheduler.BLOCK_S)
    ap.add_argument("--num-warps", type=int, default=scheduler.NUM_WARPS)
    a = ap.parse_args()
    fn = scheduler._schedule_kernel
    types = {n: "*i32" for n in fn.arg_names}
    types.update({n: "i32" for n in ("stride_kl", "stride_qo", "B", "H", "P", "max_nodes", "seg_cap", "grp_cap")})
    cases = []
    # "auto" (with rounds, as the Hopper cost model asks) holds all four schedules ("parts" and "rounds"
    # differ from it in their constants only)
    for max_batch, kind in ((int(v), kind) for v in a.max_batch.split(",") for kind in ("line", "auto")):
        p = VerifyPlan(max_batch, 65, 128, "cpu", config=CONFIGS[0], num_programs=a.programs)
        s = scheduler.DeviceScheduler(p.kv_lens_buf, p.qo_indptr_buf, p.tables, num_heads=128, max_batch=max_batch,
                                      max_tree_nodes=65, min_split=MIN_SPLIT_TILES,
                                      segment_tiles=p.costs.segment_tiles, block_s=a.block_s,
                                      num_warps=a.num_warps, lockstep=True)
        consts = s.constexprs(kind)  # the constexprs and warps the launch passes
        cases.append((f"{fn.__name__} ({kind}, max_batch {max_batch}, P {a.programs}, "
                       f"{a.block_s} pieces per program, {a.num_warps} warps)", fn,
                      types, {k: v for k, v in consts.items() if k != "num_warps"}, consts["num_warps"]))
    return 1 if report(cases, divisible_ints=False) else 0


if __name__ == "__main__":
    sys.exit(main())
