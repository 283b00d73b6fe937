"""The benchmark harness: work formulas, presets, inputs, the correctness gate, timing control flow,
and a functional end-to-end run of ``kdtree bench --tiny`` (on the CPU through the interpreter
when there is no GPU)."""

from __future__ import annotations

import contextlib
import csv
import json
import math

import pytest
import torch

from conftest import DEVICE
from kdtree_engine.bench import cli, timing
from kdtree_engine.bench.peers import Prepared, TorchSDPA
from kdtree_engine.bench.runner import OursImpl, Row, SweepOptions, crossovers, run_sweep
from kdtree_engine.verify import available_kernels
from kdtree_engine.bench.shapes import (
    DEFAULT_PREFIXES,
    LONG_PREFIXES,
    Shape,
    build_case,
    cartesian_shapes,
    choose_sets,
    preset_shapes,
    set_bytes,
)
from kdtree_engine.masks import unpack_tree_mask
from kdtree_engine.verify.contract import check_content, check_inputs



# ----------------------------------------------------------------------------------------------
# work per call


def test_work_formulas_match_engineering_notes():
    s = Shape(batch=1, q_len=33, heads=64, prefix=16384)
    assert s.flops == 2 * 33 * 64 * (16384 + 33) * (576 + 512)
    io = 33 * 64 * (576 * 2 + 512 * 2 + 4)
    assert s.bytes == (16384 + 33) * 1152 + io
    # arithmetic intensity of the KV stream (docs/benchmark.md: 272 for n=9,H=16; 3989 for n=33,H=64)
    for n, h, want in [(9, 16, 272), (33, 64, 3989)]:
        t = Shape(1, n, h, 10**6)
        assert round(2 * n * h * 1088 / 1152) == want
        assert t.flops / (t.kv_len * 1152) == pytest.approx(want, rel=1e-3)
    # batch multiplies everything; floor takes the larger of the two limits
    b4 = Shape(batch=4, q_len=33, heads=64, prefix=16384)
    assert b4.flops == 4 * s.flops and b4.bytes == 4 * s.bytes
    assert s.floor_s(4.25e12, 680e12) == pytest.approx(s.flops / 680e12)  # compute-bound
    m = Shape(1, 1, 1, 131072)
    assert m.floor_s(4.25e12, 680e12) == pytest.approx(m.bytes / 4.25e12)  # memory-bound


def test_presets():
    issue3 = preset_shapes("issue3")
    assert len(issue3) == 135
    assert {s.heads for s in issue3} == {16, 64, 128} and {s.q_len for s in issue3} == {9, 33, 65}
    assert {s.batch for s in issue3} == {1, 4, 16} and {s.page_size for s in issue3} == {1}
    assert {s.prefix for s in issue3} == {1024, 4096, 16384, 65536, 131072}

    default = preset_shapes("default")
    long = preset_shapes("default", long=True)
    assert len(set(default)) == len(default)  # no duplicates
    assert {s.prefix for s in default} >= set(DEFAULT_PREFIXES)
    assert {s.prefix for s in long} == set(DEFAULT_PREFIXES) | set(LONG_PREFIXES)
    for axis, values in [("batch", (1, 2, 4, 8, 16)), ("q_len", (9, 17, 33, 65)), ("heads", (8, 16, 64, 128)),
                         ("page_size", (1, 64))]:
        assert {getattr(s, axis) for s in default} == set(values), axis
    assert len(preset_shapes("quick")) <= 12
    assert len(preset_shapes("tiny")) == 3
    both = preset_shapes("tiny", dtypes=("bf16", "fp16"))
    assert {s.dtype for s in both} == {"bf16", "fp16"} and len(both) == 6
    assert len(cartesian_shapes([1, 2], [9], [16, 64], [0, 1024], [1], ["bf16"])) == 8


