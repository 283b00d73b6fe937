"""The device scheduler: a plan's tables computed on the GPU from device lengths, with no sync.

Two launches read ``kv_lens [B]`` and ``qo_indptr [B+1]`` where they are (any strides), copy them
into the plan's length buffers and write the line schedule of :mod:`.plan`
(:func:`~kdtree_engine.verify.plan._line_schedule`, the same pieces, program boundaries and
snapping) as the tables the kernels read: ``prog_first_seg``, the segments with their partial
slots, the split groups and their count, exactly as the host writes them for that schedule
(:meth:`~kdtree_engine.verify.plan.VerifyPlan.plan`). The host picks the cheapest of several
schedules; the device always takes the line schedule, whose table sizes stay within the plan's
capacities for any lengths (at most ``row blocks + 2P`` segments, ``4P`` partials, ``2P`` groups).

- :func:`_boundaries_kernel` (one program): the sequences' row blocks, KV tiles and columns, the
  ``P - 1`` program boundaries on the line, each program's first piece and first item, the inner
  cuts (a boundary strictly inside an item: that row block is split) and the split pieces and row
  blocks before each sequence, into a scratch buffer; ``prog_first_seg`` and the group count.
- :func:`_pieces_kernel` (``ceil(segment capacity / BLOCK_S)`` programs, each exiting when its
  pieces are past the schedule's): ``BLOCK_S`` pieces each, finding its program, item, sequence
  and partial slot by comparisons in registers against the boundaries and sequences.

Both rest on a property of the line schedule: an item (a row block against one KV column) is at
most ``chunk = ceil(total / P)`` tiles long (P: the programs with work) and the boundaries
``k * total // P`` are at least ``floor(total / P) >= chunk - 1`` apart, so at most one boundary
lies strictly inside an item. A row block's pieces are its columns plus its items' inner cuts; one
of a one-column sequence is split iff its item holds an inner cut, into two pieces.

Nothing here checks the lengths (that needs them on the host): a tree is clamped to
``1..max_tree_nodes`` nodes and a KV length to at least one tile, so a malformed step cannot
write past the tables; its results are then wrong (check with ``validate=True``).

The layer below :mod:`.plan`: imports Triton and :mod:`.launch` only; loaded when a plan is
first made from device lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, Launcher, Launches, spec_key

__all__ = ["DeviceScheduler"]

BLOCK_S = 32  # pieces per program of the piece kernel (8 warps: one piece per lane)


@triton.jit
def _scratch(scratch, MAX_B: tl.constexpr, P):
    """The scratch arrays (int64): per sequence (``MAX_B`` each, neutral past B: no items, no row
    blocks) its first item, row blocks R, KV tiles T, column width and count, line start, first row
    block, the split pieces and split row blocks before it; per program boundary (``P + 2`` each)
    the cut, the program's first piece and first item, the row block of an inner cut (-1: none) and
    the column of the boundary's item."""
    s_istart = scratch
    s_R = s_istart + MAX_B
    s_T = s_R + MAX_B
    s_width = s_T + MAX_B
    s_ncol = s_width + MAX_B
    s_wstart = s_ncol + MAX_B
    s_rstart = s_wstart + MAX_B
    s_spp = s_rstart + MAX_B
    s_spr = s_spp + MAX_B
    s_cut = s_spr + MAX_B
    s_first = s_cut + (P + 2)
    s_ord = s_first + (P + 2)
    s_key = s_ord + (P + 2)
    s_kcol = s_key + (P + 2)
    return s_istart, s_R, s_T, s_width, s_ncol, s_wstart, s_rstart, s_spp, s_spr, s_cut, s_first, s_ord, s_key, s_kcol


@triton.jit
def _locate(x, w_end, s_istart, s_R, s_T, s_width, s_ncol, s_wstart):
    """Per lane, the item holding line position ``x`` (``0 <= x < total``): its sequence b, column c,
    row block r, line range [s, e) and ordinal among all items (``w_end [BLOCK_B]``: each sequence's
    line end, ``total`` past B)."""
    b = tl.sum((w_end[:, None] <= x[None, :]).to(tl.int32), 0)
    y = x - tl.load(s_wstart + b)
    Rb = tl.load(s_R + b)
    wb = tl.load(s_width + b)
    span = Rb * wb
    c = y // span
    ln = tl.minimum(wb, tl.load(s_T + b) - c * wb)
    yc = y - c * span
    r = yc // ln
    s = x - (yc - r * ln)
    return b, c, r, s, s + ln, tl.load(s_istart + b) + c * Rb + r


