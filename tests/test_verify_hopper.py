"""The Hopper kernels, Gluon (verify/hopper.py) and CUDA C++ (verify/hopper_cuda.py, opt-in), against
the float64 reference, through the public entry point (``verify_attention(kernel=..., plan=...)``)
and the flash plan; their CUDA-graph replay is in test_verify_kernels.py (one test for the planned
kernels).

The kernel tests are GPU-only (sm_90 with Triton's Gluon); on the CPU CI the import (it must never
fail), the layout guard and the dispatch (``auto`` never picks a kernel that cannot run) are checked.
"""

import argparse
import zlib
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, load_script, run_checked, unplanned_workspace
from kdtree_engine import reference, verify_attention
from kdtree_engine.testing import TOLERANCES, CaseSpec, build_case, chain_tree, compare, random_tree, star_tree
from kdtree_engine.verify import api, available_kernels, combine, hopper, plan_verify
from kdtree_engine.verify.op import resolve

G = torch.Generator().manual_seed(4321)
requires_hopper = pytest.mark.skipif(not hopper.available(), reason="needs an sm_90 GPU and Triton's Gluon")
HOPPER_KERNELS = ["hopper", "hopper_cuda"]


def skip_unless_it_runs(kernel: str) -> None:
    if kernel not in available_kernels(DEVICE, opt_in=True):
        pytest.skip(f"{kernel} does not run here")

SHAPES = {
    "1node-p0": dict(num_heads=4, prefix_lens=[0], trees=[[-1]]),
    "chain65-p16": dict(num_heads=2, prefix_lens=[500], trees=[chain_tree(65)], page_size=16),
    "star33-p1": dict(num_heads=5, prefix_lens=[7], trees=[star_tree(33)], page_size=1),
    "tree130-5words": dict(num_heads=2, prefix_lens=[1000], trees=[random_tree(130, G)], page_size=16),
    "odd-heads-h7": dict(num_heads=7, prefix_lens=[1003], trees=[random_tree(9, G)], page_size=1),
    "prefix0-ragged": dict(num_heads=3, prefix_lens=[0, 1, 0], trees=[random_tree(4, G), [-1], random_tree(6, G)]),
    "ragged-b4": dict(num_heads=6, prefix_lens=[1000, 5, 63, 2000],
                      trees=[random_tree(17, G), random_tree(3, G), [-1], random_tree(40, G)], page_size=16),
    "page64": dict(num_heads=4, prefix_lens=[1000, 3], trees=[random_tree(9, G), chain_tree(5)], page_size=64),
    "page128": dict(num_heads=16, prefix_lens=[3000], trees=[random_tree(33, G)], page_size=128),
    # every KV length a multiple of 64 (no partial tile); pages of 256 with a partial last tile each
    "page64-exact": dict(num_heads=8, prefix_lens=[1015, 119], trees=[random_tree(9, G), chain_tree(9)], page_size=64),
    "page256-ragged": dict(num_heads=3, prefix_lens=[700, 0, 2000],
                           trees=[random_tree(17, G), [-1], random_tree(40, G)], page_size=256),
    "wide-mask": dict(num_heads=2, prefix_lens=[11], trees=[random_tree(5, G)], extra_mask_words=2),
    "fp16": dict(num_heads=8, prefix_lens=[1000], trees=[random_tree(17, G)], dtype="fp16", page_size=16),
    "h128-long": dict(num_heads=128, prefix_lens=[20000], trees=[random_tree(33, G)], page_size=1),
    "h64-two-long": dict(num_heads=64, prefix_lens=[20000, 4097], trees=[random_tree(33, G), random_tree(33, G)]),
    "1024-nodes": dict(num_heads=4, prefix_lens=[3000], trees=[random_tree(1024, G)], page_size=16),
}


def test_import_never_fails():
    assert isinstance(hopper.HAVE_GLUON, bool)
    assert hopper.available("cpu") is False


