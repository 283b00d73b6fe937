"""Triton kernels of the DDTree step: the draft top-K, the best-first expansion, the acceptance
walk.

One launch each (two for the top-K: slices of a row, then a merge per row), one program per
row, slice or sequence (several under the interpreter, which runs programs one after another),
fixed shapes, no host sync: all can be captured in a CUDA graph per (batch, budget) bucket. The
public functions (:mod:`.tree`, :mod:`.accept`) call the launchers below; this module imports
nothing of theirs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreting

__all__ = ["walk", "sample_walk", "greedy_walk", "expand", "topk_logprobs"]


# ----------------------------------------------------------------------------------------------
# helpers

_INT64_MAX = tl.constexpr(2**63 - 1)
STREAM_UNROLL = 4  # chunks per iteration of a program's pass over a vocabulary row (loads in flight)


@triton.jit
def _ranked(b_key, p_tmp, RANK_SORT: tl.constexpr, CHUNK: tl.constexpr):
    """``(keys, ranks)`` of ``[S, N]`` keys, distinct within a row except padding (INT64_MAX): on a
    GPU the rows sorted by ``tl.sort`` and ranks 0..N-1; under the interpreter, whose ``tl.sort``
    takes minutes (a Python call per element), the keys as they are and their ranks by counting,
    CHUNK columns at a time through the scratch rows ``p_tmp`` (``[S, 1]`` pointers, N entries)."""
    N: tl.constexpr = b_key.shape[1]
    if RANK_SORT:
        tl.store(p_tmp + tl.arange(0, N)[None, :], b_key)
        rank = tl.zeros(b_key.shape, tl.int32)
        for j in range(0, N, CHUNK):
            b_j = tl.load(p_tmp + j + tl.arange(0, CHUNK)[None, :])  # [S, CH]
            rank += tl.sum((b_j[:, None, :] < b_key[:, :, None]).to(tl.int32), axis=2)
        return b_key, rank
    else:
        rank = tl.zeros(b_key.shape, tl.int32) + tl.arange(0, N)[None, :]
        return tl.sort(b_key, dim=1), rank


def _rank_chunk(rows: int, n: int) -> int:
    """:func:`_ranked`'s CHUNK for ``[rows, n]`` keys: ranks by counting (the interpreter) compare
    ``[rows, n, CHUNK]`` at a time, at most 2**20."""
    return min(n, max(1, 2**20 // (rows * n)))


def block_of(n: int) -> int:
    """A block holding ``n`` elements: the power of 2 at least ``n``, and 2 at least. Triton 3.6
    miscompiles these kernels for sm_90 ("operand does not dominate this use" in
    TritonGPURemoveLayoutConversions) when a block has one element: one-node trees, depth-0 walks,
    budget-1 expansions (docs/perf_log.md run 23 and run 24)."""
    return max(triton.next_power_of_2(n), 2)


def _seqs_per_program(batch: int, block: int, slots: int = 2**16) -> int:
    """Sequences per program: one on a GPU (small trees: up to 1024 elements per program); under
    the interpreter, which runs programs one after another, the batch in few programs (about
    ``slots`` elements each)."""
    if interpreting():
        return min(triton.next_power_of_2(batch), max(1, slots // block))
    return min(triton.next_power_of_2(batch), max(1, 1024 // block))


# ----------------------------------------------------------------------------------------------
# the draft top-K: a split top-K (slices of a row, then a merge per row), log-sum-exp, tie order
# and fixed point

TOPK_SLICE = 16384  # vocabulary columns per program of the slice stage on a GPU (held in registers)
TOPK_SLICE_INTERPRETED = 2**16  # the interpreter's (its programs run one after another: few, large ones)
TOPK_INTERPRETED_SLOTS = 2**18  # the interpreter's elements per program (rows x slice)
TOPK_RANK_ALL_INTERPRETED = 2**23  # the interpreter ranks whole rows (no selection) up to these comparisons a program


@triton.jit
def _round_half_even(x):
    """torch.round of float32 ``x``: nearest integer, halves to even (exact: no rounding inside)."""
    f = tl.floor(x)
    r = x - f
    odd = (f - 2.0 * tl.floor(0.5 * f)) != 0.0
    return tl.where((r > 0.5) | ((r == 0.5) & odd), f + 1.0, f)


@triton.jit
def _order_key(x):
    """``[..]`` int32 increasing with float32 ``x`` (-0.0 folded onto +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _first_k(b_key, m_u, need, BITS: tl.constexpr):
    """``(sel, pos)``, ``[S, N]``: per row, the ``need`` (``[S]`` int32, at least 1 and at most the
    row's entry count) first entries ``m_u`` by the top BITS bits of their int32 key ``b_key``
    (their bucket; descending), then position (ascending), and their positions ``0..need-1`` in
    row order: the ``need``-th largest bucket ``t`` (the largest ``v`` with ``#{bucket >= v} >=
    need``) by bisection, BITS rounds of a count per row, then every entry above ``t`` and the
    first of those tied at it."""
    SHIFT: tl.constexpr = 32 - BITS
    v = tl.full(need.shape, -(2 ** (BITS - 1)), tl.int64)  # buckets lie in [-2**(BITS-1), 2**(BITS-1))
    step = tl.full(need.shape, 2 ** (BITS - 1), tl.int64)
    for _ in range(BITS):
        c = v + step
        n = tl.sum((m_u & (b_key >= (c << SHIFT).to(tl.int32)[:, None])).to(tl.int32), axis=1)
        v = tl.where(n >= need, c, v)
        step = step // 2
    b_u = b_key >> SHIFT
    t = v.to(tl.int32)[:, None]
    gt = m_u & (b_u > t)
    eq = m_u & (b_u == t)
    n_gt = tl.sum(gt.to(tl.int32), axis=1)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=1) <= (need - n_gt)[:, None]))
    return sel, tl.cumsum(sel.to(tl.int32), axis=1) - 1


