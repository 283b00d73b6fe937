"""Host microseconds of the verify fast path: ``VerifyAttention.plan`` for B = 1..64, and the
Python of ``VerifyAttention.run`` with the kernel launch stubbed out (what the wrapper itself
costs; Triton's own launch cost comes on top and is measured on the GPU by ``kdtree bench``'s
host column).

    PYTHONPATH=src python scripts/host_overhead.py [--device cpu|cuda] [--programs 132]

On the CPU the plan targets the H200's grid (64x64 tiles, 132 programs) without a GPU; on CUDA
the device's own config and grid, and the plan's host-to-device copy, are included.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def per_call_us(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e6 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--programs", type=int, default=132, help="grid on the CPU (the H200 runs 132)")
    p.add_argument("--calls", type=int, default=1000)
    a = p.parse_args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kdtree_engine import VerifyAttention
    from kdtree_engine.verify import VerifyPlan
    from kdtree_engine.verify.plan import CONFIGS

    cpu = a.device == "cpu"
    kw = dict(config=CONFIGS[0], num_programs=a.programs) if cpu else {}
    print(f"device {a.device}; {'64x64 tiles, %d programs' % a.programs if cpu else 'device config and grid'}")
    print("plan us, new tiles: the schedule computed every call (as for a step with new KV tile counts);")
    print("plan us, kept: other lengths within the same tiles (the schedule is reused, lengths rewritten)")
    print(f"{'B':>3} {'H':>4} {'n':>4} {'prefix':>7}  plan us, new tiles  plan us, kept  run us (launch stubbed)")
    for B in (1, 2, 4, 8, 16, 32, 64):
        for H, n, prefix in ((16, 9, 1024), (128, 9, 4096), (64, 64, 32768)):
            attn = VerifyAttention(64, 64, H, a.device, **kw)  # a decode loop's maxima
            kv = [prefix + n] * B
            qo = list(range(0, B * n + 1, n))
            computed = VerifyPlan(64, 64, H, a.device, schedule_cache=0, **kw)
            new_us = per_call_us(lambda: computed.plan(kv, qo), a.calls)
            kept = iter(range(10**9))
            kept_us = per_call_us(lambda: attn.plan([x - next(kept) % 8 for x in kv], qo), a.calls)
            T = B * n
            q = torch.zeros(T, H, 576, dtype=torch.bfloat16, device=a.device)
            kv_cache = torch.zeros(B * (prefix + n) + 1, 1, 576, dtype=torch.bfloat16, device=a.device)
            page_table = torch.zeros(B, prefix + n, dtype=torch.int32, device=a.device)
            mask = torch.zeros(T, 2, dtype=torch.int32, device=a.device)
            out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=a.device)
            lse = torch.empty(T, H, dtype=torch.float32, device=a.device)
            attn._launch = lambda *args: None
            run_us = per_call_us(lambda: attn.run(q, kv_cache, page_table, mask, out=out, lse=lse), a.calls)
            print(f"{B:>3} {H:>4} {n:>4} {prefix:>7}  {new_us:17.1f}  {kept_us:13.1f}  {run_us:23.1f}")


if __name__ == "__main__":
    main()
