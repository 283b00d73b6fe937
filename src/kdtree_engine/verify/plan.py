"""The flash kernels' plan: tile configs, the persistent schedule, and the workspace it lives in.

The layer above :mod:`.contract` and :mod:`.scheduler`: imports torch, numpy,
:mod:`kdtree_engine.backend` and the contract; Triton only through the device scheduler, loaded
on the first plan from device lengths (:meth:`VerifyPlan.plan_on_device`); never a kernel.

MLA in absorbed form has one latent KV head, so the ``n_b x H`` query rows of sequence b form one
matrix problem ``[n_b*H, 576] x [576, kv_len_b]``, packed into row blocks of ``BLOCK_M`` rows and
KV tiles of ``BLOCK_N`` positions. The kernel is persistent: the plan cuts all (sequence, row
block, KV tile) work into as many near-equal shares as the GPU runs programs at once (see
:func:`schedule`); a share is a list of segments, each a row block against a KV range. A row
block whose KV is cut into several segments writes partials, merged by the kernel's own programs
after a grid barrier or by the combine kernel (see :mod:`.combine`).

A :class:`VerifyPlan` owns every buffer the kernels read besides the caller's tensors, allocated
once at construction for its maxima; :meth:`VerifyPlan.plan` writes a new step's schedule into
them (from host lengths: host numpy, one non-blocking copy from pinned staging; from device
lengths: the device scheduler's line schedule, one launch, no sync) and allocates nothing on the
device, so a CUDA graph captured around a launch (and around a device plan) stays valid across plans.
"""

from __future__ import annotations

import heapq
import itertools
import numbers
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..backend import interpreting
from ..masks import MAX_TREE_NODES
from .contract import D_QK, D_V, MAX_HEADS, check_lengths

__all__ = [
    "FlashConfig",
    "CONFIGS",
    "INTERPRETER_CONFIG",
    "MIN_SPLIT_TILES",
    "ScheduleCosts",
    "TRITON_COSTS",
    "HOPPER_COSTS",
    "default_costs",
    "pick_config",
    "resident_programs",
    "Pieces",
    "schedule",
    "schedule_cost",
    "device_parts",
    "FlashTables",
    "VerifyPlan",
    "plan_verify",
]


@dataclass(frozen=True)
class FlashConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def shared_bytes(self, elem: int = 2) -> int:
        """Upper estimate of the shared memory: q block, two K tiles (Triton 3.6 allocates two for
        1-3 stages), the P tile. Compiler reports (``scripts/compile_report.py``, sm_90 and
        sm_120): 64x64x8x2 221,184 B (estimate 229,376), 64x32x8x3 147,712 (151,552), 32x16x4x2
        69,632 (74,752), 32x32x4x1 102,400 (112,640)."""
        return elem * (self.block_m * D_QK + 2 * self.block_n * D_QK + self.block_m * self.block_n)


# Ordered by preference; the first that fits the device's shared memory is used: 64x64x8x2 on
# Hopper (227 KB), 64x32x8x3 on A100-class parts (163 KB), 32x16x4x2 within 99 KB (sm_120 and
# other consumer parts). BLOCK_N=64 gives the QK wgmma N=32 instead of 16: measured on the H200 in
# docs/perf_log.md (run 7).
CONFIGS = (
    FlashConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),
    FlashConfig(block_m=64, block_n=32, num_warps=8, num_stages=3),
    FlashConfig(block_m=32, block_n=16, num_warps=4, num_stages=2),
)
INTERPRETER_CONFIG = FlashConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
MIN_SPLIT_TILES = 4  # the line schedule does not cut a segment into pieces shorter than this (tiles)


class ScheduleCosts(NamedTuple):
    """The schedule cost model's constants, in tile times (one program, one 64 x 64 tile) of the
    kernel that runs the plan (see :func:`schedule_cost`)."""

    segment_tiles: int  # a segment's fixed cost: q block load, pipeline fill, epilogue, its partial's combine
    hbm_tiles_per_tile: int  # KV tiles (64 x 576 bf16: 73.7 KB) the GPU reads from HBM in one tile time
    # whether schedules whose programs read one KV together (lockstep) pay against the line: the
    # device's "auto" (the unplanned call) then takes the rounds schedule where it applies and the
    # KV parts' tail where the parts alone leave programs idle, and the host prices a line that
    # cuts row blocks at LINE_OVER_LOCKSTEP times its cost. For a kernel fast enough that the
    # line's re-reads of the KV bind (the Hopper kernel; under the Triton kernel's costs the line
    # is within 1-3% of the host's pick there and neither is cheaper: see
    # scheduler.ROUNDS_MAX_SLACK_TENTHS and scheduler.AUTO_TAIL_MIN_TILES)
    lockstep: bool = False


# Measured on the H200 (docs/perf_log.md; 4.25 TB/s from HBM). The Triton flash kernel: ~16 us per
# extra segment against ~4.4 us per tile (run 9). The Hopper kernel: ~1.6-1.9 us per tile (runs 18,
# 20); its segments are costed as the Triton kernel's in tiles, the setting run 20 measured (one
# data point, 64x9x1x131072, suggests ~7.6 tiles; costing 8 there moves 64x9x4x16384 off the parts
# schedule that run 20 measured 14% faster, so it is not taken). A schedule whose programs read the
# same KV at different times is HBM-bound when it reads more than hbm_tiles_per_tile tiles per tile
# time (run 18's batch-4 shapes with few row blocks per sequence on the Hopper kernel: 1.36-1.50x
# FlashMLA; run 20 with the parts schedule: 1.09-1.25x). The Hopper kernel slows down before HBM
# is saturated: at 64x9x1x131072 and 16x33x1x131072 the line schedule, reading 10,789 tiles (795 MB)
# from HBM in 301 us (2.6 TB/s), ran 2-7% slower than the parts schedule, which reads 2,049 (run 31);
# so its HBM term counts 72 tiles per tile time (2.9 TB/s at 1.85 us per tile) where 90 said 3.6.
TRITON_COSTS = ScheduleCosts(segment_tiles=3, hbm_tiles_per_tile=250)
HOPPER_COSTS = ScheduleCosts(segment_tiles=3, hbm_tiles_per_tile=72, lockstep=True)
L2_STEP_TOLERANCE = 4  # tiles: programs this close in their walk over the same KV share it in L2
# Under costs whose lockstep is set (the Hopper kernel), a line schedule that cuts row blocks
# (its programs then read a sequence's KV at different offsets, each from HBM) is priced at this
# many times its modelled cost against the schedules whose programs read one KV together (KV parts,
# their tails, whole segments, the rounds). Measured on an H100 (docs/perf_log.md runs 51-52, the
# Hopper kernel, 64-128 heads, B 1-6, KV 16k-128k, schedules forced): the modelled cost of such a
# line is 1.08-1.43x short of its time against theirs (median 1.24), e.g. 128x32x6x131072, where
# the model put KV parts at 1.031x the line, ran them in 0.82 of its time; 128x96x1x131072 (the
# rounds modelled 1.37x the line) ran them in 1.18x. 1.2 keeps both on the right side.
LINE_OVER_LOCKSTEP = 1.2
# Under costs whose lockstep is set, a KV parts' tail (:func:`_parts_tail_candidates`) is priced at
# (1 + this x the most segments a program of it runs) times its modelled cost: the tail's busiest
# programs run many short segments over KV the other programs do not read, which the model prices
# as any others. Measured on an H100 (docs/perf_log.md run 54; the Hopper kernel, schedules forced,
# 42 shapes where a tail and another candidate were timed, 9 of them after this was set): without it
# the plan's pick was > 1.5% slower than the fastest timed at 16, 3.0% at the mean (up to 1.148x,
# 32x128x4x32768; at 32x96x8x131072, whose tail runs 17 segments a program, whole segments modelled
# 1.005x the tail ran in 0.905 of its time); with it at 2, 0.2% at the mean (64x16x2x131072 1.031x,
# 64x65x16x16384 1.024x). A flat 3% instead missed at 6 of the first 33, where the tail runs 2-3
# segments a program and was 3.5-7.6% the faster.
PARTS_TAIL_SEGMENT_MARGIN = 0.002
# Schedules a plan keeps, by (row blocks, KV tiles) per sequence: in a decode loop a sequence's
# tile count changes once every BLOCK_N tokens, so most steps reuse a schedule and only rewrite
# the lengths and the last tile's end
DEVICE_SCHEDULES = ("line", "parts", "rounds", "auto")  # what the device scheduler writes (VerifyPlan.plan_on_device)
SCHEDULE_CACHE = 64
PREPARED_CACHE = 64  # launches a plan keeps per caller signature (past this many the table starts over)