def test_cli_axis_parsing_and_selection():
    a = cli.build_parser().parse_args(["--heads", "16,64", "--prefix", "0,1k,16k", "--kernels", "naive,torch"])
    assert a.heads == [16, 64] and a.prefix == [0, 1024, 16384] and a.kernels == ["naive", "torch"]
    shapes, preset, _ = cli._shapes(a, "cuda")
    assert preset == "custom" and len(shapes) == 6
    assert {(s.batch, s.q_len, s.page_size, s.dtype) for s in shapes} == {(1, 33, 1, "bf16")}
    a = cli.build_parser().parse_args(["--grid", "issue3", "--heads", "64"])
    shapes, preset, _ = cli._shapes(a, "cuda")
    assert preset == "issue3" and len(shapes) == 45 and {s.heads for s in shapes} == {64}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--kernels", "naive,bogus"])


def test_choose_sets_covers_l2_within_memory():
    small = Shape(1, 9, 16, 0)
    assert choose_sets(small, l2_bytes=60 * 2**20, max_sets=16, free_bytes=None) == 16
    big = Shape(16, 33, 64, 200000)
    assert choose_sets(big, l2_bytes=60 * 2**20, max_sets=16, free_bytes=None) == 1
    mid = Shape(1, 33, 64, 16384)
    n = choose_sets(mid, l2_bytes=60 * 2**20, max_sets=16, free_bytes=None)
    assert n * set_bytes(mid) >= 3 * 60 * 2**20 and (n - 1) * set_bytes(mid) < 3 * 60 * 2**20
    assert choose_sets(mid, l2_bytes=60 * 2**20, max_sets=16, free_bytes=3 * set_bytes(mid)) == 1


# ----------------------------------------------------------------------------------------------
# inputs


@pytest.mark.parametrize("shape", [Shape(2, 9, 3, 40, 1), Shape(2, 33, 2, 50, 16), Shape(1, 5, 1, 0, 64)],
                         ids=lambda s: s.label.replace(" ", "-"))
def test_build_case_inputs(shape):
    case = build_case(shape, DEVICE, n_sets=2, seed=3)
    info = check_inputs(**case.inputs(0))
    check_content(case.page_table, case.kv_lens, case.qo_indptr, case.tree_mask, info)  # raises if bad
    assert info.num_rows == shape.rows and info.page_size == shape.page_size
    all_slots = torch.cat([case.slots(b) for b in range(shape.batch)])
    assert all_slots.unique().numel() == all_slots.numel()  # no two positions share a slot
    for s in case.sets:
        rows = s.kv_cache.view(-1, 576)[all_slots]
        assert torch.isfinite(rows).all() and (rows != 0).float().mean() > 0.99  # random, never zeros
        assert torch.isnan(s.kv_cache).any()  # spare page (and tails) poisoned
        assert torch.isnan(s.out).all() and torch.isnan(s.lse).all()
        assert (s.q != 0).float().mean() > 0.99
    assert not torch.equal(case.sets[0].q, case.sets[1].q)
    assert not torch.equal(case.sets[0].kv_cache, case.sets[1].kv_cache)
    for b in range(shape.batch):
        vis = case.visible(b)
        assert vis.shape == (shape.q_len, shape.kv_len) and vis[:, : shape.prefix].all()
        q0 = b * shape.q_len
        packed = unpack_tree_mask(case.tree_mask[q0 : q0 + shape.q_len], shape.q_len)
        assert torch.equal(vis[:, shape.prefix :].cpu(), packed.cpu())


# ----------------------------------------------------------------------------------------------
# the correctness gate: a wrong kernel cannot post a time


class _WrongScale(TorchSDPA):
    """The torch baseline with a 10% wrong softmax scale: close, but outside the tolerance."""

    name = "wrong-scale"

    def prepare(self, case):
        right = case.sm_scale
        case.sm_scale = right * 1.1
        try:
            return super().prepare(case)  # captures the wrong scale
        finally:
            case.sm_scale = right


class _Unwritten(TorchSDPA):
    """Writes every sequence but the last: the NaN poison must catch it."""

    name = "unwritten"

    def prepare(self, case):
        qo = case.qo_indptr_host.tolist()
        inner = super().prepare(case)

        def run(i):
            s = case.sets[i]
            keep = s.out[qo[-2] :].clone()
            inner.run(i)
            s.out[qo[-2] :] = keep

        return Prepared(run=run, keep=[inner])


