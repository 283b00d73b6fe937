"""The clock of every benchmark of the package (``kdtree bench``, ``kdtree_engine.kvpool_bench``,
``kdtree_engine.ddtree.bench``): CUDA events, CUDA-graph replay, L2 flush, wall clock, medians;
and the device ceilings (copy bandwidth, matmul rate). The machine description is
:func:`kdtree_engine.bench.report.machine_line`.

Method (docs/benchmark.md, "How it times"):

- A call under test is ``run(i)``: one launch on input set ``i`` (sets rotate so consecutive calls
  do not find their inputs in L2). ``run`` must not sync with the host.
- Warm-up first (compilation, allocator, clocks), then ``n`` samples, each bracketed by a pair of
  CUDA events recorded on the current stream; all events are read after one final synchronize.
  A ``torch.cuda._sleep`` spin before the loop lets the host queue the launches ahead of the GPU,
  so the events measure GPU time, not launch latency.
- Short calls are captured in a CUDA graph of ``k`` calls (rotating through the sets) and each
  sample is one replay, divided by ``k``: no Python or launch overhead in the figure. The graph is
  warmed on a side stream before capture, as the torch documentation prescribes.
- Reported: median (and min, quartiles) over the samples.
- Calls that must find nothing in L2 (a model step streams 61 layers of KV) are preceded by an
  :class:`L2Flush`; host-bound calls are timed as wall-clock latency between device syncs
  (:func:`wall_times_ms`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

__all__ = [
    "SLEEP_CYCLES_PER_MS",
    "Timing",
    "Ceilings",
    "Clock",
    "L2Flush",
    "summarize",
    "merge_timings",
    "time_cuda",
    "time_cpu",
    "head_start",
    "event_times_ms",
    "wall_times_ms",
    "capture_graph",
    "copy_tbps",
    "measure_ceilings",
    "back_to_back_us",
    "host_us_per_call",
]

SLEEP_CYCLES_PER_MS = 2_000_000  # ~2 GHz SM clock; only sizes the head-start spin


@dataclass
class Timing:
    median_us: float
    min_us: float
    p25_us: float
    p75_us: float
    samples: int  # timed samples (events pairs or wall-clock measurements)
    calls_per_sample: int  # calls inside one sample (graph of k calls), already divided out
    method: str  # "graph", "eager" or "cpu-wall"
    note: str = ""
    times_us: tuple[float, ...] = field(default=(), repr=False)  # the samples (not in to_dict)

    @property
    def spread(self) -> float:
        """Inter-quartile range relative to the median."""
        return (self.p75_us - self.p25_us) / self.median_us if self.median_us > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["times_us"]
        d["spread"] = self.spread
        return d


def summarize(times_us: list[float], calls_per_sample: int, method: str, note: str = "") -> Timing:
    """Median, min and quartiles of per-call times (already divided by ``calls_per_sample``)."""
    if not times_us:
        raise ValueError("no samples")
    xs = sorted(times_us)
    if len(xs) >= 4:
        q = statistics.quantiles(xs, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25, p75 = xs[0], xs[-1]
    return Timing(
        median_us=statistics.median(xs),
        min_us=xs[0],
        p25_us=p25,
        p75_us=p75,
        samples=len(xs),
        calls_per_sample=calls_per_sample,
        method=method,
        note=note,
        times_us=tuple(times_us),
    )


def merge_timings(parts: list[Timing]) -> Timing:
    """One timing of the samples of several (rounds of one measurement): median and quartiles over
    all their samples; method and notes as given (joined where they differ)."""
    methods = sorted({t.method for t in parts})
    notes = [t.note for t in parts if t.note]
    return summarize([x for t in parts for x in t.times_us], max(t.calls_per_sample for t in parts),
                     "/".join(methods), "; ".join(dict.fromkeys(notes)))


def head_start(ms: float) -> None:
    """Keep the GPU busy for ~``ms`` so the host can queue the timed launches ahead of it."""
    if ms > 0 and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(ms * SLEEP_CYCLES_PER_MS))


class L2Flush:
    """Overwrites a buffer larger than the L2 cache (256 MiB by default), so the next launch finds
    none of its inputs there. One ``fill_`` launch per call."""

    def __init__(self, device, nbytes: int = 256 << 20):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._i = 0

    def __call__(self) -> None:
        self._i += 1
        self.buf.fill_(self._i & 0xFF)


def event_times_ms(launch: Callable[[int], None], n: int, head_start_ms: float = 0.0, *,
                   before: Callable[[int], None] | None = None, flush: L2Flush | None = None,
                   head_start_each_ms: float = 0.0) -> list[float]:
    """Milliseconds of ``launch(j)`` for j in 0..n-1, each between two CUDA events.

    ``head_start_ms``: one spin before the loop. Per call, untimed and in this order: ``before(j)``
    (set-up launches), ``flush()`` (L2), a ``head_start_each_ms`` spin. Synchronizes before and once
    after the loop (never inside it).
    """
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda.synchronize()
    head_start(head_start_ms)
    for j in range(n):
        if before is not None:
            before(j)
        if flush is not None:
            flush()
        head_start(head_start_each_ms)
        starts[j].record()
        launch(j)
        ends[j].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def wall_times_ms(launch: Callable[[int], None], n: int, *, before: Callable[[int], None] | None = None,
                  device=None) -> list[float]:
    """Wall-clock milliseconds of ``launch(j)`` for j in 0..n-1 (host time included). On a CUDA
    ``device`` each call is bracketed by device syncs, so the figure is its whole latency."""
    cuda = device is not None and torch.device(device).type == "cuda"
    out = []
    for j in range(n):
        if before is not None:
            before(j)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        launch(j)
        if cuda:
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


class Clock:
    """Per-call times of ``fn(i)`` on one device: CUDA events with an L2 flush and a head-start spin
    before each call; on the CPU (smoke runs only, not performance figures) the wall clock."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.flush = L2Flush(self.device) if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def times_ms(self, fn: Callable[[int], None], reps: int, *, flush: bool = True, head_ms: float = 0.5,
                 before: Callable[[int], None] | None = None) -> list[float]:
        """Milliseconds of ``fn(i)`` for i < reps (events read after one final sync);
        ``before(i)`` runs untimed first; ``flush``: empty the L2 before each call."""
        if not self.cuda:
            return wall_times_ms(fn, reps, before=before)
        return event_times_ms(fn, reps, before=before, flush=self.flush if flush else None,
                              head_start_each_ms=head_ms)


