"""Host microseconds of the verify fast path: ``VerifyAttention.plan`` for B = 1..64 (host lengths,
and device lengths: the device scheduler's launch), ``VerifyAttention.run`` and unplanned
``verify_attention``.

    PYTHONPATH=src python scripts/host_overhead.py [--device cpu|cuda] [--programs 132]

On the CPU the plan targets the H200's grid (64x64 tiles, 132 programs) without a GPU, and every
kernel launch is stubbed at the compiled kernel (each :class:`~kdtree_engine.verify.launch.Launcher`
gets a compiled kernel whose ``run`` does nothing), so the figures are all the Python of a call
but Triton's C launcher. On CUDA nothing is stubbed; the device's own config and grid, and the
plan's host-to-device copy, are included.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs of ``calls`` calls, per call (a shared machine's noise only adds)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--programs", type=int, default=132, help="grid on the CPU (the H200 runs 132)")
    p.add_argument("--calls", type=int, default=1000)
    a = p.parse_args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kdtree_engine import VerifyAttention, verify_attention
    from kdtree_engine.verify import VerifyPlan
    from kdtree_engine.verify.plan import CONFIGS

    cpu = a.device == "cpu"
    kw = dict(config=CONFIGS[0], num_programs=a.programs) if cpu else {}
    if cpu:
        stub_launches()
    print(f"device {a.device}; {'64x64 tiles, %d programs, launches stubbed' % a.programs if cpu else 'device config and grid'}")
    print("plan us, new tiles: the host schedule computed every call (a step with new KV tile counts);")
    print("plan us, kept: other lengths within the same tiles (the schedule is reused, lengths rewritten);")
    print("plan us, device: the device scheduler's launch; run us: one planned layer; no plan us: verify_attention")
    print(f"{'B':>3} {'H':>4} {'n':>4} {'prefix':>7}  {'new tiles':>9} {'kept':>6} {'device':>7} {'run':>6} {'no plan':>8}")
    for B in (1, 2, 4, 8, 16, 32, 64):
        for H, n, prefix in ((16, 9, 1024), (128, 9, 4096), (64, 64, 32768)):
            attn = VerifyAttention(64, 64, H, a.device, **kw)  # a decode loop's maxima
            kv = [prefix + n] * B
            qo = list(range(0, B * n + 1, n))
            computed = VerifyPlan(64, 64, H, a.device, schedule_cache=0, **kw)
            new_us = per_call_us(lambda: computed.plan(kv, qo), a.calls)
            kept = iter(range(10**9))
            kept_us = per_call_us(lambda: attn.plan([x - next(kept) % 8 for x in kv], qo), a.calls)
            kv_dev = torch.tensor(kv, dtype=torch.int32, device=a.device)
            qo_dev = torch.tensor(qo, dtype=torch.int32, device=a.device)
            dev_us = per_call_us(lambda: attn.workspace.plan_on_device(kv_dev, qo_dev), a.calls)
            attn.plan(kv, qo)
            T = B * n
            q = torch.zeros(T, H, 576, dtype=torch.bfloat16, device=a.device)
            kv_cache = torch.zeros(B * (prefix + n) + 1, 1, 576, dtype=torch.bfloat16, device=a.device)
            page_table = torch.zeros(B, prefix + n, dtype=torch.int32, device=a.device)
            mask = torch.zeros(T, 2, dtype=torch.int32, device=a.device)
            out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=a.device)
            lse = torch.empty(T, H, dtype=torch.float32, device=a.device)
            run_us = per_call_us(lambda: attn.run(q, kv_cache, page_table, mask, out=out, lse=lse), a.calls)
            args = (q, kv_cache, page_table, kv_dev, qo_dev, mask)
            # on the CPU the unplanned call plans from host lengths (the device path needs CUDA)
            unplanned_us = per_call_us(lambda: verify_attention(*args, out=out, lse=lse, validate=False), a.calls)
            print(f"{B:>3} {H:>4} {n:>4} {prefix:>7}  {new_us:9.1f} {kept_us:6.1f} {dev_us:7.1f} {run_us:6.1f} "
                  f"{unplanned_us:8.1f}", flush=True)


def stub_launches() -> None:
    """Every verify kernel's launcher gets a compiled kernel that does nothing (CPU measurements)."""
    from kdtree_engine.verify import combine, scheduler, triton_flash, triton_naive
    from kdtree_engine.verify.launch import Launcher

    class Compiled:
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            return None

    class Jit:
        def __init__(self, fn):
            self.arg_names = fn.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kw: Compiled()

    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    for launcher in (combine._COMBINE, scheduler._SCHEDULE, triton_flash._FLASH, triton_naive._NAIVE):
        assert isinstance(launcher, Launcher)
        launcher.fn = Jit(launcher.fn)


if __name__ == "__main__":
    main()