def test_gate_fails_wrong_kernels_and_passes_right_ones():
    shapes = [Shape(2, 9, 2, 24, 1)]
    impls = [OursImpl("naive"), TorchSDPA(), _WrongScale(), _Unwritten()]
    opts = SweepOptions(device=DEVICE, repeats=3, min_repeats=1, budget_s=0.01, check_heads=2)
    rows, abort = run_sweep(shapes, impls, opts, None)
    assert abort is None
    by = {r.kernel: r for r in rows}
    assert by["naive"].status == "ok" and by["naive"].timing is not None
    assert by["torch"].status == "ok" and by["torch"].timing is not None
    assert by["torch"].speedup_vs_naive is not None and by["naive"].speedup_vs_naive is None
    for bad in ("wrong-scale", "unwritten"):
        assert by[bad].status == "FAIL", by[bad]
        assert by[bad].timing is None and by[bad].tflops is None
        assert "out of seq" in by[bad].check
    assert "seq 1" in by["unwritten"].check  # the last sequence was left unwritten


# ----------------------------------------------------------------------------------------------
# crossovers, plan binding


def _row(kernel, prefix, us):
    t = timing.summarize([us], 1, "graph")
    return Row(shape=Shape(1, 33, 64, prefix), kernel=kernel, status="ok", timing=t)


def test_crossovers():
    rows = [_row("naive", p, us) for p, us in [(0, 10), (1024, 20), (4096, 60), (16384, 200)]]
    rows += [_row("flash", p, us) for p, us in [(0, 15), (1024, 25), (4096, 30), (16384, 40)]]
    (c,) = crossovers(rows)
    assert c["crossover_prefix"] == 4096 and "between prefix 1024 and 4096" in c["verdict"]
    rows2 = [_row("naive", p, 100) for p in (0, 1024)] + [_row("flash", p, 1) for p in (0, 1024)]
    assert crossovers(rows2)[0]["crossover_prefix"] == 0
    rows3 = [_row("naive", p, 1) for p in (0, 1024)] + [_row("flash", p, 100) for p in (0, 1024)]
    assert crossovers(rows3)[0]["crossover_prefix"] is None
    assert crossovers(rows[:4]) == []  # no flash


# ----------------------------------------------------------------------------------------------
# timing control flow on a fake device clock (the real thing needs a GPU)


class _FakeDevice:
    def __init__(self, cost_us, capture_fails=False):
        self.t = 0.0
        self.cost_us = cost_us
        self.capture_fails = capture_fails
        self.capturing = None
        dev = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = dev.t

            def elapsed_time(self, end):
                return (end.at - self.at) / 1e3

        class Stream:
            def wait_stream(self, other):
                pass

        class Graph:
            def __init__(self):
                self.calls = []

            def replay(self):
                for i in self.calls:
                    dev.t += dev.cost_us

        @contextlib.contextmanager
        def graph(g):
            if dev.capture_fails:
                raise RuntimeError("operation not permitted when stream is capturing")
            dev.capturing = g
            try:
                yield
            finally:
                dev.capturing = None

        self.Event, self.Stream, self.Graph, self.graph = Event, Stream, Graph, graph

    def run(self, i):
        if self.capturing is not None:
            self.capturing.calls.append(i)
        else:
            self.t += self.cost_us


@pytest.fixture
def fake_cuda(monkeypatch):
    def make(cost_us, capture_fails=False):
        dev = _FakeDevice(cost_us, capture_fails)
        monkeypatch.setattr(torch.cuda, "Event", dev.Event)
        monkeypatch.setattr(torch.cuda, "Stream", dev.Stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", dev.Graph)
        monkeypatch.setattr(torch.cuda, "graph", dev.graph)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: dev.Stream())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None, raising=False)
        return dev

    return make


