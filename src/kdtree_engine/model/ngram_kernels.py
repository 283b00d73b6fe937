"""The n-gram drafter's ``draft_tensor`` as three Triton launches (about 60 tensor ops otherwise).

:func:`ngram_draft` gives the same ``[B, L, V]`` float32 logits, bit for bit, as
:meth:`NGramDrafter._draft_tensor_torch <kdtree_engine.model.drafters.NGramDrafter>`, with shapes
fixed by ``(B, C, L, V)`` and no host sync (capturable in a CUDA graph):

1. ``_match_kernel``, a program per (sequence, chunk of ``MATCH_BLOCK`` history positions): each
   position's match length (the common suffix of the history up to it and the context, at most
   ``max_ngram``), the chunk's longest length and its ``M`` most recent positions of that length;
2. ``_vote_kernel``, a program per sequence: the ``M`` most recent positions of the longest
   length over all chunks (if at least ``min_ngram``), their followers' votes at each of the ``L``
   positions and the log-probabilities (float64, as the tensor ops compute them);
3. ``_fill_kernel``, a program per (row ``(b, i)``, slice of the vocabulary): the row's fill value
   (``log(s / V)`` for a position with votes, else 0) with the voted tokens' log-probabilities.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from ..ddtree.kernels import block_of

__all__ = ["ngram_draft"]

MATCH_BLOCK = 1024  # history positions per program of the match kernel
FILL_BLOCK_V = 4096  # vocabulary columns per program of the fill kernel


@triton.jit(do_not_specialize=["stride_h", "stride_n", "num_chunks"])
def _match_kernel(history, lengths, cbest, cpos, stride_h, stride_n, num_chunks,
                  K: tl.constexpr, M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (b, c): positions ``[c * BLOCK, (c+1) * BLOCK)`` of ``history [B, C]`` int64 (sequence
    b's first ``lengths[b]``): the chunk's longest match length into ``cbest [B * num_chunks]`` int32
    and its ``M`` most recent positions of that length, newest first, -1 padded, into
    ``cpos [B * num_chunks, M]`` int32."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = tl.load(lengths + b * stride_n).to(tl.int64)
    row = history + b * stride_h
    offs = c * BLOCK + tl.arange(0, BLOCK)
    alive = offs < n - 1  # an earlier position than the context's last
    length = tl.zeros([BLOCK], dtype=tl.int32)
    for j in tl.static_range(K):
        sj = tl.load(row + tl.maximum(n - 1 - j, 0))  # the context's (j+1)-th last token
        alive = alive & (offs >= j)
        h = tl.load(row + offs - j, mask=alive, other=0)
        alive = alive & (h == sj)
        length += alive.to(tl.int32)
    cb = tl.max(length, 0)
    chunk = b * num_chunks + c
    tl.store(cbest + chunk, cb)
    key = tl.where(length == cb, offs, -1)
    mi = tl.arange(0, BLOCK_M)
    ends = tl.full([BLOCK_M], -1, tl.int32)
    for m in tl.static_range(M):  # the chunk's M most recent positions of its longest length
        v = tl.max(key, 0)
        ends = tl.where(mi == m, v, ends)
        key = tl.where(key == v, -1, key)
    tl.store(cpos + chunk * M + mi, ends, mask=mi < M)


@triton.jit(do_not_specialize=["stride_h", "stride_n", "num_chunks"])
def _vote_kernel(history, lengths, cbest, cpos, ws_tok, ws_lp, stride_h, stride_n, num_chunks,
                 MIN_NGRAM: tl.constexpr, M: tl.constexpr, L: tl.constexpr, A_BITS: tl.constexpr,
                 C_BITS: tl.constexpr, BLOCK_NC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program b: the ``M`` most recent positions of the longest length over the chunks (none below
    ``MIN_NGRAM``), their followers at the ``L`` positions, the votes and log-probabilities (float64
    ``log((1 - s) votes / total + s / V)``, ``A_BITS`` / ``C_BITS`` the float64 bits of ``1 - s`` and
    ``s / V``) into ``ws_tok [B, L, M]`` int64 (-1: no follower) and ``ws_lp [B, L, M]`` float32."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(lengths + b * stride_n).to(tl.int64)
    ci = tl.arange(0, BLOCK_NC)
    mi = tl.arange(0, BLOCK_M)
    cb = tl.load(cbest + b * num_chunks + ci, mask=ci < num_chunks, other=0)
    best = tl.max(cb, 0)
    cmask = (ci[:, None] < num_chunks) & (mi[None, :] < M)
    cand = tl.load(cpos + (b * num_chunks + ci[:, None]) * M + mi[None, :], mask=cmask, other=-1)
    key = tl.where((cb[:, None] == best) & (best >= MIN_NGRAM) & cmask, cand, -1)
    ends = tl.full([BLOCK_M], -1, tl.int32)
    for m in tl.static_range(M):  # the M most recent positions of the longest length, newest first
        v = tl.max(tl.max(key, 1), 0)
        ends = tl.where(mi == m, v, ends)
        key = tl.where(key == v, -1, key)
    # follower i of match m: history[ends[m] + 1 + i], while inside the context
    li = tl.arange(0, BLOCK_L)
    e = ends[None, :].to(tl.int64)
    idx = e + 1 + li[:, None]  # [BLOCK_L, BLOCK_M]
    ok = (e >= 0) & (idx < n) & (li[:, None] < L) & (mi[None, :] < M)
    tok = tl.load(history + b * stride_h + idx, mask=ok, other=0)
    votes = tl.zeros([BLOCK_L, BLOCK_M], dtype=tl.int32)
    for mp in tl.static_range(M):
        sel = mi[None, :] == mp
        t_mp = tl.sum(tl.where(sel, tok, 0), 1)
        ok_mp = tl.sum(tl.where(sel & ok, 1, 0), 1) > 0
        votes += ((tok == t_mp[:, None]) & ok_mp[:, None]).to(tl.int32)
    total = tl.sum(ok.to(tl.int32), 1)
    a = tl.full([BLOCK_L, BLOCK_M], A_BITS, tl.int64).to(tl.float64, bitcast=True)  # 1 - s
    cst = tl.full([BLOCK_L, BLOCK_M], C_BITS, tl.int64).to(tl.float64, bitcast=True)  # s / V
    lp = tl.log(a * votes.to(tl.float64) / tl.maximum(total, 1)[:, None].to(tl.float64) + cst).to(tl.float32)
    o = (b * L + li[:, None]) * M + mi[None, :]
    wmask = (li[:, None] < L) & (mi[None, :] < M)
    tl.store(ws_tok + o, tl.where(ok, tok, -1), mask=wmask)
    tl.store(ws_lp + o, lp, mask=wmask)


@triton.jit(do_not_specialize=["vocab"])
def _fill_kernel(ws_tok, ws_lp, out, vocab, M: tl.constexpr, FILL_BITS: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Program (r, v): columns ``[v * BLOCK_V, (v+1) * BLOCK_V)`` of output row r of ``out [B * L, V]``
    float32: the row's fill (``FILL_BITS``, the float32 bits of ``log(s / V)``, where the row has a
    vote; else 0) and its voted tokens' log-probabilities."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mi = tl.arange(0, BLOCK_M)
    toks = tl.load(ws_tok + r * M + mi, mask=mi < M, other=-1)
    fill = tl.full([BLOCK_V], FILL_BITS, tl.int32).to(tl.float32, bitcast=True)  # log(s / V)
    val = tl.where(tl.max(toks, 0) >= 0, fill, 0.0)  # a position without votes: uniform (all 0)
    for m in tl.static_range(M):
        t = tl.load(ws_tok + r * M + m)
        val = tl.where(cols == t, tl.load(ws_lp + r * M + m), val)
    tl.store(out + r * vocab + cols, val, mask=cols < vocab)


def _bits64(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits32(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def ngram_draft(history: torch.Tensor, lengths: torch.Tensor, num_positions: int, *, vocab_size: int,
                max_ngram: int, min_ngram: int, max_matches: int, smoothing: float) -> torch.Tensor:
    """``NGramDrafter.draft_tensor`` in three launches; the same arguments and result."""
    B, C = history.shape
    V, L, K, M = vocab_size, num_positions, max_ngram, min(max_matches, C)
    dev = history.device
    out = torch.empty(B, L, V, dtype=torch.float32, device=dev)
    if B == 0 or L == 0 or V == 0:
        return out
    if history.stride(1) != 1:
        history = history.contiguous()
    block = min(MATCH_BLOCK, triton.next_power_of_2(C))
    nc = triton.cdiv(C, block)
    block_m = block_of(M)
    cbest = torch.empty(B, nc, dtype=torch.int32, device=dev)
    cpos = torch.empty(B, nc, M, dtype=torch.int32, device=dev)
    ws_tok = torch.empty(B, L, M, dtype=torch.int64, device=dev)
    ws_lp = torch.empty(B, L, M, dtype=torch.float32, device=dev)
    _match_kernel[(B, nc)](history, lengths, cbest, cpos, history.stride(0), lengths.stride(0), nc,
                           K=K, M=M, BLOCK=block, BLOCK_M=block_m, num_warps=4)
    s = smoothing
    _vote_kernel[(B,)](history, lengths, cbest, cpos, ws_tok, ws_lp, history.stride(0), lengths.stride(0), nc,
                       MIN_NGRAM=min_ngram, M=M, L=L, A_BITS=_bits64(1.0 - s), C_BITS=_bits64(s / V),
                       BLOCK_NC=block_of(nc), BLOCK_M=block_m,
                       BLOCK_L=block_of(L), num_warps=4)
    block_v = min(FILL_BLOCK_V, triton.next_power_of_2(V))
    _fill_kernel[(B * L, triton.cdiv(V, block_v))](ws_tok, ws_lp, out, V, M=M, FILL_BITS=_bits32(math.log(s / V)),
                                                   BLOCK_V=block_v, BLOCK_M=block_m, num_warps=4)
    return out
