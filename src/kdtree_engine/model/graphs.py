"""A model step's phases run eagerly or as captured CUDA graphs, and the clock that splits its time.

A step is a list of :class:`~kdtree_engine.model.mla.Phase` closures over the step's state (the
speculative loop builds one list per step shape, its "bucket"). :class:`StepGraph` runs them in
one of three modes:

- ``"eager"``: each phase is called (the CPU, or ``graphs="off"``);
- ``"step"``: the whole list captured as ONE CUDA graph, replayed per step (the fast path);
- ``"phases"``: one CUDA graph per phase, replayed in order with CUDA events between them (the
  time split by phase kind; the gaps between graph launches cost a few microseconds each).

A graph mode runs its first step eagerly on a side stream (JIT compiles, lazy initialisation,
allocator warm-up: CUDA's rule that a captured workload is warmed up first), captures at the
second step and replays from then on. Capturing does not run the kernels: a captured step is
replayed at once. Inputs the phases read (e.g. draft logits) must live in buffers allocated
before the capture, written in place before each replay; the phases' outputs are the tensors
they made during the capture, rewritten by every replay.

:class:`PhaseClock` accumulates the time of the phases by kind: CUDA events on the GPU (resolved
once, by :meth:`PhaseClock.flush`), ``time.perf_counter`` on the CPU.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import torch

from .mla import Phase

__all__ = ["GRAPH_MODES", "PhaseClock", "StepGraph"]

GRAPH_MODES = ("eager", "step", "phases")
CAPTURE_ERROR_MODE = "thread_local"  # see StepGraph._capture


class PhaseClock:
    """Time of a step's phases by kind (``seconds[kind]``), GPU time on CUDA, host time on the CPU.

    ``seconds["step"]`` holds what a ``"step"`` graph replay takes as a whole (its phases are not
    separable); :attr:`total_s` is the sum over every kind.
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = {}
        self._pending: list = []

    def mark(self):
        """A point in time: a recorded CUDA event on the current stream, or the host clock."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, kind: str, start, end) -> None:
        """Book ``end - start`` (two :meth:`mark` results) to ``kind``."""
        if self.cuda:
            self._pending.append((kind, start, end))
        else:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + end - start

    def flush(self) -> None:
        """Resolve the pending CUDA event pairs (waits for them)."""
        for kind, a, b in self._pending:
            b.synchronize()
            self.seconds[kind] = self.seconds.get(kind, 0.0) + a.elapsed_time(b) / 1e3
        self._pending.clear()

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


class StepGraph:
    """The phases of one step shape, run per step in ``mode`` (see the module docstring).

    Args:
        phases: the step, in order; each phase's ``run()`` must have fixed shapes and no host sync
            for a graph mode.
        mode: ``"eager"``, ``"step"`` or ``"phases"`` (the graph modes need CUDA).
        device: where the phases run.

    :meth:`run` returns True when the phases' Python ran in this call (eager, warm-up or capture),
    False for a pure replay: host-side effects of a phase (such as
    :meth:`~kdtree_engine.kvpool.KVPool.commit`'s bookkeeping) must then be redone by the caller.
    ``capture_s``: wall seconds spent capturing (not counted as decoding).
    """

    def __init__(self, phases: Sequence[Phase], mode: str, device: torch.device):
        if mode not in GRAPH_MODES:
            raise ValueError(f"mode must be one of {GRAPH_MODES}, got {mode!r}")
        device = torch.device(device)
        if mode != "eager" and device.type != "cuda":
            raise ValueError(f"mode {mode!r} captures CUDA graphs: it needs a CUDA device, got {device}")
        self.phases = list(phases)
        self.mode = mode
        self.device = device
        self.runs = 0
        self.capture_s = 0.0
        self._graphs: list[tuple[str, torch.cuda.CUDAGraph]] = []
        self._stream = torch.cuda.Stream(device) if mode != "eager" else None

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def run(self, clock: PhaseClock) -> bool:
        """One step: eager, or warm-up (first call), capture + replay (second), replay (later)."""
        self.runs += 1
        if self.mode == "eager":
            self._eager(clock)
            return True
        if self.runs == 1:
            cur = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(cur)
            with torch.cuda.stream(self._stream):
                self._eager(clock)
            cur.wait_stream(self._stream)
            return True
        ran_python = not self.captured
        if ran_python:
            self._capture()
        self._replay(clock)
        return ran_python

    def _eager(self, clock: PhaseClock) -> None:
        for p in self.phases:
            t0 = clock.mark()
            p.run()
            clock.add(p.kind, t0, clock.mark())

    def release(self) -> None:
        """Destroy the captured graphs now (the next :meth:`run` starts over with a warm-up)."""
        self._graphs.clear()
        self.runs = 0

    def _capture(self) -> None:
        """Capture the phases (one graph, or one per phase), in CUDA's ``thread_local`` capture
        mode: another thread's CUDA calls do not invalidate the capture. Seen on the H200: a
        request's step graphs, dead in a reference cycle (a bucket's phases close over the bucket),
        were collected by Python's cyclic collector in another thread (the demo's progress bars)
        while this thread captured; destroying a graph then is an error in the default ``global``
        mode ("operation not permitted when stream is capturing (function reset)"), which
        invalidated the capture. The collector is also off in this thread meanwhile, for the same
        reason (torch.cuda.graph no longer collects before capturing); :meth:`release` destroys
        graphs at a time of the caller's choosing."""
        t0 = time.perf_counter()
        groups = [(None, self.phases)] if self.mode == "step" else [(p.kind, [p]) for p in self.phases]
        pool = torch.cuda.graph_pool_handle()  # one memory pool: the graphs replay in capture order
        collecting = gc.isenabled()
        gc.disable()
        try:
            for kind, phases in groups:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=self._stream, capture_error_mode=CAPTURE_ERROR_MODE):
                    for p in phases:
                        p.run()
                self._graphs.append((kind or "step", g))
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0

    def _replay(self, clock: PhaseClock) -> None:
        for kind, g in self._graphs:
            t0 = clock.mark()
            g.replay()
            clock.add(kind, t0, clock.mark())
