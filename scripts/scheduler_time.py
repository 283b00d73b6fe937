"""GPU time of the device scheduler (one ``VerifyPlan.plan_on_device``), and its tables checked
against the host's tables of the same schedule.

    PYTHONPATH=src python scripts/scheduler_time.py [--modules kdtree_engine.verify.scheduler,...]
        [--schedule line|parts|rounds|auto]

Per shape (B x heads x tree nodes x prefix: every sequence has ``prefix + nodes`` KV positions)
and per scheduler module (``--modules``, comma-separated; each must define ``DeviceScheduler`` as
:mod:`kdtree_engine.verify.scheduler` does; ``module:N`` passes ``block_s=N``, the pieces per
program, ``module:N:W`` also ``num_warps=W``): the module's scheduler launches for a plan of
``--max-batch`` 64 and ``--max-tree-nodes`` 65 (one plan per head count, the device's config and
grid), captured ``--calls`` times in a CUDA graph; the graph replayed ``--replays`` times, the
fastest replay per call in us. The tables the last replay wrote are compared with the host's
tables of ``--schedule`` (the line schedule, or the KV parts or rounds schedule where it applies:
:func:`~kdtree_engine.testing.device_tables`) of the same lengths (``ok`` or ``DIFF``). To A/B another scheduler, e.g. the
two-launch one of branch ``parallel-scheduler`` (with the launch module it imports; a scheduler
whose constructor takes a ``scratch`` buffer, as that one and main's do, gets one):

    V=src/kdtree_engine/verify
    git show parallel-scheduler:$V/launch.py > $V/launch_old.py
    git show parallel-scheduler:$V/scheduler.py | sed 's/from .launch import/from .launch_old import/' \\
        > $V/scheduler_old.py
    PYTHONPATH=src python scripts/scheduler_time.py \\
        --modules kdtree_engine.verify.scheduler,kdtree_engine.verify.scheduler:64,kdtree_engine.verify.scheduler_old

Each module compiles once per head count and B (a few seconds each on a warm machine).
``--device cpu`` runs the scheduler under Triton's interpreter at the H200's grid (64 x 64 tiles,
132 programs) and only checks the tables.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os

SHAPES = "1x16x9x16384,4x64x33x16384,16x128x33x16384,64x16x9x4096,64x128x33x16384,64x128x65x16384"
MAX_BATCH, MAX_TREE_NODES = 64, 65


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", default="kdtree_engine.verify.scheduler")
    ap.add_argument("--shapes", default=SHAPES, help="B x heads x nodes x prefix, comma-separated")
    ap.add_argument("--calls", type=int, default=20, help="scheduler calls per graph")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH, help="the plans' max_batch (at least every B)")
    ap.add_argument("--max-tree-nodes", type=int, default=MAX_TREE_NODES, help="the plans' max_tree_nodes")
    ap.add_argument("--schedule", default="line", choices=("line", "parts", "rounds", "auto"), help="what the scheduler writes")
    a = ap.parse_args()
    cpu = a.device == "cpu"
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton loads

    import numpy as np
    import torch

    from kdtree_engine.bench.timing import capture_graph, event_times_ms
    from kdtree_engine.testing import device_tables
    from kdtree_engine.verify.plan import CONFIGS, MIN_SPLIT_TILES, VerifyPlan

    modules = a.modules.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    for B, _, n, _ in shapes:  # the scheduler clamps to the plan's sizes: a larger shape would read as DIFF
        if B > a.max_batch or n > a.max_tree_nodes:
            ap.error(f"shape with B={B}, {n} nodes: past --max-batch {a.max_batch} / --max-tree-nodes {a.max_tree_nodes}")
    plans = {}
    print(f"{torch.cuda.get_device_name() if not cpu else 'cpu (interpreter)'}; us per plan_on_device "
          f"(CUDA-graph replay, fastest of {a.replays} x {a.calls} calls); tables vs the host's {a.schedule} schedule")
    print("| B x H x nodes x prefix | segments | " + " | ".join(modules) + " |")
    print("|---|---|" + "---|" * len(modules))
    for B, H, n, prefix in shapes:
        if H not in plans:
            kw = dict(config=CONFIGS[0], num_programs=132) if cpu else {}
            plans[H] = VerifyPlan(a.max_batch, a.max_tree_nodes, H, a.device, **kw)
        p = plans[H]
        kv_host, n_host = np.full(B, prefix + n), np.full(B, n)
        kv = torch.tensor(kv_host, dtype=torch.int32, device=a.device)
        qo = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=a.device)
        first, seg, grp = device_tables(p, kv_host, n_host, a.schedule)
        S, G = seg.shape[1], grp.shape[1]
        cells = []
        for spec in modules:
            name, _, tail = spec.partition(":")
            block_s, _, warps = tail.partition(":")
            cls = importlib.import_module(name).DeviceScheduler
            # an older scheduler's scratch: room for its per-sequence and per-program arrays
            scratch = ((torch.empty(16 * (a.max_batch + 1) + 8 * (p.num_programs + 2), dtype=torch.int64,
                                    device=a.device),) if "scratch" in inspect.signature(cls).parameters else ())
            sched = cls(p.kv_lens_buf, p.qo_indptr_buf, p.tables, *scratch, num_heads=H, max_batch=a.max_batch,
                        max_tree_nodes=a.max_tree_nodes, min_split=MIN_SPLIT_TILES,
                        **({"segment_tiles": p.costs.segment_tiles}
                           if "segment_tiles" in inspect.signature(cls).parameters else {}),
                        **({"lockstep": p.costs.lockstep} if "lockstep" in inspect.signature(cls).parameters else {}),
                        **(dict(block_s=int(block_s)) if block_s else {}),
                        **(dict(num_warps=int(warps)) if warps else {}))
            launch = sched.prepare(kv, qo, **(dict(schedule=a.schedule) if a.schedule != "line" else {}))
            ptrs = (kv.data_ptr(), qo.data_ptr())
            p.tables.segments.fill_(-9)
            p.tables.groups.fill_(-9)
            if cpu:
                launch((kv, qo), ptrs)
                time = "-"
            else:
                graph = capture_graph(lambda _i: launch((kv, qo), ptrs), list(range(a.calls)))
                time = f"{min(event_times_ms(lambda _j: graph.replay(), a.replays)) * 1e3 / a.calls:.1f}"
            t = p.tables
            same = (np.array_equal(t.prog_first_seg.cpu().numpy(), first)
                    and np.array_equal(t.segments.cpu().numpy()[:, :S], seg)
                    and int(t.group_count[0]) == G and np.array_equal(t.groups.cpu().numpy()[:, :G], grp)
                    and p.kv_lens_buf[:B].tolist() == kv.tolist() and p.qo_indptr_buf[: B + 1].tolist() == qo.tolist())
            cells.append(f"{time} {'ok' if same else 'DIFF'}")
        print(f"| {B}x{H}x{n}x{prefix} | {S} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
