"""The device scheduler: a plan's tables computed on the GPU from device lengths, with no sync.

One program reads ``kv_lens [B]`` and ``qo_indptr [B+1]`` where they are (any strides), copies
them into the plan's length buffers and writes the line schedule of :mod:`.plan`
(:func:`~kdtree_engine.verify.plan._line_schedule`, the same pieces, program boundaries and
snapping) as the tables the kernels read: ``prog_first_seg``, the segments with their partial
slots, the split groups and their count, exactly as the host writes them for that schedule
(:meth:`~kdtree_engine.verify.plan.VerifyPlan.plan`). The host picks the cheapest of several
schedules; the device always takes the line schedule, whose table sizes stay within the plan's
capacities for any lengths (at most ``row blocks + 2P`` segments, ``4P`` partials, ``2P`` groups).

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

from .launch import Launch, Launcher, spec_key

__all__ = ["DeviceScheduler"]

BLOCK_S = 64  # pieces written per step


@triton.jit
def _find(ends, n, x, LOG_N: tl.constexpr):
    """Per lane, the first index i in ``[0, n)`` with ``ends[i] > x`` (``ends`` ascending in memory)."""
    lo = tl.zeros_like(x)
    hi = tl.zeros_like(x) + n
    for _ in range(LOG_N):
        go = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(ends + mid, mask=go, other=0)
        right = go & (v <= x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(go & ~right, mid, hi)
    return lo


@triton.jit
def _locate(x, B, s_wend, s_wstart, s_R, s_T, s_width, s_ncol, LOG_B: tl.constexpr):
    """The item (sequence b, column c, row block r, line range [s, e)) holding line position x."""
    b = _find(s_wend, B, x, LOG_B)
    y = x - tl.load(s_wstart + b)
    Rb = tl.maximum(tl.load(s_R + b), 1)
    wb = tl.maximum(tl.load(s_width + b), 1)
    Tb = tl.load(s_T + b)
    span = Rb * wb
    c = tl.minimum(y // span, tl.load(s_ncol + b) - 1)
    ln = tl.maximum(tl.minimum(wb, Tb - c * wb), 1)
    yc = y - c * span
    r = yc // ln
    s = x - (yc - r * ln)
    return b, c, r, s, s + ln


@triton.jit
def _schedule_kernel(
    kv_lens, qo_indptr, stride_kl, stride_qo, B, kv_out, qo_out,
    prog_first_seg, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial,
    grp_seq, grp_row0, grp_first, grp_count, group_count, scratch,
    H, P, max_nodes, seg_cap, grp_cap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, MAX_B: tl.constexpr,
    BLOCK_B: tl.constexpr, LOG_B: tl.constexpr, BLOCK_P: tl.constexpr, LOG_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The line schedule of ``B`` sequences on ``P`` programs (one program; see the module docstring)."""
    # scratch, int64: per sequence (MAX_B + 1 each) line end and start, R, T, column width and count,
    # item end, KV length; per program boundary (P + 2 each) cut, next cut, first segment, first
    # item; per sequence its first row block, the split row blocks and pieces before it; per
    # boundary the row block of an inner cut (-1: none)
    s_wend = scratch
    s_wstart = s_wend + (MAX_B + 1)
    s_R = s_wstart + (MAX_B + 1)
    s_T = s_R + (MAX_B + 1)
    s_width = s_T + (MAX_B + 1)
    s_ncol = s_width + (MAX_B + 1)
    s_iend = s_ncol + (MAX_B + 1)
    s_kv = s_iend + (MAX_B + 1)
    s_cut = s_kv + (MAX_B + 1)
    s_cutn = s_cut + (P + 2)
    s_first = s_cutn + (P + 2)
    s_ord = s_first + (P + 2)

    # per sequence: row blocks R, KV tiles T, work W = R T on the line, columns of about `chunk` tiles
    o_b = tl.arange(0, BLOCK_B)
    m_b = o_b < B
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
    tl.store(s_wend + o_b, w_end, mask=m_b)
    tl.store(s_wstart + o_b, w_end - W, mask=m_b)
    tl.store(s_R + o_b, R, mask=m_b)
    tl.store(s_T + o_b, T, mask=m_b)
    tl.store(s_width + o_b, width, mask=m_b)
    tl.store(s_ncol + o_b, ncol, mask=m_b)
    tl.store(s_iend + o_b, tl.cumsum(items, 0), mask=m_b)
    tl.store(s_kv + o_b, kv.to(tl.int64), mask=m_b)
    # the row blocks of a sequence cut into several columns are all split: their rows and pieces,
    # summed over the sequences before each (and the row-block ids, to key the row blocks)
    multi = m_b & (ncol > 1)
    sp_rows = tl.where(multi, R, 0)
    sp_pieces = tl.where(multi, items, 0)
    s_rstart = s_ord + (P + 2)
    s_sprows = s_rstart + (MAX_B + 1)
    s_sppieces = s_sprows + (MAX_B + 1)
    s_ikey = s_sppieces + (MAX_B + 1)
    tl.store(s_rstart + o_b, tl.cumsum(R, 0) - R, mask=m_b)
    tl.store(s_sprows + o_b, tl.cumsum(sp_rows, 0) - sp_rows, mask=m_b)
    tl.store(s_sppieces + o_b, tl.cumsum(sp_pieces, 0) - sp_pieces, mask=m_b)
    tl.debug_barrier()

    # program boundaries k = 1 .. pe-1 at k * total / pe, snapped to an item's edge when closer
    # than `snap`; cut[0] = 0, cut[k >= pe] = total. Program p runs [cut[p], cut[p + 1]).
    o_k = tl.arange(0, BLOCK_P).to(tl.int64)
    bnd = o_k * total // pe
    kb, kc, kr, ks, ke = _locate(tl.minimum(bnd, total - 1), B, s_wend, s_wstart, s_R, s_T, s_width, s_ncol, LOG_B)
    valid = (o_k >= 1) & (o_k < pe)
    cut = tl.where(bnd - ks < snap, ks, tl.where(ke - bnd < snap, ke, bnd))
    cut = tl.where(o_k == 0, 0, tl.where(valid, cut, total))
    inner = valid & (ks < cut) & (cut < ke)  # a cut inside an item: that row block is split
    key = tl.load(s_rstart + kb, mask=valid, other=0) + kr  # the row block's id
    ncol1 = tl.load(s_ncol + kb, mask=valid, other=2) == 1
    tl.store(s_cut + o_k, cut, mask=o_k < P + 2)
    tl.store(s_ikey + o_k, tl.where(inner, key, -1), mask=o_k < P + 2)
    tl.debug_barrier()
    # the first inner cut of a row block of a one-column sequence (which it splits): the inner cuts
    # of one item are consecutive cuts (any cut between them lies inside that item too)
    prev_key = tl.load(s_ikey + o_k - 1, mask=(o_k >= 1) & (o_k < P + 2), other=-1)
    first_cut = inner & ncol1 & (prev_key != key)
    cut_next = tl.load(s_cut + o_k + 1, mask=o_k < P + 1, other=0)
    m_p = o_k < P
    busy = m_p & (cut < cut_next)
    lb, lc, lr, ls, le = _locate(tl.where(busy, cut, 0), B, s_wend, s_wstart, s_R, s_T, s_width, s_ncol, LOG_B)
    hb, hc, hr, hs, he = _locate(tl.where(busy, cut_next - 1, 0), B, s_wend, s_wstart, s_R, s_T, s_width, s_ncol,
                                 LOG_B)
    i_start_l = tl.load(s_iend + lb) - tl.load(s_R + lb) * tl.load(s_ncol + lb)
    i_start_h = tl.load(s_iend + hb) - tl.load(s_R + hb) * tl.load(s_ncol + hb)
    ord_lo = i_start_l + lc * tl.load(s_R + lb) + lr  # the item ordinal of a program's first position
    ord_hi = i_start_h + hc * tl.load(s_R + hb) + hr
    count = tl.where(busy, ord_hi - ord_lo + 1, 0)
    first = tl.cumsum(count, 0) - count
    S = tl.sum(count, 0)
    tl.store(prog_first_seg + o_k, first.to(tl.int32), mask=o_k <= P)
    tl.store(s_first + o_k, first, mask=o_k < P + 2)
    tl.store(s_ord + o_k, ord_lo, mask=o_k < P + 2)
    tl.store(s_cutn + o_k, cut_next, mask=o_k < P + 2)
    n_groups = tl.sum(sp_rows, 0) + tl.sum(first_cut.to(tl.int64), 0)
    tl.store(group_count, n_groups.to(tl.int32))
    tl.debug_barrier()

    # the pieces, in program order: piece i is item ord_lo[p] + j of its program p (j = i - first[p]),
    # from the program's cut (j = 0) or the item's start, to the item's end or the next cut
    for i0 in range(0, S, BLOCK_S):
        i = i0 + tl.arange(0, BLOCK_S).to(tl.int64)
        m_i = (i < S) & (i < seg_cap)
        p = _find(s_first + 1, P, i, LOG_P)  # the first program whose next first segment is past i
        j = i - tl.load(s_first + p)
        it = tl.load(s_ord + p) + j
        b = _find(s_iend, B, it, LOG_B)
        Rb = tl.maximum(tl.load(s_R + b), 1)
        ncb = tl.load(s_ncol + b)
        wb = tl.load(s_width + b)
        local = it - (tl.load(s_iend + b) - Rb * ncb)
        c = local // Rb
        r = local % Rb
        ln = tl.minimum(wb, tl.load(s_T + b) - c * wb)
        s = tl.load(s_wstart + b) + c * Rb * wb + r * ln
        x = tl.where(j == 0, tl.load(s_cut + p), s)
        y = tl.minimum(s + ln, tl.load(s_cutn + p))
        t0 = c * wb + x - s
        t1 = t0 + y - x
        K = tl.load(s_rstart + b) + r
        mine = inner[None, :] & (key[None, :] == K[:, None])  # [S, P] the inner cuts of this row block
        n_pieces = ncb + tl.sum(mine.to(tl.int64), 1)
        split = n_pieces > 1
        before = mine & ((kc[None, :] < c[:, None]) | ((kc[None, :] == c[:, None]) & (cut[None, :] <= x[:, None])))
        idx = c + tl.sum(before.to(tl.int64), 1)  # this piece's place among its row block's pieces
        lower = key[None, :] < K[:, None]
        firsts_below = tl.sum((first_cut[None, :] & lower).to(tl.int64), 1)
        multi_b = ncb > 1
        base = (tl.load(s_sppieces + b) + tl.where(multi_b, r * ncb, 0)
                + tl.sum((inner[None, :] & lower).to(tl.int64), 1) + firsts_below)  # split pieces before it
        g = tl.load(s_sprows + b) + tl.where(multi_b, r, 0) + firsts_below  # split row blocks before it
        tl.store(seg_seq + i, b.to(tl.int32), mask=m_i)
        tl.store(seg_row0 + i, (r * BLOCK_M).to(tl.int32), mask=m_i)
        tl.store(seg_kv_start + i, (t0 * BLOCK_N).to(tl.int32), mask=m_i)
        tl.store(seg_kv_end + i, tl.minimum(t1 * BLOCK_N, tl.load(s_kv + b)).to(tl.int32), mask=m_i)
        tl.store(seg_partial + i, tl.where(split, base + idx, -1).to(tl.int32), mask=m_i)
        m_g = m_i & split & (idx == 0) & (g < grp_cap)
        tl.store(grp_seq + g, b.to(tl.int32), mask=m_g)
        tl.store(grp_row0 + g, (r * BLOCK_M).to(tl.int32), mask=m_g)
        tl.store(grp_first + g, base.to(tl.int32), mask=m_g)
        tl.store(grp_count + g, n_pieces.to(tl.int32), mask=m_g)