def _device_limits(device: torch.device) -> tuple[int, int]:
    """(multiprocessor count, max shared memory per block in bytes, opt-in)."""
    if device.type != "cuda":
        return 4, 1 << 30
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.shared_memory_per_block_optin


def pick_config(device: torch.device) -> FlashConfig:
    """The first of :data:`CONFIGS` that fits the device (the interpreter's own config on the CPU)."""
    if interpreting():
        return INTERPRETER_CONFIG
    _, smem = _device_limits(device)
    for cfg in CONFIGS:
        if cfg.shared_bytes() <= smem:
            return cfg
    return CONFIGS[-1]


def resident_programs(cfg: FlashConfig, device: torch.device) -> int:
    """Programs of ``cfg`` the device runs at once: SMs x blocks per SM (shared memory, and the
    register file at 255 registers per thread)."""
    num_sms, smem = _device_limits(device)
    return num_sms * max(1, min(smem // cfg.shared_bytes(), 8 // cfg.num_warps))


# ----------------------------------------------------------------------------------------------
# The schedule (host, numpy: no Python loop over tiles, segments or programs)


class Pieces(NamedTuple):
    """A schedule: piece i is row block ``row[i]`` of sequence ``seq[i]`` against KV tiles
    ``[t0[i], t1[i])``, run by program ``prog[i]``. int64 arrays ``[n]``, sorted by program."""

    seq: np.ndarray
    row: np.ndarray
    t0: np.ndarray
    t1: np.ndarray
    prog: np.ndarray


def default_costs(device: torch.device) -> ScheduleCosts:
    """The cost model of the kernel ``kernel="auto"`` runs on ``device``: :data:`HOPPER_COSTS` on an
    sm_90 GPU, :data:`TRITON_COSTS` elsewhere."""
    if device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device) == (9, 0):
        return HOPPER_COSTS
    return TRITON_COSTS


class ScheduleTerms(NamedTuple):
    """What :func:`schedule_cost` weighs, in tiles (a segment costing ``segment_tiles`` extra)."""

    busiest: int  # the longest program's work
    total: int  # all programs' work
    hbm_tiles: int  # KV tiles read from HBM (pieces reading a tile at about the same time read it once)


def schedule_terms(pieces: Pieces, segment_tiles: int) -> ScheduleTerms:
    """The terms of a schedule's cost (:func:`schedule_cost`).

    The HBM traffic counts a KV tile once for all pieces that read it at about the same time (their
    programs then share it in L2): the pieces of one sequence whose ``t0 - start`` (``start``: the
    piece's start time in its program) fall in the same window of :data:`L2_STEP_TOLERANCE` + 1
    tiles (counted from the sequence's smallest) form one stream, which reads ``max t1 - min t0``
    tiles. Programs that read the same KV at offsets further apart each read it from HBM. (Windows,
    not chains of neighbours: programs whose offsets drift by a few tiles each, as the line
    schedule's do when its columns and shares differ, were one stream however far the first and
    the last were apart.)"""
    if len(pieces.prog) == 0:
        return ScheduleTerms(0, 0, 0)
    seq, _, t0, t1, prog = pieces
    work = t1 - t0 + segment_tiles
    load = np.bincount(prog, weights=work)
    begin = np.cumsum(work) - work  # where each piece starts in the concatenation of all programs
    new_prog = np.diff(prog, prepend=-1) != 0  # pieces are sorted by program
    start = begin - begin[new_prog][np.cumsum(new_prog) - 1]
    offset = t0 - start
    least = np.full(int(seq.max()) + 1, np.iinfo(np.int64).max)
    np.minimum.at(least, seq, offset)
    window = (offset - least[seq]) // (L2_STEP_TOLERANCE + 1)
    _, stream = np.unique(seq * (int(window.max()) + 1) + window, return_inverse=True)
    lo = np.full(stream.max() + 1, np.iinfo(np.int64).max)
    hi = np.zeros(stream.max() + 1, dtype=np.int64)
    np.minimum.at(lo, stream, t0)
    np.maximum.at(hi, stream, t1)
    return ScheduleTerms(int(load.max()), int(work.sum()), int((hi - lo).sum()))


def schedule_cost(pieces: Pieces, costs: ScheduleCosts = TRITON_COSTS) -> int:
    """Estimated time of a schedule in tile times: the larger of its longest program (a segment
    costing ``costs.segment_tiles`` extra) and its KV traffic from HBM (``costs.hbm_tiles_per_tile``
    tiles per tile time; :func:`schedule_terms` says how the traffic is counted)."""
    terms = schedule_terms(pieces, costs.segment_tiles)
    return int(max(terms.busiest, terms.hbm_tiles / costs.hbm_tiles_per_tile))


class Candidate(NamedTuple):
    """A schedule :func:`schedule` weighs: its name, its pieces and its priced cost in tile times."""

    name: str  # "line", "parts", "whole:<width in tiles>", "parts_tail", "parts_tail:2", "rounds"
    pieces: Pieces
    cost: float


def schedule(row_blocks, tiles, num_programs: int, min_tiles: int = MIN_SPLIT_TILES,
             costs: ScheduleCosts = TRITON_COSTS, only: str | None = None) -> Pieces:
    """Cut the work (sequence b: ``row_blocks[b]`` row blocks x ``tiles[b]`` KV tiles) into pieces
    run by programs ``0 .. num_programs - 1`` (some may get none): the cheapest of
    :func:`schedule_candidates` (ties to the first).

    ``only="line"``, ``"parts"``, ``"parts_tail"`` (the first of those tails; ``ValueError`` where
    there is none), ``"rounds"`` (:func:`_rounds_schedule`, the device's) or ``"whole"`` (whole
    segments as wide as the longest sequence: every row block against its whole KV, longest
    first): that candidate, whatever it costs (tuning and tests; parts needs at most
    ``num_programs`` row blocks per sequence); or the name of one of :func:`schedule_candidates`
    for this work (``"whole:140"``, ``"parts_tail:2"``; ``ValueError`` naming those there are
    where it is not one of them).
    """
    R = np.asarray(row_blocks, dtype=np.int64)
    T = np.asarray(tiles, dtype=np.int64)
    total = int((R * T).sum())
    if total == 0:
        e = np.zeros(0, dtype=np.int64)
        return Pieces(e, e, e, e, e)
    if only is None:
        candidates = schedule_candidates(R, T, num_programs, min_tiles, costs)
        return min(candidates, key=lambda c: c.cost).pieces  # min keeps the first of equals
    P = programs_with_work(R, T, num_programs)
    chunk = -(-total // P)
    snap = min(min_tiles, chunk // 4)
    if only == "line":
        return _line_schedule(R, T, P, chunk, snap)
    if only == "parts":
        if int(R.max()) > P:
            raise ValueError(f"the parts schedule needs at most {P} row blocks per sequence, got {int(R.max())}")
        return _parts_schedule(R, T, P, snap)
    if only == "parts_tail":
        tail = _first_tail(R, T, P, costs)
        if tail is None:
            raise ValueError(f"no parts-and-tail schedule of {int(R.max())} row blocks a sequence on {P} programs")
        return tail
    if only == "rounds":
        return _rounds_schedule(R, T, P)
    if only == "whole":
        return _whole_segments(R, T, P, int(T.max()), costs.segment_tiles)
    candidates = schedule_candidates(R, T, num_programs, min_tiles, costs)
    for name, pieces, _ in candidates:
        if name == only:
            return pieces
    raise ValueError(f"only must be None, 'line', 'parts', 'parts_tail', 'rounds', 'whole' or one of this work's "
                     f"candidates ({', '.join(c.name for c in candidates)}), got {only!r}")


def schedule_candidates(row_blocks, tiles, num_programs: int, min_tiles: int = MIN_SPLIT_TILES,
                        costs: ScheduleCosts = TRITON_COSTS) -> list[Candidate]:
    """The schedules :func:`schedule` picks from, in its order, each priced by :func:`schedule_cost`
    under ``costs`` (``ValueError`` where there is no work):

    - the line schedule (:func:`_line_schedule`): exact shares, segments cut where they fall;
    - KV parts (:func:`_parts_schedule`): the concatenated KV cut into parts, each read by one
      program per row block at the same time (shared in L2);
    - whole segments (:func:`_whole_segments`: KV columns of a width W, each with every row block
      of its sequence, dealt longest first to the least-loaded program) for W = the smallest width
      that gives at most one segment per program, W = one program's share, and W = whole
      sequences. When the smallest width is at most one program's share, it is the only
      candidate: every program of another schedule has at least that many tiles and a segment;
    - where ``L`` (the most row blocks of a sequence) does not divide the programs, KV parts with
      the programs they leave idle on the KV's last tiles (:func:`_parts_tail_schedule`), for two
      lengths of that tail; last, so taken only where cheaper than every other (perf log, CPU
      session 35, under the Hopper costs on 132 programs: the busiest program's tile pairs 0.77-0.99x
      at 155 of 500 equal-tree shapes, B 1-8, H 16-128, trees of 1-65 nodes, KV 1k-128k; none more);
    - where the device's ``"auto"`` would take the rounds schedule (``costs.lockstep`` and
      :func:`rounds_apply`), the rounds (:func:`_rounds_schedule`).

    Under costs whose ``lockstep`` is set, a line that cuts row blocks (:func:`cuts_row_blocks`)
    is priced at :data:`LINE_OVER_LOCKSTEP` times its cost, a parts tail by the segments its
    busiest programs run (:func:`candidate_cost`).
    """
    R = np.asarray(row_blocks, dtype=np.int64)
    T = np.asarray(tiles, dtype=np.int64)
    total = int((R * T).sum())
    if total == 0:
        raise ValueError("schedule_candidates needs work: every sequence has no row blocks or no KV tiles")
    P = programs_with_work(R, T, num_programs)
    chunk = -(-total // P)
    snap = min(min_tiles, chunk // 4)
    n_blocks, longest = int(R.sum()), int(T.max())
    widths = []
    if n_blocks <= P:
        lo = _smallest_width(R, T, P, total, n_blocks)
        if lo <= chunk:
            pieces = _whole_segments(R, T, P, lo, costs.segment_tiles)
            return [Candidate(f"whole:{lo}", pieces, schedule_cost(pieces, costs))]
        widths.append(lo)
    widths += [w for w in (chunk, longest) if w not in widths]
    parts = int(R.max()) <= P // 2
    named = [("line", _line_schedule(R, T, P, chunk, snap))]
    if parts:
        named.append(("parts", _parts_schedule(R, T, P, snap)))
    named += [(f"whole:{w}", _whole_segments(R, T, P, w, costs.segment_tiles)) for w in sorted(widths)]
    if parts:  # last: taken only where cheaper than all the others (the rounds need 2 L > P: not with parts)
        tails = _parts_tail_candidates(R, T, P, costs.segment_tiles, n_blocks)
        named += [("parts_tail" + (f":{i + 1}" if i else ""), tail) for i, tail in enumerate(tails)]
    if costs.lockstep and rounds_apply(R, T, P):
        named.append(("rounds", _rounds_schedule(R, T, P)))
    return [Candidate(name, pieces, candidate_cost(name, pieces, T, costs)) for name, pieces in named]


def candidate_cost(name: str, pieces: Pieces, T: np.ndarray, costs: ScheduleCosts) -> float:
    """The priced cost of candidate ``name`` over sequences of ``T`` KV tiles: :func:`schedule_cost`;
    for the line, :func:`line_cost`; under costs whose ``lockstep`` is set, a parts tail's times 1 +
    :data:`PARTS_TAIL_SEGMENT_MARGIN` x the most segments a program of it runs."""
    if name == "line":
        return line_cost(pieces, T, costs)
    cost = schedule_cost(pieces, costs)
    if costs.lockstep and name.startswith("parts_tail"):
        return cost * (1 + PARTS_TAIL_SEGMENT_MARGIN * int(np.bincount(pieces.prog).max()))
    return cost


def cuts_row_blocks(pieces: Pieces, T: np.ndarray) -> bool:
    """Whether a piece of the schedule covers part of its row block's KV (of ``T[seq]`` tiles): in
    the line schedule, its programs then read a sequence's KV at different offsets."""
    return bool(((pieces.t0 != 0) | (pieces.t1 != T[pieces.seq])).any())


def line_cost(pieces: Pieces, T: np.ndarray, costs: ScheduleCosts) -> float:
    """The priced cost of a line schedule over sequences of ``T`` KV tiles: :func:`schedule_cost`,
    times :data:`LINE_OVER_LOCKSTEP` under costs whose ``lockstep`` is set where it cuts row
    blocks (:func:`cuts_row_blocks`)."""
    cost = schedule_cost(pieces, costs)
    return cost * LINE_OVER_LOCKSTEP if costs.lockstep and cuts_row_blocks(pieces, T) else cost


def _parts_schedule(R: np.ndarray, T: np.ndarray, P: int, snap: int) -> Pieces:
    """The KV of all sequences end to end, cut into ``G = P // L`` parts of about equal length
    (``L`` = the most row blocks of a sequence); program ``g * L + r`` runs row block r of every
    sequence against its KV in part g, so the L programs of a part read the same KV at the same
    time. A part boundary closer than ``snap`` tiles to a sequence's edge moves to the edge.
    Balanced when every sequence has L row blocks (one tree size); sequences with fewer leave
    programs of their part idle (the cost model weighs that)."""
    L = int(R.max())
    G = P // L
    end = np.cumsum(T)
    begin = end - T
    cuts, points, length, span_seq = _cut_line(begin, end, G, snap)  # spans: one sequence in one part
    span_part = np.searchsorted(cuts, points, side="right")
    n = R[span_seq]  # one piece per row block of the span's sequence
    span = np.repeat(np.arange(len(points)), n)
    row = np.arange(len(span)) - np.repeat(np.cumsum(n) - n, n)
    seq = span_seq[span]
    t0 = points[span] - begin[seq]
    prog = span_part[span] * L + row
    by = np.argsort(prog, kind="stable")
    return Pieces(seq[by], row[by], t0[by], (t0 + length[span])[by], prog[by])


def _parts_tail_schedule(R: np.ndarray, T: np.ndarray, P: int, tail: int) -> Pieces:
    """:func:`_parts_schedule` on the first ``G L`` programs (``L`` the most row blocks of a sequence,
    ``G = P // L``) over the concatenated KV but its last ``tail`` tiles, and :func:`_line_schedule`
    of those last tiles (every row block of the sequences there) on the ``S = P - G L`` programs
    the parts leave idle (``0 < tail <`` the KV's tiles, ``S > 0``). With parts of ``W`` tiles and a
    tail of ``S W / L``, every program has about ``W`` tiles: ``P / (G L)`` times the parts
    schedule's throughput (132 / 126 at 9 row blocks on 132 SMs), the tail's KV read by its row
    blocks at different times (a stream each in :func:`schedule_cost`). The parts are cut where they
    fall, not snapped to a sequence's edge: a snapped part is up to ``snap`` tiles longer, and its
    programs were then the busiest."""
    L = int(R.max())
    G = P // L
    begin = np.cumsum(T) - T
    head = np.clip(int(T.sum()) - tail - begin, 0, T)  # each sequence's tiles before the tail
    h = np.flatnonzero(head)
    parts = _parts_schedule(R[h], head[h], G * L, 0)
    t = np.flatnonzero(head < T)
    work = int((R[t] * (T - head)[t]).sum())
    S = P - G * L
    S_work = programs_with_work(R[t], (T - head)[t], S)
    chunk = -(-work // S_work)
    line = _line_schedule(R[t], (T - head)[t], S_work, chunk, min(MIN_SPLIT_TILES, chunk // 4))
    start = head[t[line.seq]]
    return Pieces(*(np.concatenate(x) for x in ((h[parts.seq], t[line.seq]), (parts.row, line.row),
                                                 (parts.t0, line.t0 + start), (parts.t1, line.t1 + start),
                                                 (parts.prog, line.prog + G * L))))


def _parts_tail_candidates(R: np.ndarray, T: np.ndarray, P: int, segment_tiles: int,
                           n_blocks: int) -> list[Pieces]:
    """:func:`_parts_tail_schedule` for the tail that balances a part's program against a tail
    program by tiles, ``K S / P`` (K the KV's tiles), and for the one that also counts their
    segments (a tail program runs about ``L / S + 1`` segments, a part's one):
    ``(K S - c L G) / P`` with ``c = segment_tiles``. None where ``L`` divides ``P``, where the
    sequences' row blocks differ (one tree size: the case the parts schedule balances; with
    others the parts leave programs idle, and the cost model weighs the tail against the line's
    HBM traffic alone), where a tail would be empty, or where the tables would exceed the plan's
    bounds (``n_blocks + 2P`` segments, ``4P`` partial slots, ``2P`` split row blocks)."""
    L = int(R.max())
    G, K = P // L, int(T.sum())
    S = P - G * L
    if S == 0 or int(R.min()) != L:
        return []
    out = []
    for tail in sorted({K * S // P, (K * S - segment_tiles * L * G) // P}):
        if not 0 < tail < K:
            continue
        pieces = _parts_tail_schedule(R, T, P, tail)
        key = (np.cumsum(R) - R)[pieces.seq] + pieces.row
        count = np.bincount(key)
        if (len(key) <= n_blocks + 2 * P and int(count[count > 1].sum()) <= 4 * P
                and int((count > 1).sum()) <= 2 * P):
            out.append(pieces)
    return out


def device_parts(row_blocks, tiles, num_programs: int, costs: ScheduleCosts = TRITON_COSTS) -> Pieces:
    """The KV parts schedule as the device scheduler writes it (``"parts"`` where the parts apply: one
    tree size, ``2 L`` at most the programs with work): with the programs the parts leave idle on
    the KV's last tiles (``schedule(..., only="parts_tail")``) where ``L`` does not divide those
    programs and a tail of a tile or more exists, else the parts alone (``only="parts"``)."""
    return _device_parts_candidate(row_blocks, tiles, num_programs, costs).pieces


def _device_parts_candidate(row_blocks, tiles, num_programs: int, costs: ScheduleCosts = TRITON_COSTS) -> Candidate:
    """:func:`device_parts` as a :class:`Candidate`: named ``"parts_tail"`` where it has the tail and
    priced as one (:func:`candidate_cost`: the tail's segment margin), else ``"parts"``."""
    R = np.asarray(row_blocks, dtype=np.int64)
    T = np.asarray(tiles, dtype=np.int64)
    tail = _first_tail(R, T, programs_with_work(R, T, num_programs), costs)
    name, pieces = ("parts_tail", tail) if tail is not None else ("parts", schedule(R, T, num_programs, only="parts"))
    return Candidate(name, pieces, candidate_cost(name, pieces, T, costs))


def _first_tail(R: np.ndarray, T: np.ndarray, P: int, costs: ScheduleCosts) -> Pieces | None:
    """The first of :func:`_parts_tail_candidates` on ``P`` programs with work (the segment-counting
    tail where it is a tile or more, else the other), which the device scheduler writes; None
    where there is none (or a sequence has more than ``P // 2`` row blocks)."""
    tails = _parts_tail_candidates(R, T, P, costs.segment_tiles, int(R.sum())) if int(R.max()) <= P // 2 else []
    return tails[0] if tails else None


def _numbered(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``n[b]`` items for each b, numbered in order: each item's b and its index among b's."""
    owner = np.repeat(np.arange(len(n)), n)
    return owner, np.arange(len(owner)) - np.repeat(np.cumsum(n) - n, n)


def _rounds_schedule(R: np.ndarray, T: np.ndarray, P: int) -> Pieces:
    """Every row block of every sequence against its whole KV, in sequence order, segment i run by
    program ``i mod P``: the programs of one round read the same sequence's tiles at the same time
    (the device's schedule for sequences of more row blocks than half the programs, where the KV
    parts schedule does not apply; no row block is split, so nothing is merged)."""
    seq, row = _numbered(R)
    by = np.argsort(np.arange(len(seq)) % P, kind="stable")
    return Pieces(seq[by], row[by], np.zeros(len(seq), dtype=np.int64), T[seq][by], by % P)


def programs_with_work(R: np.ndarray, T: np.ndarray, num_programs: int) -> int:
    """The programs of ``num_programs`` that a schedule of sequences of ``R`` row blocks x ``T`` KV
    tiles gives work: at most one per (row block, tile), at least one."""
    return max(1, min(num_programs, int((R * T).sum())))


def whole_segments_apply(R: np.ndarray, T: np.ndarray, num_programs: int) -> bool:
    """Whether :func:`schedule` takes whole segments without pricing them (and the device's
    ``"auto"`` writes them): KV columns of one program's share make at most as many segments
    (column x row block) as programs with work."""
    pe = programs_with_work(R, T, num_programs)
    return int((R * -(-T // -(-int((R * T).sum()) // pe))).sum()) <= pe


def rounds_apply(R: np.ndarray, T: np.ndarray, num_programs: int) -> bool:
    """Whether the device takes the rounds schedule (:func:`_rounds_schedule`) for sequences of ``R``
    row blocks x ``T`` KV tiles on ``num_programs`` programs (when asked for ``"rounds"`` or
    ``"auto"``): a sequence has more row blocks than half the programs with work, and the last round
    keeps most of them busy (:data:`~kdtree_engine.verify.scheduler.ROUNDS_MAX_SLACK_TENTHS`)."""
    from .scheduler import ROUNDS_MAX_SLACK_TENTHS  # (loads Triton)

    pe, S = programs_with_work(R, T, num_programs), int(R.sum())
    return 2 * int(R.max()) > pe and -(-S // pe) * pe * 10 <= ROUNDS_MAX_SLACK_TENTHS.value * S


def _smallest_width(R: np.ndarray, T: np.ndarray, P: int, total: int, n_blocks: int) -> int:
    """Smallest W with ``sum_b R_b * ceil(T_b / W) <= P`` (exists: ``n_blocks <= P``). It lies in
    ``[ceil(total / P), ceil(total / (P - n_blocks))]`` (``ceil(x/W) < x/W + 1``) and below max T."""
    lo = -(-total // P)
    hi = int(T.max()) if n_blocks == P else min(int(T.max()), -(-total // (P - n_blocks)))
    while True:  # one numpy evaluation for up to 64 widths at a time; one pass in most cases
        ws = np.unique(np.linspace(lo, hi, min(64, hi - lo + 1)).astype(np.int64))
        fits = (R[:, None] * -(-T[:, None] // ws[None, :])).sum(0) <= P
        j = int(fits.argmax())  # fits[-1] holds: hi fits
        if j == 0 or ws[j] - ws[j - 1] == 1:
            return int(ws[j])
        lo, hi = int(ws[j - 1]) + 1, int(ws[j])


def _whole_segments(R: np.ndarray, T: np.ndarray, P: int, width: int, segment_tiles: int) -> Pieces:
    """KV columns of ``width`` tiles x row blocks, dealt longest first (sequence order on ties) to
    the least-loaded program (lowest index on ties; a segment costing ``segment_tiles`` extra): the
    first P segments one per program, the rest through a heap (a Python loop over the segments
    past the first P)."""
    cols = -(-T // width)
    n = R * cols  # segments per sequence
    seq, local = _numbered(n)
    Rs = R[seq]
    t0 = (local // Rs) * width
    t1 = np.minimum(t0 + width, T[seq])
    if len(seq) <= P:
        return Pieces(seq, local % Rs, t0, t1, np.arange(len(seq)))
    cost = t1 - t0 + segment_tiles
    order = np.argsort(-cost, kind="stable")
    prog = np.empty(len(seq), dtype=np.int64)
    prog[order[:P]] = np.arange(P)
    heap = list(zip(cost[order[:P]].tolist(), range(P)))
    heapq.heapify(heap)
    rest = order[P:].tolist()
    for i, c in zip(rest, cost[rest].tolist()):
        load, p = heap[0]
        prog[i] = p
        heapq.heapreplace(heap, (load + c, p))
    by = np.argsort(prog, kind="stable")
    return Pieces(seq[by], (local % Rs)[by], t0[by], t1[by], prog[by])


def _line_schedule(R: np.ndarray, T: np.ndarray, P: int, chunk: int, snap: int) -> Pieces:
    """The work on a line (per sequence, KV columns of about ``chunk`` tiles; within a column the
    sequence's row blocks one after another, so programs side by side read the same KV); program
    p takes ``[p * total / P, (p + 1) * total / P)``, cut at tile granularity; a cut that would
    leave a piece shorter than ``snap`` tiles moves to the segment's edge."""
    ncol = -(-T // chunk)
    width = -(-T // np.maximum(ncol, 1))
    n = R * ncol  # items (column x row block) per sequence
    seq, local = _numbered(n)
    Rs, ws = R[seq], width[seq]
    c0 = (local // Rs) * ws
    c1 = np.minimum(c0 + ws, T[seq])
    end = np.cumsum(c1 - c0)
    start = end - (c1 - c0)
    cuts, points, length, item = _cut_line(start, end, P, snap)
    t0 = c0[item] + points - start[item]
    return Pieces(seq[item], local[item] % Rs[item], t0, t0 + length, np.searchsorted(cuts, points, side="right"))


def _cut_line(start: np.ndarray, end: np.ndarray, shares: int, snap: int):
    """Cut a line of consecutive items (item i: ``[start[i], end[i])``, ``end[-1]`` = the total) into
    ``shares`` shares of about equal length; a cut closer than ``snap`` to an item's edge moves to
    that edge. Returns the ``shares - 1`` cuts, the spans' starts (every span lies in one item and
    one share: it starts at an item start or a cut), their lengths and their items."""
    total = int(end[-1])
    bnd = np.arange(1, shares, dtype=np.int64) * total // shares  # share i ends at bnd[i]
    k = np.searchsorted(end, bnd, side="right")  # the item holding bnd: start[k] <= bnd < end[k]
    s, e = start[k], end[k]
    cuts = np.where(bnd - s < snap, s, np.where(e - bnd < snap, e, bnd))
    points = np.union1d(start, cuts)
    points = points[points < total]
    return cuts, points, np.diff(points, append=total), np.searchsorted(end, points, side="right")


# ----------------------------------------------------------------------------------------------
# The workspace


class FlashTables(NamedTuple):
    """What a flash launch reads besides the caller's tensors (views into a plan's buffers).

    ``segments`` and ``groups`` are int32 tables with one field per row; every row starts 16-byte
    aligned (Triton specialises pointers on alignment).
    """

    config: FlashConfig
    prog_first_seg: torch.Tensor  # [P + 1] int32: program p runs segments [first[p], first[p+1]); P = the grid
    segments: torch.Tensor  # [5, S] int32: seq, row0, kv_start, kv_end, partial slot (-1: writes out/lse)
    groups: torch.Tensor  # [4, G] int32: seq, row0, first partial slot, split count
    group_count: torch.Tensor  # [1] int32: groups in use (the merge's grid is fixed)
    grid_barrier: torch.Tensor  # [1] int32: the word of a kernel's grid barrier before its own combine
    partial_out: torch.Tensor  # [4 * P, BLOCK_M, 512] float32
    partial_lse: torch.Tensor  # [4 * P, BLOCK_M] float32 (log2 units)
    num_groups: int | None  # groups in use, when the host knows it (None: launch the combine anyway)
    segment_rows: tuple  # the 5 rows of segments as [S] views (made once: a view costs host time per launch)
    group_rows: tuple  # the 4 rows of groups as [G] views
    # the kernels schedule a one-sequence step themselves from its device lengths and write the groups
    # (VerifyPlan._plan_in_kernel): prog_first_seg and segments are not read
    in_kernel: bool = False

    @property
    def num_programs(self) -> int:
        return self.prog_first_seg.shape[0] - 1


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


_PLANS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # VerifyPlan.serial -> the live plan
_SERIALS = itertools.count()


def plan_of(serial: int) -> VerifyPlan | None:
    """The live :class:`VerifyPlan` of this :attr:`~VerifyPlan.serial` (None: gone)."""
    return _PLANS.get(serial)


class VerifyPlan:
    """The flash kernels' work list in buffers allocated once, for at most ``max_batch`` sequences
    of at most ``max_tree_nodes`` tree nodes each and ``num_heads`` heads (see :meth:`plan`).

    Device buffers (fixed addresses for the object's life): one int32 block holding the lengths
    (``kv_lens [max_batch]``, ``qo_indptr [max_batch + 1]``) and the schedule tables, and the
    partials ``[4 * P, BLOCK_M, 512]`` + ``[4 * P, BLOCK_M]`` float32 (P = programs of the grid:
    a schedule has at most 2P more segments than row blocks, so at most 4P partials), and the word
    of the kernels' grid barrier (:func:`~kdtree_engine.verify.combine.grid_barrier`; a host plan's
    copy writes 0 over it, which any finished barrier leaves as good). Calls that share a plan must
    run one after another on one stream (they share the partials and the barrier).

    ``schedule_cache``: schedules kept by (row blocks, KV tiles) per sequence (host memory only;
    0: compute every plan's schedule). ``costs``: the host schedule's cost model (default: that of
    the kernel ``"auto"`` runs on the device, :func:`default_costs`). ``partials_of``: a plan of the
    same device, config and grid whose partial buffers this one shares instead of allocating its own
    (for plans whose calls run one after another on one stream).
    """

    def __init__(
        self,
        max_batch: int,
        max_tree_nodes: int,
        num_heads: int,
        device: str | torch.device = "cuda",
        *,
        config: FlashConfig | None = None,
        num_programs: int | None = None,
        schedule_cache: int = SCHEDULE_CACHE,
        costs: ScheduleCosts | None = None,
        partials_of: VerifyPlan | None = None,
    ):
        for name, v, hi in (("max_batch", max_batch, 1 << 20), ("max_tree_nodes", max_tree_nodes, MAX_TREE_NODES),
                            ("num_heads", num_heads, MAX_HEADS), ("num_programs", num_programs or 1, 1 << 20)):
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not 1 <= v <= hi:
                raise ValueError(f"{name} must be an int in 1..{hi}, got {v!r}")
        max_batch, max_tree_nodes, num_heads = int(max_batch), int(max_tree_nodes), int(num_heads)
        num_programs = None if num_programs is None else int(num_programs)
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device is {device}, but this torch sees no CUDA GPU")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cfg = config or pick_config(device)
        P = num_programs or resident_programs(cfg, device)
        self.max_batch, self.max_tree_nodes, self.num_heads = max_batch, max_tree_nodes, num_heads
        self.device, self.config = device, cfg
        self.max_row_blocks = max_batch * -(-max_tree_nodes * num_heads // cfg.block_m)
        seg_cap = _pad4(self.max_row_blocks + 2 * P)
        self._part_cap, grp_cap = 4 * P, _pad4(2 * P)
        sizes = {"kv_lens": max_batch, "qo_indptr": max_batch + 1, "prog_first_seg": P + 1, "group_count": 1,
                 "grid_barrier": 1, "segments": 5 * seg_cap, "groups": 4 * grp_cap}
        offsets, n = {}, 0
        for name, size in sizes.items():
            offsets[name] = n
            n += _pad4(size)
        if partials_of is None:
            partial_out = partial_lse = None
        elif (partials_of.device, partials_of.config, partials_of.num_programs) != (device, cfg, P):
            raise ValueError(f"partials_of is a plan for {partials_of.device}, {partials_of.config}, "
                             f"{partials_of.num_programs} programs; this one is for {device}, {cfg}, {P}")
        else:
            partial_out, partial_lse = partials_of.tables.partial_out, partials_of.tables.partial_lse
        # normal tensors even when built under torch.inference_mode(): a plan made there is
        # updated in place by later plans outside it (and the other way round)
        with torch.inference_mode(False):
            pin = device.type == "cuda"
            self._host = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
            self._host_np = self._host.numpy()
            self._dev = self._host if device.type == "cpu" else torch.zeros(n, dtype=torch.int32, device=device)
            self._copied = torch.cuda.Event() if pin else None

            def view(buf, name, shape):
                return buf[offsets[name] : offsets[name] + sizes[name]].reshape(shape)  # a view: contiguous

            if partial_out is None:  # zeroed once: a merge reads whole blocks, rows never written too
                partial_out = torch.zeros(self._part_cap, cfg.block_m, D_V, dtype=torch.float32, device=device)
                partial_lse = torch.zeros(self._part_cap, cfg.block_m, dtype=torch.float32, device=device)
            self._h = {name: view(self._host_np, name, (-1,)) for name in sizes}
            self._h["segments"] = self._h["segments"].reshape(5, seg_cap)
            self._h["groups"] = self._h["groups"].reshape(4, grp_cap)
            self.kv_lens_buf = view(self._dev, "kv_lens", (max_batch,))
            self.qo_indptr_buf = view(self._dev, "qo_indptr", (max_batch + 1,))
            segments = view(self._dev, "segments", (5, seg_cap))
            groups = view(self._dev, "groups", (4, grp_cap))
            self._tables = FlashTables(
                config=cfg,
                prog_first_seg=view(self._dev, "prog_first_seg", (P + 1,)),
                segments=segments,
                groups=groups,
                group_count=view(self._dev, "group_count", (1,)),
                grid_barrier=view(self._dev, "grid_barrier", (1,)),
                partial_out=partial_out,
                partial_lse=partial_lse,
                num_groups=0,
                segment_rows=segments.unbind(0),
                group_rows=groups.unbind(0),
            )
        self._scheduler = None  # the device scheduler's launch, made at the first device plan
        self._device_tables = self._tables._replace(num_groups=None)  # a device plan's group count stays there
        self._kernel_tables = self._device_tables._replace(in_kernel=True)  # _plan_in_kernel's
        self._in_kernel: dict[int, bool] = {}  # schedules_in_kernel by T
        self.tables = self._tables  # with the host's group count of the current plan
        self.num_seqs = self.num_rows = self.num_segments = 0
        self.kv_lens_host = self.qo_indptr_host = None
        self.kv_lens = self.kv_lens_buf[:0]  # [B] int32 device view of the planned lengths (fixed address)
        self.qo_indptr = self.qo_indptr_buf[:1]  # [B + 1] int32 device view of the planned row offsets
        self.max_kv_len = self.max_nodes = 0
        # a new object whenever a check of a call against the plan may answer differently (a host
        # plan: every plan; a device plan: another B): callers keep the state they checked against
        self.state = object()
        self.prepared: dict = {}  # the callers' launches prepared on these buffers, by their keys (see keep)
        self._device_launches: dict = {}  # (the scheduler's launch, B) by the lengths' signature
        self._schedules: dict[bytes, tuple] = {}  # (row blocks, tiles) -> tables, least recently used first
        self._cache_size = schedule_cache
        self.costs = costs or default_costs(device)
        self._staged = None  # the key whose tables the staging buffer holds
        # names this plan for the torch op, which reads its host lengths when it runs (a traced
        # caller reading them would guard on them: a recompile per plan)
        self.serial = next(_SERIALS)
        _PLANS[self.serial] = self

    @property
    def num_programs(self) -> int:
        return self._tables.num_programs

    def check_fits(self, num_rows: int, mask_words: int, page_capacity: int) -> None:
        """A call's rows T, mask words per row and page-table capacity (pages x page size) against
        this plan, where it knows them (host lengths): ``ValueError`` when the kernels would read
        past the mask or the page table, or the rows are not the plan's."""
        if self.num_rows is not None and num_rows != self.num_rows:
            raise ValueError(f"q has {num_rows} rows; the plan holds {self.num_rows}")
        if self.max_nodes is not None and 32 * mask_words < self.max_nodes:
            raise ValueError(f"tree_mask has {mask_words} words per row, too narrow for a tree of {self.max_nodes} nodes")
        if self.max_kv_len is not None and page_capacity < self.max_kv_len:
            raise ValueError(f"page_table holds {page_capacity} positions, fewer than the planned kv_len "
                             f"{self.max_kv_len}")

    @property
    def num_groups(self) -> int:
        return self.tables.num_groups

    def plan(self, kv_lens, qo_indptr, *, device_schedule: str = "line") -> VerifyPlan:
        """Schedule a step: ``kv_lens`` ``[B]`` and ``qo_indptr`` ``[B+1]``.

        Both CUDA tensors: :meth:`plan_on_device` (one launch, no sync, no length checks) writing
        ``device_schedule`` (see there).
        Otherwise host data (lists, numpy arrays, CPU tensors; a CUDA tensor beside host data is
        copied, one sync): checks the lengths (``ValueError`` naming the argument, incl.
        B > max_batch or a tree > max_tree_nodes), computes the cheapest schedule on the host and
        writes lengths and schedule into the fixed buffers with one non-blocking copy on the
        current stream (kernels queued before it finish reading the old plan first). Allocates
        nothing on the device either way. Returns self.
        """
        if device_schedule not in DEVICE_SCHEDULES:
            raise ValueError(f"device_schedule must be one of {DEVICE_SCHEDULES}, got {device_schedule!r}")
        if (isinstance(kv_lens, torch.Tensor) and isinstance(qo_indptr, torch.Tensor) and kv_lens.is_cuda
                and qo_indptr.is_cuda):
            return self.plan_on_device(kv_lens, qo_indptr, schedule=device_schedule)
        kv, qo = check_lengths(kv_lens, qo_indptr)
        B = kv.shape[0]
        if B > self.max_batch:
            raise ValueError(f"kv_lens has {B} sequences; this plan holds at most max_batch={self.max_batch}")
        n = qo[1:] - qo[:-1]
        n_max = int(n.max())
        if n_max > self.max_tree_nodes:
            raise ValueError(f"qo_indptr gives a tree of {n_max} nodes; "
                             f"this plan holds at most max_tree_nodes={self.max_tree_nodes}")
        R, T = self.blocks_and_tiles(kv, n)
        key = R.tobytes() + T.tobytes()
        tables = self._schedules.pop(key, None)
        if tables is None:
            tables = self._schedule_tables(R, T)
            if self._schedules and len(self._schedules) >= self._cache_size:
                del self._schedules[next(iter(self._schedules))]  # the least recently used
        if self._cache_size:
            self._schedules[key] = tables
        first, seg, seg_tile_end, grp, flash_tables = tables
        S, num_groups = seg.shape[1], grp.shape[1]
        if self._copied is not None:
            self._copied.synchronize()  # the previous plan's copy has left the staging buffer
        h = self._h
        h["kv_lens"][:B] = kv
        h["qo_indptr"][: B + 1] = qo
        if key != self._staged:  # the tables of the same tile counts are in the staging buffer already
            h["prog_first_seg"][:] = first
            h["group_count"][0] = num_groups
            h["segments"][:, :S] = seg
            h["groups"][:, :num_groups] = grp
            self._staged = key
        h["segments"][3, :S] = np.minimum(seg_tile_end, kv[seg[0]])  # a sequence's last tile ends at its length
        if self._copied is not None:
            self._dev.copy_(self._host, non_blocking=True)
            self._copied.record()
        if B != self.num_seqs:
            self.kv_lens = self.kv_lens_buf[:B]
            self.qo_indptr = self.qo_indptr_buf[: B + 1]
        self.num_seqs, self.num_rows, self.num_segments = B, int(qo[-1]), S
        self.kv_lens_host, self.qo_indptr_host = kv, qo
        self.max_kv_len, self.max_nodes = int(kv.max()), n_max
        self.tables = flash_tables
        self.state = object()
        return self

    def plan_on_device(self, kv_lens: torch.Tensor, qo_indptr: torch.Tensor, *, signature=None,
                       ptrs: tuple[int, int] | None = None, schedule: str = "line") -> VerifyPlan:
        """Schedule a step from device lengths: ``kv_lens`` ``[B]`` and ``qo_indptr`` ``[B+1]``
        int32 on the plan's device (any strides), one launch of the scheduler kernel
        (:mod:`.scheduler`) on the current stream, no sync, nothing allocated: capturable in a CUDA
        graph with the kernels that read the plan.

        ``schedule``: ``"line"`` (any lengths); ``"parts"``: the KV parts schedule when every tree
        has the same row blocks L and the programs with work are at least 2L (where the host
        offers it), else the line schedule; ``"rounds"``: where a sequence has more row blocks than
        half the programs (:func:`rounds_apply`), every row block against its whole sequence, dealt
        round by round (:func:`_rounds_schedule`), else the line. The device cannot price them
        (:meth:`device_schedule_for` does, from host lengths of the same shape, e.g. when a step
        graph is captured). ``"auto"`` (what an unplanned call takes): the host's own schedule where
        the host takes it without pricing (whole segments, at most one per program: small steps),
        else parts where it also keeps nine tenths of the programs busy, a rule checked against the
        cost model (:data:`~kdtree_engine.verify.scheduler.AUTO_MIN_FILL_TENTHS`); where the plan's
        cost model says lockstep schedules pay (``costs.lockstep``: the Hopper kernel's), else the
        parts with their tail on a step long enough
        (:data:`~kdtree_engine.verify.scheduler.AUTO_TAIL_MIN_TILES`), else rounds where they
        apply; else the line.

        Only shapes, dtypes and the device are checked (``TypeError`` / ``ValueError`` naming the
        argument); the lengths stay on the device, so the host knows B but not T, the tree sizes
        or the KV lengths (:attr:`num_rows`, :attr:`max_nodes`, :attr:`max_kv_len` are None, and
        the merge of the splits always runs). Malformed lengths are clamped, never written past the
        tables, and give wrong results: check them with
        :func:`~kdtree_engine.verify.contract.check_lengths` (one sync) where that matters.

        ``signature``: a hashable object that stands for the lengths' dtypes, devices, shapes,
        strides and 16-byte alignment (e.g. the caller's
        :class:`~kdtree_engine.verify.contract.Signature` of the call's inputs), saving their
        reading; they are checked when first seen either way. ``ptrs``: with ``signature``, the
        lengths' data pointers when the caller has read them. Returns self.
        """
        self.launch_on_device(kv_lens, qo_indptr, signature, ptrs, schedule)
        return self

    def launch_on_device(self, kv_lens, qo_indptr, signature, ptrs, schedule: str = "line") -> tuple[int, int] | None:
        """:meth:`plan_on_device`, returning where the scheduler launched, ``(device, stream)``, for
        the launches that read the plan right after it (None: they read it themselves; see
        :class:`~kdtree_engine.verify.launch.Launch`)."""
        if schedule not in DEVICE_SCHEDULES:
            raise ValueError(f"schedule must be one of {DEVICE_SCHEDULES}, got {schedule!r}")
        try:
            if ptrs is None:
                ptrs = (kv_lens.data_ptr(), qo_indptr.data_ptr())
            key = (signature or (kv_lens.dtype, kv_lens.device, kv_lens.shape, kv_lens.stride(), qo_indptr.dtype,
                                 qo_indptr.device, qo_indptr.shape, qo_indptr.stride(), ptrs[0] & 15, ptrs[1] & 15),
                   schedule)
            kept = self._device_launches.get(key)
        except (AttributeError, TypeError):  # not tensors: named below
            key = kept = None
        if kept is None:
            kept = self._device_launch(key, kv_lens, qo_indptr, schedule)
        launch, B = kept
        site = launch((kv_lens, qo_indptr), ptrs)
        self._planned_on_device(B, self._device_tables)
        return site

    def _plan_in_kernel(self) -> VerifyPlan:
        """Leave a one-sequence step's schedule to the kernels (no launch, no sync, nothing written
        here): each program computes its segments from the call's own device lengths at entry (B = 1:
        :func:`~kdtree_engine.verify.scheduler.one_sequence_shape`, the KV cut into ``min(P // R,
        tiles)`` parts, each read by the R row blocks side by side) and the split groups are written
        there for the merge. What ``verify_attention`` without a plan does at B = 1 where
        :meth:`schedules_in_kernel`: one launch instead of the scheduler's and the kernel's.
        Internal: the plan's length buffers are not written, so only a caller that passes the
        kernels its own lengths may run on such a plan (not :class:`VerifyAttention.run
        <kdtree_engine.verify.api.VerifyAttention>`, which passes the plan's). Returns self."""
        self._planned_on_device(1, self._kernel_tables)
        return self

    def schedules_in_kernel(self, num_rows: int) -> bool:
        """Whether a one-sequence step of ``num_rows`` tree nodes (T) is best left to the kernels
        (:meth:`_plan_in_kernel`) on this plan's grid and heads
        (:func:`~kdtree_engine.verify.scheduler.parts_fill`; kept by T)."""
        hit = self._in_kernel.get(num_rows)
        if hit is None:
            from .scheduler import parts_fill  # (loads Triton)

            R = -(-min(num_rows, MAX_TREE_NODES) * self.num_heads // self.config.block_m)
            hit = self.keep(self._in_kernel, num_rows, parts_fill(R, self.num_programs))
        return hit

    def _planned_on_device(self, B: int, tables: FlashTables) -> None:
        """The host's view of a plan whose lengths stay on the device: B sequences, ``tables``."""
        if B != self.num_seqs or self.tables is not tables:  # another B, or another kind of plan before
            self.kv_lens = self.kv_lens_buf[:B]
            self.qo_indptr = self.qo_indptr_buf[: B + 1]
            self.num_seqs, self.num_rows, self.num_segments = B, None, None
            self.kv_lens_host = self.qo_indptr_host = None
            self.max_kv_len = self.max_nodes = None
            self.tables = tables
            self.state = object()
        self._staged = None  # on the CPU the device buffer is the staging buffer

    def _device_launch(self, key, kv_lens, qo_indptr, schedule: str) -> tuple:
        """``(launch, B)``: the scheduler's launch for device lengths of this signature and their
        sequence count (kept by ``key``), after checking their shapes, dtypes and device
        (``TypeError`` / ``ValueError`` naming the argument)."""
        for name, t in (("kv_lens", kv_lens), ("qo_indptr", qo_indptr)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32 or t.dim() != 1:
                raise TypeError(f"{name} must be a 1-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}; this plan is on {self.device}")
        B = kv_lens.shape[0]
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"kv_lens has {B} sequences; this plan holds 1..max_batch={self.max_batch}")
        if qo_indptr.shape[0] != B + 1:
            raise ValueError(f"qo_indptr must have B+1={B + 1} entries, got {qo_indptr.shape[0]}")
        if self._scheduler is None:
            from .scheduler import DeviceScheduler

            self._scheduler = DeviceScheduler(self.kv_lens_buf, self.qo_indptr_buf, self._tables,
                                              num_heads=self.num_heads, max_batch=self.max_batch,
                                              max_tree_nodes=self.max_tree_nodes, min_split=MIN_SPLIT_TILES,
                                              segment_tiles=self.costs.segment_tiles,
                                              lockstep=self.costs.lockstep)
        return self.keep(self._device_launches, key, (self._scheduler.prepare(kv_lens, qo_indptr, schedule), B))

    def blocks_and_tiles(self, kv_lens: np.ndarray, tree_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row blocks R and KV tiles T per sequence (int64 ``[B]`` each) of these lengths (``[B]``
        each) on this plan's tiles and heads."""
        bm, bn = self.config.block_m, self.config.block_n
        return (-(-np.asarray(tree_sizes, dtype=np.int64) * self.num_heads // bm),
                -(-np.asarray(kv_lens, dtype=np.int64) // bn))

    def device_schedule_for(self, kv_lens, qo_indptr) -> str:
        """The device scheduler's schedule for these host lengths: what a caller that knows a
        step's shape ahead (an engine capturing a step graph) passes to :meth:`plan_on_device` for
        the device lengths of steps like it. ``"auto"`` where the host takes whole segments
        without pricing them (:func:`whole_segments_apply`: small steps; the device's ``"auto"``
        writes the same tables, and past them its own rules as the lengths grow), else the
        cheapest of ``"line"``, ``"parts"`` and ``"rounds"`` where they apply by the plan's cost
        model (:func:`schedule_cost` under :attr:`costs`; a line that cuts row blocks at
        :data:`LINE_OVER_LOCKSTEP` times its cost where ``costs.lockstep`` is set, and the parts with
        the tail the device writes at the tail's margin, as on the host: :func:`candidate_cost`)."""
        kv, qo = check_lengths(kv_lens, qo_indptr)
        R, T = self.blocks_and_tiles(kv, np.minimum(qo[1:] - qo[:-1], self.max_tree_nodes))
        if whole_segments_apply(R, T, self.num_programs):
            return "auto"
        if rounds_apply(R, T, self.num_programs):
            kinds = ("line", "rounds")
        elif int(R.min()) == int(R.max()) and 2 * int(R.max()) <= programs_with_work(R, T, self.num_programs):
            kinds = ("line", "parts")
        else:
            return "line"
        costs = [_device_parts_candidate(R, T, self.num_programs, self.costs).cost if k == "parts"
                 else candidate_cost(k, schedule(R, T, self.num_programs, only=k), T, self.costs) for k in kinds]
        return kinds[costs.index(min(costs))]

    @staticmethod
    def keep(table: dict, key, value):
        """``table[key] = value`` (nothing for a None key), the table starting over past
        :data:`PREPARED_CACHE` entries; returns value."""
        if key is not None:
            if len(table) >= PREPARED_CACHE:
                table.clear()
            table[key] = value
        return value

    def _schedule_tables(self, R: np.ndarray, T: np.ndarray):
        """The tables of the schedule of one (row blocks, KV tiles) per sequence: see :meth:`_tables_of`."""
        return self._tables_of(schedule(R, T, self.num_programs, costs=self.costs), R)

    def _tables_of(self, pieces: Pieces, R: np.ndarray):
        """The tables of a schedule of row blocks ``R`` per sequence: ``prog_first_seg [P + 1]``,
        segments ``[5, S]`` int32 (kv_end at the tile boundary), the tile ends ``[S]``, groups
        ``[4, G]`` int32, and the :class:`FlashTables` that carry G to the launcher."""
        bm, bn, P = self.config.block_m, self.config.block_n, self.num_programs
        seq, row, t0, t1, prog = pieces
        # partial slots: the pieces of a split row block get consecutive slots
        key = (np.cumsum(R) - R)[seq] + row
        split = np.bincount(key, minlength=int(R.sum()))[key] > 1
        slot = np.full(len(seq), -1, dtype=np.int64)
        idx = np.flatnonzero(split)
        idx = idx[np.argsort(key[idx], kind="stable")]
        slot[idx] = np.arange(len(idx))
        first = np.flatnonzero(np.diff(key[idx], prepend=-1))
        if len(seq) > self._h["segments"].shape[1] or len(idx) > self._part_cap or len(first) > self._h["groups"].shape[1]:
            raise RuntimeError(f"schedule exceeds its proven bounds ({len(seq)} segments, {len(idx)} partials, "
                               f"{len(first)} groups for P={P}, {int(R.sum())} row blocks)")
        segments = np.stack([seq, row * bm, t0 * bn, t1 * bn, slot]).astype(np.int32)
        g = idx[first]
        groups = np.stack([seq[g], row[g] * bm, first, np.diff(first, append=len(idx))]).astype(np.int32)
        first_seg = np.searchsorted(prog, np.arange(P + 1)).astype(np.int32)
        return first_seg, segments, t1 * bn, groups, self._tables._replace(num_groups=len(first))


def plan_verify(
    kv_lens,
    qo_indptr,
    num_heads: int,
    device: str | torch.device = "cuda",
    *,
    config: FlashConfig | None = None,
    num_programs: int | None = None,
) -> VerifyPlan:
    """A :class:`VerifyPlan` sized for exactly these lengths, planned once (host lengths: no sync).

    Args:
        kv_lens: ``[B]`` KV length per sequence (list / numpy / CPU tensor; a CUDA tensor is
            copied, which syncs).
        qo_indptr: ``[B+1]`` q row offsets (host).
        num_heads: H.
        device: where the kernel runs.
        config: kernel tile config (default: the best that fits the device).
        num_programs: the grid (tuning / tests); default: the programs the device runs at once.
            Small work is spread too: at prefix 1k-4k, 12-48 programs of 4+ tiles took 39-42 us
            where one tile per program took 29-33 us (H200, docs/perf_log.md run 11).
    """
    kv, qo = check_lengths(kv_lens, qo_indptr)
    max_nodes = int((qo[1:] - qo[:-1]).max())
    return VerifyPlan(kv.shape[0], max_nodes, num_heads, device, config=config,
                      num_programs=num_programs).plan(kv, qo)
