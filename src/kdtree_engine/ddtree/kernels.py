"""Triton kernels of the DDTree step: the draft top-K's finish, the best-first expansion, the
acceptance walk.

One launch each, one program per row or sequence (several under the interpreter, which runs
programs one after another), fixed shapes, no host sync: all can be captured in a CUDA graph
per (batch, budget) bucket. The public functions (:mod:`.tree`, :mod:`.accept`) call
the launchers below; this module imports nothing of theirs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreting

__all__ = ["walk", "expand", "finish_topk"]


# ----------------------------------------------------------------------------------------------
# helpers

_INT64_MAX = tl.constexpr(2**63 - 1)


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



def _seqs_per_program(batch: int, block: int) -> int:
    """Sequences per program: one on a GPU (small trees: up to 1024 elements per program); under
    the interpreter, which runs programs one after another, the batch in few programs."""
    if interpreting():
        return min(triton.next_power_of_2(batch), max(1, 2**16 // block))
    return min(triton.next_power_of_2(batch), max(1, 1024 // block))


# ----------------------------------------------------------------------------------------------
# the draft top-K: log-sum-exp, tie order and fixed point after torch.topk


@triton.jit
def _round_half_even(x):
    """torch.round of float32 ``x``: nearest integer, halves to even (exact: no rounding inside)."""
    f = tl.floor(x)
    r = x - f
    odd = (f - 2.0 * tl.floor(0.5 * f)) != 0.0
    return tl.where((r > 0.5) | ((r == 0.5) & odd), f + 1.0, f)


@triton.jit(do_not_specialize=["num_rows", "vocab", "stride_row"])
def _finish_topk_kernel(
    logits, vals, ids, out_lp, out_ids, tmp,
    num_rows, vocab, stride_row,
    K: tl.constexpr,
    SCALE: tl.constexpr,
    FLOOR: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RANK_SORT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Rows ``i_p * ROWS ..`` of :func:`kdtree_engine.ddtree.draft_topk` after ``torch.topk``.

    logits: ``[R, V]`` any float dtype (row stride ``stride_row``, unit column stride).
    vals, ids: ``[R, K]`` contiguous, the top-K logits and their token ids in any order.
    out_lp, out_ids: ``[R, K]`` int64: ``round(SCALE * max(x - lse, FLOOR))`` and the ids,
    ordered by logit (descending) then id (ascending); the log-sum-exp is online, float32.
    """
    i_p = tl.program_id(0)
    o_r = i_p * ROWS + tl.arange(0, ROWS)
    m_r = o_r < num_rows
    p_x = logits + o_r.to(tl.int64)[:, None] * stride_row  # [R, 1]
    b_old = tl.full([ROWS, BLOCK_V], float("-inf"), tl.float32)  # running max per lane
    b_s = tl.zeros([ROWS, BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)[None, :]
        b_x = tl.load(p_x + o_v, mask=m_r[:, None] & (o_v < vocab), other=float("-inf")).to(tl.float32)
        b_m = tl.maximum(b_old, b_x)
        b_ref = tl.where(b_m > float("-inf"), b_m, 0.0)  # exp(-inf - ref) = 0, never -inf - -inf
        b_s = b_s * tl.exp(b_old - b_ref) + tl.exp(b_x - b_ref)
        b_old = b_m
    m = tl.max(b_old, axis=1)  # [R]
    m = tl.where(m > float("-inf"), m, 0.0)
    lse = m + tl.log(tl.sum(b_s * tl.exp(b_old - m[:, None]), axis=1))  # [R]

    o_k = tl.arange(0, BLOCK_K)[None, :]
    m_k = m_r[:, None] & (o_k < K)  # [R, BK]
    p_k = o_r.to(tl.int64)[:, None] * K + o_k
    b_v = tl.load(vals + p_k, mask=m_k, other=0.0).to(tl.float32) + 0.0  # -0.0 -> +0.0
    b_bits = b_v.to(tl.int32, bitcast=True)
    b_ord = (b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # increases with the value
    b_id = tl.load(ids + p_k, mask=m_k, other=0)
    # ascending key = logit descending, then id ascending
    b_key, b_pos = _ranked(tl.where(m_k, ((-b_ord) << 32) | b_id, _INT64_MAX), tmp + o_r.to(tl.int64)[:, None] * BLOCK_K, RANK_SORT, CHUNK)
    b_ord = (-(b_key >> 32)).to(tl.int32)
    b_v = (b_ord ^ ((b_ord >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    b_lp = _round_half_even(tl.maximum(b_v - lse[:, None], FLOOR) * SCALE)
    p_out = o_r.to(tl.int64)[:, None] * K + b_pos
    m_out = m_r[:, None] & (b_pos < K)
    tl.store(out_lp + p_out, b_lp.to(tl.int64), mask=m_out)
    tl.store(out_ids + p_out, b_key & 0xFFFFFFFF, mask=m_out)


def finish_topk(logits, vals, ids, scale: int, floor: float):
    """Launch :func:`_finish_topk_kernel` on ``logits [R, V]`` (unit column stride) and the
    ``[R, K]`` output of ``torch.topk``; returns ``(logprobs, token_ids)``, each ``[R, K]`` int64."""
    R, V = logits.shape
    K = vals.shape[1]
    dev = logits.device
    out_lp = torch.empty(R, K, dtype=torch.int64, device=dev)
    out_ids = torch.empty(R, K, dtype=torch.int64, device=dev)
    block_k = triton.next_power_of_2(K)
    block_v = min(triton.next_power_of_2(V), 4096)
    rows = _seqs_per_program(R, max(block_v, block_k))
    grid = triton.cdiv(R, rows)
    rank_sort = interpreting()
    tmp = torch.empty(grid * rows * block_k if rank_sort else 1, dtype=torch.int64, device=dev)
    _finish_topk_kernel[(grid,)](
        logits, vals.contiguous(), ids.contiguous(), out_lp, out_ids, tmp,
        R, V, logits.stride(0),
        K=K,
        SCALE=float(scale),
        FLOOR=float(floor),
        ROWS=rows,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        RANK_SORT=rank_sort,
        CHUNK=min(block_k, max(1, 2**20 // (rows * block_k))),
        num_warps=8 if block_v >= 2048 else 4,
    )
    return out_lp, out_ids


# ----------------------------------------------------------------------------------------------
# the acceptance walk


@triton.jit(do_not_specialize=["num_seqs", "max_depth", "stride_tree", "stride_tgt", "stride_out"])
def _walk_kernel(
    tok, par, num_nodes, tgt, starts,
    acc, acc_tok, new_tok, lengths, bonus,
    num_seqs, max_depth,
    stride_tree, stride_tgt, stride_out,
    USE_STARTS: tl.constexpr,
    SEQS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The walks of sequences ``i_s * SEQS ..``: from the root, move to the lowest-index child
    whose token is the target's token at the current node, at most ``max_depth`` times.

    tok, par: ``[B, n]`` int64 (row stride ``stride_tree``, unit column stride), -1 padded.
    tgt: int64 target tokens; node j of sequence b at ``starts[b] + j`` (USE_STARTS, flat rows)
    or ``b * stride_tgt + j``.
    acc, acc_tok, new_tok: ``[B, max_depth+1]`` int64 (row stride ``stride_out``); lengths, bonus: ``[B]``.
    """
    i_s = tl.program_id(0)
    o_s = i_s * SEQS + tl.arange(0, SEQS)
    m_s = o_s < num_seqs
    o_n = tl.arange(0, BLOCK_N)
    size = tl.load(num_nodes + o_s, mask=m_s, other=0)  # [S]
    m_sn = o_n[None, :] < size[:, None]  # [S, BN]
    p_tree = o_s.to(tl.int64) * stride_tree  # [S]
    b_par = tl.load(par + p_tree[:, None] + o_n[None, :], mask=m_sn, other=-2)  # [S, BN]
    b_tok = tl.load(tok + p_tree[:, None] + o_n[None, :], mask=m_sn, other=-1)  # [S, BN]
    if USE_STARTS:
        p_tgt = tgt + tl.load(starts + o_s, mask=m_s, other=0)  # [S]
    else:
        p_tgt = tgt + o_s.to(tl.int64) * stride_tgt
    p_out = o_s.to(tl.int64) * stride_out  # [S]
    tl.store(acc + p_out, tl.zeros([SEQS], tl.int64), mask=m_s)
    tl.store(acc_tok + p_out, tl.load(tok + p_tree, mask=m_s, other=-1), mask=m_s)
    cur = tl.zeros([SEQS], tl.int64)
    alive = m_s
    length = tl.full([SEQS], 1, tl.int64)
    for d in range(max_depth):
        want = tl.load(p_tgt + cur, mask=m_s, other=-1)  # [S]
        hit = (b_par == cur[:, None]) & (b_tok == want[:, None])
        nxt = tl.min(tl.where(hit, o_n[None, :], BLOCK_N), axis=1).to(tl.int64)  # [S]
        found = (nxt < BLOCK_N) & alive
        nxt_tok = tl.load(tok + p_tree + nxt, mask=found, other=-1)
        tl.store(acc + p_out + d + 1, tl.where(found, nxt, -1), mask=m_s)
        tl.store(acc_tok + p_out + d + 1, nxt_tok, mask=m_s)
        tl.store(new_tok + p_out + d, tl.where(found, nxt_tok, tl.where(alive, want, -1)), mask=m_s)
        cur = tl.where(found, nxt, cur)
        alive = found
        length += found.to(tl.int64)
    last = tl.load(p_tgt + cur, mask=m_s, other=-1)
    tl.store(new_tok + p_out + max_depth, tl.where(alive, last, -1), mask=m_s)
    tl.store(bonus + o_s, last, mask=m_s)
    tl.store(lengths + o_s, length, mask=m_s)


def walk(tokens, parents, num_nodes, target, starts, max_depth: int):
    """Launch :func:`_walk_kernel` on contiguous int64 ``[B, n]`` trees; ``target`` is ``[B, n]``
    (``starts`` None) or flat ``[T]`` with sequence b at ``starts[b]``.

    Returns ``(accepted, accepted_tokens, new_tokens, lengths, bonus)``."""
    B, n = tokens.shape
    dev = tokens.device
    acc = torch.empty(B, max_depth + 1, dtype=torch.int64, device=dev)
    acc_tok = torch.empty_like(acc)
    new_tok = torch.empty_like(acc)
    lengths = torch.empty(B, dtype=torch.int64, device=dev)
    bonus = torch.empty(B, dtype=torch.int64, device=dev)
    block_n = triton.next_power_of_2(n)
    seqs = _seqs_per_program(B, block_n)
    _walk_kernel[(triton.cdiv(B, seqs),)](
        tokens, parents, num_nodes, target, target if starts is None else starts,
        acc, acc_tok, new_tok, lengths, bonus,
        B, max_depth,
        tokens.stride(0), 0 if starts is not None else target.stride(0), acc.stride(0),
        USE_STARTS=starts is not None,
        SEQS=seqs,
        BLOCK_N=block_n,
    )
    return acc, acc_tok, new_tok, lengths, bonus


# ----------------------------------------------------------------------------------------------
# the best-first expansion

@triton.jit(do_not_specialize=["num_seqs", "depth_cap", "n_draft", "stride_top", "stride_scratch", "stride_out"])
def _expand_kernel(
    lp, ids, roots, sec_tab, pair_off, kept_off,
    keys, emit, tmp,
    out_tok, out_par, out_dep, out_rank, out_score,
    num_seqs, depth_cap, n_draft,
    stride_top, stride_scratch, stride_out,
    K: tl.constexpr,
    S: tl.constexpr,
    SLOT_BITS: tl.constexpr,
    DEPTH_BITS: tl.constexpr,
    SEQS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RANK_SORT: tl.constexpr,
    CHUNK_C: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    """The DDTrees of sequences ``i_s * SEQS ..`` (see :func:`kdtree_engine.ddtree.expand_topk`).

    lp, ids: ``[B, L, K]`` int64, contiguous per sequence (row stride ``stride_top``).
    sec_tab: int64, the candidates of every depth, ``parent slot * K + rank``; depth d's are
    ``sec_tab[pair_off[d]:pair_off[d+1]]``, it keeps ``kept_off[d+1] - kept_off[d]`` of them.
    keys, emit: ``[B, total]`` int64 / int32 scratch (row stride ``stride_scratch``).
    out_*: ``[B, n_draft+1]`` int64 (row stride ``stride_out``): token, parent, depth, rank, score.

    Depth d: every candidate's within-depth key ``(-score) << S | sec`` (unique), sorted; the
    first ``kept`` are stored in key order (slot = position). Then the kept nodes of all depths
    are sorted by ``(-score, depth, slot)``; the first ``n_draft`` are the tree, in emission order.
    """
    i_s = tl.program_id(0)
    o_s = i_s * SEQS + tl.arange(0, SEQS)
    m_s = o_s < num_seqs
    p_top = o_s.to(tl.int64)[:, None] * stride_top  # [S, 1]
    p_scr = o_s.to(tl.int64)[:, None] * stride_scratch  # [S, 1]
    p_out = o_s.to(tl.int64)[:, None] * stride_out  # [S, 1]
    p_tmp = tmp + o_s.to(tl.int64)[:, None] * tl.maximum(BLOCK_C, BLOCK_T)  # [S, 1] (interpreter only)
    o_c = tl.arange(0, BLOCK_C)[None, :]  # [1, BC]
    prev = tl.load(kept_off)
    for d in range(depth_cap):
        c0 = tl.load(pair_off + d)
        m_c = m_s[:, None] & (o_c < tl.load(pair_off + d + 1) - c0)  # [S, BC]
        k0 = tl.load(kept_off + d)
        b_sec = tl.load(sec_tab + c0 + o_c, mask=m_c, other=0)  # [S, BC]
        b_slot = b_sec // K
        b_rank = b_sec % K
        b_neg = -tl.load(lp + p_top + d * K + b_rank, mask=m_c, other=0)  # [S, BC]
        if d > 0:
            b_neg += tl.load(keys + p_scr + prev + b_slot, mask=m_c, other=0) >> S
        b_key, b_pos = _ranked(tl.where(m_c, (b_neg << S) | b_sec, _INT64_MAX), p_tmp, RANK_SORT, CHUNK_C)
        tl.store(keys + p_scr + k0 + b_pos, b_key, mask=m_s[:, None] & (b_pos < tl.load(kept_off + d + 1) - k0))
        tl.debug_barrier()
        prev = k0

    # merge the depths: scratch position t holds (depth, slot) = (dep(t), t - kept_off[dep(t) - 1])
    o_t = tl.arange(0, BLOCK_T)
    total = tl.load(kept_off + depth_cap)
    b_dep = tl.full([BLOCK_T], 1, tl.int64)
    for d in range(depth_cap):
        b_dep += (o_t >= tl.load(kept_off + d + 1)).to(tl.int64)
    b_slot = o_t - tl.load(kept_off + b_dep - 1, mask=o_t < total, other=0)  # [BT]
    m_t = m_s[:, None] & (o_t < total)[None, :]  # [S, BT]
    b_key = tl.load(keys + p_scr + o_t[None, :], mask=m_t, other=0)
    b_merged = ((b_key >> S) << (SLOT_BITS + DEPTH_BITS)) | (b_dep << SLOT_BITS)[None, :] | b_slot[None, :]
    b_merged, b_order = _ranked(tl.where(m_t, b_merged, _INT64_MAX), p_tmp, RANK_SORT, CHUNK_T)  # [S, BT]

    # node b_order + 1 of the tree is the kept node at scratch position e_pos
    m_e = m_s[:, None] & (b_order < n_draft)  # [S, BT]
    e_dep = (b_merged >> SLOT_BITS) & ((1 << DEPTH_BITS) - 1)
    e_pos = tl.load(kept_off + e_dep - 1, mask=m_e, other=0) + (b_merged & ((1 << SLOT_BITS) - 1))
    tl.store(emit + p_scr + e_pos, b_order + 1, mask=m_e)
    tl.debug_barrier()
    e_sec = tl.load(keys + p_scr + e_pos, mask=m_e, other=0) & ((1 << S) - 1)
    e_rank = e_sec % K
    m_p = m_e & (e_dep > 1)
    e_parent_pos = tl.load(kept_off + e_dep - 2, mask=m_p, other=0) + e_sec // K
    e_parent = tl.load(emit + p_scr + e_parent_pos, mask=m_p, other=0).to(tl.int64)
    e_tok = tl.load(ids + p_top + (e_dep - 1) * K + e_rank, mask=m_e, other=0)
    p_node = p_out + 1 + b_order
    tl.store(out_tok + p_node, e_tok, mask=m_e)
    tl.store(out_par + p_node, e_parent, mask=m_e)
    tl.store(out_dep + p_node, e_dep, mask=m_e)
    tl.store(out_rank + p_node, e_rank, mask=m_e)
    tl.store(out_score + p_node, -(b_merged >> (SLOT_BITS + DEPTH_BITS)), mask=m_e)
    # the roots
    p_root = o_s.to(tl.int64) * stride_out
    zero = tl.zeros([SEQS], tl.int64)
    tl.store(out_tok + p_root, tl.load(roots + o_s, mask=m_s, other=0), mask=m_s)
    tl.store(out_par + p_root, zero - 1, mask=m_s)
    tl.store(out_dep + p_root, zero, mask=m_s)
    tl.store(out_rank + p_root, zero - 1, mask=m_s)
    tl.store(out_score + p_root, zero, mask=m_s)


def _bits(x: int) -> int:
    return max(int(x).bit_length(), 1)


def expand(lp, ids, roots, sec_tab, pair_off, kept_off, budget: int, depth_cap: int, max_pairs: int, total: int):
    """Launch :func:`_expand_kernel` on contiguous int64 ``lp, ids [B, L, K]`` and ``roots [B]``.

    Returns ``(tokens, parents, depths, ranks, scores)``, each ``[B, min(budget, total) + 1]``
    int64 (node 0 the root)."""
    B, _, K = lp.shape
    dev = lp.device
    n_draft = min(budget, total)
    keys = torch.empty(B, total, dtype=torch.int64, device=dev)
    emit = torch.empty(B, total, dtype=torch.int32, device=dev)
    out = torch.empty(5, B, n_draft + 1, dtype=torch.int64, device=dev)
    block_c = triton.next_power_of_2(max_pairs)
    block_t = triton.next_power_of_2(total)
    seqs = _seqs_per_program(B, block_t)
    grid = triton.cdiv(B, seqs)
    rank_sort = interpreting()
    # ranks by counting (interpreter): [seqs, block, chunk] comparisons at a time, at most 2**20
    chunk_c = min(block_c, max(1, 2**20 // (seqs * block_c)))
    chunk_t = min(block_t, max(1, 2**20 // (seqs * block_t)))
    tmp = torch.empty(grid * seqs * max(block_c, block_t) if rank_sort else 1, dtype=torch.int64, device=dev)
    _expand_kernel[(grid,)](
        lp, ids, roots, sec_tab, pair_off, kept_off,
        keys, emit, tmp,
        out[0], out[1], out[2], out[3], out[4],
        B, depth_cap, n_draft,
        lp.stride(0), keys.stride(0), out.stride(1),
        K=K,
        S=_bits(budget * K),
        SLOT_BITS=_bits(budget),
        DEPTH_BITS=_bits(depth_cap),
        SEQS=seqs,
        BLOCK_C=block_c,
        BLOCK_T=block_t,
        RANK_SORT=rank_sort,
        CHUNK_C=chunk_c,
        CHUNK_T=chunk_t,
        num_warps=min(16, max(4, seqs * block_t // 512)),
    )
    return tuple(out.unbind(0))