_SCHEDULE = Launcher(_schedule_kernel)


def _log2_ceil(n: int) -> int:
    return max(1, (n - 1).bit_length() + 1)


class DeviceScheduler:
    """The scheduler launch of one plan: writes the line schedule of device lengths into
    ``kv_out [max_batch]``, ``qo_out [max_batch + 1]`` (int32) and ``tables`` (a
    :class:`~kdtree_engine.verify.plan.FlashTables`), using ``scratch`` (int64, at least
    ``11 (max_batch + 1) + 5 (P + 2)`` elements: the kernel's per-sequence and per-program arrays).
    Everything but the lengths is fixed at construction (one launch costs only its arguments)."""

    def __init__(self, kv_out, qo_out, tables, scratch, *, num_heads: int, max_batch: int, max_tree_nodes: int,
                 min_split: int):
        cfg, P = tables.config, tables.num_programs
        if scratch.numel() < 11 * (max_batch + 1) + 5 * (P + 2) or scratch.dtype != torch.int64:
            raise ValueError(f"scheduler scratch too small: {scratch.numel()} {scratch.dtype}")
        seg_cap, grp_cap = tables.segment_rows[0].shape[0], tables.group_rows[0].shape[0]
        self._const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MIN_SPLIT=min_split, MAX_B=max_batch,
                           BLOCK_B=triton.next_power_of_2(max_batch), LOG_B=_log2_ceil(max_batch + 1),
                           BLOCK_P=triton.next_power_of_2(P + 2), LOG_P=_log2_ceil(P + 1), BLOCK_S=BLOCK_S,
                           num_warps=8)
        self._key = (num_heads, P, seg_cap, grp_cap, max_tree_nodes, *self._const.values())
        self._outputs = (kv_out, qo_out, tables.prog_first_seg, *tables.segment_rows, *tables.group_rows,
                         tables.group_count, scratch, num_heads, P, max_tree_nodes, seg_cap, grp_cap)

    def prepare(self, kv_lens, qo_indptr) -> Launch:
        """The launch that schedules ``kv_lens`` ``[B]`` / ``qo_indptr`` ``[B+1]`` (int32 on the
        plan's device, any strides, ``B <= max_batch``), and any lengths of their signature (dtype,
        16-byte alignment, B, strides): ``launch((kv_lens, qo_indptr), data pointers)``, one launch
        on the current stream, no sync."""
        ints = (kv_lens.stride(0), qo_indptr.stride(0), kv_lens.shape[0])
        return Launch(_SCHEDULE, (spec_key((kv_lens, qo_indptr), ints), self._key), (1,), (), (0, 1),
                      (*ints, *self._outputs), self._const)
