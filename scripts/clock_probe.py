"""SM clock and power while one kernel runs back to back: the Hopper verify kernel beside FlashMLA.

    PYTHONPATH=src python scripts/clock_probe.py --flashmla .peers/flashmla [--shapes 64x9x1x131072,...]
        [--seconds 2] [--json clocks.json]

Per shape (H x tree nodes x B x prefix; chain trees, page size 64, bf16) and kernel: one planned call
captured in a CUDA graph, the graph replayed for ``--seconds`` while ``nvidia-smi`` samples the SM
clock and the power draw every 50 ms; prints the call's time, the median clock and power over the
samples taken while the GPU was busy, and the time per call in thousands of cycles at that clock (a
kernel that draws more power may run at a lower clock: the per-cycle gap is then smaller than the
time gap). FlashMLA is optional (``--flashmla DIR``: a folder with ``flashmla_peer.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tune_flash import empty_outputs  # noqa: E402

from kdtree_engine import VerifyAttention  # noqa: E402
from kdtree_engine.masks import concat_tree_masks, mask_words, tree_mask_from_parents  # noqa: E402

SHAPES = "64x9x1x131072,16x33x4x131072,64x33x4x131072,128x33x4x131072"


def chain_inputs(H: int, n: int, B: int, prefix: int, page: int = 64):
    """Chain-tree inputs on the GPU: pages shuffled over the pool (the same pages for both kernels)."""
    L = prefix + n
    pages = math.ceil(L / page)
    kv_cache = torch.randn(B * pages, page, 576, device="cuda", dtype=torch.bfloat16)
    page_table = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages).contiguous()
    q = torch.randn(B * n, H, 576, device="cuda", dtype=torch.bfloat16)
    chain = tree_mask_from_parents(list(range(-1, n - 1)))
    tree_mask = concat_tree_masks([chain] * B, words=mask_words(n)).cuda()
    kv_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qo_indptr = torch.arange(0, B * n + 1, n, dtype=torch.int32, device="cuda")
    return q, kv_cache, page_table, tree_mask, kv_lens, qo_indptr


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def replay_sampled(fn, seconds: float) -> tuple[float, float, float, int]:
    """``fn`` captured in a CUDA graph and replayed for ``seconds``: (us per call, median SM MHz, median
    W, samples), the medians over ``nvidia-smi``'s 50 ms samples taken while the GPU was busy (NaN
    where none was)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    per_call = start.elapsed_time(end) / 1e3
    calls = max(1, int(seconds / max(per_call, 1e-6)))
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,utilization.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # nvidia-smi's first samples: idle
    start.record()
    for _ in range(calls):
        graph.replay()
    end.record()
    end.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    samples = []
    for line in out.strip().splitlines():
        try:
            mhz, watts, util = (float(v) for v in line.split(","))
        except ValueError:
            continue
        if util >= 90:
            samples.append((mhz, watts))
    mhz = statistics.median(s[0] for s in samples) if samples else float("nan")
    watts = statistics.median(s[1] for s in samples) if samples else float("nan")
    return start.elapsed_time(end) * 1e3 / calls, mhz, watts, len(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--flashmla", default=None, help="folder with flashmla_peer.py")
    ap.add_argument("--seconds", type=seconds, default=2.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    fm = None
    if a.flashmla:
        from kdtree_engine.bench.flashmla import load_flashmla_module
        fm = load_flashmla_module(a.flashmla)
    rows = []
    print(f"{'shape':>20} {'kernel':>8} | {'us':>9} {'MHz':>6} {'W':>6} {'kcycles':>8} {'samples':>7}")
    for shape in a.shapes.split(","):
        H, n, B, prefix = (int(v) for v in shape.split("x"))
        q, kv_cache, page_table, tree_mask, kv_lens, qo_indptr = chain_inputs(H, n, B, prefix)
        attn = VerifyAttention(B, n, H, "cuda", kernel="hopper")
        attn.plan(kv_lens.cpu(), qo_indptr.cpu())
        out, lse = empty_outputs(q)
        calls = {"hopper": lambda: attn.run(q, kv_cache, page_table, tree_mask, out=out, lse=lse)}
        if fm is not None:
            meta, splits = fm.get_mla_metadata(kv_lens, n, H, 1)
            q4 = q.view(B, n, H, 576)
            kc = kv_cache.view(-1, 64, 1, 576)
            calls["flashmla"] = lambda: fm.dense_decode_fwd(q4, kc, 512, kv_lens, page_table, 1 / math.sqrt(576),
                                                            True, meta, splits)
        for name, fn in calls.items():
            us, mhz, watts, samples = replay_sampled(fn, a.seconds)
            rows.append(dict(shape=shape, kernel=name, us=us, mhz=mhz, watts=watts, samples=samples))
            print(f"{shape:>20} {name:>8} | {us:9.1f} {mhz:6.0f} {watts:6.0f} {us * mhz / 1e3:8.1f} {samples:>7}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