def test_supports_refuses_unaligned_strides():
    q = torch.zeros(3, 2, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    assert hopper.supports(q, kv)
    wide = torch.zeros(3, 2, 580, dtype=torch.bfloat16)[..., :576]  # row stride 580: not a multiple of 16
    assert not hopper.supports(wide, kv)
    assert not hopper.supports(q, torch.zeros(4, 16, 584, dtype=torch.bfloat16)[..., :576])


@pytest.mark.parametrize("kernel", HOPPER_KERNELS)
@pytest.mark.parametrize("num_programs", [None, 7, 1])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_hopper_matches_reference(shape, num_programs, kernel):
    """``num_programs=1``: one program runs every segment in turn, so every barrier phase carries over
    from segment to segment (odd and even tile counts mixed)."""
    skip_unless_it_runs(kernel)
    spec = CaseSpec(shape, seed=zlib.crc32(shape.encode()) % 1000, **SHAPES[shape])
    c = build_case(spec, "cuda")
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), spec.num_heads, "cuda", num_programs=num_programs)
    run_checked(c, kernel, spec.dtype, plan=plan)


@pytest.mark.parametrize("kernel", HOPPER_KERNELS)
@pytest.mark.parametrize("num_programs", [6, 12, None])
def test_hopper_first_tile_invisible_and_logits_far_below_zero(num_programs, kernel):
    """Consumer 0 brings its P to the step's joint max by ``exp2(m0 - m1)``. A row that has seen no
    key yet in its segment and none in consumer 0's tile (``m0 = -inf``) while its keys in consumer
    1's tile score far below zero (``m1 < -128`` in log2 units) made that factor overflow and the
    row NaN. A star tree of 192 nodes after 64 prefix tokens, split so that the segments of nodes
    128-191 start at the tile of nodes 64-127, which none of them sees; every key entry 1 and every
    query entry -8, so each row's logits are -192 (its exact output: the keys' latent part)."""
    skip_unless_it_runs(kernel)
    spec = CaseSpec("far-below-zero", 1, [64], [star_tree(192)], page_size=64)
    c = build_case(spec, "cuda")
    c["kv_cache"].fill_(1.0)
    c["q"].fill_(-8.0)
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 1, "cuda", num_programs=num_programs)
    out, _ = run_checked(c, kernel, "bf16", plan=plan)
    assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("kernel", HOPPER_KERNELS)
@pytest.mark.parametrize("page_size", [16, 64])
def test_hopper_deterministic_and_nan_never_leaks(page_size, kernel):
    skip_unless_it_runs(kernel)
    spec = CaseSpec("poison", 16, [5000, 19], [random_tree(33, G), [-1]], page_size=page_size, spare_pages=5)
    c = build_case(spec, "cuda")
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 16, "cuda", num_programs=50)
    out1, lse1 = run_checked(c, kernel, "bf16", plan=plan)
    out2, lse2 = run_checked(c, kernel, "bf16", plan=plan)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert bool(torch.isfinite(out1).all()) and bool(torch.isfinite(lse1).all())


@pytest.mark.parametrize("kernel", HOPPER_KERNELS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "combine-kernel"])
@pytest.mark.parametrize("heads, nodes, prefix, page_size", [
    (16, 9, 131000, 1),  # 3 row blocks: 44 parts of 46-47 tiles
    (128, 33, 20000, 64),  # 66 row blocks: 2 parts
    (64, 9, 4097, 16),  # 9 row blocks, 14 parts, a partial last tile
    (16, 9, 0, 64),  # the tree alone: one tile, one part, nothing split
    (4, 1, 63, 1),  # one row block, one tile
])
def test_hopper_schedules_one_sequence_itself(heads, nodes, prefix, page_size, fused, kernel, monkeypatch):
    """An unplanned one-sequence call whose KV parts fill the grid: the kernel's own schedule (the
    workspace's segment tables poisoned: never read), its split groups merged in the kernel or by
    the combine kernel, against the reference and bitwise equal over two calls."""
    skip_unless_it_runs(kernel)
    monkeypatch.setattr(api, "_UNPLANNED", {})  # a fresh workspace: its launches prepared here
    monkeypatch.setattr(combine, "FUSED_COMBINE", fused)
    c = build_case(CaseSpec("one", heads, [prefix], [random_tree(nodes, G)], page_size=page_size), "cuda")
    out1, lse1 = run_checked(c, kernel, "bf16")
    ws = unplanned_workspace(c)
    assert ws.tables.in_kernel and ws.schedules_in_kernel(nodes)
    ws.tables.prog_first_seg.fill_(-(2**30))
    ws.tables.segments.fill_(2**30)
    out2, lse2 = run_checked(c, kernel, "bf16")
    assert unplanned_workspace(c) is ws and torch.equal(out1, out2) and torch.equal(lse1, lse2)


