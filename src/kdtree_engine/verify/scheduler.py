"""The device scheduler: a plan's tables computed on the GPU from device lengths, with no sync.

One launch reads ``kv_lens [B]`` and ``qo_indptr [B+1]`` where they are (any strides), copies them
into the plan's length buffers and writes the line schedule of :mod:`.plan`
(:func:`~kdtree_engine.verify.plan._line_schedule`, the same pieces, program boundaries and
snapping) as the tables the kernels read: ``prog_first_seg``, the segments with their partial
slots, the split groups and their count, exactly as the host writes them for that schedule
(:meth:`~kdtree_engine.verify.plan.VerifyPlan.plan`). The host picks the cheapest of several
schedules; the device takes the line schedule, whose table sizes stay within the plan's
capacities for any lengths (at most ``row blocks + 2P`` segments, ``4P`` partials, ``2P`` groups),
or, in its ``PARTS`` variant, the KV parts schedule
(:func:`~kdtree_engine.verify.plan._parts_schedule`, :func:`_parts_pieces`) when every sequence has
the same row blocks L and ``2 L`` at most the programs with work (the case where the host offers
it; at most ``row blocks + P`` segments, ``2P`` partials, ``P`` groups) and the KV tiles in all
fewer than :data:`PARTS_MAX_TILES`, else the line schedule; where L does not divide the programs
with work, with the programs the parts leave idle on the KV's last tiles
(:func:`~kdtree_engine.verify.plan._parts_tail_schedule`, :func:`_parts_tail_pieces`: the host's
``device_parts``; at most ``row blocks + P + S - 1`` segments, ``4P`` partials, ``P + S - 1``
groups, S the idle programs).
The device cannot price them: the caller picks (``VerifyPlan.device_schedule_for``), or asks for
``"auto"``: whole segments (:func:`~kdtree_engine.verify.plan._whole_segments`) where the host takes
them without pricing: where KV columns of one program's share (``chunk`` tiles) make at most as many
segments (column x row block) as programs, each program runs one, as in the host's plan (at most
``P`` segments, partials and groups; :func:`_segment_pieces`); else parts alone where they keep nine
tenths of the programs busy (:data:`AUTO_MIN_FILL_TENTHS`), or with their tail where they keep
fewer on a long enough step (:data:`AUTO_TAIL_MIN_TILES`; under a lockstep cost model, as the
rounds); else, as for ``"rounds"``, the rounds
schedule (:func:`~kdtree_engine.verify.plan._rounds_schedule`, :func:`_rounds_pieces`: every row
block against its whole sequence, segment i on program ``i mod pe``; as many segments as row
blocks, nothing split) where a sequence has more row blocks than half the programs with work, which
the parts schedule cannot take and where the line re-reads each sequence's KV per program
(:data:`ROUNDS_MAX_SLACK_TENTHS`); else the line.

:func:`_schedule_kernel` runs ``ceil(segment capacity / BLOCK_S)`` programs of ``BLOCK_S`` pieces
(32 by default: one per lane). Each computes the whole schedule's shape in registers, redundantly
(B sequences and ``P + 2`` boundaries: cheaper than a second launch and a round trip through
memory):

- :func:`_sequences`: the sequences' row blocks, KV tiles, line ranges and columns; a program whose
  pieces are past the items and the ``P - 1`` possible inner cuts stops there;
- :func:`_boundaries`: the ``P - 1`` program boundaries on the line (the sequence of each from the
  number of boundaries before each sequence's end, a closed form), each program's first item and
  first piece (the items before it and the inner cuts up to it: no search), the inner cuts (a
  boundary strictly inside an item: that row block is split) and the split pieces and row blocks
  before each sequence;
- then its pieces, each finding its program, item, sequence and partial slot by comparisons
  against the boundaries and sequences and gathers from them.

Program 0 also writes the lengths, ``prog_first_seg`` and the group count.

This rests on a property of the line schedule: an item (a row block against one KV column) is at
most ``chunk = ceil(total / P)`` tiles long (P: the programs with work) and the boundaries
``k * total // P`` are at least ``floor(total / P) >= chunk - 1`` apart, so at most one boundary
lies strictly inside an item, and the cuts (boundaries after snapping) never decrease. A row
block's pieces are its columns plus its items' inner cuts; one of a one-column sequence is split
iff its item holds an inner cut, into two pieces.

Nothing here checks the lengths (that needs them on the host): a tree is clamped to
``1..max_tree_nodes`` nodes and a KV length to at least one tile, so a malformed step cannot
write past the tables; its results are then wrong (check with ``validate=True``).

A one-sequence step needs no tables at all: its KV parts schedule is arithmetic (the end of this
module). The kernels compute it themselves at entry from the device lengths (``IN_KERNEL``,
:func:`work_range` / :func:`work_segment`, the split groups written for the merge by
:func:`one_sequence_groups`) where :func:`parts_fill` says its parts fill the grid: an
unplanned B = 1 call is then one launch, and a captured one reschedules on every replay.

The layer below :mod:`.plan`: imports Triton, :mod:`.launch` and :mod:`kdtree_engine.masks` only;
loaded when a plan is first made from device lengths (or asked :meth:`VerifyPlan.schedules_in_kernel
<kdtree_engine.verify.plan.VerifyPlan.schedules_in_kernel>`), and by the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..masks import MAX_TREE_NODES
from .launch import Launch, Launcher, spec_key

__all__ = ["DeviceScheduler"]

# pieces per program (8 warps: one piece per lane; no spills on sm_90a up to P = 300, where 64 spill)
BLOCK_S = 32
NUM_WARPS = 8
# schedule "auto": the KV parts schedule only where its G = pe // L parts of L programs keep at least
# this many tenths of the pe programs busy. Against the line schedule under the plan's cost model
# (2,500 random equal-tree batches, B 1-64, H 8-128, trees 1-129 nodes, KV to 200k, 132 and 264
# programs; 2,062 with 2 L <= pe), as of run 31's model (L2 streams as windows, the Hopper kernel's
# HBM term at 72 tiles per tile time): Hopper costs, parts taken in 1,656, cheaper by 3.0x median
# (3.6x at the 90th percentile), dearer in 1 by 1.04x; Triton costs, 1.00x median, dearer in 746 by
# at most 1.11x. Without the rule parts is dearer by up to 1.22x (Hopper) and 1.46x (Triton): L near
# P / 2 leaves programs idle.
AUTO_MIN_FILL_TENTHS = 9
# schedule "auto" under costs whose lockstep flag is set (the Hopper kernel's): where the parts fill
# fewer than AUTO_MIN_FILL_TENTHS, the parts with their tail (the programs they leave idle run the
# KV's last tiles: plan.device_parts) when the step holds at least this many tile pairs (row block x
# KV tile) per program (~2 us each on the H100), so that the tail's cost in the scheduler (7-15 us
# in run 48; 4-30 us more than the line's scheduler in run 53, growing with the KV tiles) is small
# against the kernel. Under the Hopper cost model (656 random equal-tree steps with 2 L <= pe and
# the parts below nine tenths: H 16-128, trees 1-129 nodes, B 1-16, KV 4k-128k, equal and ragged;
# 132 programs) the line, which "auto" took there, costs 2.04x the host's pick at the median, the
# parts and tail 1.00x; the tail is dearer than the line in 12, all but 4 of them below 300 tile
# times, by at most 1.005x above it. Measured (run 53, H100, planned): the line 1.68-1.77x the
# parts and tail at 148-1,243 tile pairs a program (16 and 32 heads); at 148 (4 x 75 nodes x 16
# heads, 16k) the bound was 256 and the unplanned call took the line, 488 us against 282; run 54
# (unplanned calls, this bound at 16 against 64): 0.84-0.88x the time at six steps of 19-55 tile
# pairs a program (16-128 heads, 24-105 nodes, B 1-2, 4k-8k; 16x75x2x8192: 107.4 us against 127.6),
# equal at 10 (both took the line). Under the Triton kernel's costs the tail is the line's cost at
# the median (dearer in 346 of 656): not taken there.
AUTO_TAIL_MIN_TILES = 16
# schedule "rounds" (and "auto" past whole segments and parts): the rounds schedule where a sequence
# has more than pe / 2 row blocks and the S row blocks in all fill their last round well enough:
# ceil(S / pe) * pe <= this many tenths of S. Under the Hopper cost model (3,753 random steps with
# 2 L > pe: B 2-64, H 64 / 128, trees 34-256 nodes, KV to 200k, equal, +-10% and independent
# lengths), the line schedule (the only one the device had there) costs 1.74x the host's pick at the
# median (1.82x at the 90th percentile); the rule takes rounds in 3,211 and brings the median to
# 1.00 (1.17x at the 90th percentile); where it takes rounds they cost more than the line in 440,
# by at most 1.32x (ragged lengths over few rounds). Under the Triton kernel's costs, where HBM
# rarely binds, the line is within 1.00-1.02x of the host's pick at the median there and rounds are
# 1.02-1.03x (worst 1.57x, on 84 / 132 / 264 programs), so "auto" takes them only for a plan whose
# costs say so (ScheduleCosts.lockstep: the Hopper kernel's). 12 tenths since the H100 runs 51-52
# (docs/perf_log.md) put a line that cuts row blocks at 1.2x its modelled cost
# (plan.LINE_OVER_LOCKSTEP): rounds up to 1.2x the busiest program's ideal load still beat it. With
# the line so priced (5,535 such random steps), 11 tenths left the device 1.88x the host's pick at
# the 99th percentile (132 steps above 1.3x), 12 tenths 1.24x (40); the 142 steps it adds take
# rounds modelled at 0.63x the line at the median, 1.025x at most; at 128 heads x 48 nodes x 6
# sequences (slack 1.15) run 52 timed them at 0.90x the line over 131072 tokens.
ROUNDS_MAX_SLACK_TENTHS = tl.constexpr(12)
# the KV parts schedule runs in int32: taken only where the KV tiles of all sequences number fewer
# (2**31 tiles of 64 tokens: more than any 64 sequences of int32 lengths hold), else the line
PARTS_MAX_TILES = tl.constexpr(2**31)
MAX_NODES = tl.constexpr(MAX_TREE_NODES)  # a one-sequence schedule's tree clamped to this (int32 row counts)


@triton.jit
def _sequences(kv, q0, q1, m_b, H, P, max_nodes, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               MIN_SPLIT: tl.constexpr):
    """Per sequence (``[BLOCK_B]``, neutral past B: no row blocks, tiles or items) its row blocks R,
    KV tiles T, line start and end (work W = R T), column width and count, first item and first row
    block; and the programs with work ``pe``, the line's length ``total``, one program's share ``chunk``
    (tiles) and the snap distance."""
    n = tl.minimum(tl.maximum(q1 - q0, 1), max_nodes).to(tl.int64)
    R = tl.where(m_b, (n * H + BLOCK_M - 1) // BLOCK_M, 0)
    T = tl.where(m_b, tl.maximum((kv.to(tl.int64) + BLOCK_N - 1) // BLOCK_N, 1), 0)
    w_start, w_end, width, ncol, i_start, r_start, pe, total, chunk, snap = _line_shape(R, T, m_b, P, MIN_SPLIT)
    return R, T, w_start, w_end, width, ncol, i_start, r_start, pe, total, chunk, snap


@triton.jit
def _line_shape(R, T, m_b, P, MIN_SPLIT: tl.constexpr):
    """The line schedule's shape for sequences of ``R`` row blocks x ``T`` KV tiles (int64 ``[BLOCK_B]``,
    0 where ``m_b`` is false) on ``P`` programs: per sequence its line start and end (work W = R T),
    column width and count, first item and first row block; the programs with work ``pe``, the
    line's length ``total``, one program's share ``chunk`` (tiles) and the snap distance."""
    W = R * T
    w_end = tl.cumsum(W, 0)
    total = tl.sum(W, 0)
    pe = tl.maximum(tl.minimum(total, P), 1)
    chunk = (total + pe - 1) // pe  # columns of about `chunk` tiles
    ncol = tl.where(m_b, (T + chunk - 1) // chunk, 1)
    width = (T + ncol - 1) // ncol
    items = R * ncol
    i_start = tl.cumsum(items, 0) - items  # items are numbered along the line
    return (w_end - W, w_end, width, ncol, i_start, tl.cumsum(R, 0) - R, pe, total, chunk,
            tl.minimum(chunk // 4, MIN_SPLIT))


@triton.jit
def _boundaries(R, T, w_start, w_end, width, ncol, i_start, r_start, pe, total, snap, BLOCK_P: tl.constexpr):
    """The program boundaries (``[BLOCK_P]``, index k): each program's first piece ``first`` and
    first item, its cut, the row block (-1: none) and column of an inner cut (a cut strictly inside
    an item: that row block is split); per sequence its split row blocks and split pieces and those
    before it."""
    # the boundaries before each sequence's start and end: k with k * total // pe < w (k total < w pe)
    k_lo = ((w_start * pe + total - 1) // total).to(tl.int32)
    k_hi = ((w_end * pe + total - 1) // total).to(tl.int32)
    # boundaries k = 1 .. pe-1 at k * total / pe (in sequence kb: the sequences it is not before the
    # end of), snapped to an item's edge when closer than `snap`; cut[0] = 0, cut[k >= pe] = total.
    # Program p runs [cut[p], cut[p + 1]).
    o_k = tl.arange(0, BLOCK_P)
    valid = (o_k >= 1) & (o_k < pe)
    bnd = tl.where(valid, o_k.to(tl.int64) * total // pe, 0)
    kb = tl.where(valid, tl.sum((k_hi[:, None] <= o_k[None, :]).to(tl.int32), 0), 0)
    kR = tl.gather(R, kb, 0)
    kw = tl.gather(width, kb, 0)
    y = bnd - tl.gather(w_start, kb, 0)
    span = kR * kw
    kc = y // span  # the item holding bnd: column kc, row block kr, [ks, ke) on the line
    ln = tl.minimum(kw, tl.gather(T, kb, 0) - kc * kw)
    yc = y - kc * span
    kr = yc // ln
    ks = bnd - (yc - kr * ln)
    ke = ks + ln
    cut = tl.where(bnd - ks < snap, ks, tl.where(ke - bnd < snap, ke, bnd))
    cut = tl.where(o_k == 0, 0, tl.where(valid, cut, total))
    inner = valid & (ks < cut) & (cut < ke)
    key = tl.where(inner, tl.gather(r_start, kb, 0) + kr, -1).to(tl.int32)
    # program k's first item: the one holding cut[k] (past the last cut: the items in all); its first
    # piece: the items before that one and the inner cuts up to k (program k - 1 ends with a piece of
    # the item holding cut[k] iff cut[k] is inner)
    items = R * ncol
    ord_lo = tl.where(valid, tl.gather(i_start, kb, 0) + kc * kR + kr + (cut == ke).to(tl.int64),
                      tl.where(o_k == 0, 0, tl.sum(items, 0))).to(tl.int32)
    inner = inner.to(tl.int32)
    n_inner = tl.cumsum(inner, 0)
    # per sequence, its split row blocks and their pieces: every row block of a sequence of several
    # columns (with its columns and inner cuts), one per inner cut (two pieces) in a one-column one
    before = n_inner - inner  # inner cuts before boundary k
    n_in = tl.gather(before, k_hi, 0) - tl.gather(before, k_lo, 0)
    multi = ncol > 1
    sp_rows = tl.where(multi, R, n_in)
    sp_pieces = tl.where(multi, items + n_in, 2 * n_in)
    return (ord_lo + n_inner, ord_lo, cut, key, kc.to(tl.int32), sp_rows, tl.cumsum(sp_rows, 0) - sp_rows,
            tl.cumsum(sp_pieces, 0) - sp_pieces)


@triton.jit
def _line_pieces(i0, kv, R, T, w_start, w_end, width, ncol, i_start, r_start, pe, total, snap, prog_first_seg,
                 group_count, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0,
                 grp_first, grp_count, P, seg_cap, grp_cap,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
    """Pieces ``[i0, i0 + BLOCK_S)`` of the line schedule (program 0: also the program boundaries and
    the group count)."""
    if i0 < tl.sum(R * ncol, 0) + pe - 1:  # past that (the items and the inner cuts): no piece here
        first, ord_lo, cut, key, kcol, sp_rows, spr, spp = _boundaries(
            R, T, w_start, w_end, width, ncol, i_start, r_start, pe, total, snap, BLOCK_P)
        o_k = tl.arange(0, BLOCK_P)
        if i0 == 0:
            tl.store(prog_first_seg + o_k, first, mask=o_k <= P)
            tl.store(group_count, tl.sum(sp_rows, 0).to(tl.int32))
        S = tl.max(first, 0)  # first[k >= pe]: the pieces in all
        if i0 < S:
            i = i0 + tl.arange(0, BLOCK_S)
            m_i = (i < S) & (i < seg_cap)
            b, r, t0, t1, n_pieces, idx, below, base, g = _line_lanes(
                i, m_i, R, T, w_start, width, ncol, i_start, r_start, first, ord_lo, cut, key, kcol, spr, spp,
                BLOCK_P)
            split = n_pieces > 1
            _store_pieces(i, m_i, b, r * BLOCK_M, (t0 * BLOCK_N).to(tl.int32),
                          tl.minimum(t1 * BLOCK_N, tl.gather(kv, b, 0)).to(tl.int32), tl.where(split, base + idx, -1),
                          g, m_i & split & (idx == 0) & (g < grp_cap), base, n_pieces, seg_seq, seg_row0, seg_kv_start,
                          seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count)


@triton.jit
def _line_lanes(i, m_i, R, T, w_start, width, ncol, i_start, r_start, first, ord_lo, cut, key, kcol, spr, spp,
                BLOCK_P: tl.constexpr):
    """Per lane, piece ``i`` of the line schedule whose program boundaries :func:`_boundaries` gave
    (lanes where ``m_i`` is false take item 0): its sequence and row block, KV tiles ``[t0, t1)``,
    the pieces of its row block and its place among them, the inner cuts of the row blocks before
    it in its sequence, its row block's first partial slot (where split) and group."""
    o_k = tl.arange(0, BLOCK_P)
    # piece i is item ord_lo[p] + j of its program p (j = i - first[p]): from the program's
    # cut (j = 0) or the item's start to the item's end or the next cut
    p = tl.sum(((o_k[:, None] >= 1) & (first[:, None] <= i[None, :])).to(tl.int32), 0)
    p = tl.minimum(p, BLOCK_P - 2)  # lanes past the pieces
    j = i - tl.gather(first, p, 0)
    it = tl.where(m_i, tl.gather(ord_lo, p, 0) + j, 0)  # lanes past the pieces take item 0
    b = tl.sum((i_start[:, None] <= it[None, :]).to(tl.int32), 0) - 1
    Rb = tl.gather(R, b, 0).to(tl.int32)
    ncb = tl.gather(ncol, b, 0).to(tl.int32)
    wb = tl.gather(width, b, 0)
    local = it - tl.gather(i_start, b, 0).to(tl.int32)
    c = local // Rb
    r = local % Rb
    ln = tl.minimum(wb, tl.gather(T, b, 0) - c * wb)
    s = tl.gather(w_start, b, 0) + (c * Rb) * wb + r * ln  # line positions: int64
    x = tl.where(j == 0, tl.gather(cut, p, 0), s)
    e = tl.minimum(s + ln, tl.gather(cut, p + 1, 0))
    t0 = c * wb + x - s
    t1 = t0 + e - x
    # the inner cuts of this row block K (n_pieces - ncol of them, one per column at most;
    # those in columns before c and one at x come before this piece) and of the row blocks
    # before it in its sequence (split pieces before it: r ncol + those when it has several
    # columns, else two each, a one-column row block having one at most)
    r_first = tl.gather(r_start, b, 0).to(tl.int32)
    K = r_first + r
    mine = key[:, None] == K[None, :]
    n_pieces = ncb + tl.sum(mine.to(tl.int32), 0)
    idx = c + tl.sum((mine & (kcol[:, None] < c[None, :])).to(tl.int32), 0) + (x > s).to(tl.int32)
    below = tl.sum(((key[:, None] >= r_first[None, :]) & (key[:, None] < K[None, :])).to(tl.int32), 0)
    multi = ncb > 1
    base = tl.gather(spp, b, 0).to(tl.int32) + tl.where(multi, r * ncb, below) + below
    g = tl.gather(spr, b, 0).to(tl.int32) + tl.where(multi, r, below)  # split row blocks before it
    return b, r, t0, t1, n_pieces, idx, below, base, g