@triton.jit
def _finish_rows(b_c, lse, i_r, m_r, out_lp, out_ids, p_tmp,
                 K: tl.constexpr, SCALE: tl.constexpr, FLOOR: tl.constexpr,
                 RANK_SORT: tl.constexpr, CHUNK: tl.constexpr):
    """Rows ``i_r`` (``[S]`` int64; ``m_r``: the real ones) of the outputs ``[R, K]``: the entries
    ``b_c`` ``[S, N]`` (``(-key) << 32 | id``, ascending = logit descending then id ascending;
    padding INT64_MAX, N >= K real entries a row) ranked, the first K stored with their fixed point
    ``round(SCALE * max(x - lse, FLOOR))`` (``lse`` ``[S]``). ``p_tmp``: ``[S, 1]`` pointers to N
    int64 each (the ranks' scratch under the interpreter)."""
    b_c, b_pos = _ranked(b_c, p_tmp, RANK_SORT, CHUNK)
    b_ord = (-(b_c >> 32)).to(tl.int32)
    b_v = (b_ord ^ ((b_ord >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    b_lp = _round_half_even(tl.maximum(b_v - lse[:, None], FLOOR) * SCALE)
    p_out = i_r[:, None] * K + b_pos
    m_out = m_r[:, None] & (b_pos < K)
    tl.store(out_lp + p_out, b_lp.to(tl.int64), mask=m_out)
    tl.store(out_ids + p_out, b_c & 0xFFFFFFFF, mask=m_out)


@triton.jit(do_not_specialize=["num_rows"])
def _topk_slice_kernel(
    logits, ws_m, ws_s, ws_cand, out_lp, out_ids, tmp,
    num_rows, vocab, stride_row,
    K: tl.constexpr,
    SCALE: tl.constexpr,
    FLOOR: tl.constexpr,
    ROWS: tl.constexpr,
    SLICE: tl.constexpr,
    BITS: tl.constexpr,
    SELECT: tl.constexpr,
    FINISH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK_SORT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program ``(i, g)``: columns ``[g * SLICE, (g + 1) * SLICE)`` of rows ``i * ROWS ..`` (one
    row on a GPU when the slice is large), the whole slice in registers. The entries of a row are
    taken by logit (descending) then column (ascending); SELECT: the first ``min(K, columns)`` by
    :func:`_first_k` on the top BITS bits of their order key (16 for bf16 logits, whose keys'
    low 16 bits carry no information, else 32), else all of them.

    logits: ``[R, V]`` any float dtype (row stride ``stride_row``, unit column stride).
    FINISH (the row is one slice): the outputs ``out_lp, out_ids`` ``[R, K]`` int64, by
    :func:`_finish_rows`, with ``lse = m + log(sum(exp(x - m)))``; ``tmp``: ``[programs * ROWS,
    BLOCK_R]`` int64 scratch (BLOCK_R: next_pow2(K) after a selection, else SLICE).
    Otherwise stage 1 of the split top-K: ``ws_m, ws_s`` ``[R, G]`` float32 (G = number of
    slices), the slice's maximum ``m`` and ``sum(exp(x - m))`` (``m`` taken as 0 when -inf);
    ``ws_cand`` ``[R, G, K]`` int64, its ``min(K, columns)`` candidates ``(-key) << 32 | column``
    in column order (entries past them are not written).
    """
    i_p = tl.program_id(0)
    g = tl.program_id(1)
    G = tl.num_programs(1)
    o_r = i_p * ROWS + tl.arange(0, ROWS)
    m_r = o_r < num_rows
    i_r = o_r.to(tl.int64)
    o_v = g * SLICE + tl.arange(0, SLICE)[None, :]
    m_x = m_r[:, None] & (o_v < vocab)
    b_x = tl.load(logits + i_r[:, None] * stride_row + o_v, mask=m_x, other=float("-inf")).to(tl.float32)
    b_m = tl.max(b_x, axis=1)  # [R]
    b_ref = tl.where(b_m > float("-inf"), b_m, 0.0)
    b_s = tl.sum(tl.exp(b_x - b_ref[:, None]), axis=1)
    b_key = _order_key(b_x)
    if SELECT:
        sel, pos = _first_k(b_key, m_x, tl.zeros([ROWS], tl.int32) + tl.minimum(K, vocab - g * SLICE), BITS)
    b_c = ((-b_key.to(tl.int64)) << 32) | o_v
    if FINISH:
        p_tmp = tmp + i_r[:, None] * BLOCK_R
        if SELECT:
            tl.store(p_tmp + pos, b_c, mask=sel)
            tl.debug_barrier()
            o_k = tl.arange(0, BLOCK_R)[None, :]
            b_c = tl.load(p_tmp + o_k, mask=m_r[:, None] & (o_k < K), other=_INT64_MAX)
        else:
            b_c = tl.where(m_x, b_c, _INT64_MAX)
        _finish_rows(b_c, b_ref + tl.log(b_s), i_r, m_r, out_lp, out_ids, p_tmp, K, SCALE, FLOOR, RANK_SORT, CHUNK)
    else:
        tl.store(ws_m + i_r * G + g, b_m, mask=m_r)
        tl.store(ws_s + i_r * G + g, b_s, mask=m_r)
        p_cand = ws_cand + (i_r[:, None] * G + g) * K
        if SELECT:
            tl.store(p_cand + pos, b_c, mask=sel)
        else:  # the slice has at most K columns: all of them
            tl.store(p_cand + o_v - g * SLICE, b_c, mask=m_x)


@triton.jit(do_not_specialize=["num_rows", "num_slices"])
def _topk_merge_kernel(
    ws_m, ws_s, ws_cand, out_lp, out_ids, tmp,
    num_rows, vocab, num_slices,
    K: tl.constexpr,
    SCALE: tl.constexpr,
    FLOOR: tl.constexpr,
    ROWS: tl.constexpr,
    SLICE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RANK_SORT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Stage 2 of the split top-K, rows ``program_id(0) * ROWS ..``: from the ``G = num_slices``
    slices' ``(m, s)`` and candidates (``ws_*``, see :func:`_topk_slice_kernel`), ``lse = M +
    log(sum_g s_g exp(m_g - M))`` (``M``: the largest ``m_g``) and the ``K`` first candidates by
    logit (descending) then id (ascending) (:func:`_first_k`: the candidates are in column order,
    so ties at the ``K``-th logit go to the lowest ids), by :func:`_finish_rows`.

    out_lp, out_ids: ``[R, K]`` int64. tmp: ``[programs * ROWS, BLOCK_K]`` int64 scratch.
    """
    i_p = tl.program_id(0)
    o_r = i_p * ROWS + tl.arange(0, ROWS)
    m_r = o_r < num_rows
    i_r = o_r.to(tl.int64)
    o_g = tl.arange(0, BLOCK_G)[None, :]
    m_g = m_r[:, None] & (o_g < num_slices)
    b_m = tl.load(ws_m + i_r[:, None] * num_slices + o_g, mask=m_g, other=float("-inf"))
    b_s = tl.load(ws_s + i_r[:, None] * num_slices + o_g, mask=m_g, other=0.0)
    top = tl.max(b_m, axis=1)
    top = tl.where(top > float("-inf"), top, 0.0)
    lse = top + tl.log(tl.sum(b_s * tl.exp(b_m - top[:, None]), axis=1))  # [R]

    o_c = tl.arange(0, BLOCK_C)[None, :]  # candidate j of slice g at g * K + j
    m_c = m_r[:, None] & (o_c < num_slices * K) & (o_c % K < tl.minimum(vocab - (o_c // K) * SLICE, SLICE))
    p_c = ws_cand + i_r[:, None] * num_slices * K  # [R, 1]
    b_key = (-(tl.load(p_c + o_c, mask=m_c, other=0) >> 32)).to(tl.int32)
    sel, pos = _first_k(b_key, m_c, tl.zeros([ROWS], tl.int32) + K, BITS)
    p_tmp = tmp + i_r[:, None] * BLOCK_K
    tl.store(p_tmp + pos, o_c, mask=sel)  # the selected candidates' indices, then the candidates
    tl.debug_barrier()
    o_k = tl.arange(0, BLOCK_K)[None, :]
    m_k = m_r[:, None] & (o_k < K)
    b_c = tl.load(p_c + tl.load(p_tmp + o_k, mask=m_k, other=0), mask=m_k, other=_INT64_MAX)
    _finish_rows(b_c, lse, i_r, m_r, out_lp, out_ids, p_tmp, K, SCALE, FLOOR, RANK_SORT, CHUNK)


def _topk_warps(block: int) -> int:
    """Warps of a top-K program holding ``block`` entries a row (16 from 16384 entries: 32 a thread)."""
    return 16 if block >= 16384 else 8 if block >= 2048 else 4


def topk_logprobs(logits, k: int, scale: int, floor: float):
    """The ``k`` first columns of each row of ``logits [R, V]`` (unit column stride) by logit
    (descending) then column (ascending), with their fixed-point log-softmax ``round(scale *
    max(x - lse, floor))`` (in float32). A row of one slice (``V <= TOPK_SLICE``; under the
    interpreter ``TOPK_SLICE_INTERPRETED``): one launch of :func:`_topk_slice_kernel`; else the
    split top-K, two launches: :func:`_topk_slice_kernel` on ``R x G`` programs (G = ``ceil(V /
    slice)``) and :func:`_topk_merge_kernel`, one program per row on a GPU.

    Returns ``(logprobs, token_ids)``, each ``[R, k]`` int64."""
    R, V = logits.shape
    dev = logits.device
    rank_sort = interpreting()
    vslice = min(triton.next_power_of_2(V), TOPK_SLICE_INTERPRETED if rank_sort else TOPK_SLICE)
    G = triton.cdiv(V, vslice)
    block_k = triton.next_power_of_2(k)
    finish = G == 1
    rows = _seqs_per_program(R, vslice, TOPK_INTERPRETED_SLOTS)
    if not finish:
        select = vslice > k  # else every column of a slice is a candidate
    else:  # a row that fits the K block is ranked whole; under the interpreter (counting) one as cheap
        select = vslice > block_k and not (rank_sort and rows * vslice * vslice <= TOPK_RANK_ALL_INTERPRETED)
    block_r = block_k if select else vslice
    out_lp = torch.empty(R, k, dtype=torch.int64, device=dev)
    out_ids = torch.empty(R, k, dtype=torch.int64, device=dev)
    ws_m = ws_s = ws_cand = out_lp  # not read with one slice
    if not finish:
        ws_m = torch.empty(R, G, dtype=torch.float32, device=dev)
        ws_s = torch.empty(R, G, dtype=torch.float32, device=dev)
        ws_cand = torch.empty(R, G, k, dtype=torch.int64, device=dev)
    common = dict(K=k, SCALE=float(scale), FLOOR=float(floor), SLICE=vslice,
                  BITS=16 if logits.dtype == torch.bfloat16 else 32, RANK_SORT=rank_sort)

    grid = triton.cdiv(R, rows)
    tmp = torch.empty(grid * rows if finish else 1, block_r, dtype=torch.int64, device=dev)
    _topk_slice_kernel[(grid, G)](
        logits, ws_m, ws_s, ws_cand, out_lp, out_ids, tmp,
        R, V, logits.stride(0),
        ROWS=rows,
        SELECT=select,
        FINISH=finish,
        BLOCK_R=block_r,
        CHUNK=_rank_chunk(rows, block_r),
        num_warps=_topk_warps(vslice),
        **common,
    )
    if finish:
        return out_lp, out_ids
    block_c = triton.next_power_of_2(G * k)
    rows = _seqs_per_program(R, block_c, TOPK_INTERPRETED_SLOTS)
    grid = triton.cdiv(R, rows)
    tmp = torch.empty(grid * rows, block_k, dtype=torch.int64, device=dev)
    _topk_merge_kernel[(grid,)](
        ws_m, ws_s, ws_cand, out_lp, out_ids, tmp,
        R, V, G,
        ROWS=rows,
        BLOCK_G=triton.next_power_of_2(G),
        BLOCK_C=block_c,
        BLOCK_K=block_k,
        CHUNK=_rank_chunk(rows, block_k),
        num_warps=_topk_warps(block_c),
        **common,
    )
    return out_lp, out_ids


# ----------------------------------------------------------------------------------------------
# the acceptance walk, on given target tokens or sampling the target along the path

SAMPLE_BLOCK_V = 4096  # lanes of the sampler: vocabulary columns per step, and the lane maxima
SAMPLE_CAP_MIN = 256  # smallest candidate buffer of the sampler (it holds at least 2 * top_k)
SAMPLE_CAP_MIN_INTERPRETED = 16  # the interpreter's: many sequences per program, small vocabularies
MAX_FUSED_TOP_K = 1024  # a larger int top_k samples through the tensor-op filter


@triton.jit
def _key(y):
    """``[..]`` int64 key in ``[0, 2**32)`` increasing with float32 ``y`` (-0.0 folded onto +0.0)."""
    bits = (y + 0.0).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2**31


@triton.jit
def _unkey(u):
    """The float32 whose :func:`_key` is ``u``."""
    o = (u - 2**31).to(tl.int32)
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _largest_key(b_u, b_w, x_u, x_w, need):
    """Per row of ``[S, N]`` keys ``b_u`` with weights ``b_w`` (plus one extra entry per row,
    ``x_u``/``x_w`` ``[S]``): the largest ``v`` in ``[0, 2**32)`` whose weight at or above it,
    ``sum(b_w[b_u >= v]) + x_w * (x_u >= v)``, is ``>= need`` (0 when none is). Bisection on the
    key's 32 bits; the weight is monotone in ``v``, so the answer is a key of an entry."""
    v = tl.zeros(need.shape, tl.int64)
    step = tl.full(need.shape, 2**31, tl.int64)
    for _ in range(32):
        c = v + step
        w = tl.sum(tl.where(b_u >= c[:, None], b_w, 0), axis=1) + tl.where(x_u >= c, x_w, 0)
        v = tl.where(w >= need, c, v)
        step = step // 2
    return v


@triton.jit
def _scan_row(p_x, vocab, m_row, t, lo, strict, p_bv, p_bi,
              CAP: tl.constexpr, BLOCK_V: tl.constexpr, STORE: tl.constexpr):
    """One pass over rows ``p_x`` (``[S, 1]`` pointers) of ``y = x / t``: ``(f, g)`` = the number
    of entries with key ``>= lo`` / ``> lo`` (``[S]`` int32). STORE: the selected entries (``> lo``
    where ``strict``, else ``>= lo``) in column order go to the candidate buffer ``p_bv`` (y) /
    ``p_bi`` (column), the first CAP of them."""
    o_v = tl.arange(0, BLOCK_V)[None, :]
    f = tl.zeros(lo.shape, tl.int32)
    g = tl.zeros(lo.shape, tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        m = m_row[:, None] & (v0 + o_v < vocab)
        y = tl.math.div_rn(tl.load(p_x + v0 + o_v, mask=m, other=0.0).to(tl.float32), t[:, None])
        u = _key(y)
        ge = m & (u >= lo[:, None])
        gt = m & (u > lo[:, None])
        n_ge = tl.sum(ge.to(tl.int32), axis=1)
        n_gt = tl.sum(gt.to(tl.int32), axis=1)
        if STORE:
            if tl.sum(tl.where(strict, n_gt, n_ge)) > 0:  # the cumsum only where entries are stored
                sel = tl.where(strict[:, None], gt, ge)
                pos = tl.where(strict, g, f)[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
                ok = sel & (pos < CAP)
                tl.store(p_bv + pos, y, mask=ok)
                tl.store(p_bi + pos, v0 + o_v, mask=ok)
        f += n_ge
        g += n_gt
    return f, g


@triton.jit
def _nth_equal(p_x, vocab, m_row, t, key, nth, BLOCK_V: tl.constexpr):
    """``[S]`` int64: the column of the ``nth`` (0-based) entry of each row whose key is ``key``."""
    o_v = tl.arange(0, BLOCK_V)[None, :]
    seen = tl.zeros(key.shape, tl.int32)
    col = tl.zeros(key.shape, tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        m = m_row[:, None] & (v0 + o_v < vocab)
        y = tl.math.div_rn(tl.load(p_x + v0 + o_v, mask=m, other=0.0).to(tl.float32), t[:, None])
        eq = m & (_key(y) == key[:, None])
        pos = seen[:, None] + tl.cumsum(eq.to(tl.int32), axis=1) - 1
        col += tl.sum(tl.where(eq & (pos == nth[:, None]), v0 + o_v, 0), axis=1).to(tl.int64)
        seen += tl.sum(eq.to(tl.int32), axis=1)
    return col


@triton.jit
def _sample_top_k(p_x, vocab, m_row, t, k, p, u01, p_bv, p_bi,
                  CAP: tl.constexpr, BLOCK_V: tl.constexpr, UNROLL: tl.constexpr):
    """One sample per row of ``softmax(filter_logits(x))`` with an int top-k ``k <= CAP / 2``
    (``[S]`` int64 columns), by inverse CDF at the uniform ``u01``; ``k = 1, u01 = 0`` gives the
    first argmax (greedy rows). Only the kept tokens are ranked, in a candidate buffer:

    1. the k-th largest lane maximum (lane j: columns j, j + BLOCK_V, ..) is ``lo``, a lower bound
       of the k-th largest y: at least k entries have a key ``>= lo``;
    2. one pass stores the entries ``>= lo`` (``f`` of them, ``g`` strictly above); when they
       overflow the buffer and ``g >= k``, ``lo`` rises by bisection (counting passes) until
       ``f <= CAP`` or ``g < k`` (then ``lo`` is the k-th largest key, ``f - g`` entries tie at
       it and only the ``g < k`` entries above it are stored; the ties are one weighted entry);
    3. on the buffer: the top-k threshold, the top-p threshold (the largest key whose mass at or
       above it reaches ``p`` times the top-k mass: the smallest most-probable set, plus ties),
       and the inverse CDF over the kept entries (buffer in column order, then the ties).
    """
    o_c = tl.arange(0, CAP)[None, :]
    o_v = tl.arange(0, BLOCK_V)[None, :]
    # 1. lane maxima
    b_max = tl.full([p_x.shape[0], BLOCK_V], float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK_V * UNROLL):
        for j in tl.static_range(UNROLL):
            c = v0 + j * BLOCK_V + o_v
            x = tl.load(p_x + c, mask=m_row[:, None] & (c < vocab), other=float("-inf")).to(tl.float32)
            b_max = tl.maximum(b_max, tl.math.div_rn(x, t[:, None]))
    none = tl.zeros(k.shape, tl.int64)
    lo = _largest_key(_key(b_max), 1, none, none, k)
    # 2. the candidates
    strict = k < 0  # all False
    f, g = _scan_row(p_x, vocab, m_row, t, lo, strict, p_bv, p_bi, CAP, BLOCK_V, True)
    bad = m_row & (f > CAP) & (g >= k)
    n_bad = tl.sum(bad.to(tl.int32))
    if n_bad > 0:
        hi = tl.full(lo.shape, 2**32, tl.int64)
        for _ in range(32):
            if tl.sum(bad.to(tl.int32)) > 0:
                mid = (lo + hi) // 2
                fm, gm = _scan_row(p_x, vocab, bad, t, mid, strict, p_bv, p_bi, CAP, BLOCK_V, False)
                up = bad & (fm >= k)
                lo = tl.where(up, mid, lo)
                hi = tl.where(bad & ~up, mid, hi)
                f = tl.where(up, fm, f)
                g = tl.where(up, gm, g)
                bad = bad & (f > CAP) & (g >= k)
    strict = m_row & (f > CAP)
    if n_bad + tl.sum(strict.to(tl.int32)) > 0:  # lo moved, or only the entries above it fit
        _scan_row(p_x, vocab, m_row, t, lo, strict, p_bv, p_bi, CAP, BLOCK_V, True)
    # 3. thresholds and the draw
    n_buf = tl.where(strict, g, f)
    m_buf = m_row[:, None] & (o_c < n_buf[:, None])
    b_y = tl.load(p_bv + o_c, mask=m_buf, other=float("-inf"))
    b_u = tl.where(m_buf, _key(b_y), 0)
    n_tie = tl.where(strict, f - g, 0).to(tl.int64)
    y_tie = _unkey(lo)
    top = tl.maximum(tl.max(b_y, axis=1), tl.where(n_tie > 0, y_tie, float("-inf")))
    b_e = tl.where(m_buf, tl.exp(b_y - top[:, None]), 0.0)
    e_tie = tl.where(n_tie > 0, tl.exp(y_tie - top), 0.0)
    thr = _largest_key(b_u, m_buf.to(tl.int64), lo, n_tie, k.to(tl.int64))
    mass = tl.sum(tl.where(b_u >= thr[:, None], b_e, 0.0), axis=1) + tl.where(lo >= thr, n_tie * e_tie, 0.0)
    use_p = m_row & (p < 1.0)
    if tl.sum(use_p.to(tl.int32)) > 0:
        thr_p = _largest_key(b_u, b_e, lo, n_tie * e_tie, p * mass)
        thr = tl.where(use_p, tl.maximum(thr, thr_p), thr)
    kept = m_buf & (b_u >= thr[:, None])
    cdf = tl.cumsum(tl.where(kept, b_e, 0.0), axis=1)  # [S, CAP]
    in_buf = tl.max(cdf, axis=1)
    ties = tl.where(lo >= thr, n_tie, 0)
    goal = u01 * (in_buf + ties * e_tie)
    hit = kept & (cdf > goal[:, None])
    first = tl.min(tl.where(hit, o_c, CAP), axis=1)
    last = tl.max(tl.where(kept, o_c, -1), axis=1)
    pick = tl.where(first < CAP, first, last)
    col = tl.sum(tl.where(o_c == pick[:, None], tl.load(p_bi + o_c, mask=m_buf, other=0), 0), axis=1).to(tl.int64)
    from_ties = m_row & (ties > 0) & (first == CAP)
    if tl.sum(from_ties.to(tl.int32)) > 0:
        nth = ((goal - in_buf) / tl.where(e_tie > 0, e_tie, 1.0)).to(tl.int64)
        nth = tl.minimum(tl.maximum(nth, 0), ties - 1)
        col = tl.where(from_ties, _nth_equal(p_x, vocab, from_ties, t, lo, nth, BLOCK_V), col)
    return col


@triton.jit
def _sample_full(p_x, vocab, m_row, t, greedy, u01, BLOCK_V: tl.constexpr, UNROLL: tl.constexpr):
    """One sample per row of ``softmax(x / t)`` (no top-k, no top-p), ``[S]`` int64, by inverse
    CDF at ``u01``; ``greedy`` rows: the first argmax. Two passes over the row."""
    o_v = tl.arange(0, BLOCK_V)[None, :]
    b_old = tl.full([p_x.shape[0], BLOCK_V], float("-inf"), tl.float32)
    b_s = tl.zeros([p_x.shape[0], BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V * UNROLL):
        for j in tl.static_range(UNROLL):
            c = v0 + j * BLOCK_V + o_v
            y = tl.math.div_rn(tl.load(p_x + c, mask=m_row[:, None] & (c < vocab), other=float("-inf")).to(tl.float32), t[:, None])
            b_m = tl.maximum(b_old, y)
            b_ref = tl.where(b_m > float("-inf"), b_m, 0.0)
            b_s = b_s * tl.exp(b_old - b_ref) + tl.exp(y - b_ref)
            b_old = b_m
    top = tl.max(b_old, axis=1)
    top = tl.where(top > float("-inf"), top, 0.0)
    goal = u01 * tl.sum(b_s * tl.exp(b_old - top[:, None]), axis=1)
    run = tl.zeros(top.shape, tl.float32)
    col = tl.full(top.shape, -1, tl.int64)
    last = tl.zeros(top.shape, tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        m = m_row[:, None] & (v0 + o_v < vocab)
        y = tl.math.div_rn(tl.load(p_x + v0 + o_v, mask=m, other=float("-inf")).to(tl.float32), t[:, None])
        w = tl.where(m, tl.where(greedy[:, None], (y == top[:, None]).to(tl.float32), tl.exp(y - top[:, None])), 0.0)
        cdf = run[:, None] + tl.cumsum(w, axis=1)
        first = tl.min(tl.where((cdf > goal[:, None]) & (w > 0), v0 + o_v, vocab), axis=1).to(tl.int64)
        col = tl.where((col < 0) & (first < vocab), first, col)
        last = tl.maximum(last, tl.max(tl.where(w > 0, v0 + o_v, 0), axis=1).to(tl.int64))
        run = tl.max(cdf, axis=1)
    return tl.where(col >= 0, col, last)


@triton.jit(do_not_specialize=["num_seqs", "max_depth", "stride_tree", "seq_rows", "stride_out", "temp_val",
                               "top_k", "top_p_val"])
def _walk_kernel(
    tok, par, num_nodes, tgt, starts,
    temp, top_p, seed, buf_v, buf_i,
    acc, acc_tok, new_tok, lengths, bonus,
    num_seqs, max_depth, vocab,
    stride_tree, seq_rows, stride_row, stride_out,
    temp_val, top_k, top_p_val,
    USE_STARTS: tl.constexpr,
    SAMPLE: tl.constexpr,
    TOP_K: tl.constexpr,
    TEMP_ROWS: tl.constexpr,
    TOP_P_ROWS: tl.constexpr,
    CAP: tl.constexpr,
    SEQS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """The walks of sequences ``program_id(0) * SEQS ..``: :func:`_walk`."""
    _walk(tl.program_id(0), tok, par, num_nodes, tgt, starts, temp, top_p, seed, buf_v, buf_i,
          acc, acc_tok, new_tok, lengths, bonus, num_seqs, max_depth, vocab,
          stride_tree, seq_rows, stride_row, stride_out, temp_val, top_k, top_p_val,
          USE_STARTS, SAMPLE, TOP_K, TEMP_ROWS, TOP_P_ROWS, CAP, SEQS, BLOCK_N, BLOCK_D, BLOCK_V, UNROLL)


@triton.jit
def _walk(
    i_s,
    tok, par, num_nodes, tgt, starts,
    temp, top_p, seed, buf_v, buf_i,
    acc, acc_tok, new_tok, lengths, bonus,
    num_seqs, max_depth, vocab,
    stride_tree, seq_rows, stride_row, stride_out,
    temp_val, top_k, top_p_val,
    USE_STARTS: tl.constexpr,
    SAMPLE: tl.constexpr,
    TOP_K: tl.constexpr,
    TEMP_ROWS: tl.constexpr,
    TOP_P_ROWS: tl.constexpr,
    CAP: tl.constexpr,
    SEQS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """The walks of sequences ``i_s * SEQS ..``: from the root, move to the lowest-index child
    whose token is the target's token at the current node, while one exists (at most
    ``max_depth`` moves); the program stops when all its walks have.

    tok, par: ``[B, n]`` int64 (row stride ``stride_tree``, unit column stride), -1 padded.
    Node j of sequence b is flat row ``r = starts[b] + j`` (USE_STARTS) or ``b * seq_rows + j``.
    The target's token at a node: ``tgt[r]`` (int64 tokens), or SAMPLE: one sample of the
    filtered target logits ``tgt[r * stride_row + :vocab]`` at the uniform ``rand(seed, r)``, only
    for the nodes the walk reaches. Filtering as :func:`kdtree_engine.ddtree.filter_logits`:
    temperature (``temp[r]`` or ``temp_val``; <= 0: greedy), TOP_K: int top-k ``top_k`` (else no
    top-k and no top-p), top-p (``top_p[r]`` or ``top_p_val``; >= 1: off); ``buf_v``/``buf_i``:
    ``[programs * SEQS, CAP]`` float32/int32 candidate buffers.
    acc, acc_tok, new_tok: ``[B, max_depth+1]`` int64 (row stride ``stride_out``, BLOCK_D >= its
    width); lengths, bonus: ``[B]``. Target tokens are read past L1 (``.cg``): the greedy
    kernel's walk reads tokens other programs wrote.
    """
    o_s = i_s * SEQS + tl.arange(0, SEQS)
    m_s = o_s < num_seqs
    o_n = tl.arange(0, BLOCK_N)
    size = tl.load(num_nodes + o_s, mask=m_s, other=0)  # [S]
    m_sn = o_n[None, :] < size[:, None]  # [S, BN]
    p_tree = o_s.to(tl.int64) * stride_tree  # [S]
    b_par = tl.load(par + p_tree[:, None] + o_n[None, :], mask=m_sn, other=-2)  # [S, BN]
    b_tok = tl.load(tok + p_tree[:, None] + o_n[None, :], mask=m_sn, other=-1)  # [S, BN]
    if USE_STARTS:
        row0 = tl.load(starts + o_s, mask=m_s, other=0).to(tl.int64)  # [S]
    else:
        row0 = o_s.to(tl.int64) * seq_rows
    p_out = o_s.to(tl.int64) * stride_out  # [S]
    o_d = tl.arange(0, BLOCK_D)[None, :]
    m_d = m_s[:, None] & (o_d <= max_depth)
    pad = tl.full([SEQS, BLOCK_D], -1, tl.int64)
    tl.store(acc + p_out[:, None] + o_d, tl.where(o_d == 0, 0, pad), mask=m_d)
    root_tok = tl.load(tok + p_tree, mask=m_s, other=-1)
    tl.store(acc_tok + p_out[:, None] + o_d, tl.where(o_d == 0, root_tok[:, None], pad), mask=m_d)
    tl.store(new_tok + p_out[:, None] + o_d, pad, mask=m_d)
    p_buf = o_s.to(tl.int64)[:, None] * CAP  # [S, 1] (programs own consecutive rows)
    cur = tl.zeros([SEQS], tl.int64)
    alive = m_s
    length = tl.full([SEQS], 1, tl.int64)
    last = tl.full([SEQS], -1, tl.int64)
    depth_cap = tl.zeros([SEQS], tl.int32) + max_depth  # a node at max_depth has no children
    for d in range(max_depth + 1):
        if tl.sum(alive.to(tl.int32)) > 0:
            row = row0 + cur
            if SAMPLE:
                if TEMP_ROWS:
                    t = tl.load(temp + row, mask=alive, other=1.0).to(tl.float32)
                else:
                    t = tl.zeros([SEQS], tl.float32) + temp_val
                greedy = t <= 0.0
                t = tl.where(greedy, 1.0, t)
                u01 = tl.where(greedy, 0.0, tl.rand(tl.load(seed), row.to(tl.int32)))
                p_x = tgt + row[:, None] * stride_row  # [S, 1]
                if TOP_K:
                    if TOP_P_ROWS:
                        p = tl.load(top_p + row, mask=alive, other=2.0).to(tl.float32)
                    else:
                        p = tl.zeros([SEQS], tl.float32) + top_p_val
                    k = tl.where(greedy, 1, tl.zeros([SEQS], tl.int32) + top_k)
                    want = _sample_top_k(p_x, vocab, alive, t, k, tl.where(greedy, 2.0, p), u01,
                                         buf_v + p_buf, buf_i + p_buf, CAP, BLOCK_V, UNROLL)
                else:
                    want = _sample_full(p_x, vocab, alive, t, greedy, u01, BLOCK_V, UNROLL)
            else:
                want = tl.load(tgt + row, mask=alive, other=-1, cache_modifier=".cg")  # [S]
            hit = (b_par == cur[:, None]) & (b_tok == want[:, None])
            nxt = tl.min(tl.where(hit, o_n[None, :], BLOCK_N), axis=1).to(tl.int64)  # [S]
            found = (nxt < BLOCK_N) & alive & (depth_cap > d)
            nxt_tok = tl.load(tok + p_tree + nxt, mask=found, other=-1)
            tl.store(acc + p_out + d + 1, nxt, mask=found)
            tl.store(acc_tok + p_out + d + 1, nxt_tok, mask=found)
            tl.store(new_tok + p_out + d, tl.where(found, nxt_tok, want), mask=alive)
            last = tl.where(alive & ~found, want, last)
            cur = tl.where(found, nxt, cur)
            alive = found
            length += found.to(tl.int64)
    tl.store(bonus + o_s, last, mask=m_s)
    tl.store(lengths + o_s, length, mask=m_s)


def _walk_outputs(batch: int, max_depth: int, dev):
    """Empty ``acc, acc_tok, new_tok`` (``[B, max_depth+1]``) and ``lengths, bonus`` (``[B]``), int64."""
    acc = torch.empty(batch, max_depth + 1, dtype=torch.int64, device=dev)
    lengths = torch.empty(batch, dtype=torch.int64, device=dev)
    return acc, torch.empty_like(acc), torch.empty_like(acc), lengths, torch.empty_like(lengths)


def _walk_launch(tokens, parents, num_nodes, target, starts, seq_rows: int, max_depth: int, sample=None):
    """Launch :func:`_walk_kernel` on contiguous int64 ``[B, n]`` trees. ``target``: int64 tokens
    (``sample`` None) or float logits ``[T, V]`` with unit column stride; node j of sequence b is
    row ``starts[b] + j``, or ``b * seq_rows + j`` with ``starts`` None. ``sample``: dict with
    ``temp``/``top_p`` (``[T]`` tensors or floats), ``top_k`` (int, 0: no top-k) and ``seed``
    (``[1]`` int64 tensor)."""
    B, n = tokens.shape
    dev = tokens.device
    acc, acc_tok, new_tok, lengths, bonus = _walk_outputs(B, max_depth, dev)
    block_n = block_of(n)
    s = sample or {}
    vocab = target.shape[1] if sample else 1
    top_k = s.get("top_k", 0)
    block_v = min(triton.next_power_of_2(vocab), SAMPLE_BLOCK_V) if sample else 1
    cap_min = SAMPLE_CAP_MIN_INTERPRETED if interpreting() else SAMPLE_CAP_MIN
    cap = max(cap_min, 2 * triton.next_power_of_2(top_k)) if top_k else 1
    if not sample:
        seqs = _seqs_per_program(B, block_n)
    elif interpreting():
        seqs = min(triton.next_power_of_2(B), max(1, 2**16 // max(block_v, cap, block_n)))
    else:
        seqs = 1  # a row of the vocabulary per program and step
    grid = triton.cdiv(B, seqs)
    buf_v = torch.empty(grid * seqs * cap if top_k else 1, dtype=torch.float32, device=dev)
    buf_i = torch.empty(buf_v.shape, dtype=torch.int32, device=dev)
    temp, top_p = s.get("temp", 1.0), s.get("top_p", 2.0)
    temp_rows, top_p_rows = isinstance(temp, torch.Tensor), isinstance(top_p, torch.Tensor)
    _walk_kernel[(grid,)](
        tokens, parents, num_nodes, target, target if starts is None else starts,
        temp if temp_rows else buf_v, top_p if top_p_rows else buf_v, s.get("seed", lengths), buf_v, buf_i,
        acc, acc_tok, new_tok, lengths, bonus,
        B, max_depth, vocab,
        tokens.stride(0), seq_rows, target.stride(0) if sample else 1, acc.stride(0),
        1.0 if temp_rows else float(temp), top_k, 2.0 if top_p_rows else float(top_p),
        USE_STARTS=starts is not None,
        SAMPLE=bool(sample),
        TOP_K=top_k > 0,
        TEMP_ROWS=temp_rows,
        TOP_P_ROWS=top_p_rows,
        CAP=cap,
        SEQS=seqs,
        BLOCK_N=block_n,
        BLOCK_D=block_of(max_depth + 1),
        BLOCK_V=block_v,
        UNROLL=STREAM_UNROLL,
        num_warps=8 if sample and block_v >= 2048 else 4,
    )
    return acc, acc_tok, new_tok, lengths, bonus


def walk(tokens, parents, num_nodes, target, starts, max_depth: int):
    """The walk on given target tokens: ``target`` int64 ``[B, n]`` (``starts`` None, unit column
    stride, row stride ``n``) or flat ``[T]`` with sequence b at ``starts[b]``.

    Returns ``(accepted, accepted_tokens, new_tokens, lengths, bonus)``."""
    seq_rows = target.stride(0) if starts is None else 0
    return _walk_launch(tokens, parents, num_nodes, target, starts, seq_rows, max_depth)


def sample_walk(tokens, parents, num_nodes, logits, starts, max_depth: int, *, temp, top_k: int, top_p, seed):
    """The walk sampling the target along it: ``logits [T, V]`` (unit column stride), sequence b's
    node j at row ``starts[b] + j`` (or ``b * n + j`` with ``starts`` None). ``temp``, ``top_p``:
    floats or ``[T]`` float32 tensors; ``top_k``: int in ``[0, MAX_FUSED_TOP_K]`` (0: no top-k,
    then no top-p either); ``seed``: ``[1]`` int64. Same returns as :func:`walk`."""
    return _walk_launch(tokens, parents, num_nodes, logits, starts, tokens.shape[1], max_depth,
                        dict(temp=temp, top_k=top_k, top_p=top_p, seed=seed))


GREEDY_BLOCK_V = 2048  # lanes of the greedy argmax: columns per chunk (STREAM_UNROLL chunks a step)


@triton.jit
def _greedy_step(p_x, v0, vocab, m_r, best, at,
                 BLOCK_V: tl.constexpr, UNROLL: tl.constexpr, TAIL: tl.constexpr):
    """One step of the greedy argmax of rows ``p_x`` (``[R, 1]`` pointers, read where ``m_r``
    ``[R, 1]``): lane l reads columns ``v0 + u * BLOCK_V + l``, u < UNROLL (TAIL: those past
    ``vocab`` are -inf; else none is past it). Returns ``best``, ``at`` (``[R, BLOCK_V]``
    float32, int32) updated: a lane's largest value so far (NaN above every number, and kept once
    seen) and the ``v0`` of the first step that reached it. Per column one NaN-propagating max;
    the compare with ``best`` is per lane and step."""
    o_v = tl.arange(0, BLOCK_V)[None, :]
    top = tl.full(best.shape, float("-inf"), tl.float32)
    for u in tl.static_range(UNROLL):
        p = p_x + (v0 + u * BLOCK_V) + o_v
        if TAIL:  # -inf after the conversion: float8 e4m3 has no -inf to load as `other`
            m = m_r & (o_v < vocab - (v0 + u * BLOCK_V))
            x = tl.where(m, tl.load(p, mask=m).to(tl.float32), float("-inf"))
        else:
            x = tl.load(p, mask=m_r).to(tl.float32)
        top = tl.maximum(top, x, propagate_nan=tl.PropagateNan.ALL)
    up = ~(top <= best) & (best == best)  # above the lane's best, or its first NaN
    return tl.where(up, top, best), tl.where(up, v0, at)


@triton.jit(do_not_specialize=["max_depth", "stride_tree", "seq_rows", "stride_out"])
def _greedy_kernel(
    logits, tgt, count,
    tok, par, num_nodes, starts,
    acc, acc_tok, new_tok, lengths, bonus,
    num_seqs, max_depth, vocab,
    stride_tree, seq_rows, stride_row, stride_out,
    USE_STARTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    UNROLL: tl.constexpr,
    NODES: tl.constexpr,
):
    """Greedy acceptance in one launch; program ``(b, i)`` for nodes ``i * NODES ..`` of sequence b
    (one node per program on a GPU; under the interpreter, which runs programs one after another,
    a block of them).

    logits: ``[T, V]`` any float dtype, compared as float32 (row stride ``stride_row``, unit
    column stride); node j of sequence b is row ``r = starts[b] + j`` (USE_STARTS) or
    ``b * seq_rows + j``.
    tgt: ``[T]`` int64 scratch, the argmax of each row (first column among ties; NaN above every
    number, as ``torch.argmax``). count: ``[B]`` int32, zero on entry and left zero on exit.
    tok, par, num_nodes, acc, .., bonus: as :func:`_walk`.

    The argmax (:func:`_greedy_step`): each lane keeps its largest value and the step that first
    reached it; of the lanes holding the row's largest value, those of the earliest such step
    re-read that step for their first column holding it; the row's argmax is the least of those.

    A program stores its rows' argmaxes (rows past ``num_nodes[b]``: none), then counts itself
    in ``count[b]`` (an acq_rel atomic, after a barrier: the store is visible before the count);
    the program that completes sequence b's count walks it (:func:`_walk`, reading the tokens
    past L1) and zeroes ``count[b]`` (every other program of b has counted by then), so the next
    launch on the same stream can take the same counter without zeroing it.
    """
    b = tl.program_id(0)
    j = tl.program_id(1) * NODES + tl.arange(0, NODES)  # [NODES]
    m_j = j < tl.load(num_nodes + b)
    if USE_STARTS:
        row = tl.load(starts + b).to(tl.int64) + j
    else:
        row = b.to(tl.int64) * seq_rows + j
    if tl.sum(m_j.to(tl.int32)) > 0:
        p_x = logits + row[:, None] * stride_row  # [NODES, 1]
        m_r = m_j[:, None]
        best = tl.full([NODES, BLOCK_V], float("-inf"), tl.float32)
        at = tl.zeros([NODES, BLOCK_V], tl.int32)
        full = vocab - vocab % (BLOCK_V * UNROLL)
        for v0 in range(0, full, BLOCK_V * UNROLL):
            best, at = _greedy_step(p_x, v0, vocab, m_r, best, at, BLOCK_V, UNROLL, False)
        for v0 in range(full, vocab, BLOCK_V):  # the rest, one chunk a step
            best, at = _greedy_step(p_x, v0, vocab, m_r, best, at, BLOCK_V, 1, True)
        # the lanes holding the row's largest value (NaN above every number), of those the ones
        # whose step ``at`` is the earliest, ``a`` (steps hold ordered, disjoint columns: the
        # row's first such column is in step a). Each takes its first column holding the value
        # (or a NaN) in the chunks from a, last to first: the last hit stays. A tail step (one
        # chunk) hits at chunk 0; a hit past vocab (`other`) is overwritten, or is on a lane with
        # no column (vocab < BLOCK_V, a row of -inf), which loses the min to lane 0
        nan = best != best
        top = tl.max(tl.where(nan, float("-inf"), best), axis=1)[:, None]
        win = m_r & tl.where(tl.max(nan.to(tl.int32), axis=1)[:, None] > 0, nan, best == top)
        a = tl.min(tl.where(win, at, vocab), axis=1)[:, None]
        win = win & (at == a)
        c = a + tl.arange(0, BLOCK_V)[None, :]
        col = c
        for i in range(UNROLL):
            c_u = c + (UNROLL - 1 - i) * BLOCK_V
            x = tl.load(p_x + c_u, mask=win & (c_u < vocab), other=float("-inf")).to(tl.float32)
            col = tl.where((x == best) | (x != x), c_u, col)
        tl.store(tgt + row, tl.min(tl.where(win, col, vocab), axis=1).to(tl.int64), mask=m_j)
    tl.debug_barrier()
    if tl.atomic_add(count + b, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
        _walk(b, tok, par, num_nodes, tgt, starts, tgt, tgt, tgt, tgt, tgt,
              acc, acc_tok, new_tok, lengths, bonus, num_seqs, max_depth, vocab,
              stride_tree, seq_rows, 1, stride_out, 1.0, 0, 2.0,
              USE_STARTS, False, False, False, False, 1, 1, BLOCK_N, BLOCK_D, 1, UNROLL)
        tl.store(count + b, 0)


def greedy_walk(tokens, parents, num_nodes, logits, starts, max_depth: int, count=None):
    """Greedy acceptance in one launch (:func:`_greedy_kernel`): the argmax of every row of
    ``logits [T, V]`` (unit column stride), then the walk on them. Node j of sequence b is row
    ``starts[b] + j`` (or ``b * n + j`` with ``starts`` None). ``count``: int32 ``[>= B]`` zeros,
    left zero (None: a zeroed one per call). Same returns as :func:`walk`."""
    B, n = tokens.shape
    dev = tokens.device
    acc, acc_tok, new_tok, lengths, bonus = _walk_outputs(B, max_depth, dev)
    vocab = logits.shape[1]
    tgt = torch.empty(logits.shape[0], dtype=torch.int64, device=dev)
    if count is None:
        count = torch.zeros(B, dtype=torch.int32, device=dev)
    block_v = min(triton.next_power_of_2(vocab), GREEDY_BLOCK_V)
    nodes = min(triton.next_power_of_2(n), max(1, 2**16 // block_v)) if interpreting() else 1
    _greedy_kernel[(B, triton.cdiv(n, nodes))](
        logits, tgt, count,
        tokens, parents, num_nodes, tgt if starts is None else starts,
        acc, acc_tok, new_tok, lengths, bonus,
        B, max_depth, vocab,
        tokens.stride(0), n, logits.stride(0), acc.stride(0),
        USE_STARTS=starts is not None,
        BLOCK_N=block_of(n),
        BLOCK_D=block_of(max_depth + 1),
        BLOCK_V=block_v,
        UNROLL=STREAM_UNROLL,
        NODES=nodes,
        num_warps=8,
    )
    return acc, acc_tok, new_tok, lengths, bonus


# ----------------------------------------------------------------------------------------------
# the best-first expansion

EXPAND_TIERS = (256, 1024)  # candidate blocks sorted when few survive (else the whole candidate block)
PAIR_CHUNK = 1024  # candidates scanned per step of the pruning pass
EXPAND_INTERPRETED_SLOTS = 2**16  # the interpreter's candidate slots per program (sequences x BLOCK_C)


@triton.jit
def _count_below(p_arr, n, x, STEPS: tl.constexpr, RANK_SORT: tl.constexpr, CHUNK: tl.constexpr):
    """``#{j < n : arr[j] < x}`` for each element of ``x`` (int64 ``[S, N]``), ``arr`` ascending
    at ``p_arr`` (``[S, 1]`` pointers, ``n`` ``[S, 1]``): a lower-bound binary search, ``STEPS >=
    log2(n + 1)`` rounds of gathers; under the interpreter (RANK_SORT), whose cost is per
    operation, by counting, CHUNK entries of ``arr`` at a time (``N`` of them at most)."""
    if RANK_SORT:
        N: tl.constexpr = x.shape[1]
        lo = tl.zeros(x.shape, tl.int32)
        for j in range(0, N, CHUNK):
            o_j = j + tl.arange(0, CHUNK)[None, :]
            b_j = tl.load(p_arr + o_j, mask=o_j < n, other=_INT64_MAX)  # [S, CH]; padding never < x
            lo += tl.sum((b_j[:, None, :] < x[:, :, None]).to(tl.int32), axis=2)
        return lo
    else:
        lo = tl.zeros(x.shape, tl.int32)
        hi = tl.zeros(x.shape, tl.int32) + n
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            live = mid < hi
            go = live & (tl.load(p_arr + mid, mask=live, other=0) < x)
            lo = tl.where(go, mid + 1, lo)
            hi = tl.where(live & ~go, mid, hi)
        return lo


@triton.jit
def _sort_depth(p_cand, n_s, keep, d, p_dkey, p_dglob, p_tmp, S, SLOT_BITS, DEPTH_BITS,
                N: tl.constexpr, RANK_SORT: tl.constexpr, CHUNK: tl.constexpr):
    """Per sequence (``[SEQS, 1]`` pointers, ``[SEQS]`` counts): sort the ``n_s <= N`` candidate
    keys at ``p_cand`` and store the first ``keep`` of them, in key order, as depth ``d + 1``'s kept
    nodes: within-depth keys at ``p_dkey``, global keys ``(-score) << (SLOT_BITS + DEPTH_BITS) |
    depth << SLOT_BITS | slot`` at ``p_dglob``."""
    o = tl.arange(0, N)[None, :]
    b_key = tl.load(p_cand + o, mask=o < n_s[:, None], other=_INT64_MAX)
    b_key, b_pos = _ranked(b_key, p_tmp, RANK_SORT, CHUNK)
    m = b_pos < keep[:, None]
    tl.store(p_dkey + b_pos, b_key, mask=m)
    dep = tl.zeros([], tl.int64) + d + 1
    glob = ((b_key >> S) << (SLOT_BITS + DEPTH_BITS)) | (dep << SLOT_BITS) | b_pos
    tl.store(p_dglob + b_pos, glob, mask=m)


@triton.jit(do_not_specialize=["num_seqs", "depth_cap", "n_draft", "stride_top", "stride_scratch", "stride_emit",
                               "stride_out"])
def _expand_kernel(
    lp, ids, roots, pairs, pair_end,
    scratch, emit,
    out_tok, out_par, out_dep, out_rank, out_score, out_num,
    num_seqs, depth_cap, n_draft,
    stride_top, stride_scratch, stride_emit, stride_out,
    K: tl.constexpr,
    BUDGET: tl.constexpr,
    S: tl.constexpr,
    SLOT_BITS: tl.constexpr,
    DEPTH_BITS: tl.constexpr,
    SEQS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    TIER_S: tl.constexpr,
    TIER_M: tl.constexpr,
    STEPS: tl.constexpr,
    RANK_SORT: tl.constexpr,
    CHUNK_S: tl.constexpr,
    CHUNK_M: tl.constexpr,
    CHUNK_C: tl.constexpr,
    CHUNK_G: tl.constexpr,
):
    """The DDTrees of sequences ``program_id(0) * SEQS ..`` (see
    :func:`kdtree_engine.ddtree.expand_topk`): one sequence per program on a GPU (SEQS = 1); under
    the interpreter, which runs programs one after another, a block of them, each sequence a row
    of every tensor (per-sequence counts are ``[SEQS]``; loop bounds and the sort block are the
    block's largest, the rest masked per sequence).

    lp, ids: ``[B, L, K]`` int64, contiguous per sequence (row stride ``stride_top``).
    pairs: int64 ``parent slot * K + rank`` for every parent slot ``i < BUDGET`` and rank
    ``r < min(K, BUDGET // (i + 1))``, by slot then rank; ``pair_end[i]`` (``[BUDGET + 1]``) is the
    number of pairs of the slots below ``i``.
    scratch: ``[programs * SEQS, stride_scratch]`` int64, per sequence ``depth_cap * BUDGET``
    within-depth keys (depth-major), ``BLOCK_C`` candidates, ``BLOCK_G`` global keys of the current
    depth, two ``BLOCK_G`` buffers of the running tree, then (interpreter only) ``BLOCK_C`` for the
    ranks.
    emit: ``[B, depth_cap * BUDGET]`` int32 scratch (node index of a kept node).
    out_*: ``[B, n_draft+1]`` int64 (row stride ``stride_out``): token, parent, depth, rank,
    score; out_num: ``[B]`` int64, ``n_draft + 1``.

    Per depth: the kept nodes of the depth above are in key order (slot = position); a candidate
    child ``(i, r)`` has the within-depth key ``(-score) << S | i * K + r``. A candidate survives
    when its score beats the ``BUDGET``-th node of the running tree (the best ``BUDGET`` of the
    depths above, a sorted list): otherwise ``BUDGET`` shallower nodes come before it, and before
    its descendants. The survivors are a prefix of the depth's key order, found by one pass over
    the pairs of the parents that can still have one; they are sorted in the smallest block that
    holds them (``TIER_S``, ``TIER_M`` or ``BLOCK_C``) and the first ``BUDGET`` kept; the running
    tree becomes the best ``BUDGET`` of itself and them (a merge: each element's new position is
    its own plus the number of smaller elements of the other list, by binary search). The running
    tree after the last depth is the tree in emission order.
    """
    o_s = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    m_s = o_s < num_seqs
    i_s = o_s.to(tl.int64)  # [SEQS]
    p_lp = lp + i_s * stride_top  # [SEQS]
    p_seq = scratch + i_s * stride_scratch  # [SEQS]
    p_dkey = p_seq[:, None]  # [SEQS, 1]: depth_cap * BUDGET
    p_cand = p_dkey + depth_cap * BUDGET  # BLOCK_C
    p_dglob = p_cand + BLOCK_C  # BLOCK_G
    p_g = p_seq + depth_cap * BUDGET + BLOCK_C + BLOCK_G  # [SEQS]: 2 * BLOCK_G
    p_tmp = p_g[:, None] + 2 * BLOCK_G  # BLOCK_C (interpreter only)
    p_emit = emit + i_s[:, None] * stride_emit
    o_g = tl.arange(0, BLOCK_G)[None, :]
    o_p = tl.arange(0, BLOCK_P)[None, :]
    low = (1 << S) - 1
    m_prev = m_s.to(tl.int32)  # the root: one parent, score 0 (sequences past the batch: none)
    g_n = tl.zeros([SEQS], tl.int32)  # nodes in the running tree
    neg_t = tl.full([SEQS], _INT64_MAX, tl.int64)  # -score of its BUDGET-th node (none yet: no bound)
    cur = tl.zeros([SEQS], tl.int32)  # which of the two buffers holds it
    for d in range(depth_cap):
        if tl.max(m_prev, axis=0) > 0:
            p_par = p_dkey + (d - 1) * BUDGET  # the kept nodes of the depth above
            b_par = tl.load(p_par + o_g, mask=(o_g < m_prev[:, None]) & (d > 0), other=0) >> S
            x0 = -tl.load(p_lp + d * K, mask=m_prev > 0, other=0)  # the cheapest child
            live = (o_g < m_prev[:, None]) & (b_par + x0[:, None] < neg_t[:, None])
            n_pairs = tl.load(pair_end + tl.sum(live.to(tl.int32), axis=1))  # [SEQS]
            n_max = tl.max(n_pairs, axis=0)
            n_s = tl.zeros([SEQS], tl.int32)
            for c0 in range(0, n_max, BLOCK_P):
                sec = tl.load(pairs + c0 + o_p, mask=c0 + o_p < n_max, other=0)  # [1, BP]
                m_c = c0 + o_p < n_pairs[:, None]  # [SEQS, BP]
                neg = tl.load(p_par + sec // K, mask=m_c & (d > 0), other=0) >> S
                neg -= tl.load(p_lp[:, None] + d * K + sec % K, mask=m_c, other=0)
                ok = m_c & (neg < neg_t[:, None])
                tl.store(p_cand + n_s[:, None] + tl.cumsum(ok.to(tl.int32), axis=1) - 1, (neg << S) | sec, mask=ok)
                n_s += tl.sum(ok.to(tl.int32), axis=1)
            tl.debug_barrier()
            keep = tl.minimum(n_s, BUDGET)
            n_big = tl.max(n_s, axis=0)
            if d == 0:  # the root's children: ranks 0.. already in key order
                m_k = o_g < keep[:, None]
                b_k = tl.load(p_cand + o_g, mask=m_k, other=0)
                tl.store(p_dkey + o_g, b_k, mask=m_k)
                tl.store(p_dglob + o_g, ((b_k >> S) << (SLOT_BITS + DEPTH_BITS)) | (1 << SLOT_BITS) | o_g, mask=m_k)
            elif n_big == 0:
                pass
            elif n_big <= TIER_S:
                _sort_depth(p_cand, n_s, keep, d, p_dkey + d * BUDGET, p_dglob, p_tmp, S, SLOT_BITS, DEPTH_BITS,
                            TIER_S, RANK_SORT, CHUNK_S)
            elif n_big <= TIER_M:
                _sort_depth(p_cand, n_s, keep, d, p_dkey + d * BUDGET, p_dglob, p_tmp, S, SLOT_BITS, DEPTH_BITS,
                            TIER_M, RANK_SORT, CHUNK_M)
            else:
                _sort_depth(p_cand, n_s, keep, d, p_dkey + d * BUDGET, p_dglob, p_tmp, S, SLOT_BITS, DEPTH_BITS,
                            BLOCK_C, RANK_SORT, CHUNK_C)
            if n_big > 0:  # merge the depth into the running tree, keep its best BUDGET
                tl.debug_barrier()
                merging = keep > 0  # [SEQS]
                p_old = (p_g + cur * BLOCK_G)[:, None]
                p_new = (p_g + (1 - cur) * BLOCK_G)[:, None]
                m_e = o_g < keep[:, None]
                b_e = tl.load(p_dglob + o_g, mask=m_e, other=0)
                pos_e = o_g + _count_below(p_old, g_n[:, None], b_e, STEPS, RANK_SORT, CHUNK_G)
                m_o = merging[:, None] & (o_g < g_n[:, None])
                b_o = tl.load(p_old + o_g, mask=m_o, other=0)
                pos_o = o_g + _count_below(p_dglob, keep[:, None], b_o, STEPS, RANK_SORT, CHUNK_G)
                tl.store(p_new + pos_e, b_e, mask=m_e & (pos_e < BUDGET))
                tl.store(p_new + pos_o, b_o, mask=m_o & (pos_o < BUDGET))
                g_n = tl.where(merging, tl.minimum(g_n + keep, BUDGET), g_n)
                cur = tl.where(merging, 1 - cur, cur)
                tl.debug_barrier()
                full = merging & (g_n >= BUDGET)
                last = tl.load(p_g + cur * BLOCK_G + BUDGET - 1, mask=full, other=0) >> (SLOT_BITS + DEPTH_BITS)
                neg_t = tl.where(full, last, neg_t)
            m_prev = keep

    # the running tree is the tree: node q + 1 is its q-th entry (depth, slot)
    m_q = m_s[:, None] & (o_g < n_draft)
    b_q = tl.load((p_g + cur * BLOCK_G)[:, None] + o_g, mask=m_q, other=0)
    e_dep = (b_q >> SLOT_BITS) & ((1 << DEPTH_BITS) - 1)
    e_slot = b_q & ((1 << SLOT_BITS) - 1)
    tl.store(p_emit + (e_dep - 1) * BUDGET + e_slot, o_g + 1, mask=m_q)
    tl.debug_barrier()
    e_sec = tl.load(p_dkey + (e_dep - 1) * BUDGET + e_slot, mask=m_q, other=0) & low
    e_rank = e_sec % K
    m_p = m_q & (e_dep > 1)
    e_parent = tl.load(p_emit + (e_dep - 2) * BUDGET + e_sec // K, mask=m_p, other=0).to(tl.int64)
    e_tok = tl.load(ids + i_s[:, None] * stride_top + (e_dep - 1) * K + e_rank, mask=m_q, other=0)
    p_node = i_s[:, None] * stride_out + 1 + o_g
    tl.store(out_tok + p_node, e_tok, mask=m_q)
    tl.store(out_par + p_node, e_parent, mask=m_q)
    tl.store(out_dep + p_node, e_dep, mask=m_q)
    tl.store(out_rank + p_node, e_rank, mask=m_q)
    tl.store(out_score + p_node, -(b_q >> (SLOT_BITS + DEPTH_BITS)), mask=m_q)
    # the roots
    p_root = i_s * stride_out
    zero = tl.zeros([SEQS], tl.int64)
    tl.store(out_tok + p_root, tl.load(roots + i_s, mask=m_s, other=0), mask=m_s)
    tl.store(out_par + p_root, zero - 1, mask=m_s)
    tl.store(out_dep + p_root, zero, mask=m_s)
    tl.store(out_rank + p_root, zero - 1, mask=m_s)
    tl.store(out_score + p_root, zero, mask=m_s)
    tl.store(out_num + i_s, zero + n_draft + 1, mask=m_s)


def _bits(x: int) -> int:
    return max(int(x).bit_length(), 1)


def expand_constexprs(B: int, K: int, budget: int, num_pairs: int, depth_cap: int, rank_sort: bool) -> dict:
    """:func:`_expand_kernel`'s constexprs and ``num_warps`` for ``B`` sequences of ``K`` ranks per
    position, a ``budget``-node tree, a candidate table of ``num_pairs`` entries and ``depth_cap``
    depths; ``rank_sort``: under the interpreter (ranks by counting, a block of sequences per program)."""
    block_g = block_of(budget)
    # BLOCK_C twice BLOCK_G at least: else Triton 3.6 miscompiles the kernel for sm_90 as for one-element
    # blocks (see block_of; budget 3 at top-k 2)
    block_c = max(triton.next_power_of_2(num_pairs), 2 * block_g)
    tiers = [min(t, block_c) for t in EXPAND_TIERS]
    seqs = min(triton.next_power_of_2(B), max(1, EXPAND_INTERPRETED_SLOTS // block_c)) if rank_sort else 1
    return dict(K=K, BUDGET=budget, S=_bits(budget * K), SLOT_BITS=_bits(budget), DEPTH_BITS=_bits(depth_cap),
                SEQS=seqs, BLOCK_G=block_g, BLOCK_C=block_c, BLOCK_P=min(PAIR_CHUNK, block_c),
                TIER_S=tiers[0], TIER_M=tiers[1], STEPS=_bits(block_g) + 1, RANK_SORT=rank_sort,
                CHUNK_S=_rank_chunk(seqs, tiers[0]), CHUNK_M=_rank_chunk(seqs, tiers[1]),
                CHUNK_C=_rank_chunk(seqs, block_c), CHUNK_G=_rank_chunk(seqs, block_g),
                num_warps=8 if block_c >= 2048 else 4)


def expand(lp, ids, roots, pairs, pair_end, budget: int, depth_cap: int, n_draft: int):
    """Launch :func:`_expand_kernel` on contiguous int64 ``lp, ids [B, L, K]`` and ``roots [B]``
    (one program per sequence on a GPU; under the interpreter a block of sequences per program,
    about 2**16 candidate slots in all); ``pairs``, ``pair_end``: the candidate table of
    ``(K, budget)`` (see the kernel); ``n_draft``: the draft nodes of every tree, ``min(budget,
    possible nodes)``.

    Returns ``(tokens, parents, depths, ranks, scores)``, each ``[B, n_draft + 1]`` int64 (node 0
    the root), and ``num_nodes`` ``[B]`` int64."""
    B, _, K = lp.shape
    dev = lp.device
    rank_sort = interpreting()
    c = expand_constexprs(B, K, budget, pairs.numel(), depth_cap, rank_sort)
    seqs, block_c, block_g = c["SEQS"], c["BLOCK_C"], c["BLOCK_G"]
    grid = triton.cdiv(B, seqs)
    width = depth_cap * budget + block_c + 3 * block_g + (block_c if rank_sort else 0)
    scratch = torch.empty(grid * seqs, width, dtype=torch.int64, device=dev)  # padding rows: the ranks' scratch
    emit = torch.empty(B, depth_cap * budget, dtype=torch.int32, device=dev)
    num_nodes = torch.empty(B, dtype=torch.int64, device=dev)
    out = torch.empty(5, B, n_draft + 1, dtype=torch.int64, device=dev)
    _expand_kernel[(grid,)](
        lp, ids, roots, pairs, pair_end,
        scratch, emit,
        out[0], out[1], out[2], out[3], out[4], num_nodes,
        B, depth_cap, n_draft,
        lp.stride(0), scratch.stride(0), emit.stride(0), out.stride(1),
        **c,
    )
    return (*out.unbind(0), num_nodes)
