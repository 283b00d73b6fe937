"""VerifyAttention (plan once, run per layer): against verify_attention and the float64 reference,
re-planned into the same workspace, refusing plans past its maxima, through the torch op under
torch.compile, and (GPU) replayed from a CUDA graph after new plans."""

import math

import numpy as np
import pytest
import torch

from conftest import DEVICE, requires_cuda
from kdtree_engine import VerifyAttention, reference, verify_attention
from kdtree_engine.testing import TOLERANCES, CaseSpec, build_case, chain_tree, compare, random_tree
from kdtree_engine.verify.plan import CONFIGS, HOPPER_COSTS, TRITON_COSTS, VerifyPlan

G = torch.Generator().manual_seed(77)
CASES = {
    "ragged-page1": CaseSpec("ragged-page1", 3, [40, 0, 17], [random_tree(9, G), [-1], random_tree(20, G)],
                             page_size=1, seed=1),
    "ragged-page16": CaseSpec("ragged-page16", 2, [3, 50], [random_tree(5, G), chain_tree(33)], page_size=16,
                              seed=2, spare_pages=4),
}


def assert_matches_reference(c, out, lse):
    r_out, r_lse = reference(**c)
    res = compare(out, r_out, *TOLERANCES["bf16"]["out"])
    assert res.ok, f"out: {res} {res.detail}"
    res = compare(lse, r_lse, *TOLERANCES["bf16"]["lse"])
    assert res.ok, f"lse: {res} {res.detail}"


def nan_outputs(c):
    T, H, _ = c["q"].shape
    return (torch.full((T, H, 512), math.nan, dtype=c["q"].dtype, device=DEVICE),
            torch.full((T, H), math.nan, dtype=torch.float32, device=DEVICE))