@triton.jit
def _store_pieces(i, m_i, b, row0, kv_start, kv_end, slot, g, m_g, g_first, g_count,
                  seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count):
    """Table rows ``i`` (where ``m_i``): the pieces' sequence, first packed row, KV range and partial
    slot (-1: not split); and rows ``g`` of the groups (where ``m_g``, a subset of ``m_i``): the
    split row block's sequence, first row, first partial slot and split count."""
    tl.store(seg_seq + i, b, mask=m_i)
    tl.store(seg_row0 + i, row0, mask=m_i)
    tl.store(seg_kv_start + i, kv_start, mask=m_i)
    tl.store(seg_kv_end + i, kv_end, mask=m_i)
    tl.store(seg_partial + i, slot, mask=m_i)
    tl.store(grp_seq + g, b, mask=m_g)
    tl.store(grp_row0 + g, row0, mask=m_g)
    tl.store(grp_first + g, g_first, mask=m_g)
    tl.store(grp_count + g, g_count, mask=m_g)


@triton.jit
def _count_at_most(sorted_vals, x, N: tl.constexpr):
    """Per element of ``x``: how many of ``sorted_vals`` (non-decreasing ``[N]``, N a power of two)
    are ``<= x``, by binary lifting: ``log2(N) + 1`` gathers of ``x``'s shape, where a comparison
    matrix ``[N, x.numel]`` would cost N registers per element of ``x``."""
    tl.static_assert(N <= 65536)
    c = tl.zeros_like(x).to(tl.int32)  # sorted_vals[:c] <= x, found in steps N/2, N/4, ..., 1
    for j in tl.static_range(1, 17):
        if (N >> j) >= 1:
            c = tl.where(tl.gather(sorted_vals, c + ((N >> j) - 1), 0) <= x, c + (N >> j), c)
    return c + (tl.gather(sorted_vals, c, 0) <= x).to(tl.int32)


