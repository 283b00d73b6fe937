"""The SM clock while a kernel runs back to back: this tree's Hopper kernel and FlashMLA, per shape.

    PYTHONPATH=src python scripts/sm_clock.py [--shapes 16x9x4x16384x64,...] [--seconds 2] [--flashmla DIR]
        [--json clock.json]

The timeline (``scripts/hopper_timeline.py``) counts ``%clock64`` cycles, the benchmark microseconds;
turning one into the other needs the clock the SMs ran at, which under a kernel that fills the chip
sits below the card's maximum (its power limit), and may differ between two kernels. Per shape and
kernel: a CUDA graph of ``--calls`` planned calls replayed for ``--seconds``, while ``nvidia-smi
-lms 20`` samples the SM clock and the power draw; the samples of the first 0.3 s (the clock
settling) are dropped. Printed: each kernel's time a call (median replay), its clocks' median and
range, its power's median, and its time a call in cycles at that clock.
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
from ab_hopper import planned_call  # noqa: E402
from tune_flash import equal_step, time_graph  # noqa: E402

from kdtree_engine.bench.flashmla import chain_call, load_flashmla_module  # noqa: E402
from kdtree_engine.verify import hopper  # noqa: E402

SETTLE_S = 0.3
SAMPLE_MS = 20


def sampled_clocks(fn, calls: int, seconds: float) -> tuple[list[float], list[float]]:
    """SM clocks (MHz) and power draws (W) sampled while a graph of ``calls`` calls of ``fn`` is
    replayed for ``seconds`` (after ``SETTLE_S``)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True)
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    sampler.terminate()
    lines = sampler.communicate()[0].split("\n")
    rows = [line.split(",") for line in lines if line.count(",") == 1]
    rows = rows[int(SETTLE_S * 1000 / SAMPLE_MS):]
    return [float(r[0]) for r in rows], [float(r[1]) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16x9x4x16384x64,16x9x1x131072x64,16x9x4x131072x64",
                   help="H x nodes x B x prefix x page size, comma-separated")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--calls", type=int, default=8, help="calls a graph, back to back")
    p.add_argument("--flashmla", metavar="DIR", help="FlashMLA too (flashmla_peer.py in DIR): the shape as chain "
                   "trees, pages of 64")
    p.add_argument("--json")
    a = p.parse_args()
    fm = load_flashmla_module(a.flashmla) if a.flashmla else None
    rows = []
    for text in a.shapes.split(","):
        H, n, B, prefix, ps = (int(x) for x in text.split("x"))
        c, plan = equal_step(H, n, B, prefix, ps)
        out = torch.empty(B * n, H, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(B * n, H, device="cuda", dtype=torch.float32)
        kernels = {"hopper": planned_call(hopper, c, plan, out, lse)}
        if fm is not None:
            kernels["flashmla"] = chain_call(fm, H, n, B, prefix, 1.0 / math.sqrt(576), "cuda")
        for name, fn in kernels.items():
            us = time_graph(fn, calls=a.calls) * 1e6
            mhz, watts = sampled_clocks(fn, a.calls, a.seconds)
            if not mhz:
                print(f"{text} {name}: no clock samples", flush=True)
                continue
            clock = statistics.median(mhz)
            row = dict(shape=text, kernel=name, us=us, mhz_median=clock, mhz_min=min(mhz), mhz_max=max(mhz),
                       samples=len(mhz), watts_median=statistics.median(watts), cycles=us * clock)
            rows.append(row)
            print(f"{text} {name:8s} {us:9.1f} us  SM clock {clock:6.0f} MHz ({min(mhz):.0f}-{max(mhz):.0f}, "
                  f"{len(mhz)} samples)  {row['watts_median']:5.0f} W  {row['cycles']:10.0f} cycles a call",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