@pytest.mark.parametrize("kernel", ["flash", "naive"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_run_matches_verify_attention_and_reference(name, kernel):
    c = build_case(CASES[name], DEVICE)
    assert bool(c["kv_cache"].isnan().any())  # poisoned slots must not leak
    attn = VerifyAttention(4, 40, c["q"].shape[1], DEVICE, kernel=kernel, num_programs=7)
    attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu().tolist())
    out, lse = nan_outputs(c)
    got = attn.run(c["q"], c["kv_cache"], c["page_table"], c["tree_mask"], out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    assert_matches_reference(c, out, lse)
    want_out, want_lse = verify_attention(**c, kernel=kernel)
    if kernel == "naive":  # the same kernel on the same inputs: bitwise
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_replan_reuses_the_workspace():
    """New lengths (other B, tree sizes, prefixes) planned into the same buffers: no reallocation,
    right answers each time, including a plan that splits KV, one that does not, and one that
    reuses the previous schedule (same tile counts)."""
    attn = VerifyAttention(3, 24, 2, DEVICE, num_programs=6)
    ws = attn.workspace
    buffers = [ws.kv_lens_buf, ws.qo_indptr_buf, *ws.tables[1:7]]
    ptrs = [t.data_ptr() for t in buffers]
    tree = random_tree(24, G)
    specs = [
        CaseSpec("a", 2, [60, 5, 0], [random_tree(7, G), tree, [-1]], page_size=1, seed=3),
        # one token more per sequence: the same tile counts (the kept schedule, new last-tile ends)
        CaseSpec("a+1", 2, [61, 6, 1], [[-1, 0, 0, 1, 1, 2, 3], tree, [-1]], page_size=1, seed=3),
        CaseSpec("b", 2, [1], [random_tree(3, G)], page_size=16, seed=4),
        CaseSpec("c", 2, [90, 33], [chain_tree(12), random_tree(2, G)], page_size=1, seed=5),
    ]
    split = []
    for spec in specs:
        c = build_case(spec, DEVICE)
        attn.plan(spec.kv_lens, c["qo_indptr"].cpu())
        split.append(ws.num_groups > 0)
        out, lse = nan_outputs(c)
        attn.run(c["q"], c["kv_cache"], c["page_table"], c["tree_mask"], out=out, lse=lse)
        assert_matches_reference(c, out, lse)
        assert attn.kv_lens.tolist() == spec.kv_lens
        assert [t.data_ptr() for t in buffers] == ptrs
    assert any(split) and not all(split)


@pytest.mark.parametrize("kv_lens, qo_indptr, match", [
    ([10] * 4, [0, 1, 2, 3, 4], "kv_lens has 4 sequences; this plan holds at most max_batch=3"),
    ([40], [0, 17], "qo_indptr gives a tree of 17 nodes; this plan holds at most max_tree_nodes=16"),
    ([4, 4], [0, 2], "qo_indptr must have 3 entries"),
    ([1, 4], [0, 2, 3], "kv_lens\\[0\\]=1 is shorter than its tree"),
    ([4, 4], [0, 2, 2], "qo_indptr gives a sequence with no tree node"),
    ([4, 4], [1, 2, 3], "qo_indptr must start at 0"),
])
def test_plan_beyond_the_maxima_or_malformed_is_refused(kv_lens, qo_indptr, match):
    attn = VerifyAttention(3, 16, 2, DEVICE)
    with pytest.raises(ValueError, match=match):
        attn.plan(kv_lens, qo_indptr)


@pytest.mark.parametrize("args, match", [
    (dict(max_batch=0), "max_batch must be an int in 1"),
    (dict(max_tree_nodes=1025), "max_tree_nodes must be an int in 1..1024"),
    (dict(num_heads=129), "num_heads must be an int in 1..128"),
    (dict(kernel="fast"), "kernel must be one of"),
    (dict(max_batch=True), "max_batch must be an int in 1"),
    (dict(device="meta"), "the kernels run on a CUDA GPU"),
])
def test_bad_construction_is_refused(args, match):
    kw = dict(max_batch=2, max_tree_nodes=8, num_heads=2, device=DEVICE) | args
    with pytest.raises(ValueError, match=match):
        VerifyAttention(**kw)


@pytest.mark.parametrize("kernel, costs", [("flash", TRITON_COSTS), ("hopper", HOPPER_COSTS)])
def test_a_named_kernel_plans_with_its_own_cost_model(kernel, costs):
    """4 trees of 9 and 5 nodes x 64 heads at 131072 on 132 programs: the two kernels' cost models
    pick different schedules (the Hopper kernel's HBM term takes the KV parts schedule), whatever the
    device. (With one tree size both take the parts with the KV's last tiles on the programs they
    leave idle, which the line's shares cost more than under either.)"""
    lens, indptr = [131081, 131077, 131081, 131077], [0, 9, 14, 23, 28]
    attn = VerifyAttention(4, 9, 64, DEVICE, kernel=kernel, config=CONFIGS[1], num_programs=132)
    attn.plan(lens, indptr)
    tables = {}
    for name, model in (("triton", TRITON_COSTS), ("hopper", HOPPER_COSTS)):
        p = VerifyPlan(4, 9, 64, DEVICE, config=CONFIGS[1], num_programs=132, costs=model).plan(lens, indptr)
        tables[name] = (p.num_segments, p.tables.segments.cpu().clone())
    assert tables["triton"][0] != tables["hopper"][0]
    own = tables["triton" if costs is TRITON_COSTS else "hopper"]
    assert attn.workspace.num_segments == own[0]
    assert torch.equal(attn.workspace.tables.segments.cpu(), own[1])


def test_run_before_plan_and_bad_device_schedule_are_refused():
    attn = VerifyAttention(np.int64(2), 8, 2, DEVICE)  # numpy integers are ints
    c = build_case(CASES["ragged-page16"], DEVICE)
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(c["q"], c["kv_cache"], c["page_table"], c["tree_mask"])
    with pytest.raises(ValueError, match="device_schedule must be one of"):
        attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), device_schedule="whole")


