"""naive and flash kernels against the float64 reference, on awkward shapes, with poisoning.

Without CUDA these run through Triton's interpreter at small sizes (conftest.py).
"""

import collections
import functools
import math
import zlib

import numpy as np
import pytest
import torch

from conftest import DEVICE, HAS_CUDA, requires_cuda, run_checked, unplanned_workspace
from kdtree_engine import reference, verify_attention
from kdtree_engine.testing import TOLERANCES, CaseSpec, build_case, chain_tree, compare, random_tree, star_tree
from kdtree_engine.verify import available_kernels
from kdtree_engine.verify import plan as vplan
from kdtree_engine.verify import triton_flash
from kdtree_engine.verify.plan import CONFIGS, plan_verify

KERNELS = ["naive", "flash"]
PLANNED = ["flash", "hopper", "hopper_cuda"]  # the kernels that read a plan (hopper_cuda: opt-in, where named)
G = torch.Generator().manual_seed(1234)
# GPU runs use longer prefixes; the interpreter stays small
P = 1000 if HAS_CUDA else 40

SHAPES = {
    "1node-p0": dict(num_heads=4, prefix_lens=[0], trees=[[-1]]),
    "1node-long": dict(num_heads=3, prefix_lens=[P], trees=[[-1]]),
    "chain65": dict(num_heads=2, prefix_lens=[P // 2], trees=[chain_tree(65)], page_size=16),
    "star33": dict(num_heads=5, prefix_lens=[7], trees=[star_tree(33)], page_size=1),
    "tree130-5words": dict(num_heads=2, prefix_lens=[P], trees=[random_tree(130, G)], page_size=16),
    "odd-heads-h7": dict(num_heads=7, prefix_lens=[P + 3], trees=[random_tree(9, G)], page_size=1),
    "prefix0-ragged": dict(num_heads=3, prefix_lens=[0, 1, 0], trees=[random_tree(4, G), [-1], random_tree(6, G)]),
    "ragged-b4": dict(num_heads=6, prefix_lens=[P, 5, 63, 2 * P],
                      trees=[random_tree(17, G), random_tree(3, G), [-1], random_tree(40, G)], page_size=16),
    "page64": dict(num_heads=4, prefix_lens=[P, 3], trees=[random_tree(9, G), chain_tree(5)], page_size=64),
    "page1-unscattered": dict(num_heads=4, prefix_lens=[P], trees=[random_tree(9, G)], scatter=False),
    "wide-mask": dict(num_heads=2, prefix_lens=[11], trees=[random_tree(5, G)], extra_mask_words=2),
    "fp16": dict(num_heads=8, prefix_lens=[P], trees=[random_tree(17, G)], dtype="fp16", page_size=16),
    "h128": dict(num_heads=128, prefix_lens=[9], trees=[random_tree(3, G)], page_size=1),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_kernel_matches_reference(kernel, shape):
    spec = CaseSpec(shape, seed=zlib.crc32(shape.encode()) % 1000, **SHAPES[shape])
    run_checked(build_case(spec, DEVICE), kernel, spec.dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_non_contiguous_q_and_out(kernel):
    spec = CaseSpec("strided", 3, [P, 2], [random_tree(5, G), [-1, 0]], page_size=16)
    c = build_case(spec, DEVICE)
    wide = torch.randn(c["q"].shape[0], 6, 576, device=DEVICE).to(c["q"].dtype)
    wide[:, 1::2] = c["q"]  # heads at stride 2 * 576
    c["q"] = wide[:, 1::2]
    assert not c["q"].is_contiguous()
    out_buf = torch.full((c["q"].shape[0], 3, 1024), math.nan, dtype=c["q"].dtype, device=DEVICE)
    out = out_buf[..., 256:768]
    verify_attention(**c, kernel=kernel, out=out)
    r_out, _ = reference(**c)
    assert compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok
    assert bool(out_buf[..., :256].isnan().all()) and bool(out_buf[..., 768:].isnan().all())


@pytest.mark.parametrize("num_programs", [1, 3, 64])
def test_flash_program_counts(num_programs):
    """One program running every segment in turn, a few with KV ranges cut mid-pair, many splits."""
    spec = CaseSpec("splits", 4, [3 * P, 10], [random_tree(9, G), random_tree(20, G)], page_size=1)
    c = build_case(spec, DEVICE)
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 4, DEVICE, num_programs=num_programs)
    assert plan.num_programs <= num_programs
    run_checked(c, "flash", "bf16", plan=plan)


@pytest.mark.parametrize("seed", range(6))
def test_flash_random_batches_and_program_counts(seed):
    """Random ragged batches (prefix 0 included) under random program counts: (sequence, row
    block) pairs cut across programs, several segments run in turn by one program."""
    rng = torch.Generator().manual_seed(100 + seed)
    B = int(torch.randint(1, 5, (1,), generator=rng))
    H = int(torch.randint(1, 7, (1,), generator=rng))
    prefixes = [int(x) for x in torch.randint(0, 90, (B,), generator=rng)]
    trees = [random_tree(int(torch.randint(1, 20, (1,), generator=rng)), rng) for _ in range(B)]
    spec = CaseSpec(f"rand{seed}", H, prefixes, trees, page_size=[1, 16][seed % 2], seed=seed)
    c = build_case(spec, DEVICE)
    programs = int(torch.randint(1, 4 if seed < 3 else 24, (1,), generator=rng))
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), H, DEVICE, num_programs=programs)
    run_checked(c, "flash", "bf16", plan=plan)


@pytest.mark.parametrize("row_blocks, tiles, programs", [
    ([3], [2049], 132), ([17, 17, 17, 17], [2049, 1537, 1025, 513], 132), ([1], [5], 132),
    ([130] * 4, [2049] * 4, 132), ([2, 9, 1], [7, 300, 1], 5), ([4], [4], 16), ([1, 1], [1, 1], 1),
])
def test_schedule_covers_every_tile_once_and_balances(row_blocks, tiles, programs):
    pieces = vplan.schedule(row_blocks, tiles, programs)
    total = sum(r * t for r, t in zip(row_blocks, tiles))
    assert list(pieces.prog) == sorted(pieces.prog) and set(pieces.prog.tolist()) <= set(range(programs))
    seen = {}
    for b, r, t0, t1 in zip(*(x.tolist() for x in pieces[:4])):
        assert 0 <= t0 < t1 <= tiles[b] and 0 <= r < row_blocks[b]
        for t in range(t0, t1):
            seen[b, r, t] = seen.get((b, r, t), 0) + 1
    assert len(seen) == total and set(seen.values()) == {1}
    P = min(programs, total)
    chunk = math.ceil(total / P)
    line = vplan.schedule(row_blocks, tiles, programs, only="line")
    assert vplan.schedule_cost(pieces) <= vplan.schedule_cost(line)
    assert vplan.schedule_cost(pieces) >= chunk + vplan.TRITON_COSTS.segment_tiles  # no program can do better
    load = np.bincount(line.prog, weights=line.t1 - line.t0)
    assert load.max() <= chunk + 2 * vplan.MIN_SPLIT_TILES


@pytest.mark.parametrize("seed", range(40))
def test_parts_schedule_covers_every_tile_once_in_lockstep(seed):
    """Random batches (ragged row blocks and tiles, tiny and large): every (sequence, row block,
    tile) once; with one tree size, the programs of a part read the same KV ranges in the same order."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 9))
    R = rng.integers(1, 12, B) if seed % 2 else np.full(B, int(rng.integers(1, 12)))
    T = rng.integers(1, [8, 300, 3000][seed % 3], B)
    P = int(rng.integers(2 * int(R.max()), 140))
    pieces = vplan._parts_schedule(R, T, P, int(rng.integers(0, 5)))
    assert list(pieces.prog) == sorted(pieces.prog) and pieces.prog.max() < P
    cover = collections.Counter()
    for b, r, t0, t1 in zip(*(x.tolist() for x in pieces[:4])):
        assert 0 <= t0 < t1 <= T[b] and 0 <= r < R[b]
        cover.update((b, r, t) for t in range(t0, t1))
    assert len(cover) == int((R * T).sum()) and set(cover.values()) == {1}
    if seed % 2 == 0:
        L = int(R[0])
        ranges = collections.defaultdict(list)
        for b, t0, t1, p in zip(*(x.tolist() for x in (pieces.seq, pieces.t0, pieces.t1, pieces.prog))):
            ranges[p].append((b, t0, t1))
        for p, rs in ranges.items():
            assert rs == ranges[p - p % L]


@pytest.mark.parametrize("seed", range(40))
def test_parts_tail_schedule_covers_every_tile_once_and_fills_the_grid(seed):
    """One tree size (L row blocks a sequence) on P programs that L does not divide: every
    (sequence, row block, tile) once; the first G L programs (G = P // L) run KV parts, the L
    programs of a part the same KV ranges in the same order; the other P - G L run the KV's last
    tiles; every program works, and none has much more than an equal share."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 9))
    L = int(rng.integers(2, 20))
    R = np.full(B, L)
    T = rng.integers(1, [40, 600, 5000][seed % 3], B)
    P = int(rng.integers(2 * L, 140))
    if P % L == 0:
        P += 1
    if int(T.sum()) < 2 * P:  # a tail of at least a tile
        T = T + 2 * P // B
    pieces = vplan.schedule(R, T, P, only="parts_tail")
    assert list(pieces.prog) == sorted(pieces.prog) and set(pieces.prog.tolist()) == set(range(P))
    cover = collections.Counter()
    for b, r, t0, t1 in zip(*(x.tolist() for x in pieces[:4])):
        assert 0 <= t0 < t1 <= T[b] and 0 <= r < L
        cover.update((b, r, t) for t in range(t0, t1))
    assert len(cover) == int((R * T).sum()) and set(cover.values()) == {1}
    G = P // L
    ranges = collections.defaultdict(list)
    for b, t0, t1, p in zip(*(x.tolist() for x in (pieces.seq, pieces.t0, pieces.t1, pieces.prog))):
        ranges[p].append((b, t0, t1))
    for p in range(G * L):
        assert ranges[p] == ranges[p - p % L]
    load = np.bincount(pieces.prog, weights=pieces.t1 - pieces.t0)
    assert load.max() <= int((R * T).sum()) / P + L + 2


def test_parts_tail_schedule_fills_the_sms_where_the_parts_leave_some_idle():
    """9 row blocks a sequence (64 heads x 9 nodes, 16 heads x 33) on 132 programs: KV parts run
    on 14 x 9 = 126 of them. The Hopper cost model takes the parts and tail there: all 132 work,
    the busiest with as many tile pairs (the kernels' steps) as an equal share rounds up to (run
    47's grid: 4x64x9x16384 and 4x16x33x16384 were 1.118 of FlashMLA's time)."""
    for B, T in ((4, 257), (4, 2049), (1, 2049)):
        R, T = np.full(B, 9), np.full(B, T)
        pieces = vplan.schedule(R, T, 132, costs=vplan.HOPPER_COSTS)
        steps = np.bincount(pieces.prog, weights=(pieces.t1 - pieces.t0 + 1) // 2)
        assert len(steps) == 132 and steps.min() > 0
        assert steps.max() <= -(-int((R * T).sum()) // 264) + 1
        parts = vplan.schedule(R, T, 132, only="parts")
        assert vplan.schedule_cost(pieces, vplan.HOPPER_COSTS) < vplan.schedule_cost(parts, vplan.HOPPER_COSTS)
    with pytest.raises(ValueError, match="no parts-and-tail schedule"):
        vplan.schedule(np.full(4, 3), np.full(4, 257), 132, only="parts_tail")  # 3 divides 132


def test_schedule_only_takes_any_candidate_by_its_name():
    """128 heads x 9 nodes over 65536 keys on 132 programs (18 row blocks, 1025 tiles): ``only``
    names a candidate of :func:`schedule_candidates` as it lists them (for A/Bs of close picks), and
    a name that is not among them is a ValueError listing those that are."""
    R, T = np.full(1, 18), np.full(1, 1025)
    candidates = vplan.schedule_candidates(R, T, 132, costs=vplan.HOPPER_COSTS)
    assert {"whole:140", "parts_tail:2"} <= {c.name for c in candidates}
    for name, pieces, _ in candidates:
        got = vplan.schedule(R, T, 132, costs=vplan.HOPPER_COSTS, only=name)
        assert all(np.array_equal(a, b) for a, b in zip(got, pieces)), name
    with pytest.raises(ValueError, match=r"candidates \(line, parts, whole:140, .*got 'whole:139'"):
        vplan.schedule(R, T, 132, costs=vplan.HOPPER_COSTS, only="whole:139")


def test_a_tail_whose_programs_run_many_segments_is_priced_above_whole_segments():
    """8 sequences of 48 row blocks (32 heads x 96 nodes) over 514 KV tiles on 132 programs: the
    tail's busiest program runs 17 segments, modelled 0.995x whole segments (the H100 ran whole
    segments in 0.915 of its time, run 54); the Hopper plan takes whole segments. With 9 row blocks
    (two segments a program) the tail stays; the Triton kernel's costs price it as modelled."""
    def candidates(R, T):
        return {c.name: c for c in vplan.schedule_candidates(R, T, 132, costs=vplan.HOPPER_COSTS)}

    def pick(named):
        return min(named.values(), key=lambda c: c.cost).name

    R, T = np.full(8, 48), np.full(8, 514)
    named = candidates(R, T)
    tail, whole = named["parts_tail"], named["whole:514"]
    assert np.bincount(tail.pieces.prog).max() == 17
    assert vplan.schedule_cost(tail.pieces, vplan.HOPPER_COSTS) < whole.cost < tail.cost
    assert pick(named).startswith("whole")
    assert pick(candidates(np.full(4, 9), np.full(4, 257))).startswith("parts_tail")
    triton = {c.name: c for c in vplan.schedule_candidates(R, T, 132, costs=vplan.TRITON_COSTS)}
    assert triton["parts_tail"].cost == vplan.schedule_cost(triton["parts_tail"].pieces, vplan.TRITON_COSTS)


@pytest.mark.parametrize("kernel", ["flash", "hopper"])
@pytest.mark.parametrize("candidate", ["parts", "line", "parts_tail"])
def test_planned_kernels_run_each_schedule(kernel, candidate, monkeypatch):
    """The kernels read any schedule's tables: a ragged batch (one tree size; and, but for the parts
    and tail, a mixed one, where the parts schedule leaves programs idle) planned with one candidate
    forced (the parts and tail: 16 heads x 9 nodes, 3 or 5 row blocks a sequence on 13 programs)."""
    if kernel not in available_kernels(DEVICE):
        pytest.skip(f"{kernel} does not run here")

    monkeypatch.setattr(vplan, "schedule", functools.partial(vplan.schedule, only=candidate))
    heads = 16 if candidate == "parts_tail" else 5
    batches = ([random_tree(9, G)] * 3, [random_tree(9, G), [-1], random_tree(20, G)])
    for i, trees in enumerate(batches[:1] if candidate == "parts_tail" else batches):
        spec = CaseSpec(f"{candidate}{i}", heads, [300, 77, 1000], trees, page_size=[1, 16][i], seed=i)
        c = build_case(spec, DEVICE)
        plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), heads, DEVICE, num_programs=13)
        run_checked(c, kernel, "bf16", plan=plan)


def test_schedule_keeps_row_blocks_of_a_sequence_on_the_same_kv():
    """64 heads x 9 nodes x 4 sequences at 131072 (9 row blocks each, 132 programs), Hopper kernel
    costs: the line schedule's programs read each sequence's KV at 36 different offsets (HBM-bound,
    run 18: 1.50x FlashMLA); the plan takes KV parts instead, read by 9 programs at once (and the
    KV's last tiles on the 6 programs the parts leave idle). The Triton kernel's tiles take 2.7x as
    long, so there the line schedule is not HBM-bound."""
    R, T = np.full(4, 9), np.full(4, 2049)
    line = vplan.schedule(R, T, 132, only="line")
    hopper_costs = vplan.HOPPER_COSTS
    chosen = vplan.schedule(R, T, 132, costs=hopper_costs)
    assert vplan.schedule_cost(chosen, hopper_costs) < vplan.schedule_cost(line, hopper_costs)
    assert vplan.schedule_cost(line, hopper_costs) > 559 + 3 * hopper_costs.segment_tiles  # the memory term decides
    in_parts = chosen.prog < 126
    assert len(set(zip(chosen.seq[in_parts].tolist(), chosen.t0[in_parts].tolist()))) <= 132 // 9 + 4
    assert len(set(zip(chosen.seq.tolist(), chosen.t0.tolist()))) <= 132 // 9 + 4 + 6
    assert vplan.schedule_cost(line, vplan.TRITON_COSTS) <= 559 + 3 * vplan.TRITON_COSTS.segment_tiles


def test_schedule_cost_counts_drifting_programs_as_separate_streams():
    """Programs whose offsets into one sequence's KV drift a few tiles apart each share it in L2 with
    their neighbours only: 40 programs, each 3 tiles further in than the one before (over 117 tiles
    in all), read it ~24 times from HBM, not once (a chain of neighbours within the tolerance was one
    stream). At 64 heads x 9 nodes x 131072 (one sequence, 9 row blocks) the line schedule drifts so
    (its 15 columns of 137 tiles against shares of 140: run 31 measured it 2-7% slower than the KV
    parts schedule on the Hopper kernel), and the Hopper costs take parts there (on 126 programs;
    the KV's last tiles on the other 6)."""
    n, drift, length = 40, 3, 100
    t0 = np.arange(n) * drift
    pieces = vplan.Pieces(np.zeros(n, dtype=np.int64), np.arange(n), t0, t0 + length, np.arange(n))
    costs = vplan.ScheduleCosts(segment_tiles=0, hbm_tiles_per_tile=1)
    windows = -(-(drift * (n - 1) + 1) // (vplan.L2_STEP_TOLERANCE + 1))
    assert vplan.schedule_cost(pieces, costs) >= (windows - 1) * length
    R, T = np.full(1, 9), np.full(1, 2049)
    chosen = vplan.schedule(R, T, 132, costs=vplan.HOPPER_COSTS)
    in_parts = chosen.prog < 126
    assert in_parts.sum() == 126 and len(set(zip(chosen.seq[in_parts].tolist(), chosen.t0[in_parts].tolist()))) == 14


def test_plan_costs_follow_the_device():
    assert vplan.default_costs(torch.device("cpu")) == vplan.TRITON_COSTS
    if HAS_CUDA:
        on_hopper = torch.cuda.get_device_capability(0) == (9, 0)
        assert vplan.default_costs(torch.device("cuda", 0)) == (vplan.HOPPER_COSTS if on_hopper else vplan.TRITON_COSTS)
    plan = vplan.VerifyPlan(2, 9, 4, DEVICE, costs=vplan.HOPPER_COSTS)
    assert plan.costs == vplan.HOPPER_COSTS


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.num_warps}x{c.num_stages}")
def test_flash_every_tile_config(cfg):
    if HAS_CUDA and cfg.shared_bytes() > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        pytest.skip("does not fit this GPU's shared memory")
    spec = CaseSpec("cfg", 3, [2 * cfg.block_n + 5, 0], [random_tree(11, G), [-1, 0, 1]], page_size=1)
    c = build_case(spec, DEVICE)
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 3, DEVICE, config=cfg, num_programs=5)
    run_checked(c, "flash", "bf16", plan=plan)


def test_smallest_config_fits_99_kb():
    """sm_120 and other consumer parts give a block 99 KB of shared memory."""
    assert CONFIGS[-1].shared_bytes() <= 99 * 1024


def test_flash_split_ending_inside_the_tree():
    """A split whose KV range holds only tree nodes a row cannot see gives that row lse=-inf partials."""
    spec = CaseSpec("tail", 2, [0], [chain_tree(64)], page_size=1)
    c = build_case(spec, DEVICE)
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 2, DEVICE, num_programs=32)
    run_checked(c, "flash", "bf16", plan=plan)


