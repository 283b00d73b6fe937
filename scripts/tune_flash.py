"""Flash-kernel tuning probe for the GPU: compiler report and timing per tile config and shape.

    PYTHONPATH=src python scripts/tune_flash.py [--configs 64x64x8x2,64x32x8x3] [--shapes ...]
        [--kernel flash|hopper] [--schedules auto,line,parts] [--kv-spread F [--seed S]]

For each config: registers, spills, shared memory, whether the SASS/PTX uses wgmma; for each shape
and schedule (``auto``: the plan's choice; ``line``, ``parts``, ``parts_tail``, ``rounds``, ``whole``, or
a candidate's name such as ``whole:140``: that candidate of ``verify.plan.schedule`` forced): median us
(CUDA graph replay of the planned call), TFLOP/s, TB/s,
% of the roofline floor from ceilings measured in this run, the schedule's modelled cost, and a
correctness check against the float64 reference on one sequence's first four heads. Prints a table;
--json writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import numpy as np
import torch

from kdtree_engine import reference, verify_attention
from kdtree_engine.bench.timing import measure_ceilings
from kdtree_engine.testing import TOLERANCES, compare, random_tree
from kdtree_engine.masks import concat_tree_masks, mask_words, tree_mask_from_parents
from kdtree_engine.verify import D_V, hopper, plan as vplan, triton_flash
from kdtree_engine.verify.plan import FlashConfig, plan_verify

AUTO_SCHEDULE = vplan.schedule
CHECK_HEADS = 4  # heads of the first sequence checked against the float64 reference


def forced_schedule(name: str):
    """``verify.plan.schedule`` with one candidate forced (``auto``: the plan's own choice)."""
    return AUTO_SCHEDULE if name == "auto" else functools.partial(AUTO_SCHEDULE, only=name)


def time_graph(fn, reps: int = 50, calls: int = 1) -> float:
    """Median seconds of one call, replayed from a CUDA graph of ``calls`` calls back to back
    (divided out; more than one lets a call's launch overlap the call before it, as in the bench's
    graphs of calls), warm-up on a side stream first."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def kv_lengths(n: int, B: int, prefix: int, spread: float, seed: int) -> list[int]:
    """Each sequence's KV length: ``prefix + n``, or with ``spread`` > 0 a prefix drawn uniformly
    from ``[(1 - spread) * prefix, prefix]`` per sequence (the first keeps the whole prefix, so the
    reference check covers the longest)."""
    rng = np.random.default_rng(seed)
    prefixes = [prefix] + [int(prefix * (1 - spread * rng.random())) for _ in range(B - 1)]
    return [p + n for p in prefixes]


def make_inputs(H: int, n: int, lens: list[int], page_size: int, *, seed: int = 0):
    """Random inputs built on the GPU for sequences of KV lengths ``lens`` (``n`` tree nodes each);
    page_size-1 slots (or pages) shuffled over the pool."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lens)
    pages_per_seq = math.ceil(max(lens) / page_size)
    num_pages = B * pages_per_seq
    kv_cache = torch.randn(num_pages, page_size, 576, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(num_pages, device="cuda").to(torch.int32)
    page_table = perm.view(B, pages_per_seq).contiguous()
    q = torch.randn(B * n, H, 576, device="cuda", dtype=torch.bfloat16) * 2
    trees = [random_tree(n, gen) for _ in range(B)]
    tree_mask = concat_tree_masks([tree_mask_from_parents(t) for t in trees], words=mask_words(n)).cuda()
    kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qo_indptr = torch.arange(0, B * n + 1, n, dtype=torch.int32, device="cuda")
    return dict(q=q, kv_cache=kv_cache, page_table=page_table, kv_lens=kv_lens, qo_indptr=qo_indptr,
                tree_mask=tree_mask)


def plan_with_schedule(lens: list[int], n: int, H: int, sched: str = "auto", config: FlashConfig | None = None):
    """The host plan on the GPU of sequences of KV lengths ``lens`` (``n`` tree nodes each) with the
    schedule ``sched`` forced (:func:`forced_schedule`: ``auto``, or a name ``verify.plan.schedule``
    takes as ``only``, such as ``parts`` or ``whole:140``; ``ValueError`` where this work has no such
    candidate)."""
    vplan.schedule = forced_schedule(sched)
    try:
        return plan_verify(lens, list(range(0, len(lens) * n + 1, n)), H, "cuda", config=config)
    finally:
        vplan.schedule = AUTO_SCHEDULE


def equal_step(H: int, n: int, B: int, prefix: int, page_size: int):
    """:func:`make_inputs` for ``B`` sequences of ``prefix + n`` tokens (``n`` tree nodes each) and
    the host plan of those lengths: ``(inputs, plan)``."""
    lens = [prefix + n] * B
    return make_inputs(H, n, lens, page_size), plan_with_schedule(lens, n, H)


def empty_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A call's outputs for ``q`` ``[T, H, 576]``, unwritten: ``out`` ``[T, H, 512]`` (q's dtype) and
    ``lse`` ``[T, H]`` float32, on q's device."""
    T, H, _ = q.shape
    return (torch.empty(T, H, D_V, device=q.device, dtype=q.dtype),
            torch.empty(T, H, device=q.device, dtype=torch.float32))


def compiled_report(kernel_fn) -> dict:
    """Registers, spills, shared memory and wgmma use of the most recently compiled variant."""
    try:
        cache = kernel_fn.device_caches[torch.cuda.current_device()][0]
        compiled = list(cache.values())[-1]
        compiled._init_handles()
    except (AttributeError, IndexError, KeyError, TypeError):
        return dict(regs="?", spills="?", smem="?", wgmma="?", mma_sync="?")
    ptx = compiled.asm.get("ptx", "")
    return dict(regs=compiled.n_regs, spills=compiled.n_spills, smem=compiled.metadata.shared,
                wgmma="wgmma" in ptx, mma_sync="mma.sync" in ptx)


def parse_config(text: str) -> FlashConfig:
    bm, bn, w, s = (int(x) for x in text.split("x"))
    return FlashConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s)


