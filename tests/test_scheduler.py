"""The device scheduler (verify/scheduler.py, VerifyPlan.plan_on_device): the tables it writes from
device lengths equal the host's tables of the line schedule on random ragged batches, a run on them
matches the reference, bad lengths tensors are refused, and (GPU) a CUDA graph holding the plan and
the run replays correctly after new lengths are written into the length tensors. The one-sequence
schedule the kernels compute themselves covers every tile once, and an unplanned one-sequence call
takes it where its parts fill the grid."""

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, requires_cuda, run_checked, unplanned_workspace
from kdtree_engine import VerifyAttention, reference
from kdtree_engine.bench.timing import capture_graph
from kdtree_engine.testing import (TOLERANCES, CaseSpec, build_case, chain_tree, compare, device_tables,
                                   random_tree)
from kdtree_engine.verify import api
from kdtree_engine.verify import plan as plan_mod
from kdtree_engine.verify.plan import (HOPPER_COSTS, LINE_OVER_LOCKSTEP, MIN_SPLIT_TILES, TRITON_COSTS, FlashConfig,
                                       VerifyPlan, cuts_row_blocks, device_parts, rounds_apply, schedule,
                                       schedule_candidates, schedule_cost, whole_segments_apply)
from kdtree_engine.verify.scheduler import (AUTO_TAIL_MIN_TILES, one_sequence_groups, parts_fill, work_range,
                                           work_segment)

CONFIGS = [FlashConfig(32, 16, 4, 1), FlashConfig(64, 64, 8, 2)]


def random_batches(seed: int, count: int):
    rng = np.random.default_rng(seed)
    yield np.array([1]), np.array([1]), 1, 1, 0, 1  # the smallest step
    yield np.array([100000, 10]), np.array([64, 3]), 64, 132, 1, 7  # one long sequence: split columns
    for i in range(count):
        B = int(rng.integers(1, 40))
        n = rng.integers(1, 70, B)
        kv = n + rng.integers(0, int(rng.choice([10, 1000, 20000])), B)
        yield kv, n, int(rng.choice([1, 3, 16, 64, 128])), int(rng.integers(1, 300)), i % 2, B + int(rng.integers(0, 9))


def same(a, b) -> bool:
    """Whether two schedules (``Pieces``, or tables as ``device_tables`` returns them) hold equal
    arrays."""
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def check_device_plan(p: VerifyPlan, kv: np.ndarray, qo: np.ndarray, what: str, schedule: str = "line"):
    """Plan ``kv [B]`` / ``qo [B + 1]`` on the device from strided tensors (every other element of a
    bigger buffer): the lengths copied, the tables the host's tables of ``schedule`` (where it
    applies, else the line schedule) of the clamped lengths (trees of 1..max_tree_nodes nodes, KV of
    at least one tile; a segment ending at most at the KV length as given)."""
    kv_dev = torch.zeros(2 * len(kv), dtype=torch.int32, device=DEVICE)
    kv_dev[::2] = torch.tensor(kv)
    qo_dev = torch.zeros(2 * len(qo), dtype=torch.int32, device=DEVICE)
    qo_dev[::2] = torch.tensor(qo)
    p.plan_on_device(kv_dev[::2], qo_dev[::2], schedule=schedule)
    first, seg, grp = device_tables(p, np.maximum(kv, 1), np.clip(qo[1:] - qo[:-1], 1, p.max_tree_nodes), schedule)
    seg[3] = np.minimum(seg[3], kv[seg[0]])
    t = p.tables
    S, G = seg.shape[1], grp.shape[1]
    assert np.array_equal(t.prog_first_seg.cpu().numpy(), first), what
    assert np.array_equal(t.segments.cpu().numpy()[:, :S], seg), what
    assert int(t.group_count[0]) == G and np.array_equal(t.groups.cpu().numpy()[:, :G], grp), what
    assert p.kv_lens.tolist() == kv.tolist() and p.qo_indptr.tolist() == qo.tolist()
    assert t.num_groups is None and p.num_rows is None


@pytest.mark.parametrize("seed", [0, 1])
def test_device_tables_equal_the_host_line_schedule(seed):
    """Up to 300 programs, page tiles 16 and 64, H 1-128, trees 1-69 nodes, KV up to ~20k and one
    of 100k."""
    for kv, n, H, P, c, max_batch in random_batches(seed, 25):
        p = VerifyPlan(max_batch, int(n.max()), H, DEVICE, config=CONFIGS[c], num_programs=P)
        check_device_plan(p, kv, np.concatenate([[0], np.cumsum(n)]), f"kv={kv.tolist()} n={n.tolist()} H={H} P={P} "
                          f"{CONFIGS[c]}")


@pytest.mark.parametrize("seed,kind", [(0, "parts"), (1, "parts"), (2, "auto")])
def test_device_tables_equal_the_host_parts_schedule(seed, kind):
    """The KV parts schedule: equal trees (the engine's step) over ragged KV, from one to 40
    sequences, 1-300 programs, parts of 1 to many sequences, cuts snapped to a sequence's edge or
    not; ragged trees and too few programs fall back to the line schedule, as the host's
    ``device_tables`` says ("auto": also parts that leave more than a tenth of the programs idle)."""
    rng = np.random.default_rng(100 + seed)
    for i in range(24):
        B = int(rng.integers(1, 40))
        n = int(rng.integers(1, 70))
        kv = n + rng.integers(0, int(rng.choice([10, 1000, 20000])), B)
        trees = np.full(B, n) if i % 6 else rng.integers(1, 70, B)  # every 6th: ragged (line)
        H, P, c = int(rng.choice([1, 3, 16, 64, 128])), int(rng.integers(1, 300)), i % 2
        p = VerifyPlan(B + int(rng.integers(0, 9)), int(trees.max()), H, DEVICE, config=CONFIGS[c], num_programs=P)
        check_device_plan(p, kv, np.concatenate([[0], np.cumsum(trees)]),
                          f"kv={kv.tolist()} n={trees.tolist()} H={H} P={P} {CONFIGS[c]}", kind)