def test_time_cuda_graph_path(fake_cuda):
    dev = fake_cuda(10.0)
    t = timing.time_cuda(dev.run, 4, repeats=100, min_repeats=5, budget_s=0.01)
    assert t.method == "graph" and t.median_us == pytest.approx(10.0)
    assert t.calls_per_sample % 4 == 0 and t.calls_per_sample * 10.0 >= 200  # replay >= 200 us
    assert 5 <= t.samples <= 100 and t.samples * t.calls_per_sample * 10.0 <= 0.01e6 + 1


def test_time_cuda_eager_paths(fake_cuda):
    dev = fake_cuda(5000.0)  # long call: eager, few samples
    t = timing.time_cuda(dev.run, 2, repeats=100, min_repeats=5, budget_s=0.01)
    assert t.method == "eager" and t.median_us == pytest.approx(5000.0) and t.samples == 5
    dev = fake_cuda(50.0, capture_fails=True)  # capture fails: eager with a note
    t = timing.time_cuda(dev.run, 2, repeats=20, min_repeats=5, budget_s=1.0)
    assert t.method == "eager" and "graph capture failed" in t.note and t.samples == 20
    dev = fake_cuda(3e6)  # 3 s per call: only 3 samples
    t = timing.time_cuda(dev.run, 1, repeats=100, min_repeats=5, budget_s=0.25)
    assert t.samples == 3


def test_summarize():
    t = timing.summarize([4.0, 1.0, 3.0, 2.0, 100.0], 1, "eager")
    assert t.median_us == 3.0 and t.min_us == 1.0 and t.p25_us <= t.median_us <= t.p75_us
    assert math.isfinite(t.spread)


# ----------------------------------------------------------------------------------------------
# end to end


def test_cli_dry_run(capsys):
    assert cli.main(["--dry-run", "--grid", "issue3", "--no-files"]) == 0
    out = capsys.readouterr().out
    assert "135 shapes" in out and "estimated total" in out


def test_git_commit_without_git(monkeypatch):
    """A copy without .git (e.g. on a GPU machine): $KDTREE_GIT_COMMIT if set and non-empty, else
    "unknown"; never an empty string."""
    from kdtree_engine.bench import report

    monkeypatch.setattr(report, "_run", lambda cmd: None)
    monkeypatch.setenv("KDTREE_GIT_COMMIT", "")
    assert report.git_commit() == "unknown"
    monkeypatch.setenv("KDTREE_GIT_COMMIT", "abc123")
    assert report.git_commit() == "abc123"
    monkeypatch.delenv("KDTREE_GIT_COMMIT")
    assert report.git_commit() == "unknown"


def test_cli_tiny_functional_run(tmp_path, capsys):
    """The whole pipeline on the tiny preset: table, JSON, CSV and PNG; every kernel passes the
    gate. On the CPU it must say loudly that the numbers are not performance figures."""
    paths = {k: tmp_path / f"b.{k}" for k in ("json", "csv", "png")}
    rc = cli.main(["--tiny", "--kernels", "naive,torch", "--repeats", "3", "--budget-ms", "20",
                   "--json", str(paths["json"]), "--csv", str(paths["csv"]), "--plot", str(paths["png"])])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads(paths["json"].read_text())
    assert len(data["rows"]) == 3 * 2
    assert all(r["status"] == "ok" and r["median_us"] > 0 for r in data["rows"]), data["rows"]
    assert {r["kernel"] for r in data["rows"]} == {"naive", "torch"}
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["git"]
    with paths["csv"].open() as f:
        assert f.readline().startswith("# ")
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and rows[0]["kernel"] == "naive"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if DEVICE == "cpu":
        assert data["cpu_functional_run"] is True
        assert out.count("CPU functional run — not a performance figure") >= 2
        assert data["ceilings"] is None and data["ceilings_end"] is None
        assert all(r["pct_floor"] is None for r in data["rows"])
    else:
        assert data["ceilings"]["copy_tbps"] > 0 and data["ceilings_end"]["copy_tbps"] > 0
        assert data["ceilings_end"]["matmul_tflops"].keys() == data["ceilings"]["matmul_tflops"].keys()
        assert all(r["pct_floor"] > 0 for r in data["rows"])