@triton.jit
def _inner_cuts_at_most(n_inner, cut, x, N: tl.constexpr):
    """Per element of ``x``: how many inner cuts lie at or below it, given the cuts ``cut``
    (non-decreasing ``[N]``) and ``n_inner`` (``[N]``: the inner cuts among the first k + 1)."""
    n = _count_at_most(cut, x, N)
    return tl.where(n > 0, tl.gather(n_inner, tl.maximum(n - 1, 0), 0), 0)


@triton.jit
def _parts_pieces(i0, kv, T, L, pe, snap, m_b, prog_first_seg, group_count,
                  seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count,
                  P, seg_cap, grp_cap,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """Pieces ``[i0, i0 + BLOCK_S)`` of the KV parts schedule of ``L`` row blocks per sequence
    (:func:`~kdtree_engine.verify.plan._parts_schedule`; program 0: also the program
    boundaries and the group count): :func:`_parts_layout` with ``G = pe // L`` parts."""
    T = T.to(tl.int32)
    L = L.to(tl.int32)
    t_begin, t_end, cut, first, b0, pieces, n_inner, inner_to_begin, m_seq, split_seq, slot_base, grp_base = \
        _parts_layout(T, L, (pe // L).to(tl.int32), snap.to(tl.int32), m_b, BLOCK_B, BLOCK_P)
    if i0 == 0:
        o_k = tl.arange(0, BLOCK_P)
        tl.store(prog_first_seg + o_k, first, mask=o_k <= P)
        tl.store(group_count, L * tl.sum(split_seq.to(tl.int32), 0))
    if i0 < pieces:
        i = i0 + tl.arange(0, BLOCK_S)
        m_i = (i < pieces) & (i < seg_cap)
        b, r, x, y, tb, q, m_p, base = _parts_lanes(i, m_i, t_begin, t_end, cut, first, b0, n_inner, inner_to_begin,
                                                    m_seq, slot_base, L, BLOCK_P)
        split = m_p > 1
        gi = tl.gather(grp_base, b, 0) + r
        _store_pieces(i, m_i, b, r * BLOCK_M, (x - tb) * BLOCK_N,  # < the KV length: int32
                      tl.minimum((y - tb).to(tl.int64) * BLOCK_N, tl.gather(kv, b, 0)).to(tl.int32),
                      tl.where(split, base + q, -1), gi, m_i & split & (q == 0) & (gi < grp_cap), base, m_p, seg_seq,
                      seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count)


@triton.jit
def _parts_tail_pieces(i0, kv, T, L, pe, tail, m_b, prog_first_seg, group_count,
                       seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first,
                       grp_count, P, seg_cap, grp_cap,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_S: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Pieces ``[i0, i0 + BLOCK_S)`` of the KV parts schedule with its tail
    (:func:`~kdtree_engine.verify.plan._parts_tail_schedule`; program 0: also the program boundaries
    and the group count): :func:`_parts_layout` (no snap) on the first ``G L`` programs (``G = pe //
    L``) over the KV but its last ``tail`` tiles (``1 <= tail <`` the tiles in all), then the line
    schedule of those tiles (every row block of the sequences there, sequence ``hb`` on) on the
    other ``S = pe - G L``, as :func:`_line_lanes` numbers them. Its items are one column each (a
    tail program's share, ``L tail / S`` tiles, is longer than any sequence's tail: ``S < L``).

    The partial slots and groups are the host's (by row block, then by program): the sequences
    before ``hb`` as the parts number them; where ``hb`` starts in the head (the straddler) every row
    block of it is split, its head pieces (``m_h`` a row block) before its tail pieces (one, two
    where a tail cut falls inside it: ``r`` plus the tail's inner cuts keyed below ``r`` before
    row block r); the sequences after it as the tail's line numbers them, shifted past the
    straddler's (``L m_h`` plus its row blocks the tail did not cut)."""
    T = T.to(tl.int32)
    L = L.to(tl.int32)
    G = (pe // L).to(tl.int32)
    GL = G * L
    S = (pe - GL).to(tl.int32)
    t_end = tl.cumsum(T, 0)
    t_begin = t_end - T
    K_h = tl.sum(T, 0) - tail.to(tl.int32)  # the head's tiles
    Th = tl.minimum(tl.maximum(K_h - t_begin, 0), T)  # each sequence's tiles in the head
    hb = tl.sum((t_end <= K_h).to(tl.int32), 0)  # the first sequence with tiles in the tail (< B: tail >= 1)
    o_b = tl.arange(0, BLOCK_B)
    th_hb = tl.sum(tl.where(o_b == hb, Th, 0), 0)  # > 0: sequence hb straddles the head and the tail
    straddle = th_hb > 0
    t_begin_h, t_end_h, cut, first, b0, pieces_h, n_inner, inner_to_begin, m_seq, split_seq, slot_base, grp_base = \
        _parts_layout(Th, L, G, 0, m_b, BLOCK_B, BLOCK_P)
    m_h = tl.sum(tl.where(o_b == hb, m_seq, 0), 0)
    head_slots = tl.sum(tl.where(o_b == hb, slot_base, 0), 0)  # the split pieces of the sequences before hb
    head_groups = tl.sum(tl.where(o_b == hb, grp_base, 0), 0)
    # the tail's sequences, hb + j at lane j
    at = tl.minimum(hb + o_b, BLOCK_B - 1)
    m_t = (hb + o_b < BLOCK_B) & (tl.gather(m_b.to(tl.int32), at, 0) > 0)
    Tt = tl.where(m_t, tl.gather(T - Th, at, 0), 0).to(tl.int64)
    Th_t = tl.where(m_t, tl.gather(Th, at, 0), 0).to(tl.int64)
    R_t = tl.where(m_t, L, 0).to(tl.int64)
    w_start, w_end, width, ncol, i_start, r_start, pe_t, total_t, _, snap_t = _line_shape(R_t, Tt, m_t, S, MIN_SPLIT)
    first_t, ord_lo, cut_t, key, kcol, sp_rows, spr, spp = _boundaries(
        R_t, Tt, w_start, w_end, width, ncol, i_start, r_start, pe_t, total_t, snap_t, BLOCK_P)
    pieces_t = tl.max(first_t, 0)
    cut_rows0 = tl.sum(((key >= 0) & (key < L)).to(tl.int32), 0)  # tail cuts inside the first tail sequence
    slot_shift = head_slots + tl.where(straddle, L * m_h + L - cut_rows0, 0)
    grp_shift = head_groups + tl.where(straddle, L - cut_rows0, 0)
    if i0 == 0:
        o_k = tl.arange(0, BLOCK_P)
        tl.store(prog_first_seg + o_k, first, mask=o_k <= GL)  # first[G L] = the head's pieces
        tail_first = pieces_h + tl.gather(first_t, tl.minimum(tl.maximum(o_k - GL, 0), BLOCK_P - 1), 0)
        tl.store(prog_first_seg + o_k, tail_first, mask=(o_k > GL) & (o_k <= P))
        tl.store(group_count, head_groups + tl.where(straddle, L, 0) + tl.sum(sp_rows, 0).to(tl.int32)
                 - tl.where(straddle, cut_rows0, 0))
    n_all = pieces_h + pieces_t
    if i0 < n_all:
        i = i0 + tl.arange(0, BLOCK_S)
        m_i = (i < n_all) & (i < seg_cap)
        is_h = i < pieces_h
        # the head's pieces
        b, r, x, y, tb, q, m_p, base = _parts_lanes(i, m_i & is_h, t_begin_h, t_end_h, cut, first, b0, n_inner,
                                                    inner_to_begin, m_seq, slot_base, L, BLOCK_P)
        # (not `straddle & (b == hb)`: the interpreter cannot mask with a scalar bool and a vector's)
        strad_h = (b == hb) & (b * 0 + th_hb > 0)
        below_r = tl.sum(((key[:, None] >= 0) & (key[:, None] < r[None, :])).to(tl.int32), 0)
        cut_r = tl.sum((key[:, None] == r[None, :]).to(tl.int32), 0)
        base_s = head_slots + r * (m_h + 1) + below_r  # the straddler's row block r's first slot
        slot_h = tl.where(strad_h, base_s + q, tl.where(m_p > 1, base + q, -1))
        g_h = tl.where(strad_h, head_groups + r, tl.gather(grp_base, b, 0) + r)
        first_h = tl.where(strad_h, base_s, base)
        count_h = tl.where(strad_h, m_h + 1 + cut_r, m_p)
        grp_h = (strad_h | (m_p > 1)) & (q == 0)
        # the tail's pieces
        bl, rt, t0, t1, n_pieces, idx, below, base_t, g_t = _line_lanes(
            tl.where(is_h, 0, i - pieces_h), m_i & (i >= pieces_h), R_t, Tt, w_start, width, ncol, i_start, r_start,
            first_t, ord_lo, cut_t, key, kcol, spr, spp, BLOCK_P)
        strad_t = (bl == 0) & (bl * 0 + th_hb > 0)
        slot_t = tl.where(strad_t, head_slots + rt * (m_h + 1) + below + m_h + idx,
                          tl.where(n_pieces > 1, base_t + idx + slot_shift, -1))
        grp_t = ((bl != 0) | (bl * 0 + th_hb == 0)) & (n_pieces > 1) & (idx == 0)
        th = tl.gather(Th_t, bl, 0)
        seq = tl.where(is_h, b, hb + bl)
        k0 = tl.where(is_h, (x - tb).to(tl.int64), th + t0)
        k1 = tl.where(is_h, (y - tb).to(tl.int64), th + t1)
        gi = tl.where(is_h, g_h, g_t + grp_shift)
        _store_pieces(i, m_i, seq, tl.where(is_h, r, rt) * BLOCK_M, (k0 * BLOCK_N).to(tl.int32),
                      tl.minimum(k1 * BLOCK_N, tl.gather(kv, seq, 0)).to(tl.int32), tl.where(is_h, slot_h, slot_t),
                      gi, m_i & ((is_h & grp_h) | ((i >= pieces_h) & grp_t)) & (gi < grp_cap),
                      tl.where(is_h, first_h, base_t + slot_shift), tl.where(is_h, count_h, n_pieces), seg_seq,
                      seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count)


@triton.jit
def _parts_layout(T, L, G, snap, m_b, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """The KV parts schedule of sequences of ``T`` KV tiles (int32 ``[BLOCK_B]``, 0 past B; a
    sequence of 0 tiles has no piece) and ``L`` row blocks each on ``G L`` programs: the KV tiles of
    all sequences end to end are cut into ``G`` parts at ``k * total // G`` (snapped to a sequence's
    edge closer than ``snap``); program ``g L + r`` runs row block r of every sequence against its KV
    in part g, in line order. A sequence crossing ``m`` distinct inner cuts has ``m + 1`` pieces per
    row block (split). Returns the sequences' tile ranges, the cuts ``[BLOCK_P]`` (part g: ``[cut[g],
    cut[g + 1])``), each program's first piece (``first[k >= G L]``: the pieces in all), each part's
    first sequence, the pieces in all, the inner cuts' running count and how many lie below each
    sequence's start, per sequence its pieces a row block, whether it is split, and its row blocks'
    first partial slot and group.

    In int32 (the caller takes this schedule only where the tiles in all fit): the sequences' tile
    ranges, the cuts and the programs' first pieces never decrease (a cut snaps to the nearer edge
    of its sequence, the lower one first), so every "which sequence / program / cut" question is a
    binary search of a sorted vector (:func:`_count_at_most`), none a comparison matrix."""
    t_end = tl.cumsum(T, 0)  # past B: T = 0, so t_end = total there and t_begin too
    t_begin = t_end - T
    total = tl.sum(T, 0)
    o_k = tl.arange(0, BLOCK_P)
    valid = (o_k >= 1) & (o_k < G)
    bnd = tl.where(valid, (o_k.to(tl.int64) * total // G).to(tl.int32), 0)
    # the sequence holding each boundary: those ending at or before it (never one past B: bnd < total)
    kb = tl.minimum(_count_at_most(t_end, bnd, BLOCK_B), BLOCK_B - 1)
    ks = tl.gather(t_begin, kb, 0)
    ke = tl.gather(t_end, kb, 0)
    cut = tl.where(bnd - ks < snap, ks, tl.where(ke - bnd < snap, ke, bnd))
    cut = tl.where(o_k == 0, 0, tl.where(valid, cut, total))  # part g runs [cut[g], cut[g + 1])
    nxt = tl.gather(cut, tl.minimum(o_k + 1, BLOCK_P - 1), 0)
    # per part: its spans (one per sequence it meets: its first, then those starting strictly inside
    # it) and its first sequence
    starts_in = _count_at_most(t_begin, nxt - 1, BLOCK_B) - _count_at_most(t_begin, cut, BLOCK_B)
    n_sp = tl.where((o_k < G) & (nxt > cut), 1 + starts_in, 0)
    b0 = tl.minimum(_count_at_most(t_end, cut, BLOCK_B), BLOCK_B - 1)
    sp_before = tl.cumsum(n_sp, 0) - n_sp
    pieces = L * tl.sum(n_sp, 0)
    # program k = g L + r starts after the pieces of the parts before g and rows before r of part g
    pg = tl.minimum(o_k // L, BLOCK_P - 1)
    first = tl.where(o_k // L < G, L * tl.gather(sp_before, pg, 0) + (o_k % L) * tl.gather(n_sp, pg, 0), pieces)
    # the distinct cuts strictly inside a sequence split it: m of them give m + 1 pieces per row block
    prev = tl.gather(cut, tl.maximum(o_k - 1, 0), 0)
    inner = valid & (cut > prev) & (cut > ks) & (cut < ke)
    n_inner = tl.cumsum(inner.to(tl.int32), 0)  # inner cuts among k <= this one
    inner_to_begin = _inner_cuts_at_most(n_inner, cut, t_begin, BLOCK_P)  # [BLOCK_B]
    m_seq = 1 + _inner_cuts_at_most(n_inner, cut, t_end - 1, BLOCK_P) - inner_to_begin
    split_seq = (m_seq > 1) & m_b
    slots = tl.where(split_seq, L * m_seq, 0)
    slot_base = tl.cumsum(slots, 0) - slots
    grp_base = L * (tl.cumsum(split_seq.to(tl.int32), 0) - split_seq.to(tl.int32))
    return t_begin, t_end, cut, first, b0, pieces, n_inner, inner_to_begin, m_seq, split_seq, slot_base, grp_base


@triton.jit
def _parts_lanes(i, m_i, t_begin, t_end, cut, first, b0, n_inner, inner_to_begin, m_seq, slot_base, L,
                 BLOCK_P: tl.constexpr):
    """Per lane, piece ``i`` of the parts schedule :func:`_parts_layout` gave (lanes where ``m_i`` is
    false take sequence 0): its sequence and row block, its tile range ``[x, y)`` on the line and its
    sequence's start there, its place among its row block's pieces, their count, and the row
    block's first partial slot (where split)."""
    p = tl.minimum(_count_at_most(first, i, BLOCK_P) - 1, BLOCK_P - 2)  # first[0] = 0 <= i
    g = p // L
    r = p % L
    j = i - tl.gather(first, p, 0)
    b = tl.where(m_i, tl.gather(b0, g, 0) + j, 0)  # lanes past the pieces take sequence 0
    tb = tl.gather(t_begin, b, 0)
    te = tl.gather(t_end, b, 0)
    x = tl.maximum(tl.gather(cut, g, 0), tb)
    y = tl.minimum(tl.gather(cut, g + 1, 0), te)
    m_p = tl.gather(m_seq, b, 0)
    # this piece's place among its row block's: the sequence's inner cuts in (tb, x]
    q = _inner_cuts_at_most(n_inner, cut, x, BLOCK_P) - tl.gather(inner_to_begin, b, 0)
    return b, r, x, y, tb, q, m_p, tl.gather(slot_base, b, 0) + r * m_p


@triton.jit
def _segment_pieces(i0, kv, R, T, width, m_b, prog_first_seg, group_count,
                    seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count,
                    P, seg_cap, grp_cap,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """Pieces ``[i0, i0 + BLOCK_S)`` of the whole-segments schedule of KV columns ``width`` tiles wide
    (:func:`~kdtree_engine.verify.plan._whole_segments`; program 0: also the program
    boundaries and the group count), for lengths where its segments number at most the programs:
    segment i (sequence by sequence, in each its columns, in each column its row blocks) is program
    i's only one. A row block of a sequence of several columns is split, one partial per column."""
    ncol = tl.where(m_b, (T + width - 1) // width, 0).to(tl.int32)
    Rb = R.to(tl.int32)
    n = Rb * ncol
    s_end = tl.cumsum(n, 0)  # non-decreasing; past B: the segments in all
    split = ncol > 1
    slots = tl.where(split, n, 0)
    slot_base = tl.cumsum(slots, 0) - slots
    rows = tl.where(split, Rb, 0)
    grp_base = tl.cumsum(rows, 0) - rows
    pieces = tl.sum(n, 0)
    if i0 == 0:
        o_k = tl.arange(0, BLOCK_P)
        tl.store(prog_first_seg + o_k, tl.minimum(o_k, pieces), mask=o_k <= P)
        tl.store(group_count, tl.sum(rows, 0))
    if i0 < pieces:
        i = i0 + tl.arange(0, BLOCK_S)
        m_i = (i < pieces) & (i < seg_cap)
        b = tl.where(m_i, _count_at_most(s_end, i, BLOCK_B), 0)  # lanes past the pieces take sequence 0
        r_b = tl.gather(Rb, b, 0)
        nc = tl.gather(ncol, b, 0)
        local = i - (tl.gather(s_end, b, 0) - r_b * nc)
        c = local // r_b
        r = local % r_b
        t0 = c.to(tl.int64) * width
        t1 = tl.minimum(t0 + width, tl.gather(T, b, 0))
        first = tl.gather(slot_base, b, 0) + r * nc
        g = tl.gather(grp_base, b, 0) + r
        _store_pieces(i, m_i, b, r * BLOCK_M, (t0 * BLOCK_N).to(tl.int32),
                      tl.minimum(t1 * BLOCK_N, tl.gather(kv, b, 0)).to(tl.int32), tl.where(nc > 1, first + c, -1), g,
                      m_i & (nc > 1) & (c == 0) & (g < grp_cap), first, nc, seg_seq, seg_row0, seg_kv_start,
                      seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count)


@triton.jit
def _rounds_pieces(i0, kv, R, pe, prog_first_seg, group_count,
                   seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, P, seg_cap,
                   BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
    """Pieces ``[i0, i0 + BLOCK_S)`` of the rounds schedule (:func:`~kdtree_engine.verify.plan._rounds_schedule`;
    program 0: also the program boundaries and the group count, 0): segment i (the
    sequences' row blocks in order) runs on program ``i mod pe`` against its whole sequence, so the
    first ``S mod pe`` programs run ``S // pe + 1`` segments and the others ``S // pe``; the piece at
    table position j is its program's k-th, segment ``p + k pe``."""
    r_end = tl.cumsum(R, 0)  # non-decreasing; past B: S
    S = tl.sum(R, 0)
    q = S // pe
    rem = S % pe
    if i0 == 0:
        o_k = tl.arange(0, BLOCK_P)
        tl.store(prog_first_seg + o_k, tl.where(o_k <= pe, o_k * q + tl.minimum(o_k, rem), S), mask=o_k <= P)
        tl.store(group_count, 0)
    if i0 < S:
        j = i0 + tl.arange(0, BLOCK_S)
        m_j = (j < S) & (j < seg_cap)
        big = rem * (q + 1)  # positions of the programs that run one segment more
        p = tl.where(j < big, j // (q + 1), rem + (j - big) // tl.maximum(q, 1))
        i = p + (j - (p * q + tl.minimum(p, rem))) * pe
        b = tl.where(m_j, _count_at_most(r_end, i, BLOCK_B), 0)  # lanes past the pieces take sequence 0
        r = i - (tl.gather(r_end, b, 0) - tl.gather(R, b, 0))
        tl.store(seg_seq + j, b, mask=m_j)
        tl.store(seg_row0 + j, (r * BLOCK_M).to(tl.int32), mask=m_j)
        tl.store(seg_kv_start + j, 0, mask=m_j)
        tl.store(seg_kv_end + j, tl.gather(kv, b, 0), mask=m_j)
        tl.store(seg_partial + j, -1, mask=m_j)


@triton.jit
def _parts_fill(L, pe, MIN_FILL_TENTHS: tl.constexpr):
    """Whether the KV parts' ``pe // L`` groups of L programs keep ``MIN_FILL_TENTHS`` tenths of the
    ``pe`` programs busy (:func:`parts_fill`'s condition on the device)."""
    return (pe // L) * L * 10 >= MIN_FILL_TENTHS * pe


# Its integers are not specialised (Triton would key on 1 and divisibility by 16): the batch B changes
# step to step in a decode, and a new class of it must not cost a recompile of this kernel there.
@triton.jit(do_not_specialize=["stride_kl", "stride_qo", "B", "H", "P", "max_nodes", "seg_cap", "grp_cap"])
def _schedule_kernel(
    kv_lens, qo_indptr, stride_kl, stride_qo, B, kv_out, qo_out, prog_first_seg, group_count,
    seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count,
    H, P, max_nodes, seg_cap, grp_cap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, SEGMENTS: tl.constexpr, PARTS: tl.constexpr,
    MIN_FILL_TENTHS: tl.constexpr, ROUNDS: tl.constexpr, PARTS_TAIL: tl.constexpr, SEGMENT_TILES: tl.constexpr,
    TAIL_MIN_TILES: tl.constexpr,
):
    """Pieces ``[pid * BLOCK_S, (pid + 1) * BLOCK_S)`` of the schedule, in program order, each program
    computing the sequences and boundaries first: with ``SEGMENTS``, whole segments one per program
    (:func:`_segment_pieces`) where columns one program's share wide make at most as many segments as
    programs (where the host takes them whatever they cost); else with ``PARTS``, the KV parts schedule (with
    ``PARTS_TAIL``, its tail where L does not divide ``pe``: :func:`_parts_tail_pieces`) when every
    sequence has the same row blocks L, ``2 L <= pe`` (where the host offers it), the tiles in all
    are fewer than :data:`PARTS_MAX_TILES` and the parts keep
    ``MIN_FILL_TENTHS`` tenths of the ``pe`` programs busy (0: no such condition; then the parts
    alone, or, with ``PARTS_TAIL``, with their tail where the step holds ``TAIL_MIN_TILES`` tile
    pairs per program: :data:`AUTO_TAIL_MIN_TILES`), else with
    ``ROUNDS`` the rounds schedule (:func:`_rounds_pieces`) where a sequence has more than ``pe / 2``
    row blocks and their last round is full enough (:data:`ROUNDS_MAX_SLACK_TENTHS`), else the line
    schedule; program 0 also writes the lengths, ``prog_first_seg`` and
    the group count (see the module docstring). On sm_90a both variants take 99-108 registers and
    spill nothing at max_batch 1-64 (``scripts/scheduler_sm90_compile.py``); the parts schedule's
    comparison matrices, before :func:`_count_at_most`, took 255 registers, spilled up to 1.2 KB and
    ran 27-68 us on the H200 against the line's 7-11."""
    o_b = tl.arange(0, BLOCK_B)
    m_b = o_b < B
    kv = tl.load(kv_lens + o_b * stride_kl, mask=m_b, other=0)
    q0 = tl.load(qo_indptr + o_b * stride_qo, mask=m_b, other=0)
    q1 = tl.load(qo_indptr + (o_b + 1) * stride_qo, mask=m_b, other=0)
    R, T, w_start, w_end, width, ncol, i_start, r_start, pe, total, chunk, snap = _sequences(
        kv, q0, q1, m_b, H, P, max_nodes, BLOCK_M, BLOCK_N, MIN_SPLIT)
    i0 = tl.program_id(0) * BLOCK_S
    if i0 == 0:  # program 0 copies the lengths, whatever the schedule
        tl.store(kv_out + o_b, kv, mask=m_b)
        tl.store(qo_out + o_b + 1, q1, mask=m_b)
        tl.store(qo_out + o_b, q0, mask=m_b & (o_b == 0))
    L = tl.max(R, 0)
    if SEGMENTS and (tl.sum(R * ((T + chunk - 1) // chunk), 0) <= pe):
        _segment_pieces(i0, kv, R, T, chunk, m_b, prog_first_seg, group_count, seg_seq, seg_row0, seg_kv_start,
                        seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count, P, seg_cap, grp_cap,
                        BLOCK_M, BLOCK_N, BLOCK_B, BLOCK_P, BLOCK_S)
    elif PARTS and ((tl.min(tl.where(m_b, R, L), 0) == L) & (2 * L <= pe) & (tl.sum(T, 0) < PARTS_MAX_TILES)
                    & (_parts_fill(L, pe, MIN_FILL_TENTHS)
                       | (PARTS_TAIL and tl.sum(T, 0) >= (TAIL_MIN_TILES * pe + L - 1) // L))):
        # the idle programs' tail where L does not divide pe (plan._parts_tail_candidates' first
        # tail): for "parts" wherever there is one, for "auto" only where the parts alone fill too few
        S = pe - pe // L * L
        K = tl.sum(T, 0)
        tail = (K * S - SEGMENT_TILES * L * (pe // L)) // pe
        tail = tl.where(tail >= 1, tail, K * S // pe)
        if MIN_FILL_TENTHS == 0:
            with_tail = (S > 0) & (tail >= 1)
        else:  # (S > 0 where the parts fill too few)
            with_tail = (tail >= 1) & ~_parts_fill(L, pe, MIN_FILL_TENTHS)
        if PARTS_TAIL and with_tail:
            _parts_tail_pieces(i0, kv, T, L, pe, tail, m_b, prog_first_seg, group_count, seg_seq, seg_row0,
                               seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count, P,
                               seg_cap, grp_cap, BLOCK_M, BLOCK_N, BLOCK_B, BLOCK_P, BLOCK_S, MIN_SPLIT)
        else:
            _parts_pieces(i0, kv, T, L, pe, snap, m_b, prog_first_seg, group_count, seg_seq, seg_row0,
                          seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count, P,
                          seg_cap, grp_cap, BLOCK_M, BLOCK_N, BLOCK_B, BLOCK_P, BLOCK_S)
    elif ROUNDS and ((2 * L > pe) & ((tl.sum(R, 0) + pe - 1) // pe * pe * 10
                                      <= ROUNDS_MAX_SLACK_TENTHS * tl.sum(R, 0))):
        _rounds_pieces(i0, kv, R, pe, prog_first_seg, group_count, seg_seq, seg_row0, seg_kv_start, seg_kv_end,
                       seg_partial, P, seg_cap, BLOCK_M, BLOCK_B, BLOCK_P, BLOCK_S)
    else:
        _line_pieces(i0, kv, R, T, w_start, w_end, width, ncol, i_start, r_start, pe, total, snap, prog_first_seg,
                     group_count, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0,
                     grp_first, grp_count, P, seg_cap, grp_cap, BLOCK_M, BLOCK_N, BLOCK_P, BLOCK_S)


_SCHEDULE = Launcher(_schedule_kernel)


class DeviceScheduler:
    """The scheduler launch of one plan: write the line (or KV parts) schedule of device lengths into
    ``kv_out [max_batch]``, ``qo_out [max_batch + 1]`` (int32) and ``tables`` (a
    :class:`~kdtree_engine.verify.plan.FlashTables`), ``block_s`` pieces per program (a power of
    two, at least 32) and ``num_warps`` warps; ``min_split`` and ``segment_tiles``: the plan's
    ``MIN_SPLIT_TILES`` and its cost model's segment cost (which sets the parts' tail). Everything
    but the lengths is fixed at construction (a launch costs only its arguments)."""

    def __init__(self, kv_out, qo_out, tables, *, num_heads: int, max_batch: int, max_tree_nodes: int,
                 min_split: int, segment_tiles: int, block_s: int = BLOCK_S, num_warps: int = NUM_WARPS,
                 lockstep: bool = False):
        cfg, P = tables.config, tables.num_programs
        seg_cap, grp_cap = tables.segment_rows[0].shape[0], tables.group_rows[0].shape[0]
        self._const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MIN_SPLIT=min_split,
                           SEGMENT_TILES=segment_tiles, BLOCK_B=triton.next_power_of_2(max_batch),
                           BLOCK_P=triton.next_power_of_2(P + 2), BLOCK_S=block_s, num_warps=num_warps)
        self._lockstep = lockstep
        self._key = (num_heads, P, max_tree_nodes, seg_cap, grp_cap, lockstep, *self._const.values())
        self._grid = (triton.cdiv(seg_cap, block_s),)
        self._outputs = (kv_out, qo_out, tables.prog_first_seg, tables.group_count, *tables.segment_rows,
                         *tables.group_rows, num_heads, P, max_tree_nodes, seg_cap, grp_cap)

    def prepare(self, kv_lens, qo_indptr, schedule: str = "line") -> Launch:
        """The launch that schedules ``kv_lens`` ``[B]`` / ``qo_indptr`` ``[B+1]`` (int32 on the plan's
        device, any strides, ``B <= max_batch``), and any lengths of their signature (dtype, 16-byte
        alignment, B, strides): ``launch((kv_lens, qo_indptr), data pointers)``, one launch on the
        current stream, no sync. ``schedule``: ``"line"``; ``"parts"``: the KV parts schedule where it
        applies (every tree of the same row blocks L, ``2 L`` at most the programs with work; the
        programs it leaves idle on the KV's last tiles where L does not divide them:
        :func:`~kdtree_engine.verify.plan.device_parts`, which costs the scheduler 7-15 us more on an
        H100), else the line; ``"rounds"``: the rounds schedule where
        it applies (a sequence of more row blocks than half the programs with work, the last round full
        enough: :data:`ROUNDS_MAX_SLACK_TENTHS`), else the line; ``"auto"``: the host's schedule where
        the host takes it whatever it costs (whole segments, one per program), else the parts alone
        where they apply and keep :data:`AUTO_MIN_FILL_TENTHS` of the programs busy; with
        ``lockstep`` at construction (the plan's cost model says lockstep schedules pay), else the
        parts with their tail where they apply and the step holds :data:`AUTO_TAIL_MIN_TILES` tile
        pairs per program, else rounds where they apply; else the line."""
        ints = (kv_lens.stride(0), qo_indptr.stride(0), kv_lens.shape[0])
        return Launch(_SCHEDULE, (spec_key((kv_lens, qo_indptr), ints), self._key, schedule), self._grid, (),
                      (0, 1), (*ints, *self._outputs), self.constexprs(schedule))

    def constexprs(self, schedule: str) -> dict:
        """The kernel's constexprs and ``num_warps`` for ``schedule`` (``"line"``, ``"parts"``,
        ``"rounds"``, ``"auto"``)."""
        auto = schedule == "auto"
        return self._const | {"SEGMENTS": auto, "PARTS": schedule in ("parts", "auto"),
                              "PARTS_TAIL": schedule == "parts" or (auto and self._lockstep),
                              "MIN_FILL_TENTHS": AUTO_MIN_FILL_TENTHS if auto else 0,
                              "TAIL_MIN_TILES": AUTO_TAIL_MIN_TILES,
                              "ROUNDS": schedule == "rounds" or (auto and self._lockstep)}


# ----------------------------------------------------------------------------------------------
# One sequence scheduled by the verify kernels themselves (no scheduler launch)


def parts_fill(row_blocks: int, num_programs: int) -> bool:
    """The device ``"auto"``'s rule for a KV parts schedule of ``row_blocks`` row blocks a sequence
    on ``num_programs`` programs (with work): ``2 R <= P`` (at least two parts) and its ``P // R``
    parts of R programs keep :data:`AUTO_MIN_FILL_TENTHS` of the programs busy (the host's side of
    the condition in :func:`_schedule_kernel`). A one-sequence step where it holds leaves its
    schedule to the kernel (:func:`work_range`, ``IN_KERNEL``; one segment a program); elsewhere the
    scheduler's line or rounds fit better."""
    R, P = row_blocks, num_programs
    return 2 * R <= P and (P // R) * R * 10 >= AUTO_MIN_FILL_TENTHS * P


@triton.jit
def one_sequence_shape(kv_lens, qo_indptr, stride_qo, H, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The schedule of a one-sequence step (B = 1) from its device lengths: ``(kv_len, R, T, S)``,
    its KV length, row blocks R (of its nodes, clamped to ``1..MAX_TREE_NODES``), KV tiles T (at
    least one) and KV parts ``S = max(1, min(P // R, T))``. Segment i is row block ``i % R`` against
    part ``i // R`` (:func:`one_sequence_segment`), run by program ``i mod P``: the R row blocks of a
    part side by side (their KV shared in L2), one segment a program where ``2 R <= P`` (then at
    most ``P`` partials and ``P / 2`` split groups: within any plan's tables); where ``R > P / 2``
    one part, so every row block against the whole KV, dealt round by round, nothing split."""
    kv_len = tl.load(kv_lens)
    q0 = tl.load(qo_indptr)
    n = tl.minimum(tl.maximum(tl.load(qo_indptr + stride_qo) - q0, 1), MAX_NODES)
    R = (n * H + BLOCK_M - 1) // BLOCK_M
    T = tl.maximum(kv_len // BLOCK_N + (kv_len % BLOCK_N > 0).to(tl.int32), 1)
    return kv_len, R, T, tl.maximum(tl.minimum(P // R, T), 1)


@triton.jit
def one_sequence_segment(i, kv_len, R, T, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Segment ``i`` of :func:`one_sequence_shape`'s schedule: ``(row0, kv_start, kv_end, partial
    slot)``, row block ``r = i % R`` against part ``g = i // R``, KV tiles ``[g T // S, (g + 1) T // S)``
    (never empty: ``S <= T``); partial slot ``r S + g`` (a row block's splits consecutive), -1 when
    ``S = 1`` (the segment writes ``out`` / ``lse``)."""
    r = i % R
    g = i // R
    t0 = g.to(tl.int64) * T // S
    t1 = (g + 1).to(tl.int64) * T // S
    return (r * BLOCK_M, (t0 * BLOCK_N).to(tl.int32), tl.minimum(t1 * BLOCK_N, kv_len).to(tl.int32),
            tl.where(S > 1, r * S + g, -1))


@triton.jit
def one_sequence_groups(i_p, R, S, group_seq, group_row0, group_first, group_splits, num_groups,
                        BLOCK_M: tl.constexpr):
    """Program ``i_p``'s share of the split-group table of :func:`one_sequence_shape`'s schedule, for
    the merge (visible to it after the grid barrier, or to the combine kernel launched after):
    group ``i_p`` (row block ``i_p``, slots ``i_p S ..``, S splits) when ``i_p < R`` and ``S > 1``;
    program 0 writes the count. Returns the count, R or 0."""
    n_groups = tl.where(S > 1, R, 0)
    if i_p < n_groups:
        tl.store(group_seq + i_p, 0)
        tl.store(group_row0 + i_p, i_p * BLOCK_M)
        tl.store(group_first + i_p, i_p * S)
        tl.store(group_splits + i_p, S)
    if i_p == 0:
        tl.store(num_groups, n_groups)
    return n_groups


@triton.jit
def work_range(i_p, P, prog_first_seg, kv_lens, qo_indptr, stride_qo, H,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_KERNEL: tl.constexpr):
    """Program ``i_p``'s segments as ``range(first, end, step)`` and the one sequence's schedule
    ``(kv_len, R, T, S)`` for :func:`work_segment`: the plan's ``prog_first_seg[i_p] :
    prog_first_seg[i_p + 1]``, or with ``IN_KERNEL`` those of :func:`one_sequence_shape` (``i_p, i_p
    + P, ..`` below ``S R``; the schedule's values are unused otherwise)."""
    if IN_KERNEL:
        kv_len, R, T, S = one_sequence_shape(kv_lens, qo_indptr, stride_qo, H, P, BLOCK_M, BLOCK_N)
        first, end, step = i_p, S * R, P
    else:
        first, end, step = tl.load(prog_first_seg + i_p), tl.load(prog_first_seg + i_p + 1), 1
        kv_len, R, T, S = first, first, first, first
    return first, end, step, kv_len, R, T, S


@triton.jit
def work_segment(i_s, kv_len, R, T, S, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_KERNEL: tl.constexpr):
    """Segment ``i_s`` of :func:`work_range`: ``(sequence, row0, kv_start, kv_end, partial slot)``
    from the plan's tables, or with ``IN_KERNEL`` from :func:`one_sequence_segment` (sequence 0)."""
    if IN_KERNEL:
        row0, kv_start, kv_end, part = one_sequence_segment(i_s, kv_len, R, T, S, BLOCK_M, BLOCK_N)
        i_b = i_s * 0
    else:
        i_b, row0 = tl.load(seg_seq + i_s), tl.load(seg_row0 + i_s)
        kv_start, kv_end, part = tl.load(seg_kv_start + i_s), tl.load(seg_kv_end + i_s), tl.load(seg_partial + i_s)
    return i_b, row0, kv_start, kv_end, part
