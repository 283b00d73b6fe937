"""The sweep: for each shape build the inputs once, check every implementation against the float64
reference on a sample, time the ones that pass, and fill in the roofline figures.

Import this module only after ``TRITON_INTERPRET`` is settled (the CLI does it): our kernels
import Triton.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..testing import TOLERANCES, compare
from ..verify import KERNELS, OPT_IN_KERNELS, VerifyAttention, available_kernels, verify_attention
from ..verify.contract import check_content, check_inputs
from ..verify.reference import reference
from .peers import Impl, Prepared, Unavailable
from .shapes import BenchCase, Shape, build_case, case_bytes, choose_sets, set_bytes
from .timing import (Ceilings, Timing, back_to_back_us, host_us_per_call, merge_timings, n_samples, time_cpu,
                     time_cuda)

__all__ = ["OursImpl", "detect_ours", "SweepOptions", "Row", "run_sweep", "estimate", "crossovers"]

# the host figures' calls per round, in kernel time (OursImpl.host_figures)
HOST_FIGURE_BUDGET_US = 250_000.0


# ----------------------------------------------------------------------------------------------
# Our kernels, through the public entry points


class OursImpl(Impl):
    """Our kernels: ``naive`` through :func:`verify_attention`; the planned kernels (``flash``,
    ``hopper``) through :class:`VerifyAttention`, planned once per shape (outside the timed
    region) and run per call.

    For the planned kernels, :meth:`host_figures` adds the figures of the Python call itself (see
    :class:`Row`): eager, host-only, and :func:`verify_attention` without a plan.
    """

    has_lse = True

    def __init__(self, kernel: str):
        if kernel not in KERNELS + OPT_IN_KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS + OPT_IN_KERNELS}, got {kernel!r}")
        self.name = kernel
        self.kernel = kernel
        entry = "verify_attention" if kernel == "naive" else "VerifyAttention plan/run"
        self.description = f"kdtree_engine {entry} (kernel={kernel!r})"

    def est_tflops(self) -> float:
        return 20.0 if self.kernel == "naive" else 250.0

    def prepare(self, case: BenchCase) -> Prepared:
        sh = case.shape
        if self.kernel == "naive":
            def run(i: int) -> None:
                s = case.sets[i]
                verify_attention(s.q, s.kv_cache, case.page_table, case.kv_lens, case.qo_indptr, case.tree_mask,
                                 case.sm_scale, kernel="naive", out=s.out, lse=s.lse, validate=False)

            return Prepared(run=run)
        attn = VerifyAttention(sh.batch, sh.q_len, sh.heads, case.device, kernel=self.kernel)
        attn.plan(case.kv_lens_host, case.qo_indptr_host)

        def run(i: int) -> None:
            s = case.sets[i]
            attn.run(s.q, s.kv_cache, case.page_table, case.tree_mask, out=s.out, lse=s.lse, sm_scale=case.sm_scale)

        return Prepared(run=run, note="plan", keep=[attn])

    def host_figures(self, case: BenchCase, prepared: Prepared, n_sets: int, kernel_us: float) -> dict[str, float]:
        """``eager_us``: one planned call timed back to back, without a head start (the larger of
        host and GPU time per call); ``host_us``: host wall time per planned call, 1000 calls in
        bursts of 16 without a sync (:func:`~.timing.host_us_per_call`); ``unplanned_us``:
        :func:`verify_attention` without a plan (the device scheduler's launch, then the kernels),
        back to back. CUDA only. Each figure's calls are capped at :data:`HOST_FIGURE_BUDGET_US` of
        the kernel's time ``kernel_us`` (at least 16): at a 36 ms call (1,024 nodes at 128k) the
        default counts would take 80 s a row, where the host's share is nil anyway."""
        calls = max(16, int(HOST_FIGURE_BUDGET_US / max(kernel_us, 1.0)))

        def unplanned(i: int) -> None:
            s = case.sets[i]
            verify_attention(s.q, s.kv_cache, case.page_table, case.kv_lens, case.qo_indptr, case.tree_mask,
                             case.sm_scale, kernel=self.kernel, out=s.out, lse=s.lse, validate=False)

        return {
            "eager_us": back_to_back_us(prepared.run, n_sets, calls=min(200, calls)),
            "host_us": host_us_per_call(prepared.run, n_sets, calls=min(1000, calls)),
            "unplanned_us": back_to_back_us(unplanned, n_sets, calls=min(200, calls)),
        }


_NEEDS = {"hopper": "needs an sm_90 GPU and Triton's Gluon", "hopper_cuda": "needs an sm_90 GPU and nvcc"}


def detect_ours(requested: list[str] | None, device: str = "cuda") -> tuple[list[Impl], dict[str, str]]:
    """Our kernels that were asked for (all that run on ``device`` when ``requested`` is None, but
    the opt-in ones, which run only when named), naive first, and a note for each one asked for that
    does not run there."""
    runs = available_kernels(device, opt_in=True)
    want = KERNELS if requested is None else [k for k in KERNELS + OPT_IN_KERNELS if k in requested]
    notes = {k: _NEEDS.get(k, "does not run here") for k in want if k not in runs}
    return [OursImpl(k) for k in want if k in runs], notes


# ----------------------------------------------------------------------------------------------
# Options, rows


@dataclass
class SweepOptions:
    device: str = "cuda"
    repeats: int = 100
    min_repeats: int = 5
    budget_s: float = 1.0  # timed GPU time per measurement
    rounds: int = 3  # CUDA: a shape's kernels (but naive) timed in turn this many times, the order rotated
    use_graph: bool = True
    graph_max_us: float = 2000.0
    max_sets: int = 16
    l2_bytes: int = 60 * 2**20
    slow_max_ms: float = 3000.0  # skip naive and peers where their estimated call is longer
    check_seqs: int = 2  # sequences of the checked sample (first and last)
    check_heads: int = 3  # heads of the checked sample (first, middle, last)
    post_check: bool = True  # re-check set 0 after timing (graph replays wrote it)
    seed: int = 0
    mem_fraction: float = 0.85  # of the free memory a shape may use


@dataclass
class Row:
    shape: Shape
    kernel: str
    status: str  # "ok", "FAIL", "skip", "error"
    timing: Timing | None = None
    floor_us: float | None = None
    tflops: float | None = None
    tbps: float | None = None
    pct_floor: float | None = None
    speedup_vs_naive: float | None = None
    n_sets: int = 0
    l2_warm: bool = False
    check: str = ""
    max_abs_err: float | None = None
    note: str = ""
    # planned kernels only, CUDA only (None elsewhere): the Python call's own cost (OursImpl.host_figures)
    eager_us: float | None = None  # a planned call, back to back, eager (max of host and GPU time)
    graph_us: float | None = None  # a planned call replayed from a CUDA graph (GPU time)
    host_us: float | None = None  # host wall time per planned call (bursts of 16 calls without a sync)
    unplanned_us: float | None = None  # verify_attention without a plan (plans and syncs), back to back

    def to_dict(self) -> dict:
        d = {**self.shape.to_dict(), "kernel": self.kernel, "status": self.status}
        t = self.timing
        d.update(
            median_us=t.median_us if t else None,
            min_us=t.min_us if t else None,
            p25_us=t.p25_us if t else None,
            p75_us=t.p75_us if t else None,
            samples=t.samples if t else None,
            calls_per_sample=t.calls_per_sample if t else None,
            method=t.method if t else None,
            tflops=self.tflops,
            tbps=self.tbps,
            pct_floor=self.pct_floor,
            floor_us=self.floor_us,
            speedup_vs_naive=self.speedup_vs_naive,
            crossover_prefix=None,  # filled in for flash rows once the sweep is done
            flops=self.shape.flops,
            bytes=self.shape.bytes,
            n_sets=self.n_sets,
            l2_warm=self.l2_warm,
            max_abs_err=self.max_abs_err,
            eager_us=self.eager_us,
            graph_us=self.graph_us,
            host_us=self.host_us,
            unplanned_us=self.unplanned_us,
            check=self.check,
            note="; ".join(x for x in (self.note, t.note if t else "") if x),
        )
        return d


# ----------------------------------------------------------------------------------------------
# Estimates (for --dry-run, the naive cap and budgets): rough H200 figures, not measurements

H200_COPY_BPS = 4.25e12
H200_MATMUL_FPS = 680e12


def estimate_call_s(shape: Shape, impl: Impl) -> float:
    """Rough time of one call on an H200."""
    if isinstance(impl, OursImpl) and impl.kernel != "naive":
        return 5e-6 + shape.floor_s(H200_COPY_BPS, H200_MATMUL_FPS) / 0.35
    return 5e-6 + max(shape.flops / (impl.est_tflops() * 1e12), shape.bytes / H200_COPY_BPS)


def estimate(shape: Shape, impl: Impl, opts: SweepOptions) -> float:
    """Rough wall seconds of one measurement (check, warm-up, timed samples, overheads; on CUDA in
    ``opts.rounds`` rounds but for naive, each with its own check and warm-up)."""
    call = estimate_call_s(shape, impl)
    if is_slow_kind(impl) and call * 1e3 > opts.slow_max_ms:
        return 0.0
    n_sets = choose_sets(shape, l2_bytes=opts.l2_bytes, max_sets=opts.max_sets, free_bytes=130 * 2**30)
    rounds = 1 if _is_naive(impl) or torch.device(opts.device).type != "cuda" else max(1, opts.rounds)
    timed = call * n_samples(call * 1e6, repeats=-(-opts.repeats // rounds), min_repeats=-(-opts.min_repeats // rounds),
                             budget_s=opts.budget_s / rounds)
    # a later round repeats the gate and the warm-up without the first one's compilation and set-up:
    # ~0.1 s (H200 run 36: the issue-11 grid took 209 s in one round, ~265 s in three)
    return 0.25 + 0.1 * (rounds - 1) + rounds * (call * (1 + n_sets) + timed)


def is_slow_kind(impl: Impl) -> bool:
    """Everything but our planned kernels: capped by ``slow_max_ms``."""
    return not (isinstance(impl, OursImpl) and impl.kernel != "naive")


# ----------------------------------------------------------------------------------------------
# The correctness gate


@dataclass
class Sample:
    """The float64 reference of a few (sequence, head) pairs of a case."""

    seqs: list[int]
    heads: list[int]
    rows: list[tuple[int, int]]  # q rows [q0, q1) of each sequence
    out: list[torch.Tensor] = field(default_factory=list)  # [n, h, 512] float64 per sequence
    lse: list[torch.Tensor] = field(default_factory=list)  # [n, h] float64


def reference_sample(case: BenchCase, n_seqs: int, n_heads: int) -> Sample:
    sh = case.shape
    seqs = sorted({0, sh.batch - 1}) if n_seqs >= 2 else [0]
    seqs = seqs[: max(1, n_seqs)]
    if n_heads >= sh.heads:
        heads = list(range(sh.heads))
    else:
        heads = sorted({0, sh.heads // 2, sh.heads - 1, *range(max(0, n_heads - 3))})[:n_heads]
    qo = case.qo_indptr_host.tolist()
    sample = Sample(seqs=seqs, heads=heads, rows=[(qo[b], qo[b + 1]) for b in seqs])
    s0 = case.sets[0]
    hidx = torch.tensor(heads, device=case.device)
    for b, (q0, q1) in zip(seqs, sample.rows):
        out, lse = reference(
            s0.q[q0:q1].index_select(1, hidx),
            s0.kv_cache,
            case.page_table[b : b + 1],
            case.kv_lens[b : b + 1],
            torch.tensor([0, q1 - q0], dtype=torch.int32, device=case.device),
            case.tree_mask[q0:q1],
            case.sm_scale,
        )
        sample.out.append(out)
        sample.lse.append(lse)
    return sample


def check_against(case: BenchCase, sample: Sample, has_lse: bool) -> tuple[bool, str, float]:
    """Compare set 0's outputs with the reference sample: (ok, detail, max abs error of out)."""
    tol = TOLERANCES[case.shape.dtype]
    s0 = case.sets[0]
    hidx = torch.tensor(sample.heads, device=case.device)
    worst = 0.0
    for b, (q0, q1), ref_out, ref_lse in zip(sample.seqs, sample.rows, sample.out, sample.lse):
        got = s0.out[q0:q1].index_select(1, hidx)
        r = compare(got, ref_out, *tol["out"])
        worst = max(worst, r.max_abs)
        if not r.ok:
            return False, f"out of seq {b}, heads {sample.heads}: {r} {r.detail}", worst
        if has_lse:
            r = compare(s0.lse[q0:q1].index_select(1, hidx), ref_lse, *tol["lse"])
            if not r.ok:
                return False, f"lse of seq {b}, heads {sample.heads}: {r} {r.detail}", worst
    what = "out+lse" if has_lse else "out"
    return True, f"{what} ok on seqs {sample.seqs} x heads {sample.heads} (max abs {worst:.1e})", worst


# ----------------------------------------------------------------------------------------------
# The sweep


class SweepAborted(RuntimeError):
    """The device is unusable (a sticky CUDA error): the sweep stops, partial results stand."""


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def _device_ok() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def _fill_figures(row: Row, ceilings: Ceilings | None) -> None:
    t = row.timing
    if t is None or t.median_us <= 0:
        return
    sec = t.median_us * 1e-6
    row.tflops = row.shape.flops / sec / 1e12
    row.tbps = row.shape.bytes / sec / 1e12
    if ceilings is not None:
        floor = row.shape.floor_s(ceilings.copy_bps(), ceilings.matmul_fps(row.shape.dtype))
        row.floor_us = floor * 1e6
        row.pct_floor = 100.0 * floor / sec


def measure_one(impl: Impl, case: BenchCase, sample: Sample, opts: SweepOptions, n_sets: int, *,
                share: int = 1, host_figures: bool = True) -> Row:
    """Check, then time, one implementation on one case: ``1 / share`` of the options' budget and
    samples (one of ``share`` rounds); ``host_figures``: also our planned kernels' eager / host /
    unplanned figures."""
    sh = case.shape
    cuda = torch.device(opts.device).type == "cuda"  # "cuda" and "cuda:N" alike
    row = Row(shape=sh, kernel=impl.name, status="ok", n_sets=n_sets)
    if cuda and is_slow_kind(impl):
        est_ms = estimate_call_s(sh, impl) * 1e3
        if est_ms > opts.slow_max_ms:
            row.status, row.note = "skip", f"est. {est_ms / 1e3:.1f} s/call > --slow-max-ms {opts.slow_max_ms:.0f}"
            return row
    try:
        prepared = impl.prepare(case)
    except Unavailable as e:
        row.status, row.note = "skip", str(e)
        return row
    except torch.cuda.OutOfMemoryError:
        row.status, row.note = "skip", "out of memory while preparing"
        return row
    except Exception as e:
        row.status, row.note = "error", f"prepare: {_first_line(e)}"
        return row
    row.note = prepared.note
    try:
        # gate: one call on set 0 with NaN-poisoned outputs, compared with the reference sample
        case.reset_outputs()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        prepared.run(0)
        if cuda:
            torch.cuda.synchronize()
        gate_s = time.perf_counter() - t0  # includes the first compilation
        prepared.collect(0)
        ok, detail, worst = check_against(case, sample, impl.has_lse)
        row.check, row.max_abs_err = detail, worst
        if not ok:
            row.status = "FAIL"
            return row
        if cuda and is_slow_kind(impl) and gate_s > max(4 * opts.slow_max_ms / 1e3, 3.0):
            # far slower than the estimate that let it in: do not spend minutes on it
            row.status = "skip"
            row.note = f"correct, but one call took {gate_s:.1f} s (> 4x --slow-max-ms); not timed"
            return row
        if cuda:
            row.timing = time_cuda(
                prepared.run,
                n_sets,
                repeats=-(-opts.repeats // share),
                min_repeats=-(-opts.min_repeats // share),
                budget_s=opts.budget_s / share,
                use_graph=opts.use_graph and prepared.graphable,
                graph_max_us=opts.graph_max_us,
            )
        else:
            row.timing = time_cpu(prepared.run, n_sets, repeats=1)
        if cuda and host_figures and isinstance(impl, OursImpl) and impl.kernel != "naive":
            if row.timing.method == "graph":
                row.graph_us = row.timing.median_us
            figures = impl.host_figures(case, prepared, n_sets, row.timing.median_us)
            row.eager_us, row.host_us, row.unplanned_us = figures["eager_us"], figures["host_us"], figures["unplanned_us"]
        if opts.post_check:
            prepared.collect(0)
            ok, detail, worst = check_against(case, sample, impl.has_lse)
            if not ok:
                row.status, row.timing = "FAIL", None
                row.check = f"after timing: {detail}"
                return row
    except torch.cuda.OutOfMemoryError:
        row.status, row.timing, row.note = "skip", None, "out of memory"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    except Exception as e:
        row.status, row.timing = "error", None
        row.note = _first_line(e)
        if cuda and not _device_ok():
            raise SweepAborted(f"{impl.name} on {sh.label}: {row.note}") from e
    finally:
        del prepared
    return row


def run_sweep(
    shapes: list[Shape],
    impls: list[Impl],
    opts: SweepOptions,
    ceilings: Ceilings | None,
    *,
    on_row: Callable[[Row], None] | None = None,
    on_shape_done: Callable[[list[Row]], None] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> tuple[list[Row], str | None]:
    """Run every implementation on every shape. Returns the rows and an abort message (or None).

    On CUDA, a shape's implementations (but naive, timed once) are measured ``opts.rounds`` times
    in turn, each round starting at the next one, with ``1 / rounds`` of the options' budget and
    samples, and each one's samples pooled: the GPU's clock drifts under its power limit over a
    shape's measurements (H200 run 36: p75/p25 up to 1.13 at 2-7 ms calls), and in turn every
    kernel sees the same drift, so their ratios hold. Rows come in the order given (put naive
    first: the others' speedups refer to it).
    """
    rows: list[Row] = []
    cuda = torch.device(opts.device).type == "cuda"  # "cuda" and "cuda:N" alike
    for shape in shapes:
        shape_rows: list[Row] = []

        def emit(r: Row) -> None:
            shape_rows.append(r)
            rows.append(r)
            if on_row:
                on_row(r)

        free = torch.cuda.mem_get_info()[0] if cuda else None
        n_sets = choose_sets(shape, l2_bytes=opts.l2_bytes, max_sets=opts.max_sets, free_bytes=free) if cuda else 1
        need = case_bytes(shape, n_sets)
        if free is not None and need > opts.mem_fraction * free:
            for impl in impls:
                emit(Row(shape=shape, kernel=impl.name, status="skip",
                         note=f"inputs need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"))
                if on_progress:
                    on_progress(f"{shape.label} {impl.name}")
            if on_shape_done:
                on_shape_done(shape_rows)
            continue
        case = sample = None
        try:
            case = build_case(shape, opts.device, n_sets=n_sets, seed=opts.seed)
            # validate the builder's inputs once (host sync, outside any timed region)
            info = check_inputs(**case.inputs(0))
            check_content(case.page_table, case.kv_lens, case.qo_indptr, case.tree_mask, info)
            sample = reference_sample(case, opts.check_seqs, opts.check_heads)
        except Exception as e:  # out of memory, or a bug in the inputs: the shape's rows say so
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            status, note = ("skip", "out of memory building inputs") if oom else ("error", f"inputs: {_first_line(e)}")
            case = sample = None
            del e
            gc.collect()
            if cuda and not _device_ok():
                for impl in impls:
                    emit(Row(shape=shape, kernel=impl.name, status="error", note=note))
                return rows, f"{shape.label}: {note}"
            if cuda:
                torch.cuda.empty_cache()
            for impl in impls:
                emit(Row(shape=shape, kernel=impl.name, status=status, note=note))
                if on_progress:
                    on_progress(f"{shape.label} {impl.name}")
            if on_shape_done:
                on_shape_done(shape_rows)
            continue
        l2_warm = cuda and n_sets * set_bytes(shape) < 2 * opts.l2_bytes
        results, abort = _measure_rounds(shape, impls, case, sample, opts, n_sets, on_progress)
        naive_us = None
        for impl in impls:
            if impl.name not in results:  # the sweep aborted before it
                continue
            row = results[impl.name]
            row.l2_warm = bool(l2_warm and row.timing is not None)
            _fill_figures(row, ceilings)
            if impl.name == "naive" and row.timing is not None:
                naive_us = row.timing.median_us
            if naive_us is not None and row.timing is not None and impl.name != "naive":
                row.speedup_vs_naive = naive_us / row.timing.median_us
            emit(row)
        del case, sample
        gc.collect()
        if cuda and abort is None:
            torch.cuda.empty_cache()
        if on_shape_done:
            on_shape_done(shape_rows)
        if abort is not None:
            return rows, abort
    return rows, None


def _is_naive(impl: Impl) -> bool:
    return isinstance(impl, OursImpl) and impl.kernel == "naive"


def _measure_rounds(shape: Shape, impls: list[Impl], case: BenchCase, sample: Sample, opts: SweepOptions, n_sets: int,
                    on_progress: Callable[[str], None] | None) -> tuple[dict[str, Row], str | None]:
    """Each implementation's row on one shape (by name), measured in rounds (see :func:`run_sweep`):
    a row that is not ``ok`` in some round is final; the last round's row carries the pooled timing
    and the host figures (measured in that round only). Returns the rows and an abort message."""
    cuda = torch.device(opts.device).type == "cuda"
    turns = [impl for impl in impls if not _is_naive(impl)]
    rounds = max(1, opts.rounds) if cuda and turns else 1
    final: dict[str, Row] = {}
    timings: dict[str, list[Timing]] = {}
    for r in range(rounds):
        order = impls if r == 0 else turns[r % len(turns):] + turns[:r % len(turns)]
        for impl in order:
            if impl.name in final:
                continue
            once = rounds == 1 or _is_naive(impl)
            if on_progress and r == 0:
                on_progress(f"{shape.label} {impl.name}")
            free_now = torch.cuda.mem_get_info()[0] if cuda else None
            extra = impl.extra_bytes(shape)
            if free_now is not None and extra > opts.mem_fraction * free_now:
                final[impl.name] = Row(shape=shape, kernel=impl.name, status="skip", n_sets=n_sets,
                                       note=f"needs ~{extra / 2**30:.1f} GiB more, {free_now / 2**30:.1f} GiB free")
                continue
            try:
                row = measure_one(impl, case, sample, opts, n_sets, share=1 if once else rounds,
                                  host_figures=once or r == rounds - 1)
            except SweepAborted as e:
                final[impl.name] = Row(shape=shape, kernel=impl.name, status="error", note=str(e))
                return final, str(e)
            if row.status != "ok" or row.timing is None:
                final[impl.name] = row
            else:
                timings.setdefault(impl.name, []).append(row.timing)
                if once or r == rounds - 1:
                    row.timing = merge_timings(timings[impl.name]) if len(timings[impl.name]) > 1 else row.timing
                    final[impl.name] = row
            gc.collect()
    return final, None


# ----------------------------------------------------------------------------------------------
# Crossover: the prefix from which flash beats naive


def crossovers(rows: list[Row], fast: str = "flash", slow: str = "naive") -> list[dict]:
    """Per prefix series (same B, n, H, page size, dtype): the smallest measured prefix from which
    ``fast`` is faster than ``slow`` at every larger measured prefix.

    Each entry: ``group`` (label), ``prefixes`` compared, ``crossover_prefix`` (None when ``fast``
    never overtakes for good), ``verdict`` (text).
    """
    times: dict[tuple, dict[str, dict[int, float]]] = {}
    labels: dict[tuple, str] = {}
    for r in rows:
        if r.timing is None or r.kernel not in (fast, slow):
            continue
        g = r.shape.group
        labels[g] = r.shape.group_label
        times.setdefault(g, {}).setdefault(r.kernel, {})[r.shape.prefix] = r.timing.median_us
    out = []
    for g, by_kernel in times.items():
        if fast not in by_kernel or slow not in by_kernel:
            continue
        common = sorted(set(by_kernel[fast]) & set(by_kernel[slow]))
        if len(common) < 2:
            continue
        wins = [by_kernel[fast][p] < by_kernel[slow][p] for p in common]
        cross = None
        for j in range(len(common)):
            if all(wins[j:]):
                cross = common[j]
                break
        if cross is None:
            verdict = f"{fast} slower than {slow} at the largest prefix measured ({common[-1]})"
        elif cross == common[0]:
            verdict = f"{fast} faster at every prefix measured ({common[0]}..{common[-1]})"
        else:
            before = common[common.index(cross) - 1]
            verdict = f"{fast} overtakes {slow} between prefix {before} and {cross}"
        out.append({"group": labels[g], "prefixes": common, "crossover_prefix": cross, "verdict": verdict})
    return out


def est_total_s(shapes: list[Shape], impls: list[Impl], opts: SweepOptions) -> float:
    """Rough wall seconds of a sweep: measurements, plus input building and the reference per
    shape, plus ceilings and first compilations."""
    per_shape = sum(0.3 + 1e-9 * case_bytes(s, 1) for s in shapes)
    return sum(estimate(s, i, opts) for s in shapes for i in impls) + per_shape + 20.0