def test_flash_deterministic_and_plan_reuse():
    spec = CaseSpec("det", 8, [2 * P, P], [random_tree(17, G), random_tree(9, G)], page_size=1)
    c = build_case(spec, DEVICE)
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 8, DEVICE)
    out1, lse1 = verify_attention(**c, kernel="flash", plan=plan)
    out2, lse2 = verify_attention(**c, kernel="flash", plan=plan)
    out3, lse3 = verify_attention(**c, kernel="flash")
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2) and torch.equal(out1, out3)
    # the same plan serves another layer's data of the same lengths
    c2 = build_case(CaseSpec("det2", 8, [2 * P, P], spec.trees, page_size=1, seed=99), DEVICE)
    run_checked(c2, "flash", "bf16", plan=plan)


def test_plan_mismatch_is_refused():
    spec = CaseSpec("mis", 4, [10], [random_tree(5, G)])
    c = build_case(spec, DEVICE)
    plan = plan_verify([15], [0, 5], 8, DEVICE)
    with pytest.raises(ValueError, match="plan was built for H=8"):
        verify_attention(**c, kernel="flash", plan=plan)
    with pytest.raises(ValueError, match="qo_indptr must have 2 entries"):
        plan_verify([15], [0, 5, 6], 4, DEVICE)


def test_nan_in_unused_slots_and_tail_pages_never_leaks():
    """build_case poisons every slot no sequence uses; page_size 16 leaves NaN tails in last pages."""
    spec = CaseSpec("poison", 3, [19, 1], [random_tree(6, G), [-1]], page_size=16, spare_pages=5)
    c = build_case(spec, DEVICE)
    assert bool(c["kv_cache"].isnan().any())
    for kernel in KERNELS:
        out, lse = run_checked(c, kernel, "bf16")
        assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())