def test_run_checks_shapes_against_the_plan():
    c = build_case(CaseSpec("s", 2, [5, 3], [[-1, 0, 0], [-1, 0]], page_size=4, seed=6), DEVICE)
    attn = VerifyAttention(2, 8, 2, DEVICE)
    attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
    args = (c["q"], c["kv_cache"], c["page_table"], c["tree_mask"])
    with pytest.raises(ValueError, match="plan was built for H=2, T=5, B=2"):
        attn.run(c["q"][:4], *args[1:3], c["tree_mask"][:4])
    with pytest.raises(ValueError, match="page_table has 1 rows"):
        attn.run(*args[:2], c["page_table"][:1], args[3])
    with pytest.raises(ValueError, match="fewer than the planned kv_len 8"):
        attn.run(*args[:2], c["page_table"][:, :1], args[3])
    with pytest.raises(ValueError, match="sm_scale"):
        attn.run(*args, sm_scale=0.0)
    attn.run(*args)  # passes, and keeps its signature's launches and the plan it was checked against
    attn.plan([40, 3], [0, 3, 5])  # a tree of 3 nodes still fits one mask word; the pages do not
    with pytest.raises(ValueError, match="fewer than the planned kv_len 40"):
        attn.run(*args)
    attn.plan([5, 4], [0, 3, 4])  # T = 4: the same tensors no longer match the plan
    with pytest.raises(ValueError, match="plan was built for H=2, T=4, B=2"):
        attn.run(*args)
    with pytest.raises(ValueError, match="plan was built for H=2, T=4, B=2"):
        verify_attention(**c, plan=attn.workspace)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU runs the kernels under Triton's interpreter, set only where no GPU is")
@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c["page_table"].__setitem__((1, 1), -2**31), "page_table\\[1, 1\\]=-2147483648 is outside"),
        (lambda c: c["page_table"].__setitem__((0, 0), 99), "page_table\\[0, 0\\]=99 is outside"),
        (lambda c: c["tree_mask"].__setitem__((1, 0), 4), "row 1 does not set its own bit"),
    ],
)
def test_run_on_the_cpu_checks_the_contents(edit, match):
    """On the CPU, run checks page ids and mask bits as verify_attention does there (the host's
    data: no sync); Triton's interpreter would otherwise read a page id past the cache from host
    memory (a segfault); so does the op a compiled run calls. The caller's tensors are left as they
    were."""
    torch._dynamo.reset()
    c = build_case(CaseSpec("c", 2, [5, 7], [[-1, 0, 0], [-1, 0]], page_size=4, seed=6), "cpu")
    attn = VerifyAttention(2, 8, 2, "cpu")
    attn.plan(c["kv_lens"], c["qo_indptr"])
    edit(c)
    before = {k: v.clone() for k, v in c.items()}
    for run in (attn.run, torch.compile(attn.run, backend="eager", fullgraph=True)):
        with pytest.raises(ValueError, match=match):
            run(c["q"], c["kv_cache"], c["page_table"], c["tree_mask"])
    torch.testing.assert_close(c, before, rtol=0, atol=0, equal_nan=True)


def _op_args(attn, c, scale):
    ws = attn.workspace
    t, cfg = ws.tables, ws.tables.config
    return (c["q"], c["kv_cache"], c["page_table"], ws.kv_lens, ws.qo_indptr, c["tree_mask"], t.prog_first_seg,
            t.segments, t.groups, t.group_count, t.grid_barrier, t.partial_out, t.partial_lse, scale, "flash",
            cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)