@requires_hopper
@pytest.mark.parametrize("heads, prefix, few", [(16, 40000, True), (128, 4000, False)], ids=["few-groups", "many"])
def test_hopper_fused_merge_takes_both_tiles(heads, prefix, few, monkeypatch):
    """The fused merge's two tiles: ``(FEW_S, FEW_R)`` where the plan's split groups would give no
    program more than 2 items of the default tile (one sequence of 16 heads x 9 nodes: 3 row blocks
    split many ways), the default otherwise (128 heads: 18 row blocks). Both against the reference
    and bitwise equal over two calls (the kernel merging any group count itself) and to a call whose
    merge keeps the partials in L2 (``DISCARD_PARTIALS`` off: the same sums)."""
    monkeypatch.setattr(hopper, "FUSED_MERGE_MAX_GROUPS", 1 << 30)
    spec = CaseSpec("merge", heads, [prefix], [chain_tree(9)], page_size=64)
    c = build_case(spec, "cuda")
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), heads, "cuda")
    items = plan.num_groups * hopper.BLOCK_M // combine.ROWS_PER_ITEM
    assert plan.num_groups > 0 and (items <= 2 * plan.num_programs) == few
    out1, lse1 = run_checked(c, "hopper", "bf16", plan=plan)
    out2, lse2 = run_checked(c, "hopper", "bf16", plan=plan)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    monkeypatch.setattr(hopper, "DISCARD_PARTIALS", False)
    kept = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), heads, "cuda")  # its launches prepared anew
    out3, lse3 = run_checked(c, "hopper", "bf16", plan=kept)
    assert torch.equal(out1, out3) and torch.equal(lse1, lse3)


