"""Does compute-sanitizer racecheck follow the Hopper kernel's row-vector handoff between two
warp-specialised partitions? A reduced Gluon kernel, three modes, each checked for its result:

    PYTHONPATH=src compute-sanitizer --tool racecheck python3 scripts/racecheck_probe.py [mbarrier|named|none]

On the H200 with compute-sanitizer 13.0 (perf log run 23) every mode reports one hazard, at the
kernel's entry and its ``warp_specialize`` call (Triton's partition start-up), and the ``none``
mode's real race (its result is wrong) is not reported: racecheck cannot judge such kernels.

  mbarrier: producer stores a [128] vector, thread_barrier, one thread arrives on READY; consumer
            waits READY, loads, thread_barrier, one thread arrives on FREE; producer waits FREE
            before the next store (the kernel's pattern, correct by the PTX memory model)
  named:    the same handoff with named hardware barriers (bar.arrive / bar.sync over 256 threads)
  none:     no synchronisation at all (a real race racecheck must report)
"""
import sys
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

ROUNDS = 8


@gluon.jit
def _named(x, ASM: gl.constexpr):
    return gl.inline_asm_elementwise(ASM + " mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _producer(buf, bars, out, ROUNDS: gl.constexpr, MODE: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    o = gl.arange(0, 128, layout=L)
    for r in range(ROUNDS):
        if MODE == 0:
            mbarrier.wait(bars.index(1), (r & 1) ^ 1)
        if MODE == 1:
            if r > 0:
                o = _named(o, "bar.sync 9, 256;")
        buf.store(o.to(gl.float32) + r)
        if MODE == 0:
            gl.thread_barrier()
            mbarrier.arrive(bars.index(0))
        if MODE == 1:
            o = _named(o, "bar.arrive 8, 256;")


@gluon.jit
def _consumer(buf, bars, out, ROUNDS: gl.constexpr, MODE: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    o = gl.arange(0, 128, layout=L)
    acc = gl.zeros([128], gl.float32, layout=L)
    for r in range(ROUNDS):
        if MODE == 0:
            mbarrier.wait(bars.index(0), r & 1)
        if MODE == 1:
            o = _named(o, "bar.sync 8, 256;")
        acc += buf.load(L)
        if MODE == 0:
            gl.thread_barrier()
            mbarrier.arrive(bars.index(1))
        if MODE == 1:
            if r < ROUNDS - 1:
                o = _named(o, "bar.arrive 9, 256;")
    gl.store(out + o, acc)


@gluon.jit
def _probe_kernel(out, ROUNDS: gl.constexpr, MODE: gl.constexpr, num_warps: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    fence_async_shared()
    gl.warp_specialize([(_producer, (buf, bars, out, ROUNDS, MODE)), (_consumer, (buf, bars, out, ROUNDS, MODE))],
                       [4], [232])



if __name__ == "__main__":
    for mode, name in enumerate(("mbarrier", "named", "none")):
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        out = torch.zeros(128, device="cuda")
        _probe_kernel[(1,)](out, ROUNDS, mode, num_warps=4)
        torch.cuda.synchronize()
        want = torch.arange(128, device="cuda", dtype=torch.float32) * ROUNDS + sum(range(ROUNDS))
        print(f"{'PASS' if torch.equal(out, want) else 'DIFF'} race probe mode={name}", flush=True)