def test_flash_planned_once_per_shape(monkeypatch):
    """The harness plans flash once per measurement of a shape (each of the rounds on CUDA; outside
    the timed calls) and runs every call of the measurement on that plan."""
    from kdtree_engine.bench import runner

    seen = {"plans": 0, "runs": 0}
    real_plan, real_run = runner.VerifyAttention.plan, runner.VerifyAttention.run

    def plan(self, *args):
        seen["plans"] += 1
        return real_plan(self, *args)

    def run(self, *args, **kwargs):
        seen["runs"] += 1
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(runner.VerifyAttention, "plan", plan)
    monkeypatch.setattr(runner.VerifyAttention, "run", run)
    impls, notes = runner.detect_ours(["flash"])
    assert [i.name for i in impls] == ["flash"] and notes == {}
    shapes = [Shape(1, 9, 2, 0, 1), Shape(2, 5, 1, 16, 16)]
    opts = SweepOptions(device=DEVICE, repeats=2, min_repeats=1, budget_s=0.01, check_heads=2)
    rows, abort = run_sweep(shapes, impls, opts, None)
    assert abort is None and [r.status for r in rows] == ["ok", "ok"], rows
    rounds = opts.rounds if torch.device(DEVICE).type == "cuda" else 1
    assert seen["plans"] == 2 * rounds and seen["runs"] >= 4 * rounds and all(r.note == "plan" for r in rows)


def test_ours_in_order_and_only_as_asked():
    from kdtree_engine.bench.runner import detect_ours

    assert [i.name for i in detect_ours(None, DEVICE)[0]] == list(available_kernels(DEVICE))
    assert detect_ours(["hopper"], "cpu") == ([], {"hopper": "needs an sm_90 GPU and Triton's Gluon"})
    assert [i.name for i in detect_ours(["flash", "torch"])[0]] == ["flash"]
    with pytest.raises(ValueError, match="kernel must be one of"):
        OursImpl("fast")


def test_table_shows_notes_verbatim():
    """Check details and error messages hold brackets; the table must print them, not parse them."""
    from rich.console import Console

    from kdtree_engine.bench.report import rows_table

    bad = Row(shape=Shape(1, 9, 16, 0), kernel="flash", status="FAIL",
              check="out of seq 0, heads [0, 8, 15]: [bold]x[/] worst at (0, 1, 2)")
    err = Row(shape=Shape(1, 9, 16, 0), kernel="torch", status="error", note="RuntimeError: [/ weird")
    console = Console(width=250, record=True)
    console.print(rows_table([bad, err], cpu=False))
    text = console.export_text()
    assert "heads [0, 8, 15]: [bold]x[/]" in text and "[/ weird" in text


def test_measure_ceilings_arithmetic(fake_cuda):
    """Ceilings from the fake clock: every timed launch costs 100 us."""
    dev = fake_cuda(100.0)
    real_copy, real_mm = torch.Tensor.copy_, torch.mm

    def copy_(self, src, non_blocking=False):
        dev.run(0)
        return real_copy(self, src)

    def mm(a, b, out=None):
        dev.run(0)
        return real_mm(a, b, out=out)

    import unittest.mock as mock

    with mock.patch.object(torch.Tensor, "copy_", copy_), mock.patch.object(torch, "mm", mm):
        c = timing.measure_ceilings(("bf16", "fp16"), copy_gib=1 / 1024, matmul_n=64, repeats=5, device="cpu")
    assert c.copy_tbps == pytest.approx(2 * 2**20 / 100e-6 / 1e12)  # 1 MiB read + 1 MiB written
    assert c.matmul_tflops["fp16"] == pytest.approx(2 * 64**3 / 100e-6 / 1e12)
    assert c.matmul_fps("bf16") == pytest.approx(c.matmul_tflops["bf16"] * 1e12)