@requires_hopper
def test_hopper_merge_form_follows_the_group_count_and_graphs_keep_theirs(monkeypatch):
    """A planned call that split at most ``FUSED_MERGE_MAX_GROUPS`` row blocks merges them in the
    kernel, one that split more in the combine kernel after it (the same compiled kernel, told at
    run time): both against the reference, eagerly; and a CUDA graph captured in either form,
    replayed after a re-plan to the other group count (4 sequences of 16 heads x 9 nodes, 3 row
    blocks each: all split at 16k, only the first sequence's with the others at 200), stays right."""
    monkeypatch.setattr(hopper, "FUSED_MERGE_MAX_GROUPS", 8)
    c = build_case(CaseSpec("forms", 16, [16384] * 4, [chain_tree(9)] * 4, page_size=64), "cuda")
    many = c["kv_lens"].clone()
    few = many.clone()
    few[1:] = 209
    qo = c["qo_indptr"].cpu()
    plan = plan_verify(many.cpu(), qo, 16, "cuda")
    out = torch.empty(36, 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(36, 16, device="cuda")

    def replan(lens) -> int:
        c["kv_lens"].copy_(lens)
        plan.plan(lens.cpu(), qo)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        return plan.num_groups

    def call():
        verify_attention(**c, kernel="hopper", plan=plan, out=out, lse=lse)

    def check(what: str):
        torch.cuda.synchronize()
        ref_out, ref_lse = reference(**c)
        res = compare(out, ref_out, *TOLERANCES["bf16"]["out"])
        assert res.ok, f"{what}: out {res} {res.detail}"
        assert compare(lse, ref_lse, *TOLERANCES["bf16"]["lse"]).ok, what

    counts = []
    for lens in (many, few):
        counts.append(replan(lens))
        call()
        check(f"eager, {counts[-1]} groups")
    assert counts[0] > 8 >= counts[1] > 0, counts
    for capture, replay in ((many, few), (few, many)):
        replan(capture)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        groups = replan(replay)
        g.replay()
        check(f"captured at {counts[0] if capture is many else counts[1]} groups, replayed at {groups}")


@pytest.mark.parametrize("kernel, merge", [("hopper", "fused"), ("hopper", "combine"), ("hopper_cuda", "fused")])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_call_reads_what_the_call_before_it_wrote(kernel, merge, graph, monkeypatch):
    """Two planned calls back to back on one stream, the second's first KV rows (page size 1, its
    sequence 0's first 144 positions) being the first call's output (its latent columns, NaN
    before): the second reads them only once the first has written them, eagerly and replayed from
    a CUDA graph. A kernel launched as a programmatic dependent of the one before it (which may start
    while that one runs) must wait for it before any read: this catches one that does not. With
    ``merge="combine"`` the first call's splits are merged by the combine kernel after it, which
    writes the rows the second reads."""
    skip_unless_it_runs(kernel)
    monkeypatch.setattr(hopper, "FUSED_MERGE_MAX_GROUPS", -1 if merge == "combine" else 1 << 30)
    a = build_case(CaseSpec("writer", 16, [3000], [random_tree(9, G)], page_size=64), "cuda")
    b = build_case(CaseSpec("reader", 8, [2000, 500], [random_tree(17, G), chain_tree(5)], seed=1), "cuda")
    rows = a["q"].shape[0] * a["q"].shape[1]  # a's output rows, one per (node, head)
    pool = b["kv_cache"].shape[0]
    written = torch.randn(rows, 1, 576, device="cuda").to(torch.bfloat16)
    written[..., :512] = float("nan")  # the latent columns: a's output, once it is written
    b["kv_cache"] = torch.cat([b["kv_cache"], written])
    b["page_table"][0, :rows] = torch.arange(pool, pool + rows, dtype=torch.int32, device="cuda")
    out_a = b["kv_cache"][pool:, 0, :512].view(a["q"].shape[0], a["q"].shape[1], 512)
    lse_a = torch.empty(a["q"].shape[:2], device="cuda")
    out_b = torch.empty(*b["q"].shape[:2], 512, dtype=torch.bfloat16, device="cuda")
    lse_b = torch.empty(b["q"].shape[:2], device="cuda")
    plan_a = plan_verify(a["kv_lens"].cpu(), a["qo_indptr"].cpu(), 16, "cuda")
    plan_b = plan_verify(b["kv_lens"].cpu(), b["qo_indptr"].cpu(), 8, "cuda")

    def calls():
        verify_attention(**a, kernel=kernel, plan=plan_a, out=out_a, lse=lse_a)
        verify_attention(**b, kernel=kernel, plan=plan_b, out=out_b, lse=lse_b)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            calls()
        out_a.fill_(float("nan"))
        g.replay()
    else:
        out_a.fill_(float("nan"))
        calls()
    torch.cuda.synchronize()
    ref_a, _ = reference(**a)
    ref_b, ref_lse_b = reference(**b)  # on the rows a wrote
    assert compare(out_a, ref_a, *TOLERANCES["bf16"]["out"]).ok
    res = compare(out_b, ref_b, *TOLERANCES["bf16"]["out"])
    assert res.ok, f"out: {res} {res.detail}"
    assert compare(lse_b, ref_lse_b, *TOLERANCES["bf16"]["lse"]).ok


def test_dispatch_never_picks_what_cannot_run():
    c = build_case(CaseSpec("dispatch", 2, [5], [[-1, 0]]), DEVICE)
    plan = plan_verify([7], [0, 2], 2, DEVICE)
    runs = available_kernels(DEVICE)
    assert resolve("auto", c["q"], c["kv_cache"], plan.tables.config) == ("hopper" if "hopper" in runs else "flash")
    # a layout the Hopper kernel cannot copy (row stride 580 elements) goes to flash under auto
    wide = torch.zeros(*c["q"].shape[:2], 580, dtype=c["q"].dtype, device=DEVICE)[..., :576]
    assert resolve("auto", wide, c["kv_cache"], plan.tables.config) == "flash"
    if "hopper" not in runs:
        with pytest.raises(ValueError, match="kernel='hopper' needs an sm_90 GPU"):
            verify_attention(**c, kernel="hopper")



def test_timeline_and_ab_scripts_still_fit_the_kernel():
    """scripts/hopper_timeline.py stamps a copy of the kernel's source at anchors: each is still
    there as often as it expects, and the stamped copy is still Python; scripts/ab_hopper.py's way
    of loading a variant (module_from_source) gives a module with the same prepare."""
    timeline = load_script("hopper_timeline")
    src = timeline.stamped_source(8)
    compile(src, "hopper_stamped.py", "exec")
    assert all(f"_stamp(trace, steps, {point}, WG)" in src for point in range(timeline.NPOINTS))
    # scripts/ab_hopper.py loads a variant kernel the same way: a copy of this one imports and prepares
    copy = timeline.module_from_source(Path(hopper.__file__).read_text(), "hopper_copy")
    assert copy.prepare.__code__.co_varnames[:10] == hopper.prepare.__code__.co_varnames[:10]
    assert copy.HAVE_GLUON == hopper.HAVE_GLUON


def test_scripts_call_make_inputs_as_it_is_defined():
    """Every script that builds its inputs with scripts/tune_flash.py's ``make_inputs`` or
    ``equal_step`` (or a plan with its ``plan_with_schedule``), or its planned calls with
    scripts/ab_hopper.py's ``planned_call``, passes the arguments it takes (``make_inputs``'s
    signature changed once, from ``(H, n, B, prefix, page_size)`` to the KV lengths, and four
    GPU-only scripts then stopped at their first shape; the seed is keyword-only, so such a call no
    longer binds; ``planned_call``'s ``fused`` became ``max_fused_groups``, and ncu_kernels.py kept
    passing ``fused``)."""
    import ast
    import inspect

    tune, ab = load_script("tune_flash"), load_script("ab_hopper")
    signatures = {name: inspect.signature(getattr(tune, name))
                  for name in ("make_inputs", "equal_step", "plan_with_schedule")}
    signatures["planned_call"] = inspect.signature(ab.planned_call)
    calls = dict.fromkeys(signatures, 0)
    for path in sorted((Path(__file__).parent.parent / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
            if name in signatures:
                calls[name] += 1
                signatures[name].bind(*node.args, **{k.arg: k.value for k in node.keywords})
    assert calls["make_inputs"] >= 3 and calls["equal_step"] >= 3 and calls["planned_call"] >= 4, calls
    assert calls["plan_with_schedule"] >= 3, calls


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "two"])
def test_clock_seconds_refuse_what_is_not_a_finite_count(text):
    """scripts/clock_probe.py's ``--seconds`` and ab_hopper.py's ``--clock-seconds`` (the argparse type
    ``seconds``): a negative, NaN, infinite or non-number value is argparse's one-line error (a NaN
    or infinite count would reach ``int()`` in the run, after the shapes' set-up); 0 and 2.5 pass."""
    probe = load_script("clock_probe")
    with pytest.raises(argparse.ArgumentTypeError):
        probe.seconds(text)
    assert probe.seconds("0") == 0.0 and probe.seconds("2.5") == 2.5


def test_ab_script_applies_a_variant_diff(tmp_path):
    """scripts/ab_hopper.py and hopper_timeline.py take FILE.diff:NAME, that section's unified diff
    applied to this kernel (context and removed lines checked: a diff made against another kernel
    stops it)."""
    timeline = load_script("hopper_timeline")
    src = Path(hopper.__file__).read_text()
    lines = src.splitlines(keepends=True)
    i = next(k for k, line in enumerate(lines) if line.startswith("BLOCK_M, BLOCK_N = "))
    variants = tmp_path / "variants.diff"
    variants.write_text(f"### variant wide\n--- verify/hopper.py\n+++ wide.py\n@@ -{i},2 +{i},3 @@\n {lines[i - 1]}"
                        f"-{lines[i]}+{lines[i]}+# wide\n"
                        "### ablation stale\n--- verify/hopper.py\n+++ stale.py\n@@ -1,1 +1,1 @@\n-not this kernel\n+x\n")
    name, out = timeline.variant_source(f"{variants}:wide")
    assert name == "wide" and out == "".join(lines[:i + 1] + ["# wide\n"] + lines[i + 1:])
    with pytest.raises(ValueError, match="does not match"):
        timeline.variant_source(f"{variants}:stale")
    with pytest.raises(SystemExit, match="no section"):
        timeline.variant_source(f"{variants}:absent")


def test_timeline_refuses_a_consumer_with_points_never_stamped():
    """A point no step of a consumer stamped (an anchor that moved out of the code that consumer runs,
    as consumer 0's QK did into _qk_after_pv) would leave that consumer with no complete step and an
    empty report: scripts/hopper_timeline.py stops instead, naming the points."""
    timeline = load_script("hopper_timeline")
    n = timeline.NPOINTS
    # 2 programs, 3 traces (consumers 0 and 1, the loader), 4 steps: each point 10 cycles after the last
    trace = (torch.arange(4 * n).reshape(1, 1, 4, n) * 10).expand(2, 3, 4, n).clone()
    report = timeline.intervals(trace)
    assert report["consumer0"]["steps"] == report["consumer1"]["steps"] == 2 * 3
    assert report["consumer0"]["step"] == 10 * n
    trace[:, 0, :, 10] = -1
    with pytest.raises(ValueError, match=r"consumer 0 never stamped points \[10\]"):
        timeline.intervals(trace)


def test_timeline_phases_of_a_program():
    """scripts/hopper_timeline.py's program phases: entry -> consumer 0's first step (start), its
    steps (loop, only where every step was stamped), its last step's end -> the join (end, and its
    four parts), the grid barrier's wait and the merge (and its first item's two stamps); a program
    that never reached its join is left out; and per program, with its SM."""
    timeline = load_script("hopper_timeline")
    n, steps = timeline.NPOINTS, 4
    trace = torch.full((3, 3, steps, n), -1, dtype=torch.int64)
    trace[0, 0, :2, 0] = torch.tensor([100, 300])  # program 0: two steps of 200 cycles, 2 of 4 slots stamped
    trace[0, 0, :2, timeline.CHAIN - 1] = torch.tensor([280, 480])
    trace[1, 0, :, 0] = torch.tensor([50, 60, 70, 80])  # program 1: every slot stamped (maybe more steps)
    trace[1, 0, :, timeline.CHAIN - 1] = torch.tensor([59, 69, 79, 89])
    # entry, joined, barrier, merged, consumer 0's epilogue (last PV, row sums swapped, stores issued),
    # the merge's first item (first round accumulated, stores issued)
    # and the SM
    stamps = torch.tensor([[10, 600, 900, 1000, 500, 540, 580, 930, 950, 7], [0, 200, 250, -1, -1, -1, -1, -1, -1, 3],
                           [5, -1, -1, -1, -1, -1, -1, -1, -1, 0]])
    per = timeline.program_phases(trace, stamps)  # the same figures per program, None where it has none
    ph = timeline.phases(per)
    assert ph["start"] == {"min": 50, "median": 70, "max": 90, "programs": 2}
    assert ph["loop"] == {"min": 380, "median": 380, "max": 380, "programs": 1}  # program 1's steps may run past the slots
    assert ph["end"]["median"] == 600 - 480 and ph["barrier"]["median"] == (300 + 50) / 2
    assert ph["barrier"]["min"] == 50  # the last arrival's wait: the barrier's own latency
    assert [ph[k]["median"] for k in ("end_pv", "end_swap", "end_store", "end_join")] == [20, 40, 40, 20]
    assert ph["merge_round1"]["median"] == 30 and ph["merge_item1"] == {"min": 50, "median": 50, "max": 50, "programs": 1}
    assert ph["merge"] == {"min": 100, "median": 100, "max": 100, "programs": 1} and ph["total"]["max"] == 990
    assert per["sm"] == [7, 3, None] and per["steps"] == [2, None, None] and per["loop"] == [380, None, None]
    assert per["step_cycles"] == [[200, 180], None, None] and "step_cycles" not in ph  # the last: to its end
    assert per["barrier"] == [300, 50, None] and per["total"] == [990, 250, None] and "sm" not in ph


def test_timeline_loop_spread_by_row_block():
    """scripts/hopper_timeline.py's reading of the programs' loops: cycles a step, by the row block of
    each program's first segment, and the fastest and slowest programs with their SM and segments
    (programs without a whole loop left out)."""
    timeline = load_script("hopper_timeline")
    programs = {"loop": [1000, 1200, 900, None, 3000], "steps": [10, 10, 9, None, 20], "sm": [0, 1, 2, 3, 4],
                "pieces": [[[0, 0, 0, 64]], [[0, 64, 0, 64]], [[0, 128, 0, 64]], [[1, 0, 0, 64]], [[1, 128, 64, 128]]]}
    lines = timeline.loop_spread(programs, 64)
    assert lines[0] == "loop, cycles a step, median by row block (programs): 0: 100 (1)  1: 120 (1)  2: 125 (2)"
    assert lines[1].startswith("fastest: program 0 on SM 0, 100 a step x 10, segments [[0, 0, 0, 64]]; program 2 on")
    assert lines[2].startswith("slowest: program 4 on SM 4, 150 a step x 20") and "program 3" not in lines[2]
    assert timeline.loop_spread(dict(programs, pieces=None), 64)[0].startswith("fastest: program 0 on SM 0, 100")
    # each step by its index in the program (where the programs' steps were kept)
    lines = timeline.loop_spread(dict(programs, step_cycles=[[300, 100], [500, 120, 90], None, None, None]), 64)
    assert lines[1] == "cycles a step by its index in the program, median (programs): 0: 400 (2)  1: 110 (2)  2: 90 (1)"
