"""GPU measurements of the paged KV pool (issue 5).

Run on a CUDA machine (about a minute of GPU time; ``--quick``: prefix 16k only, fewer repeats)::

    python -m kdtree_engine.kvpool_bench [--quick] [--json kvpool_bench.json]

Prints a machine line, then:

1. **copy ceiling**: ``dst.copy_(src)`` of 1 GiB bf16, bytes read + written, median.
2. **verify**: one layer, B=1, ``verify_attention(kernel="naive"|"flash")`` (flash with its plan
   from ``plan_verify``, as a model step builds it) on the same logical KV in three layouts:
   page size 1 with every slot scattered (the pool after many speculative steps: a shuffled free
   list), page size 1 after ``defragment()`` (contiguous), page size 64 with scattered pages.
   Prefix 16k and 128k; shapes H=64 n=33 and H=16 n=9. L2 is flushed before every timed call
   (a model step streams 61 layers of KV). Outputs are compared across layouts (the same logical
   KV must give the same result; the naive kernel bitwise).
3. **defrag**: the fragmented page-size-1 pool of the prefix: host plan time, plan upload, the
   page copy alone and the whole apply (copy + table and free-stack rewrite) by CUDA events;
   GB/s of the copy (bytes read + written of the moved pages) against the copy ceiling; and the
   verify steps after which it pays for itself: apply time / (fragmented - contiguous verify
   time) per kernel and shape ("never" when fragmentation costs nothing).
4. **commit** per step, B=16, n=65 nodes, accepted paths of 1..8 nodes, page sizes 1 and 64,
   Triton kernel and torch ops: GPU time between CUDA events (the GPU is kept busy ahead of the
   call, so this is not launch latency), host time of the call, and the proof of no host sync:
   ``commit``, ``reserve_tree`` and ``verify_inputs`` run under
   ``torch.cuda.set_sync_debug_mode("warn")`` (warnings recorded; "error" would abort a call
   half-way and leave the pool inconsistent), and ``commit`` is captured in a CUDA graph whose
   replay leaves the pool identical to an eager commit.

On the CPU (``device="cpu"``, under ``TRITON_INTERPRET=1``) the same code runs at toy sizes with
wall-clock times: a smoke test of the benchmark, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .bench.report import machine_info, machine_line
from .bench.timing import Clock, copy_tbps
from .kvpool import KVPool
from .kvpool.pool import _canonical_device
from .masks import tree_mask_from_parents
from .testing import random_tree
from .verify import D_QK, D_V, verify_attention
from .verify import plan_verify

__all__ = ["run_benchmark", "main"]

DTYPE = torch.bfloat16
TOKEN_BYTES = D_QK * 2
PREFIXES = (16384, 131072)
SHAPES = ((64, 33), (16, 9))  # (heads, tree nodes)
KERNELS = ("naive", "flash")


def _med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def copy_ceiling(clock: Clock, gib: float, reps: int = 20) -> dict:
    n = int(gib * 2**30) // 2
    tbps = copy_tbps(n, reps, clock.device, clock)
    return {"section": "ceiling", "bytes": 4 * n, "us": 4 * n / (tbps * 1e12) * 1e6, "tbps": tbps}


# ----------------------------------------------------------------------------------------------
# Layouts and verify calls


def _rows(n: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, D_QK, generator=g, device=device, dtype=DTYPE)


def build_prefix_pool(rows: torch.Tensor, page_size: int, extra: int, *, scatter: bool, seed: int,
                      device) -> tuple[KVPool, int]:
    """One sequence holding ``rows`` as its prefix in a pool twice its size (the other half is
    other sequences' and free pages), its pages scattered when ``scatter``."""
    prefix = rows.shape[0]
    pages = 2 * math.ceil((prefix + extra) / page_size) + 8
    pool = KVPool(pages, page_size, device=device, dtype=DTYPE, max_seqs=2,
                  max_seq_len=prefix + extra + page_size)
    if scatter:
        pool.shuffle_free_pages(seed)
    sid = pool.add_sequence()
    pool.write(pool.extend([sid], [prefix]), rows, layer=0)
    return pool, sid


@dataclass
class _Tree:
    heads: int
    nodes: int
    q: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor


def _make_tree(heads: int, nodes: int, seed: int, device) -> _Tree:
    gen = torch.Generator().manual_seed(seed)
    mask = tree_mask_from_parents(random_tree(nodes, gen)).to(device)
    q = (torch.randn(nodes, heads, D_QK, generator=gen) * 2).to(DTYPE).to(device)
    return _Tree(heads, nodes, q, mask, _rows(nodes, seed + 1, device))


def time_verify(clock: Clock, kernel: str, pool: KVPool, sid: int, tree: _Tree, *, budget_s: float,
                max_reps: int) -> dict:
    """Reserve the tree, write its KV, time verify_attention on the pool's inputs, drop the tree."""
    prefix = pool.seq_len(sid)
    pool.write(pool.reserve_tree([sid], [tree.nodes]), tree.rows, layer=0)
    row = {"kernel": kernel, "heads": tree.heads, "nodes": tree.nodes}
    try:
        page_table, kv_lens = pool.verify_inputs([sid])
        kv = pool.kv_cache(0)
        qo = torch.tensor([0, tree.nodes], dtype=torch.int32, device=kv.device)
        out = torch.empty(tree.nodes, tree.heads, D_V, dtype=DTYPE, device=kv.device)
        lse = torch.empty(tree.nodes, tree.heads, dtype=torch.float32, device=kv.device)
        # the flash plan from host lengths (no device read), as a model step builds it
        plan = plan_verify([prefix + tree.nodes], [0, tree.nodes], tree.heads, kv.device) if kernel == "flash" else None

        def call(_i):
            verify_attention(tree.q, kv, page_table, kv_lens, qo, tree.mask, kernel=kernel, out=out, lse=lse,
                             plan=plan, validate=False)

        # compiles; validate=True checks the pool's inputs against the contract
        verify_attention(tree.q, kv, page_table, kv_lens, qo, tree.mask, kernel=kernel, out=out, lse=lse,
                         plan=plan, validate=True)
        clock.sync()
        est = clock.times_ms(call, 1)[0]
        reps = max(3, min(max_reps, int(budget_s * 1e3 / max(est, 1e-3))))
        ms = clock.times_ms(call, reps)
        row.update(us=_med(ms) * 1e3, min_us=min(ms) * 1e3, reps=reps,
                   out=out.float().cpu(), lse=lse.cpu())
        return row
    except Exception as e:  # keep measuring the rest; the error is reported
        row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
        return row
    finally:
        pool.truncate(sid, prefix)


def _diff(a: dict, b: dict) -> float | None:
    if "out" not in a or "out" not in b:
        return None
    return float((a["out"] - b["out"]).abs().max())


# ----------------------------------------------------------------------------------------------
# Sections


def bench_prefix(clock: Clock, prefix: int, ceiling_bps: float, *, shapes, kernels, quick: bool) -> list:
    dev = clock.device
    rows_out = []
    n_max = max(n for _, n in shapes)
    kv_rows = _rows(prefix, 1000 + prefix, dev)
    trees = [_make_tree(h, n, 7 * h + n, dev) for h, n in shapes]
    budget = 0.3 if quick else 1.0
    max_reps = 10 if quick else 30

    def layout(name: str, pool: KVPool, sid: int) -> dict:
        res = {}
        frag = pool.fragmentation()
        for tree in trees:
            for k in kernels:
                r = time_verify(clock, k, pool, sid, tree, budget_s=budget, max_reps=max_reps)
                r.update(section="verify", prefix=prefix, layout=name, page_size=pool.page_size,
                         runs=frag.runs[0])
                res[(tree.heads, tree.nodes, k)] = r
        return res

    # 1. fragmented page size 1
    pool, sid = build_prefix_pool(kv_rows, 1, n_max, scatter=True, seed=prefix, device=dev)
    frag = layout("ps1-scattered", pool, sid)
    del pool
    # 2. defragmentation, each repeat on a freshly scattered pool: even repeats time the plan
    #    upload and the whole apply, odd ones the page copies alone (which leave the pool's
    #    tables stale, so that pool is dropped)
    reps = 4 if quick else 6
    applies, copies, uploads, plans = [], [], [], []
    last = None
    for r in range(reps):
        pool, sid = build_prefix_pool(kv_rows, 1, n_max, scatter=True, seed=prefix + 17 * r, device=dev)
        t0 = time.perf_counter()
        plan = pool.plan_defragment()
        plans.append(time.perf_counter() - t0)
        if r % 2 == 0:
            uploads.append(clock.times_ms(lambda i: pool.upload_plan(plan), 1, flush=False)[0])
            applies.append(clock.times_ms(lambda i: pool.apply_defragment(plan), 1)[0])
            last = (pool, sid, plan)
        else:
            pool.upload_plan(plan)
            copies.append(clock.times_ms(lambda i: pool._run_moves(plan), 1)[0])
        del pool
    pool, sid, plan = last
    del last
    clock.sync()
    ok = pool.fragmentation().runs == [1] and torch.equal(
        pool.gather_kv(sid).view(torch.int16), kv_rows.view(torch.int16))
    pool.check()
    s = plan.schedule
    copy_ms = _med(copies)
    drow = {
        "section": "defrag", "prefix": prefix, "pages_moved": plan.pages_moved,
        "mb_moved": plan.bytes_moved / 1e6, "mb_extra": plan.bytes_extra / 1e6, "levels": s.levels,
        "scratch_pages": len(s.scratch_src), "launches": s.launches,
        "plan_ms": _med(plans) * 1e3, "upload_us": _med(uploads) * 1e3, "copy_us": copy_ms * 1e3,
        "apply_us": _med(applies) * 1e3,
        "copy_gbps": plan.bytes_moved / (copy_ms * 1e-3) / 1e9,
        "copy_pct_ceiling": 100 * plan.bytes_moved / (copy_ms * 1e-3) / ceiling_bps if ceiling_bps else None,
        "actual_gbps": (plan.bytes_moved + plan.bytes_extra) / (copy_ms * 1e-3) / 1e9,
        "kv_intact": bool(ok), "samples": len(copies),
    }
    rows_out.append(drow)
    # 3. the same KV contiguous, page size 1
    defr = layout("ps1-defragmented", pool, sid)
    del pool
    # 4. page size 64, pages scattered
    pool, sid = build_prefix_pool(kv_rows, 64, n_max, scatter=True, seed=prefix + 1, device=dev)
    p64 = layout("ps64-scattered", pool, sid)
    del pool
    for key in frag:
        f, d, p = frag[key], defr[key], p64[key]
        d["max_diff_vs_scattered"] = _diff(d, f)
        p["max_diff_vs_scattered"] = _diff(p, f)
        for r in (f, d, p):
            rows_out.append({k: v for k, v in r.items() if k not in ("out", "lse")})
        if "us" in f and "us" in d:
            gain = f["us"] - d["us"]
            cost = drow["apply_us"] + drow["upload_us"]
            rows_out.append({
                "section": "payback", "prefix": prefix, "kernel": key[2], "heads": key[0], "nodes": key[1],
                "scattered_us": f["us"], "contiguous_us": d["us"], "ps64_us": p.get("us"),
                "gain_us": gain, "defrag_us": cost,
                "steps": cost / gain if gain > 0 else None,
            })
    del kv_rows
    if clock.cuda:
        torch.cuda.empty_cache()
    return rows_out


def _commit_setup(page_size: int, use_triton: bool, B: int, n: int, A: int, steps: int, dev, seed: int = 0):
    prefix = 2048 if dev.type == "cuda" else 16
    per_seq = prefix + steps * A + n + page_size
    pages = math.ceil(B * per_seq / page_size) + 2 * B + 16
    pool = KVPool(pages, page_size, device=dev, dtype=DTYPE, max_seqs=B, max_seq_len=per_seq + page_size,
                  use_triton=use_triton)
    pool.shuffle_free_pages(seed)
    ids = [pool.add_sequence() for _ in range(B)]
    pool.write(pool.extend(ids, [prefix] * B), _rows(B * prefix, seed + 5, dev), layer=0)
    rng = np.random.default_rng(seed)
    na = rng.integers(1, min(8, n, A) + 1, size=(steps, B))
    acc = np.full((steps, B, A), -1, np.int64)
    for s in range(steps):
        for b in range(B):
            acc[s, b, : na[s, b]] = np.concatenate([[0], rng.choice(np.arange(1, n), na[s, b] - 1, replace=False)])
    return pool, ids, torch.from_numpy(acc).to(dev), torch.from_numpy(na).to(dev), na, _rows(B * n, seed + 9, dev)


def _no_sync(clock: Clock, fn) -> str:
    """Run ``fn`` under the sync debug mode and say whether it synchronized. In "warn" mode,
    recorded: "error" mode would raise in the middle of ``fn`` and leave a half-done pool
    mutation behind (a commit that rewrote the tables but never became pending), which the
    benchmark's later ``check()`` then reports as a corrupt pool instead of the sync."""
    if not clock.cuda:
        return "n/a (cpu)"
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    return "no sync" if not syncs else f"SYNC x{len(syncs)}: {syncs[0][:70]}"


def bench_commit(clock: Clock, page_size: int, use_triton: bool, *, B: int, n: int, A: int, steps: int) -> dict:
    dev = clock.device
    warm = 3
    pool, ids, acc, na, na_h, tree_rows = _commit_setup(page_size, use_triton, B, n, A, steps + warm + 1, dev)
    row = {"section": "commit", "page_size": page_size, "path": "triton" if use_triton else "torch",
           "batch": B, "nodes": n, "max_acc": A}

    def reserve(i):
        if pool.pending_commit:
            pool.finalize_commit(na_h[i - 1])  # host bookkeeping only (the server's lengths)
        pool.write(pool.reserve_tree(ids, [n] * B), tree_rows, layer=0)

    host = []

    def commit(i):
        t0 = time.perf_counter()
        pool.commit(ids, acc[i], na[i])
        host.append(time.perf_counter() - t0)

    for i in range(warm):
        reserve(i)
        commit(i)
    host.clear()
    ms = clock.times_ms(lambda i: commit(warm + i), steps, flush=False, head_ms=0.3, before=lambda i: reserve(warm + i))
    pool.finalize_commit(na_h[warm + steps - 1])
    row.update(gpu_us=_med(ms) * 1e3, min_us=min(ms) * 1e3, host_us=_med(host) * 1e6, steps=steps)
    # no host sync: commit, reserve_tree and verify_inputs under the sync debug mode
    i = steps + warm
    row["sync_reserve"] = _no_sync(clock, lambda: pool.reserve_tree(ids, [n] * B))
    row["sync_verify_inputs"] = _no_sync(clock, lambda: pool.verify_inputs(ids))
    row["sync_commit"] = _no_sync(clock, lambda: pool.commit(ids, acc[i], na[i]))
    if pool.pending_commit:
        pool.finalize_commit(na_h[i])
    pool.check()
    row["graph"] = _graph_check(clock, page_size, use_triton, B, n, A) if clock.cuda else "n/a (cpu)"
    return row


def _graph_check(clock: Clock, page_size: int, use_triton: bool, B: int, n: int, A: int) -> str:
    """Capture commit in a CUDA graph on one pool, commit eagerly on an identical pool, replay,
    compare the two pools' KV and tables."""
    dev = clock.device
    made = [_commit_setup(page_size, use_triton, B, n, A, 3, dev, seed=3) for _ in range(2)]
    for pool, ids, acc, na, na_h, rows in made:
        # one eager step on this very pool configuration first: compiled kernel, row tensor
        pool.write(pool.reserve_tree(ids, [n] * B), rows, layer=0)
        pool.commit(ids, acc[1], na[1], num_accepted_host=na_h[1])
        pool.write(pool.reserve_tree(ids, [n] * B), rows, layer=0)
    (pa, ids, acc, na, na_h, _), (pb, _, accb, nab, _, _) = made
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pa.commit(ids, acc[0], na[0])
    except Exception as e:
        return f"capture failed: {type(e).__name__}: {str(e)[:80]}"
    pb.commit(ids, accb[0], nab[0], num_accepted_host=na_h[0])
    graph.replay()
    pa.finalize_commit(na_h[0])
    torch.cuda.synchronize()
    pa.check()
    same = all(torch.equal(pa.gather_kv(s).view(torch.int16), pb.gather_kv(s).view(torch.int16)) for s in ids)
    same = same and all(torch.equal(pa.slots(s), pb.slots(s)) for s in ids)
    return "captured, replay == eager" if same else "MISMATCH after replay"


# ----------------------------------------------------------------------------------------------
# Driver and printing


def run_benchmark(device="cuda", quick: bool = False, *, prefixes=None, shapes=None, kernels=KERNELS,
                  commit_batch: int = 16, commit_nodes: int = 65, commit_steps: int | None = None,
                  copy_gib: float | None = None) -> list:
    """All measurements as a list of dicts (``section`` says which table). See the module doc."""
    dev = _canonical_device(device)  # "cuda" -> "cuda:N", as tensors and the pool report it
    cpu = dev.type == "cpu"
    prefixes = prefixes or ((16384,) if quick else PREFIXES)
    shapes = shapes or SHAPES
    clock = Clock(dev)
    rows = [{"section": "machine", **machine_info(str(dev))}]
    ceil = copy_ceiling(clock, copy_gib or (0.01 if cpu else 1.0), reps=3 if cpu else 20)
    rows.append(ceil)
    ceiling_bps = ceil["tbps"] * 1e12
    for p in prefixes:
        try:
            rows += bench_prefix(clock, p, ceiling_bps, shapes=shapes, kernels=kernels, quick=quick)
        except Exception as e:  # report and go on with the other sections
            rows.append({"section": "defrag", "prefix": p, "error": f"{type(e).__name__}: {str(e)[:200]}",
                         "traceback": traceback.format_exc()})
            if clock.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    steps = commit_steps or (2 if cpu else (30 if quick else 100))
    for ps in (1, 64):
        for use_triton in (True, False):
            try:
                rows.append(bench_commit(clock, ps, use_triton, B=commit_batch, n=commit_nodes, A=16, steps=steps))
            except Exception as e:
                rows.append({"section": "commit", "page_size": ps, "path": "triton" if use_triton else "torch",
                             "error": f"{type(e).__name__}: {str(e)[:200]}", "traceback": traceback.format_exc()})
    return rows


def _fmt(x, f="{:.1f}"):
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f.format(x)
    return str(x)


def _table(title: str, cols: list, rows: list) -> str:
    head = [c[0] for c in cols]
    body = [[_fmt(r.get(k), *( (f,) if f else ())) for _, k, f in cols] for r in rows]
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = [title, "  ".join(h.rjust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(c.rjust(w[i]) for i, c in enumerate(b)) for b in body]
    return "\n".join(lines)


def format_results(rows: list) -> str:
    sec = {}
    for r in rows:
        sec.setdefault(r["section"], []).append(r)
    out = [machine_line(sec["machine"][0])]
    c = sec["ceiling"][0]
    out.append(f"copy ceiling: {c['tbps']:.2f} TB/s ({c['bytes'] / 2**30:.1f} GiB read+written in {c['us']:.0f} us)")
    out.append(_table("\nverify (one layer, B=1, L2 flushed; us = median)", [
        ("prefix", "prefix", None), ("layout", "layout", None), ("H", "heads", None), ("n", "nodes", None),
        ("kernel", "kernel", None), ("runs", "runs", None), ("us", "us", "{:.1f}"), ("min", "min_us", "{:.1f}"),
        ("reps", "reps", None), ("maxdiff", "max_diff_vs_scattered", "{:.2e}"),
        ("error", "error", None)],
        sec.get("verify", [])))
    out.append(_table("\ndefragmentation of the scattered page-size-1 prefix (one layer)", [
        ("prefix", "prefix", None), ("pages", "pages_moved", None), ("MB", "mb_moved", "{:.1f}"),
        ("extraMB", "mb_extra", "{:.1f}"), ("levels", "levels", None), ("scratch", "scratch_pages", None),
        ("plan ms", "plan_ms", "{:.1f}"), ("upload us", "upload_us", "{:.1f}"), ("copy us", "copy_us", "{:.1f}"),
        ("apply us", "apply_us", "{:.1f}"), ("copy GB/s", "copy_gbps", "{:.0f}"),
        ("% ceiling", "copy_pct_ceiling", "{:.0f}"), ("KV intact", "kv_intact", None), ("error", "error", None)],
        sec.get("defrag", [])))
    out.append(_table("\npays back after (steps) = (apply + upload) / (scattered - contiguous verify time)", [
        ("prefix", "prefix", None), ("kernel", "kernel", None), ("H", "heads", None), ("n", "nodes", None),
        ("scattered", "scattered_us", "{:.1f}"), ("contiguous", "contiguous_us", "{:.1f}"),
        ("ps64", "ps64_us", "{:.1f}"), ("gain us", "gain_us", "{:.1f}"), ("defrag us", "defrag_us", "{:.1f}"),
        ("steps", "steps", "{:.1f}")], sec.get("payback", [])))
    out.append(_table("\ncommit per step (B sequences, n-node trees, paths of 1..8 nodes)", [
        ("ps", "page_size", None), ("path", "path", None), ("B", "batch", None), ("n", "nodes", None),
        ("GPU us", "gpu_us", "{:.2f}"), ("min", "min_us", "{:.2f}"), ("host us", "host_us", "{:.1f}"),
        ("commit", "sync_commit", None), ("reserve", "sync_reserve", None), ("verify_inputs", "sync_verify_inputs", None),
        ("CUDA graph", "graph", None), ("error", "error", None)], sec.get("commit", [])))
    nver = sum(1 for r in sec.get("payback", []) if r.get("steps") is None)
    if nver:
        out.append(f"\n{nver} kernel/shape pair(s): contiguous is not faster than scattered: defrag never pays back there")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="prefix 16k only, fewer repeats")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures GPU time")
        return 2
    rows = run_benchmark(args.device, args.quick)
    print(format_results(rows))
    for r in rows:
        if "traceback" in r:
            print(f"\n--- {r['section']} {r.get('prefix', r.get('page_size', ''))}:", r["traceback"], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    bad = [r for r in rows if "error" in r or r.get("kv_intact") is False
           or str(r.get("sync_commit", "")).startswith("SYNC") or "MISMATCH" in str(r.get("graph", ""))]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