def _sweep_on_fake_device(fake_cuda, monkeypatch, cost_us: float, before_call=None):
    """The sweep's CUDA code path with CUDA's clock, streams, graphs and memory queries stubbed: the
    fake device (returned) charges ``cost_us`` a timed call (``before_call(dev)`` first), and the
    kernels really run, outside graph capture, on the test device's tensors (CPU tensors under the
    interpreter without CUDA; on a CUDA machine CUDA tensors, which Triton needs, the clock stays
    fake)."""
    from kdtree_engine.bench import runner

    dev = fake_cuda(cost_us)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    real_build = runner.build_case
    monkeypatch.setattr(runner, "build_case", lambda shape, device, **kw: real_build(shape, DEVICE, **kw))
    real_time_cuda = runner.time_cuda

    def time_cuda(run, n_sets, **kw):
        def both(i):
            if before_call is not None:
                before_call(dev)
            dev.run(i)
            if dev.capturing is None:
                run(i)

        return real_time_cuda(both, n_sets, **kw)

    monkeypatch.setattr(runner, "time_cuda", time_cuda)
    return dev


def test_runner_cuda_branch_on_fake_device(fake_cuda, monkeypatch):
    """The sweep's CUDA code path (memory checks, set rotation, graph timing, ceilings, figures) on
    the fake device, 7 us a call."""
    _sweep_on_fake_device(fake_cuda, monkeypatch, 7.0)
    ceilings = timing.Ceilings(copy_tbps=4.0, matmul_tflops={"bf16": 600.0}, copy_bytes=0, matmul_n=0)
    huge = Shape(16, 65, 128, 2**27)  # 2.4 TB of KV: must be skipped, not built
    shapes = [Shape(1, 9, 2, 16, 1), huge]
    opts = SweepOptions(device="cuda", repeats=8, min_repeats=2, budget_s=0.01, max_sets=3, check_heads=2,
                        l2_bytes=2**20, slow_max_ms=1e6)
    rows, abort = run_sweep(shapes, [OursImpl("naive"), TorchSDPA()], opts, ceilings)
    assert abort is None
    ok = [r for r in rows if r.shape != huge]
    assert [r.status for r in ok] == ["ok", "ok"], ok
    for r in ok:
        assert r.timing.method == "graph" and r.timing.median_us == pytest.approx(7.0)
        assert r.n_sets == 3 and r.l2_warm
        assert r.pct_floor == pytest.approx(100 * r.shape.floor_s(4e12, 600e12) / 7e-6)
        assert r.tflops == pytest.approx(r.shape.flops / 7e-6 / 1e12)
    assert ok[1].speedup_vs_naive == pytest.approx(1.0)
    skipped = [r for r in rows if r.shape == huge]
    assert [r.status for r in skipped] == ["skip", "skip"] and "GiB free" in skipped[0].note
    assert ok[1].timing.samples == 3 * 3  # torch: 3 rounds of ceil(8 / 3) samples pooled; naive once, 8
    assert ok[0].timing.samples == 8


def test_runner_rounds_keep_ratios_under_a_drifting_clock(fake_cuda, monkeypatch):
    """Two equal kernels on a GPU whose calls slow down as it runs (a clock sinking under its power
    limit): timed one after the other, the second reads slower; in rotated rounds the two read
    alike (the bench's ``--rounds``, default 3)."""
    class Second(TorchSDPA):
        name = "torch-2"

    def drift(dev):
        dev.cost_us = 10.0 * (1 + dev.t / 2000.0)

    dev = _sweep_on_fake_device(fake_cuda, monkeypatch, 10.0, drift)
    ratio = {}
    for rounds in (1, 3):
        dev.t = 0.0
        opts = SweepOptions(device="cuda", repeats=24, min_repeats=2, budget_s=1.0, max_sets=1, check_heads=2,
                            l2_bytes=2**20, slow_max_ms=1e6, use_graph=False, rounds=rounds)
        rows, abort = run_sweep([Shape(1, 9, 2, 16, 1)], [TorchSDPA(), Second()], opts, None)
        assert abort is None and [r.status for r in rows] == ["ok", "ok"]
        assert all(r.timing.samples == 24 and r.timing.method == "eager" for r in rows)
        ratio[rounds] = rows[1].timing.median_us / rows[0].timing.median_us
    assert ratio[1] > 1.08 and abs(ratio[3] - 1) < 0.5 * (ratio[1] - 1), ratio