@pytest.mark.parametrize("kernel", KERNELS)
def test_row_with_no_visible_key(kernel):
    spec = CaseSpec("blind", 2, [0, 3], [[-1, 0], [-1]], page_size=1)
    c = build_case(spec, DEVICE)
    c["tree_mask"][0] = 0  # node 0 of sequence 0 has no prefix and sees nothing
    out, lse = verify_attention(**c, kernel=kernel, validate=False)
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())
    r_out, r_lse = reference(**c)
    assert compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok
    assert compare(lse, r_lse, *TOLERANCES["bf16"]["lse"]).ok


@pytest.mark.parametrize("kernel, num_programs", [("naive", None)] + [(k, n) for k in PLANNED for n in (None, 5)])
def test_nan_reaches_exactly_the_rows_that_see_it(kernel, num_programs):
    """NaN where a row's scores read it makes that row's out and lse NaN and no other row's: a NaN
    in the rope part of a prefix key (K only) reaches every node and head of its sequence, on
    whichever KV segment of a split it falls (merged by the combine); in a tree node's key only the
    nodes that see that node; in one head of a node's q that head of that node. The kernels once
    took a NaN row sum for "no visible key": a segment holding the NaN came out as 0 / -inf and the
    combine merged the other segments into a finite answer. (A NaN in the latent of a key a row
    does not see reaches it as 0 x NaN, in the reference as in the kernels.)"""
    if kernel not in available_kernels(DEVICE, opt_in=True):
        pytest.skip(f"{kernel} does not run here")
    spec = CaseSpec("nan", 3, [P, 40, 20], [random_tree(9, G), chain_tree(5), random_tree(6, G)], page_size=16)
    c = build_case(spec, DEVICE)
    ps, qo = spec.page_size, c["qo_indptr"].tolist()

    def poison(b, pos, col):
        c["kv_cache"][int(c["page_table"][b, pos // ps]), pos % ps, col] = math.nan

    poison(0, P // 2, 520)  # seq 0's prefix, K's rope columns: all its nodes
    poison(1, 40 + 2, 530)  # seq 1's node 2, K's rope columns (a chain: nodes 2, 3, 4 see it)
    c["q"][qo[2] + 1, 1] = math.nan  # seq 2's node 1, head 1: that head of that node only
    expect = torch.zeros(c["q"].shape[:2], dtype=torch.bool)
    expect[qo[0]:qo[1]] = True
    expect[qo[1] + 2:qo[2]] = True
    expect[qo[2] + 1, 1] = True
    plan = None if kernel == "naive" else plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 3, DEVICE,
                                                      num_programs=num_programs)
    out, lse = run_checked(c, kernel, "bf16", plan=plan)  # NaN where the float64 reference has it
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(out.isnan().all(-1), expect) and torch.equal(lse.isnan(), expect)
    assert bool(torch.isfinite(out[~expect]).all()) and bool(torch.isfinite(lse[~expect]).all())


@pytest.mark.parametrize("kernel, num_programs",
                         [("naive", None)] + [(k, n) for k in PLANNED for n in (None, 1, 6, 13)])
def test_logits_far_below_zero(kernel, num_programs):
    """Every logit near -192 (-277 in log2 units, a spread of a few units): no running max, rescale
    or merge may take 0 for a max it has not seen (``exp2(277)`` overflows fp32), on split KV ranges
    and ragged trees, where segments can begin at a tile their rows do not see (a star's later nodes
    see none of the nodes before them but the root; test_verify_hopper.py builds that case exactly).
    The naive kernel takes no plan: once."""
    if kernel not in available_kernels(DEVICE, opt_in=True):
        pytest.skip(f"{kernel} does not run here")
    spec = CaseSpec("far-below-zero", 3, [64, P, 0], [star_tree(192), star_tree(70), random_tree(9, G)],
                    page_size=16)
    c = build_case(spec, DEVICE)
    g = torch.Generator().manual_seed(7)
    c["q"].copy_(-8 + 0.5 * torch.randn(c["q"].shape, generator=g))
    c["kv_cache"].copy_(1 + 0.1 * torch.randn(c["kv_cache"].shape, generator=g))
    plan = None if kernel == "naive" else plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 3, DEVICE,
                                                      num_programs=num_programs)
    _, lse = run_checked(c, kernel, "bf16", plan=plan)
    assert bool((lse < -150).all())


@requires_cuda
def test_flash_long_prefix_many_heads_gpu():
    spec = CaseSpec("long", 64, [20000, 4097], [random_tree(33, G), random_tree(33, G)], page_size=1)
    run_checked(build_case(spec, "cuda"), "flash", "bf16")


@requires_cuda
@pytest.mark.parametrize("kernel", ["flash", "hopper"])
def test_no_recompile_as_a_decode_loop_changes_its_shapes(kernel):
    """Page-table width, mask words, tree sizes, prefixes and the batch change step to step in a
    decode loop: one compiled kernel for each of the two schedules (issue 11: no rebuild or
    recompile during a decode)."""
    if kernel not in available_kernels("cuda"):
        pytest.skip(f"{kernel} does not run on this GPU")
    from kdtree_engine.verify import hopper

    fn = hopper._hopper_verify_kernel if kernel == "hopper" else triton_flash._verify_flash_kernel
    cache = fn.device_caches[torch.cuda.current_device()][0]
    for step, (width, prefixes, trees) in enumerate(((40, [300], [5]), (48, [300, 17], [5, 9]),
                                                     (64, [700, 3, 250], [40, 3, 17]), (65, [64], [33]))):
        spec = CaseSpec("widths", 4, prefixes, [random_tree(n, G) for n in trees], page_size=16)
        c = build_case(spec, "cuda")
        pt = torch.zeros(len(trees), width, dtype=torch.int32, device="cuda")
        pt[:, : c["page_table"].shape[1]] = c["page_table"]
        c["page_table"] = pt
        run_checked(c, kernel, "bf16")
        if step == 1:  # one sequence (the kernel schedules it) and a batch (planned): both variants built
            compiled = len(cache)
    assert len(cache) == compiled


@requires_cuda
@pytest.mark.parametrize("kernel", PLANNED)
def test_cuda_graph_capture_and_replay(kernel):
    if kernel not in available_kernels("cuda", opt_in=True):
        pytest.skip(f"{kernel} does not run on this GPU")
    spec = CaseSpec("graph", 16, [5000, 300], [random_tree(9, G), random_tree(17, G)], page_size=1)
    c = build_case(spec, "cuda")
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 16, "cuda")
    out = torch.empty(c["q"].shape[0], 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(c["q"].shape[0], 16, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            verify_attention(**c, kernel=kernel, plan=plan, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_attention(**c, kernel=kernel, plan=plan, out=out, lse=lse)
    # replay on fresh data written into the same input buffers
    fresh = build_case(CaseSpec("graph2", 16, [5000, 300], spec.trees, page_size=1, seed=5), "cuda")
    for k in ("q", "kv_cache"):
        c[k].copy_(fresh[k])
    c["page_table"].copy_(fresh["page_table"])
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    r_out, r_lse = reference(**c)
    assert compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok
    assert compare(lse, r_lse, *TOLERANCES["bf16"]["lse"]).ok


@requires_cuda
@pytest.mark.parametrize("kernel", ["flash", "hopper"])
def test_unplanned_one_sequence_graph_reschedules_on_replay(kernel):
    """An unplanned one-sequence call captured in a CUDA graph schedules itself in the kernel from
    the device KV length: replayed after other lengths (other tile counts, so other parts) and
    inputs are written into the captured tensors, still right."""
    if kernel not in available_kernels("cuda"):
        pytest.skip(f"{kernel} does not run on this GPU")
    tree = random_tree(9, G)
    c = build_case(CaseSpec("long", 16, [6000], [tree], page_size=1), "cuda")
    out = torch.empty(9, 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(9, 16, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            verify_attention(**c, kernel=kernel, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: its workspace
        verify_attention(**c, kernel=kernel, out=out, lse=lse)
    assert unplanned_workspace(c, stream.cuda_stream).tables.in_kernel
    for prefix in (2500, 5300, 60):
        step = build_case(CaseSpec("short", 16, [prefix], [tree], page_size=1, seed=prefix), "cuda")
        for k in ("q", "tree_mask", "kv_lens", "qo_indptr"):
            c[k].copy_(step[k])
        c["page_table"][:, : step["page_table"].shape[1]].copy_(step["page_table"])
        c["kv_cache"][: step["kv_cache"].shape[0]].copy_(step["kv_cache"])
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        r_out, r_lse = reference(**step)
        assert compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok, prefix
        assert compare(lse, r_lse, *TOLERANCES["bf16"]["lse"]).ok, prefix


@requires_cuda
@pytest.mark.parametrize("kernel", PLANNED)
def test_fused_combine_matches_the_combine_kernel(kernel, monkeypatch):
    """On a GPU a kernel merges its KV splits itself after a grid barrier (one launch per call):
    the outputs of the separate combine kernel on the same plan (to rounding: the same code at
    another warp count, or in Gluon, may sum in another order), bitwise equal on repeat, and a grid
    of more programs than SMs falls back to the combine kernel, still right."""
    if kernel not in available_kernels("cuda", opt_in=True):
        pytest.skip(f"{kernel} does not run on this GPU")
    from kdtree_engine.verify import combine

    spec = CaseSpec("fused", 16, [20000, 300, 4000], [random_tree(9, G), random_tree(17, G), [-1]], page_size=1)
    c = build_case(spec, "cuda")
    r_out, r_lse = reference(**c)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {}
    for name, fused, programs in (("fused", True, None), ("again", True, None), ("combine kernel", False, None),
                                  ("grid past the SMs", True, sms + 1)):
        monkeypatch.setattr(combine, "FUSED_COMBINE", fused)
        plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 16, "cuda", num_programs=programs)
        assert plan.num_groups > 0  # the case splits row blocks: there is something to merge
        assert combine.fuses(plan.tables, torch.device("cuda", 0)) == (fused and programs is None)
        out = torch.full((c["q"].shape[0], 16, 512), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((c["q"].shape[0], 16), math.nan, dtype=torch.float32, device="cuda")
        verify_attention(**c, kernel=kernel, plan=plan, out=out, lse=lse)
        torch.cuda.synchronize()
        assert compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok, name
        assert compare(lse, r_lse, *TOLERANCES["bf16"]["lse"]).ok, name
        results[name] = out, lse
    assert all(torch.equal(a, b) for a, b in zip(results["fused"], results["again"]))
    (out, lse), (out_k, lse_k) = results["fused"], results["combine kernel"]
    torch.testing.assert_close(lse, lse_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.float(), out_k.float(), rtol=1e-2, atol=1e-2)  # bf16: one rounding step
