"""Host microseconds of the verify fast path: ``VerifyAttention.plan`` (host lengths, and device
lengths: the device scheduler's launch), ``VerifyAttention.run`` and unplanned ``verify_attention``.

    PYTHONPATH=src python scripts/host_overhead.py [--device cpu|cuda] [--programs 132] [--shapes ...]

Two host times per call:

- ``burst``: after a sync, ``--burst`` calls (a few launches each: the launch queue never fills),
  the fastest of ``--repeats`` bursts, per call: what the host spends, whatever the GPU does
  (``--gpu-busy-ms``: the sync waits that long for a GPU busy loop first, as it waits for the
  kernels at long shapes: whether a host that idled in the wait then runs the burst slower);
- ``b2b``: ``--calls`` calls back to back without a sync, per call (issue 12's measure). Once the
  launch queue is full the host waits for the GPU, so this is at least the GPU time per call,
  printed beside it (``gpu``, CUDA events around the same calls).

On the CPU the plan targets the H200's grid (64x64 tiles, 132 programs) without a GPU, and every
kernel launch is stubbed at the compiled kernel (each :class:`~kdtree_engine.verify.launch.Launcher`
gets a compiled kernel whose ``run`` does nothing), so the figures are all the Python of a call but
Triton's launcher (on the GPU ~5-8 us per launch). Thread CPU time, the fastest of the repeats (a
shared machine's noise only adds). ``run`` is split into its parts: the input checks
(:class:`~kdtree_engine.verify.contract.InputCheck`), the prepared-launch lookup, the launches'
Python (on the CPU two: the kernel and the combine; on a GPU the kernel merges its splits itself,
one launch, unless ``--unfused``), and the rest (the method's own code). On the CPU the
unplanned call plans from host lengths; its GPU path (device scheduler, then the planned call) is
estimated as ``device plan + given plan`` (``verify_attention(..., plan=)``).

On CUDA nothing is stubbed: the device's own config and grid, the plan's host-to-device copy;
``run`` is split the same way (burst timing each part), its ``launch`` column the launches
through Triton's C launcher (the driver's launch call included): what no Python change removes.
Each kernel is compiled by the first call of a shape, before its timing; the default shapes use two
head counts, and each H compiles the scheduler, the kernel and the combine once (the compiles
dominate the run time: not measured here, expect well under a minute with a warm Triton cache).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

SHAPES = ((1, 16, 9, 1024), (8, 16, 9, 4096), (1, 128, 9, 4096), (4, 128, 33, 16384))  # B, H, n, prefix


def best_us(fn, calls: int, repeats: int, clock=time.perf_counter, sync=None) -> float:
    """The fastest of ``repeats`` runs of ``calls`` calls, per call, in us (``sync()`` before each run)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = clock()
        for _ in range(calls):
            fn()
        best = min(best, clock() - t0)
    return best * 1e6 / calls