def capture_graph(run: Callable[[int], None], calls: list[int]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``run(i)`` for i in ``calls``, warmed on a side stream before capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in calls[: min(len(calls), 3)]:
            run(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in calls:
            run(i)
    torch.cuda.synchronize()
    return graph


def n_samples(per_sample_us: float, *, repeats: int, min_repeats: int, budget_s: float) -> int:
    """Samples that fit ``budget_s``, within ``[min_repeats, repeats]``; only 3 for calls so slow
    that ``min_repeats`` of them would take more than ten budgets."""
    fit = int(budget_s * 1e6 / max(per_sample_us, 1e-3))
    low = min_repeats if per_sample_us * min_repeats <= 10 * budget_s * 1e6 else min(3, min_repeats)
    return max(low, min(repeats, fit))


def time_cuda(
    run: Callable[[int], None],
    n_sets: int,
    *,
    repeats: int = 100,
    min_repeats: int = 5,
    budget_s: float = 1.0,
    use_graph: bool = True,
    graph_max_us: float = 2000.0,
    graph_min_replay_us: float = 200.0,
    graph_max_calls: int = 64,
) -> Timing:
    """Median time of one call of ``run`` on CUDA.

    1. Warm pass: each set once, timed with one event pair -> estimate per call.
    2. If ``use_graph`` and the estimate is under ``graph_max_us``: capture a graph of the sets
       (each once), time it, re-capture with ``k`` calls so one replay lasts at least
       ``graph_min_replay_us``, and sample replays. If capture fails, fall back to eager.
    3. Otherwise eager: each sample is one call, sets in rotation.

    The number of samples is what fits ``budget_s`` of timed GPU time, within
    ``[min_repeats, repeats]``.
    """
    calls = list(range(n_sets))
    # 1. warm pass (compiled already by the correctness check; this also settles clocks)
    warm = event_times_ms(lambda _j: [run(i) for i in calls], 1)[0] * 1e3 / n_sets
    note = ""
    if use_graph and warm < graph_max_us:
        graph = None
        try:
            graph = capture_graph(run, calls)
            probe = event_times_ms(lambda _j: graph.replay(), 3)
            per_call = statistics.median(probe) * 1e3 / len(calls)
            reps = max(1, math.ceil(graph_min_replay_us / max(per_call * n_sets, 1e-3)))
            k_calls = calls * reps
            if len(k_calls) > graph_max_calls:
                k_calls = calls * max(1, graph_max_calls // n_sets)
            if len(k_calls) != len(calls):
                graph = None  # free the first graph (and its pool) before the second capture
                graph = capture_graph(run, k_calls)
            k = len(k_calls)
            n = n_samples(per_call * k, repeats=repeats, min_repeats=min_repeats, budget_s=budget_s)
            ms = event_times_ms(lambda _j: graph.replay(), n, head_start_ms=min(20.0, 0.05 * n))
            return summarize([t * 1e3 / k for t in ms], k, "graph")
        except Exception as e:  # capture not possible for this kernel: time it eagerly
            first = (str(e).splitlines() or [""])[0][:80]
            note = f"graph capture failed ({type(e).__name__}: {first}); eager"
            torch.cuda.synchronize()  # a sticky CUDA error surfaces here and ends the sweep
        finally:
            del graph
    n = n_samples(warm, repeats=repeats, min_repeats=min_repeats, budget_s=budget_s)
    ms = event_times_ms(lambda j: run(j % n_sets), n, head_start_ms=min(20.0, 0.1 * n))
    return summarize([t * 1e3 for t in ms], 1, "eager", note)


def time_cpu(run: Callable[[int], None], n_sets: int, *, repeats: int = 2) -> Timing:
    """Wall-clock time of ``run`` on the CPU (the interpreter): NOT a performance figure.
    (The correctness check before it was the warm-up.)"""
    ms = wall_times_ms(lambda j: run(j % n_sets), max(1, repeats))
    return summarize([t * 1e3 for t in ms], 1, "cpu-wall")


def back_to_back_us(run: Callable[[int], None], n_sets: int, *, calls: int = 200, warmup: int = 10) -> float:
    """Microseconds per call of ``run`` called back to back (sets in rotation) between two CUDA
    events, with no head start: the larger of the host's time per call and the GPU's, i.e. what
    an eager caller gets (``triton.testing.do_bench``'s view of a Python call)."""
    for j in range(warmup):
        run(j % n_sets)
    return statistics.median(event_times_ms(lambda _k: [run(j % n_sets) for j in range(calls)], 3)) * 1e3 / calls


def host_us_per_call(run: Callable[[int], None], n_sets: int, *, calls: int = 1000, burst: int = 16) -> float:
    """Host wall microseconds per call of ``run``: ``calls`` calls (sets in rotation) in bursts of
    ``burst`` back-to-back calls without a sync, each burst after a sync, the fastest burst per call.

    Bursts, not one run of ``calls``: when the GPU takes longer per call than the host, a long run
    fills the launch queue and each later launch waits for a free slot, so its figure becomes the
    GPU's time (H200 run 25: 31 us per two-launch call whose host cost is 19 us)."""
    for j in range(min(calls, 10)):
        run(j % n_sets)
    best = float("inf")
    j = 0
    for _ in range(max(1, calls // burst)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(burst):
            run(j % n_sets)
            j += 1
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best * 1e6 / burst


# ----------------------------------------------------------------------------------------------
# Ceilings


@dataclass
class Ceilings:
    """Measured in this run on this device."""

    copy_tbps: float  # device-to-device copy, bytes read + written, TB/s
    matmul_tflops: dict  # dtype name -> dense matmul TFLOP/s (8192^3)
    copy_bytes: int
    matmul_n: int

    def copy_bps(self) -> float:
        return self.copy_tbps * 1e12

    def matmul_fps(self, dtype: str) -> float:
        return self.matmul_tflops.get(dtype, self.matmul_tflops.get("bf16")) * 1e12

    def to_dict(self) -> dict:
        return asdict(self)


def copy_tbps(numel: int, repeats: int, device, clock: Clock | None = None) -> float:
    """Copy bandwidth ``dst.copy_(src)`` of ``numel`` bf16 values, bytes read + written, TB/s,
    median of ``repeats`` after warm-up: CUDA events after one 2 ms head start, or ``clock`` (no L2
    flush; e.g. a CPU :class:`Clock`'s wall clock in a smoke run)."""
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if clock is None:
        ms = event_times_ms(lambda _j: dst.copy_(src), repeats, head_start_ms=2.0)
    else:
        ms = clock.times_ms(lambda _j: dst.copy_(src), repeats, flush=False)
    return 2 * numel * src.element_size() / (statistics.median(ms) * 1e-3) / 1e12


def _matmul_tflops(n: int, dtype: torch.dtype, repeats: int, device) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(5):
        torch.mm(a, b, out=c)
    ms = event_times_ms(lambda _j: torch.mm(a, b, out=c), repeats, head_start_ms=2.0)
    return 2 * n**3 / (statistics.median(ms) * 1e-3) / 1e12


def measure_ceilings(
    dtypes=("bf16",), *, copy_gib: float = 1.0, matmul_n: int = 8192, repeats: int = 30, device="cuda"
) -> Ceilings:
    """Copy bandwidth (``dst.copy_(src)`` of ``copy_gib`` GiB, counted read + write) and the
    dense matmul rate (``matmul_n``^3, per dtype), median of ``repeats`` after warm-up."""
    from .shapes import DTYPES

    numel = int(copy_gib * 2**30) // 2
    copy = copy_tbps(numel, repeats, device)
    tflops = {name: _matmul_tflops(matmul_n, DTYPES[name], repeats, device) for name in dtypes}
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return Ceilings(copy_tbps=copy, matmul_tflops=tflops, copy_bytes=2 * numel * 2, matmul_n=matmul_n)