def run_config(kernel, c, cfg, sched, H, n, lens, ref_out, ref_lse) -> dict | None:
    """Plan (with schedule ``sched``), check one sequence against the reference, time the graph."""
    B = len(lens)
    try:
        plan = plan_with_schedule(lens, n, H, sched, cfg)
        R = np.full(B, -(-n * H // cfg.block_m))
        T = -(-np.array(lens) // cfg.block_n)
        if sched == "auto":  # the plan's pick, named
            picked, pieces, _ = min(vplan.schedule_candidates(R, T, plan.num_programs, costs=plan.costs),
                                    key=lambda cand: cand.cost)
        else:
            picked, pieces = sched, forced_schedule(sched)(R, T, plan.num_programs, costs=plan.costs)
        cost = vplan.schedule_cost(pieces, plan.costs)
        out, lse = empty_outputs(c["q"])
        verify_attention(**c, kernel=kernel, plan=plan, out=out, lse=lse)
        torch.cuda.synchronize()
        ok = compare(out[:n, :CHECK_HEADS], ref_out, *TOLERANCES["bf16"]["out"]).ok and \
            compare(lse[:n, :CHECK_HEADS], ref_lse, *TOLERANCES["bf16"]["lse"]).ok
        rep = compiled_report(hopper._hopper_verify_kernel if kernel == "hopper" else triton_flash._verify_flash_kernel)
        t = time_graph(lambda: verify_attention(**c, kernel=kernel, plan=plan, out=out, lse=lse))
    except Exception as exc:  # a config that does not compile or fit: report, go on
        print(f"{H}x{n}x{B}x{lens[0] - n} {sched}  ERROR {type(exc).__name__}: {str(exc)[:120]}")
        return None
    return dict(schedule=sched, picked=picked, kv_lens=lens, us=t * 1e6, cost=cost, programs=plan.num_programs,
                segments=plan.num_segments, groups=plan.num_groups, ok=ok, **rep)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="64x32x8x3,64x32x8x2,64x64x8x1,64x32x4x3,32x32x4x1,32x32x4x2")
    parser.add_argument("--shapes", default="16x9x1x131072x1,64x33x1x16384x1,64x33x4x131072x1,128x33x1x65536x1,"
                        "16x9x16x4096x1,64x65x16x1024x1,64x33x1x16384x64,8x9x1x1024x1")
    parser.add_argument("--kernel", default="flash", choices=("flash", "hopper"))
    parser.add_argument("--schedules", default="auto")
    parser.add_argument("--kv-spread", type=float, default=0.0,
                        help="ragged KV: each sequence after the first takes a prefix drawn from "
                        "[(1 - F) prefix, prefix]")
    parser.add_argument("--seed", type=int, default=0, help="the ragged lengths' seed")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not 0.0 <= args.kv_spread <= 1.0:
        parser.error(f"--kv-spread must be in [0, 1], got {args.kv_spread}")
    ceilings = measure_ceilings()  # the benchmark's own ceilings: one definition of the floor
    copy_bps, mm_fps = ceilings.copy_bps(), ceilings.matmul_fps("bf16")
    print(f"ceilings: copy {copy_bps / 1e12:.2f} TB/s, bf16 matmul {mm_fps / 1e12:.0f} TFLOP/s")
    rows = []
    for shape_text in args.shapes.split(","):
        H, n, B, prefix, ps = (int(x) for x in shape_text.split("x"))
        lens = kv_lengths(n, B, prefix, args.kv_spread, args.seed)
        c = make_inputs(H, n, lens, ps)
        flops = 2 * n * H * sum(lens) * (576 + 512)
        nbytes = sum(lens) * 1152 + B * n * H * (576 + 512) * 2
        floor = max(flops / mm_fps, nbytes / copy_bps)
        # the first sequence's first CHECK_HEADS heads (all heads of a 1024-node tree at 128k would
        # take the float64 reference ~130 GB)
        ref_out, ref_lse = reference(c["q"][:n, :CHECK_HEADS], c["kv_cache"], c["page_table"][:1],
                                     c["kv_lens"][:1], c["qo_indptr"][:2], c["tree_mask"][:n])
        for cfg_text in args.configs.split(","):
            for sched in args.schedules.split(","):
                row = run_config(args.kernel, c, parse_config(cfg_text), sched, H, n, lens, ref_out, ref_lse)
                if row is None:
                    continue
                row.update(shape=shape_text, config=cfg_text, tflops=flops / row["us"] / 1e6,
                           tbps=nbytes / row["us"] / 1e6, pct_floor=1e8 * floor / row["us"], floor_us=floor * 1e6)
                rows.append(row)
                print(f"{shape_text:>22} {cfg_text:>12} {sched:>5} {'PASS' if row['ok'] else 'FAIL'} {row['us']:9.1f} us "
                      f"{row['tflops']:6.1f} TF/s {row['tbps']:5.2f} TB/s {row['pct_floor']:5.1f}% of floor "
                      f"({row['floor_us']:.1f} us) picked={row['picked']} programs={row['programs']} "
                      f"segments={row['segments']} "
                      f"cost={row['cost']} regs={row['regs']} spills={row['spills']} smem={row['smem']} "
                      f"wgmma={row['wgmma']}", flush=True)
        del c
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_tbps=copy_bps / 1e12, matmul_tflops=mm_fps / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
