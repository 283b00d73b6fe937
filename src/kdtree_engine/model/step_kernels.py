"""The decode step's bookkeeping after acceptance, fused: each emitted token's top-2 target logits,
the step's result rows and the append to the device token histories.

:func:`record_step` is one Triton launch on CUDA (and on the CPU under Triton's interpreter), plus
the zeroing of its ``[B * A]`` counters, in place of about 13 tensor ops; tensor ops otherwise
(:func:`_record_step_torch`, the same result).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreting
from ..ddtree.kernels import block_of

__all__ = ["record_step"]

RECORD_BLOCK_V = 1024  # vocabulary columns per step of a row's top-2 scan
RECORD_SLICE = 8192  # columns per program: a row of V = 163840 is read by 20 programs


@triton.jit
def _top2(b1, b2):
    """The two largest of the multiset of ``b1`` and ``b2`` (``[N]`` float32, ``b2 <= b1``
    elementwise): ``(top, second)``; a value held twice is both."""
    top = tl.max(b1, 0)
    at_top = b1 == top
    second = tl.maximum(tl.max(b2, 0), tl.max(tl.where(at_top, float("-inf"), b1), 0))
    return top, tl.where(tl.sum(at_top.to(tl.int32), 0) > 1, top, second)


@triton.jit(do_not_specialize=["vocab", "width", "stride_row", "stride_acc", "stride_new", "stride_hist"])
def _record_kernel(
    logits, qo_indptr, accepted, lengths, new_tokens, rows, history, hist_len, results, top2, part, count,
    vocab, width, stride_row, stride_acc, stride_new, stride_hist,
    SLICE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    """Program ``(b, i, s)``: the two largest values of columns ``[s * SLICE, (s+1) * SLICE)`` of
    logits row ``qo_indptr[b] + max(accepted[b, i], 0)`` into ``part[b * width + i, s]``; the last
    of the row's programs to finish (``count``, zero on entry, an acq_rel atomic after a barrier)
    merges the parts into ``top2[b, i]`` (descending; a value held twice fills both).
    Program ``(b, i, 0)`` writes ``results[b, 1 + i] = new_tokens[b, i]``; program ``(b, 0, 0)``
    also ``results[b, 0] = lengths[b]``, appends ``new_tokens[b, :lengths[b]]`` to history row
    ``rows[b]`` at ``hist_len[rows[b]]`` and advances that length (the only program to read or
    write them)."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    s = tl.program_id(2)
    node = tl.maximum(tl.load(accepted + b * stride_acc + i), 0)
    p_x = logits + (tl.load(qo_indptr + b).to(tl.int64) + node) * stride_row
    o_v = s * SLICE + tl.arange(0, BLOCK_V)
    b1 = tl.full([BLOCK_V], float("-inf"), tl.float32)  # each lane's largest value
    b2 = tl.full([BLOCK_V], float("-inf"), tl.float32)  # and its second largest
    for v0 in range(0, SLICE, BLOCK_V):
        x = tl.load(p_x + v0 + o_v, mask=v0 + o_v < vocab, other=float("-inf")).to(tl.float32)
        b2 = tl.maximum(b2, tl.minimum(b1, x))
        b1 = tl.maximum(b1, x)
    top, second = _top2(b1, b2)
    p_part = part + ((b * width + i) * tl.num_programs(2) + s) * 2
    tl.store(p_part, top)
    tl.store(p_part + 1, second)
    tl.debug_barrier()
    if tl.atomic_add(count + b * width + i, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
        o_s = tl.arange(0, BLOCK_S)
        m_s = o_s < tl.num_programs(2)
        p_row = part + (b * width + i) * tl.num_programs(2) * 2
        top, second = _top2(tl.load(p_row + 2 * o_s, mask=m_s, other=float("-inf"), volatile=True),
                            tl.load(p_row + 2 * o_s + 1, mask=m_s, other=float("-inf"), volatile=True))
        p_top2 = top2 + (b * width + i) * 2
        tl.store(p_top2, top.to(top2.dtype.element_ty))
        tl.store(p_top2 + 1, second.to(top2.dtype.element_ty))
    if s == 0:
        tl.store(results + b * (width + 1) + 1 + i, tl.load(new_tokens + b * stride_new + i))
        if i == 0:
            n = tl.load(lengths + b)
            tl.store(results + b * (width + 1), n)
            r = tl.load(rows + b).to(tl.int64)
            start = tl.load(hist_len + r)
            o_a = tl.arange(0, BLOCK_A)
            tok = tl.load(new_tokens + b * stride_new + o_a, mask=o_a < width)
            tl.store(history + r * stride_hist + start + o_a, tok, mask=o_a < n)
            tl.store(hist_len + r, start + n)


def record_step(logits: torch.Tensor, qo_indptr: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor,
                new_tokens: torch.Tensor, rows: torch.Tensor, history: torch.Tensor,
                hist_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's results from its acceptance, and the emitted tokens appended to the histories.

    Args:
        logits: ``[T, V]`` float (V >= 2, unit column stride, NaN-free rows), the target's rows.
        qo_indptr: ``[B+1]`` int32, sequence b's first row.
        accepted: ``[B, A]`` int64, the accepted node of each new token (-1 padded, as
            :class:`~kdtree_engine.ddtree.AcceptResult` gives it).
        lengths: ``[B]`` int64, tokens emitted per sequence (``1..A``).
        new_tokens: ``[B, A]`` int64, the emitted tokens (-1 padded).
        rows: ``[B]`` int64, each sequence's history row.
        history: ``[S, C]`` int64 token histories (unit column stride), row ``rows[b]`` with room
            for ``lengths[b]`` more tokens after ``hist_len[rows[b]]``; updated in place.
        hist_len: ``[S]`` int64, the histories' lengths; advanced by ``lengths`` in place.

    Returns ``(results [B, 1 + A] int64, top2 [B, A, 2])``: the lengths then the new tokens, and the
    two largest logits (descending, logits' dtype) of row ``qo_indptr[b] + max(accepted[b, i], 0)``,
    the row whose argmax new token i is. No host sync.
    """
    for name, t in (("qo_indptr", qo_indptr), ("accepted", accepted), ("lengths", lengths),
                    ("new_tokens", new_tokens), ("rows", rows), ("history", history), ("hist_len", hist_len)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point():
            raise TypeError(f"{name} must be an integer tensor")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, expected {logits.device} (the device of logits)")
    if not logits.is_floating_point() or logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits must be a float tensor [T, V >= 2], got {logits.dtype} {tuple(logits.shape)}")
    B, A = accepted.shape
    if new_tokens.shape != accepted.shape or lengths.shape != (B,) or rows.shape != (B,) or qo_indptr.shape != (B + 1,):
        raise ValueError(f"accepted {tuple(accepted.shape)}, new_tokens {tuple(new_tokens.shape)}, lengths "
                         f"{tuple(lengths.shape)}, rows {tuple(rows.shape)} and qo_indptr {tuple(qo_indptr.shape)} "
                         f"must be [B, A], [B, A], [B], [B] and [B+1]")
    if not (logits.device.type == "cuda" or interpreting()):
        return _record_step_torch(logits, qo_indptr, accepted, lengths, new_tokens, rows, history, hist_len)
    if logits.stride(1) != 1 or history.stride(1) != 1:
        raise ValueError("logits and history need a unit column stride")
    V = logits.shape[1]
    dev = logits.device
    results = torch.empty(B, 1 + A, dtype=torch.int64, device=dev)
    top2 = torch.empty(B, A, 2, dtype=logits.dtype, device=dev)
    consts = record_constexprs(V, A)
    splits = triton.cdiv(V, consts["SLICE"])
    part = torch.empty(B * A, splits, 2, dtype=torch.float32, device=dev)
    count = torch.zeros(B * A, dtype=torch.int32, device=dev)
    _record_kernel[(B, A, splits)](
        logits, qo_indptr, accepted, lengths, new_tokens, rows, history, hist_len, results, top2, part, count,
        V, A, logits.stride(0), accepted.stride(0), new_tokens.stride(0), history.stride(0),
        **consts,
        num_warps=4,
    )
    return results, top2


def record_constexprs(V: int, A: int) -> dict:
    """``_record_kernel``'s constexprs for a vocabulary of ``V`` and ``A`` new tokens per sequence
    (:func:`record_step`; its grid's third axis is ``cdiv(V, SLICE)``)."""
    block_v = min(RECORD_BLOCK_V, triton.next_power_of_2(V))
    slice_v = min(RECORD_SLICE, triton.cdiv(V, block_v) * block_v)
    return dict(SLICE=slice_v, BLOCK_V=block_v, BLOCK_S=block_of(triton.cdiv(V, slice_v)), BLOCK_A=block_of(A))


def _record_step_torch(logits, qo_indptr, accepted, lengths, new_tokens, rows, history, hist_len):
    """:func:`record_step` with tensor ops (about 13): the same results; the history's last
    column (a trash column) takes the writes of padding tokens."""
    row = qo_indptr[:-1, None].to(torch.int64) + accepted.clamp(min=0)  # [B, A]
    top2 = logits.topk(2, dim=-1).values[row]  # [B, A, 2]
    results = torch.cat([lengths[:, None], new_tokens], 1)  # [B, 1 + A]
    start = hist_len[rows]  # [B]
    j = torch.arange(accepted.shape[1], device=start.device)
    col = torch.where(j < lengths[:, None], start[:, None] + j, history.shape[1] - 1)
    history[rows[:, None], col] = new_tokens
    hist_len[rows] = start + lengths
    return results, top2