def gpu_us(fn, calls: int) -> tuple[float, float]:
    """(host us per call, GPU us per call) of ``calls`` back-to-back calls (CUDA events)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = time.perf_counter() - t0
    end.synchronize()
    return host * 1e6 / calls, start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--programs", type=int, default=132, help="grid on the CPU (the H200 runs 132)")
    p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                   help="B x H x tree nodes x prefix, comma-separated")
    p.add_argument("--calls", type=int, default=1000, help="back-to-back calls (cuda) / calls per repeat (cpu)")
    p.add_argument("--burst", type=int, default=16, help="calls per burst (cuda)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--gpu-busy-ms", type=float, default=0.0, help="cuda: a GPU busy loop of about this "
                   "long (at 1.98 GHz) before each burst's sync")
    p.add_argument("--unfused", action="store_true", help="the separate combine kernel after every kernel "
                   "(combine.FUSED_COMBINE = False: two launches per call, as before run 30)")
    a = p.parse_args()
    cpu = a.device == "cpu"
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kdtree_engine import VerifyAttention, verify_attention
    from kdtree_engine.verify import VerifyPlan, combine
    from kdtree_engine.verify.api import _DEFAULT_SCALE, _prepared
    from kdtree_engine.verify.plan import CONFIGS

    combine.FUSED_COMBINE = not a.unfused

    kw = dict(config=CONFIGS[0], num_programs=a.programs) if cpu else {}
    if cpu:
        stub_launches()
        print(f"cpu: 64x64 tiles, {a.programs} programs, launches stubbed; thread CPU us per call")
        print("plan: new tiles (host schedule computed), kept (same tiles, lengths rewritten), device (scheduler launch)")
        print("run: checks + lookup + launches + rest = total; given: verify_attention(plan=); unplanned on a GPU ~ "
              "device + given")
        print(f"{'B':>3} {'H':>4} {'n':>4} {'prefix':>7} | {'new':>6} {'kept':>5} {'device':>6} | {'checks':>6} "
              f"{'lookup':>6} {'launch':>6} {'rest':>5} {'total':>6} | {'given':>6} {'unpl.':>6}")
    else:
        print(f"{torch.cuda.get_device_name()}: device config and grid; host us per call (burst of {a.burst}, "
              f"fastest of {a.repeats}); b2b / gpu: {a.calls} calls back to back, host / GPU us per call")
        print(f"run: checks + lookup + launches ({'kernel, combine' if a.unfused else 'one'}, through Triton's C "
              "launcher) + rest = run")
        print(f"{'B':>3} {'H':>4} {'n':>4} {'prefix':>7} | {'plan kept':>9} {'device':>6} | {'checks':>6} {'lookup':>6} "
              f"{'launch':>6} {'rest':>5} {'run':>5} {'b2b':>6} {'gpu':>6} | {'no plan':>7} {'b2b':>6} {'gpu':>6} | "
              f"{'no plan / run':>13}")
    def busy_sync():
        torch.cuda._sleep(int(a.gpu_busy_ms * 1.98e6))  # clock cycles
        torch.cuda.synchronize()

    sync = None if cpu else busy_sync if a.gpu_busy_ms > 0 else torch.cuda.synchronize
    clock = time.thread_time if cpu else time.perf_counter
    calls = a.calls if cpu else a.burst
    for shape in a.shapes.split(","):
        B, H, n, prefix = (int(x) for x in shape.split("x"))
        attn = VerifyAttention(64, 64, H, a.device, **kw)  # a decode loop's maxima
        kv = [prefix + n] * B
        qo = list(range(0, B * n + 1, n))
        kept = iter(range(10**9))
        kept_us = best_us(lambda: attn.plan([x - next(kept) % 8 for x in kv], qo), calls, a.repeats, clock, sync)
        kv_dev = torch.tensor(kv, dtype=torch.int32, device=a.device)
        qo_dev = torch.tensor(qo, dtype=torch.int32, device=a.device)
        dev_us = best_us(lambda: attn.workspace.plan_on_device(kv_dev, qo_dev), calls, a.repeats, clock, sync)
        attn.plan(kv, qo)
        T = B * n
        q = torch.zeros(T, H, 576, dtype=torch.bfloat16, device=a.device)
        kv_cache = torch.zeros(B * (prefix + n) + 1, 1, 576, dtype=torch.bfloat16, device=a.device)
        # distinct slots: an all-zero table sends every KV read to one cache line (one L2 slice)
        page_table = torch.arange(B * (prefix + n), dtype=torch.int32, device=a.device).view(B, prefix + n)
        mask = torch.zeros(T, 2, dtype=torch.int32, device=a.device)
        out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=a.device)
        lse = torch.empty(T, H, dtype=torch.float32, device=a.device)
        layer = (q, kv_cache, page_table, mask)
        args = (q, kv_cache, page_table, kv_dev, qo_dev, mask)

        def run():
            attn.run(*layer, out=out, lse=lse)

        def unplanned():  # on the CPU: plans from host lengths
            verify_attention(*args, out=out, lse=lse, validate=False)

        run_us = best_us(run, calls, a.repeats, clock, sync)
        ws = attn.workspace
        tensors = (q, kv_cache, page_table, ws.kv_lens, ws.qo_indptr, mask, out, lse)
        sig, ptrs = attn._check(*tensors)
        call = _prepared(ws, sig, attn.kernel, _DEFAULT_SCALE, tensors)
        check_us = best_us(lambda: attn._check(*tensors), calls, a.repeats, clock, sync)
        lookup_us = best_us(lambda: _prepared(ws, sig, attn.kernel, _DEFAULT_SCALE, tensors), calls, a.repeats,
                            clock, sync)
        launch_us = best_us(lambda: call.run(tensors, ptrs, ws.tables.num_groups), calls, a.repeats, clock, sync)
        rest = run_us - check_us - lookup_us - launch_us
        if cpu:
            computed = VerifyPlan(64, 64, H, a.device, schedule_cache=0, **kw)
            new_us = best_us(lambda: computed.plan(kv, qo), 10, a.repeats, clock)
            given_us = best_us(lambda: verify_attention(*args, out=out, lse=lse, plan=ws, validate=False), calls,
                               a.repeats, clock)
            print(f"{B:>3} {H:>4} {n:>4} {prefix:>7} | {new_us:6.1f} {kept_us:5.1f} {dev_us:6.1f} | {check_us:6.1f} "
                  f"{lookup_us:6.1f} {launch_us:6.1f} {rest:5.1f} {run_us:6.1f} | {given_us:6.1f} "
                  f"{dev_us + given_us:6.1f}", flush=True)
        else:
            unplanned_us = best_us(unplanned, calls, a.repeats, clock, sync)
            run_b2b, run_gpu = gpu_us(run, a.calls)
            un_b2b, un_gpu = gpu_us(unplanned, a.calls)
            print(f"{B:>3} {H:>4} {n:>4} {prefix:>7} | {kept_us:9.1f} {dev_us:6.1f} | {check_us:6.1f} {lookup_us:6.1f} "
                  f"{launch_us:6.1f} {rest:5.1f} {run_us:5.1f} {run_b2b:6.1f} {run_gpu:6.1f} | {unplanned_us:7.1f} "
                  f"{un_b2b:6.1f} {un_gpu:6.1f} | {unplanned_us / run_us:13.2f}", flush=True)


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