def test_op_fake_tensor_shapes():
    """The op's fake implementation: out [T, H, 512] in q's dtype, lse [T, H] float32, no kernel run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kdtree_engine.verify.op import verify_attention_op

    c = build_case(CaseSpec("f", 3, [9], [random_tree(6, G)], page_size=1, seed=7), DEVICE)
    attn = VerifyAttention(1, 8, 3, DEVICE)
    attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in _op_args(attn, c, 0.04)]
        out, lse = verify_attention_op(*fake)
    assert (tuple(out.shape), out.dtype) == ((6, 3, 512), torch.bfloat16)
    assert (tuple(lse.shape), lse.dtype) == ((6, 3), torch.float32)


def test_opcheck():
    from kdtree_engine.verify.op import verify_attention_op

    c = build_case(CaseSpec("o", 2, [20], [random_tree(5, G)], page_size=1, seed=8), DEVICE)
    attn = VerifyAttention(1, 8, 2, DEVICE, num_programs=4)
    attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
    torch.library.opcheck(verify_attention_op, _op_args(attn, c, 1 / math.sqrt(576)),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiles_fullgraph_and_matches_eager(backend):
    """A model-step-like function (projection, verify, projection) compiles with fullgraph=True (a
    graph break raises) and gives the eager result; a new plan reuses the compiled graph."""
    torch._dynamo.reset()
    spec = CaseSpec("g", 2, [30, 4], [random_tree(6, G), random_tree(3, G)], page_size=1, seed=9)
    c = build_case(spec, DEVICE)
    attn = VerifyAttention(2, 8, 2, DEVICE, num_programs=5)
    attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())

    def step(q, kv_cache, page_table, tree_mask):
        out, lse = attn.run(q * 1.0, kv_cache, page_table, tree_mask)
        return out.float().sum(-1), lse

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    args = (c["q"], c["kv_cache"], c["page_table"], c["tree_mask"])
    want = step(*args)
    got = compiled(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_matches_reference(c, attn.run(*args)[0], got[1])
    # new lengths, same row count: the same graph, the plan's new content
    c2 = build_case(CaseSpec("g2", 2, [17, 50], [random_tree(4, G), random_tree(5, G)], page_size=1, seed=10),
                    DEVICE)
    attn.plan(c2["kv_lens"].cpu(), c2["qo_indptr"].cpu())
    got2 = compiled(c2["q"], c2["kv_cache"], c2["page_table"], c2["tree_mask"])
    assert_matches_reference(c2, attn.run(c2["q"], c2["kv_cache"], c2["page_table"], c2["tree_mask"])[0], got2[1])
    # a decode loop: the lengths grow step by step over the same tensors (their pages hold the longest
    # step's positions); the run read the plan's host state while traced, a guard on it recompiled
    # every step and fullgraph failed at the recompile limit (8)
    full = c2["kv_lens"].clone()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # (c2's pool recompiled: another shape)
    for k in range(10, -1, -1):
        c2["kv_lens"] = full - k
        attn.plan(c2["kv_lens"].cpu(), c2["qo_indptr"].cpu())
        got2 = compiled(c2["q"], c2["kv_cache"], c2["page_table"], c2["tree_mask"])
        assert_matches_reference(c2, attn.run(c2["q"], c2["kv_cache"], c2["page_table"], c2["tree_mask"])[0], got2[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # the page table's capacity is still checked, by the op when it runs (it would read past the table)
    attn.plan((full + c2["page_table"].shape[1]).cpu(), c2["qo_indptr"].cpu())
    with pytest.raises(ValueError, match="fewer than the planned kv_len"):
        compiled(c2["q"], c2["kv_cache"], c2["page_table"], c2["tree_mask"])


def test_compiled_run_with_symbolic_rows_and_given_outputs():
    """dynamic=True (T and B symbolic): plans of other T and B run in the compiled function (its
    check compared a symbolic T with `not in`, which Dynamo answered wrongly: "built for T=7; got
    T=7"), and given out / lse buffers are written (their address check ran on traced tensors)."""
    torch._dynamo.reset()
    attn = VerifyAttention(3, 8, 2, DEVICE, num_programs=4)

    def step(q, kv_cache, page_table, tree_mask, out, lse):
        return attn.run(q, kv_cache, page_table, tree_mask, out=out, lse=lse)

    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=True)
    for i, (prefixes, sizes) in enumerate((([30, 4], [6, 3]), ([9], [5]), ([3, 12, 40], [2, 7, 4]))):
        c = build_case(CaseSpec(f"d{i}", 2, prefixes, [random_tree(n, G) for n in sizes], page_size=1, seed=i), DEVICE)
        attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
        out, lse = nan_outputs(c)
        got = compiled(c["q"], c["kv_cache"], c["page_table"], c["tree_mask"], out, lse)
        assert got[0] is out and got[1] is lse
        assert_matches_reference(c, out, lse)