@pytest.mark.parametrize("seed,kind", [(0, "rounds"), (1, "auto")])
def test_device_tables_equal_the_host_rounds_schedule(seed, kind):
    """The rounds schedule: sequences of more row blocks than half the programs (many heads and
    nodes on few programs), equal and ragged trees over ragged KV, one to 12 sequences; where it
    does not apply (a last round too empty, or 2L within the programs) the line, or for "auto"
    whole segments or parts, as the host's ``device_tables`` says ("auto" under the Hopper kernel's
    costs, whose ``lockstep`` asks for rounds; under the Triton kernel's it writes the line
    there)."""
    rng = np.random.default_rng(200 + seed)
    took = 0
    for i in range(24):
        B = int(rng.integers(1, 13))
        n = int(rng.integers(8, 40))
        trees = np.full(B, n) if i % 4 else rng.integers(8, 40, B)  # every 4th: ragged
        kv = trees + rng.integers(0, int(rng.choice([10, 1000, 20000])), B)
        H, c = int(rng.choice([16, 64])), i % 2
        P = int(rng.integers(1, 3 * -(-int(trees.max()) * H // CONFIGS[c].block_m)))  # 2L above P at most draws
        p = VerifyPlan(B + int(rng.integers(0, 5)), int(trees.max()), H, DEVICE, config=CONFIGS[c], num_programs=P,
                       costs=HOPPER_COSTS)
        R, T = p.blocks_and_tiles(kv, trees)
        took += rounds_apply(R, T, P)
        check_device_plan(p, kv, np.concatenate([[0], np.cumsum(trees)]),
                          f"kv={kv.tolist()} n={trees.tolist()} H={H} P={P} {CONFIGS[c]}", kind)
    assert took >= 4
    # the Triton kernel's costs: "auto" keeps the line where rounds would apply (4 x 5 row blocks on 5)
    p = VerifyPlan(4, 40, 4, DEVICE, config=CONFIGS[0], num_programs=5, costs=TRITON_COSTS)
    kv = np.array([700, 650, 300, 900])
    assert rounds_apply(*p.blocks_and_tiles(kv, np.full(4, 40)), 5)
    check_device_plan(p, kv, np.arange(5) * 40, "Triton costs", "auto")
    assert int(p.tables.group_count[0]) > 0  # the line splits row blocks; rounds never do


def test_rounds_schedule_deals_whole_sequences_round_by_round():
    """Host side: every row block once, against its whole KV, segment i on program i mod P, the
    tables in program order; no splits, so no groups."""
    R, T = np.array([5, 3, 4]), np.array([7, 2, 9])
    seq, row, t0, t1, prog = schedule(R, T, 5, only="rounds")
    assert prog.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4]
    i = np.array([0, 5, 10, 1, 6, 11, 2, 7, 3, 8, 4, 9])  # segment i, sequences' row blocks in order
    assert seq.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 2, 0, 2] and (row == i - np.array([0, 5, 8])[seq]).all()
    assert (t0 == 0).all() and (t1 == T[seq]).all()
    p = VerifyPlan(3, 8, 8, DEVICE, config=CONFIGS[0], num_programs=5)
    first, seg, _, grp, _ = p._tables_of(schedule(R, T, 5, only="rounds"), R)
    assert first.tolist() == [0, 3, 6, 8, 10, 12] and (seg[4] == -1).all() and grp.shape[1] == 0


def test_host_prices_a_line_that_cuts_row_blocks_up():
    """Under the Hopper kernel's costs the host prices a line that cuts row blocks at
    LINE_OVER_LOCKSTEP times its cost (shapes H x nodes x B x prefix, timed on an H100 in perf log
    runs 51-52): at 128x256x1x131072 (512 row blocks of 2052 tiles on 132 programs) it takes the
    rounds, modelled at 1.031x the line and run in 0.887 of its time; at 128x16x6x131072 (32 row
    blocks a sequence) KV parts with a tail, modelled at the line's cost and run in 0.816; at
    128x48x6x131072 whole sequences (the rounds' segments), modelled at 1.145x and run in 0.897;
    at 128x96x1x131072 it keeps the line, whose one lockstep rival (whole sequences) is modelled
    at 1.37x and ran at 1.18x. A line of whole row blocks (128x33x4x131072: every program reads from
    offset 0, as the rounds do) is not priced up and keeps its tie. The Triton kernel's costs keep
    the line at the first."""
    line = lambda R, T: schedule(R, T, 132, only="line")  # noqa: E731
    shape = lambda H, n, B, prefix: (np.full(B, -(-H * n // 64)), np.full(B, -(-(prefix + n) // 64)))  # noqa: E731
    cost = lambda pieces: schedule_cost(pieces, HOPPER_COSTS)  # noqa: E731

    R, T = shape(128, 256, 1, 131072)
    assert rounds_apply(R, T, 132) and cuts_row_blocks(line(R, T), T)
    rounds = schedule(R, T, 132, only="rounds")
    assert cost(line(R, T)) < cost(rounds) <= LINE_OVER_LOCKSTEP * cost(line(R, T))
    assert same(schedule(R, T, 132, costs=HOPPER_COSTS), rounds)
    assert same(schedule(R, T, 132, costs=TRITON_COSTS), line(R, T))

    R, T = shape(128, 16, 6, 131072)
    assert same(schedule(R, T, 132, costs=HOPPER_COSTS), schedule(R, T, 132, costs=HOPPER_COSTS, only="parts_tail"))
    cands = {c.name: c for c in schedule_candidates(R, T, 132, costs=HOPPER_COSTS)}
    assert min(cands.values(), key=lambda c: c.cost).name == "parts_tail" and {"line", "parts"} <= set(cands)
    assert cands["line"].cost == LINE_OVER_LOCKSTEP * cost(line(R, T))
    with pytest.raises(ValueError, match="needs work"):
        schedule_candidates(np.zeros(2, dtype=np.int64), T[:2], 132)

    R, T = shape(128, 48, 6, 131072)  # 576 row blocks: the rounds' last is 48 / 132 full (slack 1.146)
    whole = schedule(R, T, 132, costs=HOPPER_COSTS, only="whole")
    assert rounds_apply(R, T, 132) and same(whole, schedule(R, T, 132, only="rounds"))
    assert same(schedule(R, T, 132, costs=HOPPER_COSTS), whole)

    R, T = shape(128, 96, 1, 131072)
    picked = schedule(R, T, 132, costs=HOPPER_COSTS)
    assert same(picked, line(R, T)) and cuts_row_blocks(picked, T)

    R, T = shape(128, 33, 4, 131072)
    assert not cuts_row_blocks(line(R, T), T)
    assert same(schedule(R, T, 132, costs=HOPPER_COSTS), line(R, T))


def test_auto_writes_the_hosts_whole_segments_on_small_steps():
    """``"auto"`` (the unplanned call's schedule): where KV columns of one program's share make at
    most as many segments as programs, the host's plan takes whole segments, one per program,
    without pricing them, and the device writes the very tables of the host's plan. Issue 12's
    8 x 16 heads x 9 nodes over 1,024 tokens (24 row blocks x 17 tiles on 132 programs: width 4, 120
    segments, every row block split in 5), then random ragged small steps (where segments do not
    apply, ``device_tables`` says parts or the line, as before)."""
    def host_pick(p, kv, trees):
        first, seg, tile_end, grp, _ = p._schedule_tables(*p.blocks_and_tiles(kv, trees))
        seg[3] = np.minimum(tile_end, kv[seg[0]])
        return first, seg, grp

    p = VerifyPlan(8, 9, 16, DEVICE, config=CONFIGS[1], num_programs=132, costs=HOPPER_COSTS)
    kv, trees = np.full(8, 1033), np.full(8, 9)
    check_device_plan(p, kv, np.arange(9) * 9, "8x16x9x1024", "auto")
    assert p.device_schedule_for(kv, np.arange(9) * 9) == "auto"  # what an engine's captured step asks for
    first, seg, grp = host_pick(p, kv, trees)
    assert seg.shape[1] == 120 and grp.shape[1] == 24 and (grp[3] == 5).all()
    assert np.array_equal(p.tables.segments.cpu().numpy()[:, :120], seg)
    assert np.array_equal(p.tables.groups.cpu().numpy()[:, :24], grp)
    assert np.array_equal(p.tables.prog_first_seg.cpu().numpy(), first)
    rng = np.random.default_rng(7)
    took = 0
    for i in range(10):
        B = int(rng.integers(1, 9))
        trees = rng.integers(1, 40, B)
        kv = trees + rng.integers(0, int(rng.choice([10, 300, 3000])), B)
        H, P, c = int(rng.choice([1, 3, 16, 64])), int(rng.integers(1, 200)), i % 2
        p = VerifyPlan(B + 1, int(trees.max()), H, DEVICE, config=CONFIGS[c], num_programs=P)
        qo = np.concatenate([[0], np.cumsum(trees)])
        what = f"kv={kv.tolist()} n={trees.tolist()} H={H} P={P} {CONFIGS[c]}"
        check_device_plan(p, kv, qo, what, "auto")
        if whole_segments_apply(*p.blocks_and_tiles(kv, trees), P):
            took += 1
            assert p.device_schedule_for(kv, qo) == "auto", what
            assert same(device_tables(p, kv, trees, "auto"), host_pick(p, kv, trees)), what
    assert took >= 3


def test_auto_takes_the_parts_tail_where_the_parts_fill_too_few():
    """``"auto"`` under the Hopper kernel's costs: 7 row blocks a sequence on 20 programs (two parts
    keep 14 busy, under nine tenths) take the parts with their tail, whose programs 14-19 run the
    KV's last tiles, where the step holds ``AUTO_TAIL_MIN_TILES`` tile pairs per program (B = 3 and
    B = 1 over ~5k-12k tokens); a shorter step (B = 3 over ~130-200), and the Triton kernel's costs,
    keep the line."""
    trees = 14  # 16 heads x 14 nodes = 224 rows: 7 row blocks of 32
    for B, kv_len, costs, tail in [(3, 5000, HOPPER_COSTS, True), (1, 12000, HOPPER_COSTS, True),
                                   (3, 200, HOPPER_COSTS, False), (3, 5000, TRITON_COSTS, False)]:
        p = VerifyPlan(4, trees, 16, DEVICE, config=CONFIGS[0], num_programs=20, costs=costs)
        kv = kv_len - 37 * np.arange(B)
        R, T = p.blocks_and_tiles(kv, np.full(B, trees))
        what = f"B={B} kv={kv.tolist()} {costs}"
        assert not parts_fill(7, 20) and not whole_segments_apply(R, T, 20), what
        assert (int(T.sum()) * 7 >= AUTO_TAIL_MIN_TILES * 20) == (kv_len > 200), what
        check_device_plan(p, kv, np.arange(B + 1) * trees, what, "auto")
        auto, parts, line = (device_tables(p, kv, np.full(B, trees), k) for k in ("auto", "parts", "line"))
        assert not np.array_equal(parts[1], line[1]), what
        assert same(auto, parts if tail else line), what
        assert (np.diff(parts[0])[14:] > 0).all(), what  # the tail: programs 14-19, idle in the parts alone, work


def test_auto_takes_the_parts_tail_on_random_long_steps():
    """``"auto"`` under the Hopper kernel's costs on random steps where the KV parts apply (equal
    trees, 2L <= P programs): 1-12 sequences of 1-69 nodes over 2k-60k tokens, 16-128 heads, both
    configs. The device's tables equal ``device_tables`` whether it takes the parts with their tail
    (the parts filling under nine tenths on a long enough step: 11 of the 16 draws), the parts
    alone, whole segments or the line."""
    rng = np.random.default_rng(300)
    tails = 0
    for i in range(16):
        B, n, H, c = int(rng.integers(1, 13)), int(rng.integers(1, 70)), int(rng.choice([16, 32, 64, 128])), i % 2
        L = -(-n * H // CONFIGS[c].block_m)
        P = int(rng.integers(2 * L, min(6 * L, 400)))
        kv, trees = n + rng.integers(2000, 60000, B), np.full(B, n)
        p = VerifyPlan(B, n, H, DEVICE, config=CONFIGS[c], num_programs=P, costs=HOPPER_COSTS)
        check_device_plan(p, kv, np.arange(B + 1) * n, f"kv={kv.tolist()} n={n} H={H} P={P} {CONFIGS[c]}", "auto")
        auto, parts, line = (device_tables(p, kv, trees, k) for k in ("auto", "parts", "line"))
        tails += not parts_fill(L, P) and not np.array_equal(parts[1], line[1]) and same(auto, parts)
    assert tails >= 4


@pytest.mark.parametrize("tiles, L, P, straddles, cut", [
    ([18, 1, 6, 6, 13, 11, 22, 14, 10], 11, 31, True, False),
    ([19, 21, 17, 23, 13, 27, 28, 13, 21], 7, 20, True, True),
    ([19, 26, 12, 25, 27, 14, 13, 1, 29], 8, 30, False, False),
    ([18, 10, 17, 24, 18, 25, 19, 12, 10], 10, 28, False, True),
])
def test_device_parts_fill_the_programs_the_parts_leave_idle(tiles, L, P, straddles, cut):
    """Where L row blocks a sequence do not divide the programs, the device's parts schedule puts
    the idle programs on the KV's last tiles as the host does (``device_parts``): the tables equal
    the host's where the tail's first sequence also has tiles in the parts or not, where a tail cut
    falls inside that sequence's row blocks or not, and with a later sequence of the tail split
    (the partial slots and groups are the intricate part: each case asserted here, so none goes
    untested)."""
    kv, n, H = np.array(tiles) * 16, L, 32  # CONFIGS[0]: 32-row blocks, 16-position tiles
    p = VerifyPlan(len(tiles), n, H, DEVICE, config=CONFIGS[0], num_programs=P)
    R, T = p.blocks_and_tiles(kv, np.full(len(tiles), n))
    pieces = device_parts(R, T, P)
    head_programs = P // L * L
    assert set(pieces.prog.tolist()) == set(range(P))  # the tail's programs work
    first_tail = int(pieces.seq[pieces.prog >= head_programs].min())
    in_tail = (pieces.prog >= head_programs) & (pieces.seq == first_tail)
    assert bool(((pieces.prog < head_programs) & (pieces.seq == first_tail)).any()) == straddles
    assert bool((np.bincount(pieces.row[in_tail], minlength=L) > 1).any()) == cut
    later = (pieces.prog >= head_programs) & (pieces.seq > first_tail)
    assert (np.bincount(pieces.seq[later] * L + pieces.row[later]) > 1).any()  # a later tail row block split
    check_device_plan(p, kv, np.arange(len(tiles) + 1) * n, f"tiles={tiles} L={L} P={P}", "parts")


def test_parts_schedule_splits_and_snaps():
    """Hand-made parts schedules: a long sequence cut by several parts beside short ones (split row
    blocks with several partials each), boundaries close to a sequence's edge (snapped), one
    sequence, and B = max_batch after B = 1 on the same plan."""
    p = VerifyPlan(6, 9, 16, DEVICE, config=CONFIGS[0], num_programs=40)  # 16 x 9 / 32: L = 5, 8 parts
    for kv in ([3000, 17, 900, 16, 40, 700], [16 * 37, 16 * 38, 16 * 39, 16 * 37, 16 * 40, 16 * 36], [5000]):
        kv = np.array(kv)
        check_device_plan(p, kv, np.arange(len(kv) + 1) * 9, f"kv={kv.tolist()}", "parts")
    kv = np.array([3000, 17, 900, 16, 40, 700])
    first, seg, grp = device_tables(p, kv, np.full(6, 9), "parts")
    assert grp.shape[1] > 0 and (grp[3] > 2).any()  # a row block split into three parts or more
    assert not np.array_equal(seg, device_tables(p, kv, np.full(6, 9), "line")[1])  # not the line schedule
    assert p.device_schedule_for([3000, 17, 900, 16, 40, 700], np.arange(7) * 9) in ("line", "parts")
    with pytest.raises(ValueError, match="schedule must be one of"):
        p.plan_on_device(torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), schedule="whole")


def test_parts_schedule_falls_back_to_the_line_past_int32_tiles():
    """The parts schedule runs in int32: 64 sequences of 2**31 - 1 tokens hold 2**31 KV tiles of 64
    in all, so the device writes the line schedule (int64 positions), as ``device_tables`` says; one
    sequence fewer stays under it and takes parts (its last pieces end at the KV length, 2**31 - 1,
    where their tiles end at 2**31)."""
    p = VerifyPlan(64, 1, 1, DEVICE, config=CONFIGS[1], num_programs=264)
    for B in (64, 63):
        kv = np.full(B, 2**31 - 1)
        check_device_plan(p, kv, np.arange(B + 1), f"B={B}", "parts")
        first, seg, _ = device_tables(p, kv, np.ones(B, dtype=np.int64), "parts")
        line = device_tables(p, kv, np.ones(B, dtype=np.int64), "line")[1]
        assert np.array_equal(seg, line) == (B == 64), B


def test_device_schedule_for_prefers_parts_where_the_line_is_hbm_bound():
    """The cost model's pick on the host: KV parts at batch 4 with few row blocks per sequence over
    a long prefix (the line schedule re-reads the KV: HBM-bound) and at 128 heads x 16 nodes x 6
    sequences (32 row blocks each; modelled at the line's cost, which cuts row blocks and is priced
    at LINE_OVER_LOCKSTEP times it), the line schedule for one sequence, and always the line for
    ragged trees."""
    p = VerifyPlan(4, 9, 64, DEVICE, config=CONFIGS[1], num_programs=132, costs=HOPPER_COSTS)
    assert p.device_schedule_for(np.full(4, 131072 + 9), np.arange(5) * 9) == "parts"
    wide = VerifyPlan(6, 16, 128, DEVICE, config=CONFIGS[1], num_programs=132, costs=HOPPER_COSTS)
    assert wide.device_schedule_for(np.full(6, 131072 + 16), np.arange(7) * 16) == "parts"
    assert p.device_schedule_for(np.array([131072 + 9, 40, 4000, 9]), np.array([0, 9, 10, 19, 20])) == "line"


def test_device_schedule_for_prices_the_parts_tail_it_writes():
    """Where the device writes the KV parts with their tail, the host's pick prices them as a tail
    (:func:`~kdtree_engine.verify.plan.candidate_cost`: the tail's segment margin), as the host's
    plan does: here (128 heads x 20 nodes, 4 ragged sequences, 114 programs) the tail costs 270
    tile times, the line 280.8 and the tail with its margin 284.6, so the pick is the line; priced
    without the margin it was the parts. (At 16 heads x 75 nodes x 8 x 4096, where the line ties
    with the tail unmargined, the H100 ran the line in 0.67x the tail's time: perf log run 56.)"""
    p = VerifyPlan(4, 20, 128, DEVICE, config=CONFIGS[1], num_programs=114, costs=HOPPER_COSTS)
    kv, qo = np.array([777, 11531, 12439, 9704]), np.arange(5) * 20
    R, T = p.blocks_and_tiles(kv, np.full(4, 20))
    tail = plan_mod._device_parts_candidate(R, T, 114, HOPPER_COSTS)
    line = plan_mod.candidate_cost("line", schedule(R, T, 114, only="line"), T, HOPPER_COSTS)
    assert tail.name == "parts_tail" and schedule_cost(tail.pieces, HOPPER_COSTS) < line < tail.cost
    assert p.device_schedule_for(kv, qo) == "line"


def test_device_schedule_for_takes_rounds_where_a_sequence_outgrows_half_the_programs():
    """128 heads x 65 nodes (130 row blocks on 132 programs: no parts): at batch 4 over 131072
    tokens the line re-reads each sequence's KV once per program (1.8x the host's pick under the
    cost model), the rounds schedule reads it with all programs of a round at once; one sequence:
    the rounds too (the model costs the two alike, and prices a line that cuts row blocks at
    LINE_OVER_LOCKSTEP times its cost); three sequences of 100 row blocks over ragged KV lengths
    (no parts past 66 row blocks, no rounds: their last would leave most programs idle): the line."""
    p = VerifyPlan(4, 65, 128, DEVICE, config=CONFIGS[1], num_programs=132, costs=HOPPER_COSTS)
    assert p.device_schedule_for(np.full(4, 131072 + 65), np.arange(5) * 65) == "rounds"
    assert p.device_schedule_for(np.array([131072 + 65]), np.array([0, 65])) == "rounds"
    p = VerifyPlan(3, 50, 128, DEVICE, config=CONFIGS[1], num_programs=132, costs=HOPPER_COSTS)
    assert p.device_schedule_for(np.array([634, 2064, 859]) * 64, np.arange(4) * 50) == "line"


def test_device_tables_at_the_edges():
    """The largest batch of a plan (B = max_batch = 64, 128 heads, 65 nodes: 8448 segments on 132
    programs), then one sequence on the same plan (the tables past it from the batch before); one
    and two programs over sequences cut into many columns; malformed lengths (empty, over-long and
    negative trees, KV lengths 0 and negative), clamped."""
    p = VerifyPlan(64, 65, 128, DEVICE, config=CONFIGS[1], num_programs=132)
    check_device_plan(p, np.full(64, 16449), np.arange(65) * 65, "B = max_batch")
    check_device_plan(p, np.array([70]), np.array([0, 65]), "B = 1 after B = max_batch")
    for P in (1, 2):
        p = VerifyPlan(5, 9, 16, DEVICE, config=CONFIGS[0], num_programs=P)
        check_device_plan(p, np.array([3000, 17, 900, 1, 40]), np.array([0, 9, 10, 15, 24, 25]), f"P={P}")
    p = VerifyPlan(6, 12, 8, DEVICE, config=CONFIGS[0], num_programs=7)
    check_device_plan(p, np.array([500, 0, -5, 33, 200, 90]), np.array([3, 3, 40, 20, 20, 26, 30]), "malformed")


def test_device_tables_at_64_pieces_per_program():
    """A scheduler of 64 pieces per program (two per lane, fewer programs repeating the boundaries):
    the same tables, for a batch of many programs' pieces, then one of fewer than a program's."""
    from kdtree_engine.verify.scheduler import DeviceScheduler

    p = VerifyPlan(8, 33, 64, DEVICE, config=CONFIGS[0], num_programs=24)
    p._scheduler = DeviceScheduler(p.kv_lens_buf, p.qo_indptr_buf, p.tables, num_heads=64, max_batch=8,
                                   max_tree_nodes=33, min_split=MIN_SPLIT_TILES,
                                   segment_tiles=p.costs.segment_tiles, block_s=64)
    check_device_plan(p, np.array([3000, 40, 900, 17, 2500, 33, 64, 700]), np.arange(9) * 33 - np.arange(9),
                      "8 sequences")
    check_device_plan(p, np.array([40]), np.array([0, 9]), "one sequence")


def test_run_on_a_device_plan_matches_the_reference():
    """A host plan, then a device plan (the same workspace), then a host plan again, then a device
    plan of the KV parts schedule (equal trees): each run right."""
    g = torch.Generator().manual_seed(3)
    attn = VerifyAttention(3, 24, 2, DEVICE, num_programs=6)
    specs = [CaseSpec("h", 2, [60, 5], [random_tree(7, g), random_tree(24, g)], page_size=1, seed=3),
             CaseSpec("d", 2, [90, 33, 0], [chain_tree(12), random_tree(2, g), [-1]], page_size=16, seed=5),
             CaseSpec("h2", 2, [61, 6], [random_tree(7, g), random_tree(24, g)], page_size=1, seed=3),
             CaseSpec("p", 2, [900, 40, 300], [random_tree(20, g) for _ in range(3)], page_size=16, seed=7)]
    for i, spec in enumerate(specs):
        c = build_case(spec, DEVICE)
        if i in (1, 3):
            attn.workspace.plan_on_device(c["kv_lens"], c["qo_indptr"], schedule="parts" if i == 3 else "line")
        else:
            attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
        run_matches_the_reference(attn, c, spec.name)


def run_matches_the_reference(attn: VerifyAttention, c: dict, what: str):
    """``attn.run`` on the case ``c`` into NaN-poisoned outputs, against the float64 reference."""
    T, H = c["q"].shape[:2]
    out = torch.full((T, H, 512), math.nan, dtype=c["q"].dtype, device=DEVICE)
    lse = torch.full((T, H), math.nan, dtype=torch.float32, device=DEVICE)
    attn.run(c["q"], c["kv_cache"], c["page_table"], c["tree_mask"], out=out, lse=lse)
    r_out, r_lse = reference(**c)
    assert compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok, what
    assert compare(lse, r_lse, *TOLERANCES["bf16"]["lse"]).ok, what


def test_run_on_a_rounds_plan_matches_the_reference():
    """A device plan of the rounds schedule (two 40-node trees x 4 heads under the interpreter's
    32-row blocks, x 8 heads under the GPU's 64: 5 row blocks each, whole sequences dealt to 5
    programs two by two, nothing merged), run right."""
    g = torch.Generator().manual_seed(11)
    H = 5 * (32 if DEVICE == "cpu" else 64) // 40
    attn = VerifyAttention(2, 40, H, DEVICE, num_programs=5)
    assert attn.workspace.tables.config.block_m * 5 == 40 * H
    c = build_case(CaseSpec("r", H, [300, 90], [random_tree(40, g), random_tree(40, g)], page_size=16, seed=11),
                   DEVICE)
    attn.workspace.plan_on_device(c["kv_lens"], c["qo_indptr"], schedule="rounds")
    t = attn.workspace.tables
    assert t.prog_first_seg.tolist()[:6] == [0, 2, 4, 6, 8, 10] and int(t.group_count[0]) == 0
    run_matches_the_reference(attn, c, "rounds")


@pytest.mark.parametrize("kv_lens, qo_indptr, err, match", [
    ([4, 4], [0, 1, 2], TypeError, "kv_lens must be a torch.Tensor"),
    (torch.tensor([4, 4]), torch.tensor([0, 1, 2], dtype=torch.int32), TypeError, "kv_lens must be a 1-D int32"),
    (torch.tensor([4, 4], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), ValueError,
     "qo_indptr must have B\\+1=3 entries"),
    (torch.tensor([4] * 4, dtype=torch.int32), torch.arange(5, dtype=torch.int32), ValueError,
     "kv_lens has 4 sequences; this plan holds 1..max_batch=3"),
])
def test_bad_device_lengths_are_refused(kv_lens, qo_indptr, err, match):
    p = VerifyPlan(3, 8, 2, "cpu")
    with pytest.raises(err, match=match):
        p.plan_on_device(kv_lens, qo_indptr)


@requires_cuda
def test_the_scheduler_compiles_once_as_the_batch_changes():
    """A decode's batch moves through 5, 16, 17, 32, 2 and 40 sequences (other classes of
    divisibility by 16 each) on one plan: the scheduler's kernel is compiled once per schedule, and
    each step's tables are the host's (issue 11: no recompile during a decode)."""
    from kdtree_engine.verify import scheduler

    cache = scheduler._schedule_kernel.device_caches[torch.cuda.current_device()][0]
    p = VerifyPlan(40, 9, 16, DEVICE, config=CONFIGS[1], num_programs=132, costs=HOPPER_COSTS)
    for kind in ("line", "auto"):
        for step, B in enumerate((5, 16, 17, 32, 2, 40)):
            kv = 3000 + 67 * np.arange(B)
            check_device_plan(p, kv, np.arange(B + 1) * 9, f"{kind} B={B}", kind)
            if step == 0:
                compiled = len(cache)
        assert len(cache) == compiled, kind


@requires_cuda
def test_cuda_graph_with_the_plan_replays_after_new_lengths():
    """Capture plan (device scheduler) + run in one graph, at buffers sized for the maxima; for each
    new step write its lengths into the captured length tensors and its inputs into the buffers,
    replay, compare with the reference (other B would change the shapes: B stays, trees and
    prefixes change)."""
    H, B, max_n, max_pages = 16, 3, 40, 7000
    attn = VerifyAttention(B, max_n, H, "cuda")
    g = torch.Generator().manual_seed(9)
    kv_dev = torch.zeros(B, dtype=torch.int32, device="cuda")
    qo_dev = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    steps = [CaseSpec("s0", H, [5000, 300, 9], [random_tree(9, g), random_tree(40, g), [-1]]),
             CaseSpec("s1", H, [6900, 1, 64], [random_tree(13, g), [-1, 0], chain_tree(35)], seed=1),
             CaseSpec("s2", H, [17, 4000, 2500], [random_tree(14, g), random_tree(5, g), random_tree(31, g)], seed=2)]
    T = 50  # every step has 50 rows: q and the mask keep their shapes
    q_buf = torch.zeros(T, H, 576, dtype=torch.bfloat16, device="cuda")
    mask_buf = torch.zeros(T, 2, dtype=torch.int32, device="cuda")
    pt_buf = torch.zeros(B, max_pages, dtype=torch.int32, device="cuda")
    kv_buf = torch.zeros(B * max_pages + 8, 1, 576, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(T, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(T, H, dtype=torch.float32, device="cuda")

    def load(spec):
        c = build_case(spec, "cuda")
        assert c["q"].shape[0] == T
        q_buf.copy_(c["q"])
        mask_buf.zero_()
        mask_buf[:, : c["tree_mask"].shape[1]].copy_(c["tree_mask"])
        kv_buf[: c["kv_cache"].shape[0]].copy_(c["kv_cache"])
        pt_buf[:, : c["page_table"].shape[1]].copy_(c["page_table"])
        kv_dev.copy_(c["kv_lens"])
        qo_dev.copy_(c["qo_indptr"])
        return c

    def step():
        attn.plan(kv_dev, qo_dev)
        attn.run(q_buf, kv_buf, pt_buf, mask_buf, out=out, lse=lse)

    load(steps[0])
    graph = capture_graph(lambda _i: step(), [0])
    for spec in steps + steps[:1]:
        c = load(spec)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        r_out, r_lse = reference(**c)
        assert compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok, spec.name
        assert compare(lse, r_lse, *TOLERANCES["bf16"]["lse"]).ok, spec.name


# ----------------------------------------------------------------------------------------------
# One sequence scheduled by the kernels themselves (VerifyPlan._plan_in_kernel)


@triton.jit
def _one_sequence_work(kv_lens, qo_indptr, stride_qo, H, work, groups, n_groups, K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program p's segments as the kernels see them (:func:`work_range`, :func:`work_segment` with
    IN_KERNEL): ``work[p, k] = (segment, sequence, row0, kv_start, kv_end, partial)``, its k-th of at
    most K, and its share of the groups."""
    i_p = tl.program_id(0)
    first, end, step, kv_len, R, T, S = work_range(i_p, tl.num_programs(0), kv_lens, kv_lens, qo_indptr, stride_qo,
                                                   H, BLOCK_M, BLOCK_N, True)
    k = 0
    for i_s in range(first, end, step):
        i_b, row0, kv_start, kv_end, part = work_segment(i_s, kv_len, R, T, S, kv_lens, kv_lens, kv_lens, kv_lens,
                                                         kv_lens, BLOCK_M, BLOCK_N, True)
        p = work + (i_p * K + k) * 6
        tl.store(p, i_s)
        tl.store(p + 1, i_b)
        tl.store(p + 2, row0)
        tl.store(p + 3, kv_start)
        tl.store(p + 4, kv_end)
        tl.store(p + 5, part)
        k += 1
    # the four group rows one after another, 128 entries each
    one_sequence_groups(i_p, R, S, groups, groups + 128, groups + 256, groups + 384, n_groups, BLOCK_M)


def one_sequence_work(kv_len: int, n: int, H: int, P: int, bm: int, bn: int):
    """Run :func:`_one_sequence_work` on P programs (qo_indptr strided, starting at 0): its work
    table (segments not run: -9) and groups ``[4, 128]`` with their count."""
    K = 4 + -(-min(max(n, 1), 1024) * H // bm) // P
    work = torch.full((P, K, 6), -9, dtype=torch.int32, device=DEVICE)
    groups = torch.full((4 * 128,), -9, dtype=torch.int32, device=DEVICE)
    count = torch.full((1,), -9, dtype=torch.int32, device=DEVICE)
    qo = torch.tensor([0, 7, n, 7], dtype=torch.int32, device=DEVICE)[::2]
    kv = torch.tensor([kv_len], dtype=torch.int32, device=DEVICE)
    _one_sequence_work[(P,)](kv, qo, qo.stride(0), H, work, groups, count, K=K, BLOCK_M=bm, BLOCK_N=bn)
    return work.cpu().numpy(), groups.cpu().numpy().reshape(4, 128), int(count[0])


@pytest.mark.parametrize("kv_len, n, H, P, bm, bn", [
    (1, 1, 1, 1, 64, 64), (64, 1, 1, 8, 64, 64), (200, 9, 16, 132, 64, 64), (131072 + 5, 9, 16, 132, 64, 64),
    (16384, 33, 64, 132, 64, 64), (4096, 33, 128, 132, 64, 64), (1000, 9, 128, 132, 64, 64),
    (77, 5, 3, 8, 32, 16), (3, 40, 8, 8, 32, 16), (40, 129, 128, 132, 64, 64), (500, 20, 16, 7, 32, 16),
    # malformed lengths (unchecked on a GPU without validate): no KV, a negative KV length, a tree of
    # no nodes or of more than 1,024 (clamped: within the tables whatever the lengths)
    (0, 9, 16, 132, 64, 64), (-5, 9, 16, 132, 64, 64), (300, -3, 16, 132, 64, 64), (300, 5000, 2, 132, 64, 64),
])
def test_one_sequence_schedule_covers_every_tile_once(kv_len, n, H, P, bm, bn):
    """Every (row block, KV tile) exactly once, in segments a part long; one segment a program
    where 2 R <= P, else dealt round by round; a split row block's partial slots r S .. r S + S - 1,
    one each, and its group written; nothing split when one part covers the KV. Malformed lengths:
    a tree clamped to 1..1024 nodes, a KV length <= 0 one empty segment a row block."""
    work, groups, count = one_sequence_work(kv_len, n, H, P, bm, bn)
    R, T = -(-min(max(n, 1), 1024) * H // bm), max(1, -(-kv_len // bn))
    S = max(1, min(P // R, T))
    segs = work.reshape(-1, 6)
    segs = segs[segs[:, 0] >= 0]
    assert len(segs) == S * R and sorted(segs[:, 0].tolist()) == list(range(S * R))
    per_program = (work[:, :, 0] >= 0).sum(1)
    assert per_program.max() == -(-S * R // P) and (2 * R > P or per_program.max() == 1)
    assert (segs[:, 1] == 0).all() and (segs[:, 2] % bm == 0).all() and (segs[:, 3] % bn == 0).all()
    if kv_len <= 0:
        assert S == 1 and (segs[:, 3] == 0).all() and (segs[:, 4] == kv_len).all()
        assert sorted(segs[:, 2].tolist()) == [r * bm for r in range(R)] and count == 0
        return
    covered = np.zeros((R, T), dtype=np.int64)
    for _, _, row0, start, end, _ in segs:
        assert start < end <= kv_len
        covered[row0 // bm, start // bn: -(-end // bn)] += 1
    assert (covered == 1).all()
    lengths = -(-(segs[:, 4] - segs[:, 3]) // bn)
    assert lengths.max() - lengths.min() <= 1 or kv_len % bn  # parts of T // S or T // S + 1 tiles
    if S == 1:
        assert (segs[:, 5] == -1).all() and count == 0
    else:
        r, part = segs[:, 2] // bm, segs[:, 0] // R
        assert (segs[:, 5] == r * S + part).all() and count == R
        assert groups[:, :R].tolist() == [[0] * R, [i * bm for i in range(R)], [i * S for i in range(R)], [S] * R]
        assert (groups[:, R:] == -9).all()


@pytest.mark.parametrize("R, P, applies", [(1, 132, True), (3, 132, True), (9, 132, True), (13, 132, True),
                                           (18, 132, True), (33, 132, True), (34, 132, False), (44, 132, True),
                                           (66, 132, True), (67, 132, False), (130, 132, False), (3, 8, False),
                                           (4, 8, True), (1, 1, False)])
def test_parts_fill_rule_of_the_in_kernel_schedule(R, P, applies):
    assert parts_fill(R, P) == applies


def test_unplanned_one_sequence_call_schedules_in_the_kernel(monkeypatch):
    """An unplanned B = 1 call whose parts fill the grid leaves its schedule to the kernel: the
    workspace's segment tables poisoned and its device scheduler refused, the results still right;
    a batch of two, or one sequence of too many row blocks for the grid, is scheduled as before."""
    g = torch.Generator().manual_seed(12)
    H = 4
    c = build_case(CaseSpec("one", H, [300], [random_tree(9, g)], page_size=16, seed=12), DEVICE)
    run_checked(c, "flash", "bf16")
    ws = unplanned_workspace(c)
    assert ws.tables.in_kernel and ws.num_seqs == 1 and ws.schedules_in_kernel(9)
    ws.tables.prog_first_seg.fill_(-(2**30))
    ws.tables.segments.fill_(2**30)
    monkeypatch.setattr(VerifyPlan, "launch_on_device", None)  # a call would raise
    monkeypatch.setattr(VerifyPlan, "plan", None)
    run_checked(c, "flash", "bf16")
    assert unplanned_workspace(c) is ws and ws.tables.in_kernel
    monkeypatch.undo()
    c2 = build_case(CaseSpec("two", H, [300, 20], [random_tree(9, g), [-1]], page_size=16, seed=13), DEVICE)
    run_checked(c2, "flash", "bf16")
    assert not unplanned_workspace(c2).tables.in_kernel
    H_wide, n_wide = (4, 40) if DEVICE == "cpu" else (128, 80)  # more row blocks than half the programs
    wide = build_case(CaseSpec("wide", H_wide, [50], [random_tree(n_wide, g)], page_size=16, seed=14), DEVICE)
    run_checked(wide, "flash", "bf16")
    ws = unplanned_workspace(wide)
    assert not ws.schedules_in_kernel(n_wide) and not ws.tables.in_kernel


def test_unplanned_workspace_grows_by_doubling_and_keeps_the_outgrown(monkeypatch):
    """verify_attention's workspace for (device, heads, stream) grows to at least twice its batch or
    tree bound; the outgrown one stays alive (a graph captured around an earlier call keeps its
    tables) and passes its partial buffers on; a plan of another grid cannot take them."""
    monkeypatch.setattr(api, "_UNPLANNED", {})
    monkeypatch.setattr(api, "_OUTGROWN", [])
    g = torch.Generator().manual_seed(15)
    one = build_case(CaseSpec("one", 2, [40], [random_tree(5, g)], page_size=16, seed=15), DEVICE)
    run_checked(one, "flash", "bf16")
    first = unplanned_workspace(one)
    three = build_case(CaseSpec("three", 2, [40, 9, 30], [random_tree(6, g), [-1], random_tree(3, g)],
                                page_size=16, seed=16), DEVICE)
    run_checked(three, "flash", "bf16")
    grown = unplanned_workspace(three)
    assert api._OUTGROWN == [first] and (grown.max_batch, grown.max_tree_nodes) == (3, 10)
    assert grown.tables.partial_out is first.tables.partial_out
    assert grown.tables.partial_lse is first.tables.partial_lse
    with pytest.raises(ValueError, match="partials_of is a plan for"):
        VerifyPlan(1, 1, 2, DEVICE, num_programs=first.num_programs + 1, partials_of=first)