@triton.jit
def _boundaries_kernel(
    kv_lens, qo_indptr, stride_kl, stride_qo, B, kv_out, qo_out, prog_first_seg, group_count, scratch,
    H, P, max_nodes,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, MAX_B: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """The line schedule's sequences and program boundaries (one program; see the module docstring)."""
    s_istart, s_R, s_T, s_width, s_ncol, s_wstart, s_rstart, s_spp, s_spr, s_cut, s_first, s_ord, s_key, s_kcol = \
        _scratch(scratch, MAX_B, P)

    # per sequence: row blocks R, KV tiles T, work W = R T on the line, columns of about `chunk` tiles
    o_b = tl.arange(0, BLOCK_B)
    m_b = o_b < B
    m_s = o_b < MAX_B
    kv = tl.load(kv_lens + o_b * stride_kl, mask=m_b, other=0)
    q0 = tl.load(qo_indptr + o_b * stride_qo, mask=m_b, other=0)
    q1 = tl.load(qo_indptr + (o_b + 1) * stride_qo, mask=m_b, other=0)
    tl.store(kv_out + o_b, kv, mask=m_b)
    tl.store(qo_out + o_b + 1, q1, mask=m_b)
    tl.store(qo_out + o_b, q0, mask=m_b & (o_b == 0))
    n = tl.minimum(tl.maximum(q1 - q0, 1), max_nodes).to(tl.int64)
    R = tl.where(m_b, (n * H + BLOCK_M - 1) // BLOCK_M, 0)
    T = tl.where(m_b, tl.maximum((kv.to(tl.int64) + BLOCK_N - 1) // BLOCK_N, 1), 0)
    W = R * T
    w_end = tl.cumsum(W, 0)
    total = tl.sum(W, 0)
    pe = tl.maximum(tl.minimum(total, P), 1)  # programs with work
    chunk = (total + pe - 1) // pe
    snap = tl.minimum(chunk // 4, MIN_SPLIT)
    ncol = tl.where(m_b, (T + chunk - 1) // chunk, 1)
    width = (T + ncol - 1) // ncol
    items = R * ncol
    tl.store(s_istart + o_b, tl.cumsum(items, 0) - items, mask=m_s)
    tl.store(s_R + o_b, R, mask=m_s)
    tl.store(s_T + o_b, T, mask=m_s)
    tl.store(s_width + o_b, width, mask=m_s)
    tl.store(s_ncol + o_b, ncol, mask=m_s)
    tl.store(s_wstart + o_b, w_end - W, mask=m_s)
    tl.store(s_rstart + o_b, tl.cumsum(R, 0) - R, mask=m_s)
    tl.debug_barrier()

    # program boundaries k = 1 .. pe-1 at k * total / pe, snapped to an item's edge when closer
    # than `snap`; cut[0] = 0, cut[k >= pe] = total. Program p runs [cut[p], cut[p + 1]).
    o_k = tl.arange(0, BLOCK_P).to(tl.int64)
    m_k = o_k < P + 2
    bnd = o_k * total // pe
    kb, kc, kr, ks, ke, _ = _locate(tl.minimum(bnd, total - 1), w_end, s_istart, s_R, s_T, s_width, s_ncol, s_wstart)
    valid = (o_k >= 1) & (o_k < pe)
    cut = tl.where(bnd - ks < snap, ks, tl.where(ke - bnd < snap, ke, bnd))
    cut = tl.where(o_k == 0, 0, tl.where(valid, cut, total))
    inner = valid & (ks < cut) & (cut < ke)  # a cut inside an item: that row block is split
    tl.store(s_cut + o_k, cut, mask=m_k)
    tl.store(s_key + o_k, tl.where(inner, tl.load(s_rstart + kb) + kr, -1), mask=m_k)
    tl.store(s_kcol + o_k, kc, mask=m_k)
    # per sequence, its split row blocks and their pieces: every row block of a sequence of several
    # columns (with its columns and inner cuts), one per inner cut (two pieces) in a one-column one
    n_inner = tl.sum((inner[None, :] & (kb[None, :] == o_b[:, None])).to(tl.int64), 1)
    multi = ncol > 1
    sp_rows = tl.where(multi, R, n_inner)
    sp_pieces = tl.where(multi, items + n_inner, 2 * n_inner)
    tl.store(s_spr + o_b, tl.cumsum(sp_rows, 0) - sp_rows, mask=m_s)
    tl.store(s_spp + o_b, tl.cumsum(sp_pieces, 0) - sp_pieces, mask=m_s)
    tl.store(group_count, tl.sum(sp_rows, 0).to(tl.int32))
    tl.debug_barrier()

    # per program: its items are those from the one holding its first position to the one holding
    # its last; its first piece follows the pieces of the programs before it
    cut_next = tl.load(s_cut + o_k + 1, mask=o_k < P + 1, other=0)
    busy = (o_k < P) & (cut < cut_next)
    _, _, _, _, _, ord_lo = _locate(tl.where(busy, cut, 0), w_end, s_istart, s_R, s_T, s_width, s_ncol, s_wstart)
    _, _, _, _, _, ord_hi = _locate(tl.where(busy, cut_next - 1, 0), w_end, s_istart, s_R, s_T, s_width, s_ncol,
                                    s_wstart)
    count = tl.where(busy, ord_hi - ord_lo + 1, 0)
    first = tl.cumsum(count, 0) - count  # first[P] = S, the pieces in all
    tl.store(prog_first_seg + o_k, first.to(tl.int32), mask=o_k <= P)
    tl.store(s_first + o_k, first, mask=m_k)
    tl.store(s_ord + o_k, ord_lo, mask=m_k)


@triton.jit
def _pieces_kernel(
    kv_out, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, grp_seq, grp_row0, grp_first, grp_count,
    scratch, P, seg_cap, grp_cap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_B: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Pieces ``[pid * BLOCK_S, (pid + 1) * BLOCK_S)`` of the schedule :func:`_boundaries_kernel` laid
    out in ``scratch``, in program order (see the module docstring)."""
    s_istart, s_R, s_T, s_width, s_ncol, s_wstart, s_rstart, s_spp, s_spr, s_cut, s_first, s_ord, s_key, s_kcol = \
        _scratch(scratch, MAX_B, P)
    # the programs' first pieces, the sequences' first items and the inner cuts, read with the piece
    # count (before the test on it: one load latency less)
    S = tl.load(s_first + P)
    o_k = tl.arange(0, BLOCK_P)
    m_p = o_k < P
    first_next = tl.load(s_first + 1 + o_k, mask=m_p, other=0).to(tl.int32)
    key = tl.load(s_key + o_k, mask=m_p, other=-1).to(tl.int32)
    kcol = tl.load(s_kcol + o_k, mask=m_p, other=0).to(tl.int32)
    o_b = tl.arange(0, BLOCK_B)
    m_b = o_b < MAX_B
    istart = tl.load(s_istart + o_b, mask=m_b, other=0).to(tl.int32)
    i0 = tl.program_id(0) * BLOCK_S
    if i0 < S:
        i = i0 + tl.arange(0, BLOCK_S)
        m_i = (i < S) & (i < seg_cap)
        # piece i is item ord[p] + j of its program p (j = i - first[p]): from the program's cut
        # (j = 0) or the item's start to the item's end or the next cut
        p = tl.sum((m_p[:, None] & (first_next[:, None] <= i[None, :])).to(tl.int32), 0)
        j = i - tl.load(s_first + p).to(tl.int32)
        it = tl.where(m_i, tl.load(s_ord + p).to(tl.int32) + j, 0)  # lanes past the pieces take item 0
        b = tl.sum((m_b[:, None] & (istart[:, None] <= it[None, :])).to(tl.int32), 0) - 1
        Rb = tl.load(s_R + b).to(tl.int32)
        ncb = tl.load(s_ncol + b).to(tl.int32)
        wb = tl.load(s_width + b)
        local = it - tl.load(s_istart + b).to(tl.int32)
        c = local // Rb
        r = local % Rb
        ln = tl.minimum(wb, tl.load(s_T + b) - c * wb)
        s = tl.load(s_wstart + b) + (c * Rb) * wb + r * ln  # line positions: int64
        x = tl.where(j == 0, tl.load(s_cut + p), s)
        y = tl.minimum(s + ln, tl.load(s_cut + p + 1))
        t0 = c * wb + x - s
        t1 = t0 + y - x
        # the inner cuts of this row block K (n_pieces - ncol of them, one per column at most; those
        # in columns before c and one at x come before this piece) and of the row blocks before it in
        # its sequence (split pieces before it: r ncol + those when it has several columns, else two
        # each, a one-column row block having one at most)
        r_first = tl.load(s_rstart + b).to(tl.int32)
        K = r_first + r
        mine = key[:, None] == K[None, :]
        n_pieces = ncb + tl.sum(mine.to(tl.int32), 0)
        idx = c + tl.sum((mine & (kcol[:, None] < c[None, :])).to(tl.int32), 0) + (x > s).to(tl.int32)
        below = tl.sum(((key[:, None] >= r_first[None, :]) & (key[:, None] < K[None, :])).to(tl.int32), 0)
        multi = ncb > 1
        base = tl.load(s_spp + b).to(tl.int32) + tl.where(multi, r * ncb, below) + below  # split pieces before it
        g = tl.load(s_spr + b).to(tl.int32) + tl.where(multi, r, below)  # split row blocks before it
        split = n_pieces > 1
        tl.store(seg_seq + i, b, mask=m_i)
        tl.store(seg_row0 + i, r * BLOCK_M, mask=m_i)
        tl.store(seg_kv_start + i, (t0 * BLOCK_N).to(tl.int32), mask=m_i)
        tl.store(seg_kv_end + i, tl.minimum(t1 * BLOCK_N, tl.load(kv_out + b)).to(tl.int32), mask=m_i)
        tl.store(seg_partial + i, tl.where(split, base + idx, -1), mask=m_i)
        m_g = m_i & split & (idx == 0) & (g < grp_cap)
        tl.store(grp_seq + g, b, mask=m_g)
        tl.store(grp_row0 + g, r * BLOCK_M, mask=m_g)
        tl.store(grp_first + g, base, mask=m_g)
        tl.store(grp_count + g, n_pieces, mask=m_g)


_BOUNDARIES = Launcher(_boundaries_kernel)
_PIECES = Launcher(_pieces_kernel)


class DeviceScheduler:
    """The scheduler launches of one plan: write the line schedule of device lengths into
    ``kv_out [max_batch]``, ``qo_out [max_batch + 1]`` (int32) and ``tables`` (a
    :class:`~kdtree_engine.verify.plan.FlashTables`), using ``scratch`` (int64, at least
    ``9 max_batch + 5 (P + 2)`` elements: the kernels' per-sequence and per-boundary arrays).
    Everything but the lengths is fixed at construction (a launch costs only its arguments)."""

    def __init__(self, kv_out, qo_out, tables, scratch, *, num_heads: int, max_batch: int, max_tree_nodes: int,
                 min_split: int):
        cfg, P = tables.config, tables.num_programs
        if scratch.numel() < 9 * max_batch + 5 * (P + 2) or scratch.dtype != torch.int64:
            raise ValueError(f"scheduler scratch too small: {scratch.numel()} {scratch.dtype}")
        seg_cap, grp_cap = tables.segment_rows[0].shape[0], tables.group_rows[0].shape[0]
        sizes = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MAX_B=max_batch,
                     BLOCK_B=triton.next_power_of_2(max_batch), BLOCK_P=triton.next_power_of_2(P + 2))
        self._const = dict(sizes, MIN_SPLIT=min_split, num_warps=8)
        self._key = (num_heads, P, max_tree_nodes, *self._const.values())
        self._outputs = (kv_out, qo_out, tables.prog_first_seg, tables.group_count, scratch, num_heads, P,
                         max_tree_nodes)
        const = dict(sizes, BLOCK_S=BLOCK_S, num_warps=8)
        self._pieces = Launch(_PIECES, (P, seg_cap, grp_cap, *const.values()), (triton.cdiv(seg_cap, BLOCK_S),), (),
                              (), (kv_out, *tables.segment_rows, *tables.group_rows, scratch, P, seg_cap, grp_cap),
                              const)

    def prepare(self, kv_lens, qo_indptr) -> Launches:
        """The launches that schedule ``kv_lens`` ``[B]`` / ``qo_indptr`` ``[B+1]`` (int32 on the
        plan's device, any strides, ``B <= max_batch``), and any lengths of their signature (dtype,
        16-byte alignment, B, strides): ``launches((kv_lens, qo_indptr), data pointers)``, two
        launches on the current stream, no sync."""
        ints = (kv_lens.stride(0), qo_indptr.stride(0), kv_lens.shape[0])
        boundaries = Launch(_BOUNDARIES, (spec_key((kv_lens, qo_indptr), ints), self._key), (1,), (), (0, 1),
                            (*ints, *self._outputs), self._const)
        return Launches(boundaries, self._pieces)