@requires_cuda
def test_cuda_graph_replays_after_new_plans():
    """Capture run once at the maxima's buffers, then plan new lengths (other B, tree sizes and
    prefixes within the maxima), write the step's inputs into the same buffers, and replay."""
    H, max_b, max_n, max_pages = 16, 4, 40, 7000
    attn = VerifyAttention(max_b, max_n, H, "cuda")
    q_buf = torch.zeros(max_b * max_n, H, 576, dtype=torch.bfloat16, device="cuda")
    mask_buf = torch.zeros(max_b * max_n, 2, dtype=torch.int32, device="cuda")
    pt_buf = torch.zeros(max_b, max_pages, dtype=torch.int32, device="cuda")
    kv_buf = torch.zeros(max_b * max_pages + 8, 1, 576, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(max_b * max_n, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(max_b * max_n, H, dtype=torch.float32, device="cuda")
    first = CaseSpec("g0", H, [5000, 300, 9, 0], [random_tree(9, G), random_tree(40, G), [-1], random_tree(17, G)])

    def load(spec):
        c = build_case(spec, "cuda")
        T, B = c["q"].shape[0], len(spec.trees)
        q_buf[:T].copy_(c["q"])
        mask_buf[:T].zero_()
        mask_buf[:T, : c["tree_mask"].shape[1]].copy_(c["tree_mask"])
        kv_buf[: c["kv_cache"].shape[0]].copy_(c["kv_cache"])
        pt_buf[:B, : c["page_table"].shape[1]].copy_(c["page_table"])
        attn.plan(spec.kv_lens, c["qo_indptr"].cpu())
        return c, T, B

    c, T, B = load(first)
    views = (q_buf[:T], kv_buf, pt_buf[:B], mask_buf[:T])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            attn.run(*views, out=out[:T], lse=lse[:T])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(*views, out=out[:T], lse=lse[:T])
    for spec in [first,
                 CaseSpec("g1", H, [6900, 1], [random_tree(33, G), [-1, 0]], seed=1),
                 CaseSpec("g2", H, [17, 4000, 2500, 64], [random_tree(5, G), random_tree(40, G), chain_tree(40),
                                                            random_tree(21, G)], seed=2),
                 CaseSpec("g3", H, [100], [[-1]], seed=3)]:
        c, T, B = load(spec)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(c, out[:T], lse[:T])


@pytest.mark.parametrize("first_inference", [True, False])
def test_inference_mode_and_normal_mode_mix(first_inference):
    """A workspace made under torch.inference_mode() is re-planned outside it (and the other way
    round; verify_attention's own workspace is shared by every call on a device). On CUDA the plan
    copies into device buffers, which must not be inference tensors (seen failing on the H200)."""
    spec = CaseSpec("inf", 2, [9, 3], [random_tree(4, G), random_tree(2, G)], page_size=1, seed=4)
    c = build_case(spec, DEVICE)
    ref_out, _ = reference(**{k: v.cpu() for k, v in c.items()})
    attn = None
    for inference in (first_inference, not first_inference):
        with torch.inference_mode(inference):
            attn = attn or VerifyAttention(2, 4, 2, DEVICE)
            attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
            out, _ = attn.run(c["q"], c["kv_cache"], c["page_table"], c["tree_mask"])
            assert compare(out, ref_out, *TOLERANCES["bf16"]["out"]).ok
            out, _ = verify_attention(**c)
            assert compare(out, ref_out, *TOLERANCES["bf16"]["out"]).ok


def test_run_checks_every_call_after_a_good_one():
    """run caches its layout checks by signature: after a good call, outputs that overlap an input
    (same shapes and strides, other addresses) and other shapes are still refused."""
    c = build_case(CaseSpec("k", 2, [5, 3], [[-1, 0, 0], [-1, 0]], page_size=4, seed=6), DEVICE)
    attn = VerifyAttention(2, 8, 2, DEVICE, num_programs=3)
    attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
    args = (c["q"], c["kv_cache"], c["page_table"], c["tree_mask"])
    T = c["q"].shape[0]
    buf = torch.zeros(2 * T * 2 * 512, dtype=torch.bfloat16, device=DEVICE)
    out = buf[: T * 2 * 512].view(T, 2, 512)
    lse = torch.zeros(T, 2, dtype=torch.float32, device=DEVICE)
    attn.run(*args, out=out, lse=lse)
    inside_out = out.view(-1).view(torch.float32)[: T * 2].view(T, 2)  # lse's layout, in out's memory
    with pytest.raises(ValueError, match="lse overlaps out"):
        attn.run(*args, out=out, lse=inside_out)
    with pytest.raises(ValueError, match="lse overlaps q"):
        attn.run(*args, out=out, lse=c["q"].view(-1).view(torch.float32)[: T * 2].view(T, 2))
    with pytest.raises(ValueError, match="out must have shape"):
        attn.run(*args, out=out[:, :1], lse=lse)
    attn.run(*args, out=buf[T * 2 * 512:].view(T, 2, 512), lse=lse)  # same layout, other address: fine
