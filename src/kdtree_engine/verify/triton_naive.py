"""Naive tree-verify kernel: the oracle on the GPU.

One program per (tree node, head) walks its sequence's whole KV through the page table in blocks
of ``BLOCK_N`` positions, with an fp32 online softmax. No tensor-core dots (elementwise products
and sums only), so it is also exact under the Triton CPU interpreter, and no shared-memory cap on
the KV length. It re-reads the KV once per head and node: that is what makes it slow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreting
from .contract import D_QK, D_V, kernel_ints
from .launch import Launcher, spec_key

__all__ = ["prepare"]

LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit(do_not_specialize=["stride_pt", "stride_mt", "mask_words"])  # vary call to call: no recompiles
def _verify_naive_kernel(
    q, kv, page_table, kv_lens, qo_indptr, row_seq, tree_mask, out, lse,
    stride_qt, stride_qh,
    stride_kvp, stride_kvs,
    stride_pt, stride_pp,
    stride_kl, stride_qo,
    stride_mt, stride_mw, mask_words,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    scale_log2,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_ROPE: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.load(row_seq + i_t)
    qo_start = tl.load(qo_indptr + i_b * stride_qo)
    n_nodes = tl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start
    kv_len = tl.load(kv_lens + i_b * stride_kl)
    prefix = kv_len - n_nodes

    o_d = tl.arange(0, D_LATENT)
    o_r = tl.arange(0, D_ROPE)
    p_q = q + i_t.to(tl.int64) * stride_qt + i_h * stride_qh
    b_q = tl.load(p_q + o_d).to(tl.float32)  # [D_LATENT]
    b_qr = tl.load(p_q + D_LATENT + o_r).to(tl.float32)  # [D_ROPE]

    b_m = tl.full([], float("-inf"), tl.float32)
    b_l = tl.zeros([], tl.float32)
    b_acc = tl.zeros([D_LATENT], tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
        m_n = o_n < kv_len
        b_page = tl.load(page_table + i_b.to(tl.int64) * stride_pt + (o_n // PAGE_SIZE) * stride_pp, mask=m_n, other=0)
        p_row = kv + b_page.to(tl.int64) * stride_kvp + (o_n % PAGE_SIZE) * stride_kvs  # [BLOCK_N]
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0).to(tl.float32)
        b_kr = tl.load(p_row[:, None] + D_LATENT + o_r[None, :], mask=m_n[:, None], other=0.0).to(tl.float32)
        b_s = tl.sum(b_k * b_q[None, :], 1) + tl.sum(b_kr * b_qr[None, :], 1)  # [BLOCK_N]
        b_s = b_s * scale_log2
        # tree positions: node j = position - prefix is visible iff bit j of this row's mask is set
        o_j = tl.maximum(o_n - prefix, 0)
        m_tree = m_n & (o_n >= prefix) & (o_j // 32 < mask_words)
        b_word = tl.load(tree_mask + i_t.to(tl.int64) * stride_mt + (o_j // 32) * stride_mw, mask=m_tree, other=0)
        m_vis = m_n & ((o_n < prefix) | (((b_word >> (o_j % 32)) & 1) != 0))
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 0))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.exp2(b_s - b_m_safe)  # [BLOCK_N]
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, 0)
        b_acc = b_acc * b_alpha + tl.sum(b_p[:, None] * b_k, 0)
        b_m = b_m_new

    has_key = b_l != 0  # NaN (a NaN score of a visible key) propagates: NaN out and lse
    b_out = tl.where(has_key, b_acc / tl.where(has_key, b_l, 1.0), 0.0)
    b_lse = tl.where(has_key, (b_m + tl.log2(tl.where(has_key, b_l, 1.0))) * LN2, float("-inf"))
    tl.store(out + i_t.to(tl.int64) * stride_ot + i_h * stride_oh + o_d, b_out.to(out.dtype.element_ty))
    tl.store(lse + i_t.to(tl.int64) * stride_lt + i_h * stride_lh, b_lse)


_NAIVE = Launcher(_verify_naive_kernel)


def row_to_sequence(qo_indptr: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[T]`` int32: the sequence each q row belongs to (computed on the device, no sync)."""
    rows = torch.arange(num_rows, device=qo_indptr.device, dtype=torch.int32)
    return torch.searchsorted(qo_indptr[1:].contiguous(), rows, right=True).to(torch.int32)


def prepare(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan=None):
    """The naive kernel (one program per q row and head; ``plan`` unused: the grid is ``[T, H]``)
    for every call with the signature of these tensors (inputs already checked against the
    contract): ``run(tensors, ptrs, num_groups, site)`` with ``tensors`` the eight contract tensors
    (the others unused) writes ``out`` and ``lse``. Each call maps rows to
    sequences on the device (one more launch: this is the oracle, not a fast path)."""
    T, H, _ = q.shape
    block_n = 128 if interpreting() else 32
    tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
    ints = kernel_ints(*tensors)
    page_size = kv_cache.shape[1]
    key = (spec_key(tensors, ints), page_size, block_n)
    constexprs = dict(PAGE_SIZE=page_size, BLOCK_N=block_n, D_LATENT=D_V, D_ROPE=D_QK - D_V, num_warps=4)
    scale_log2 = sm_scale * LOG2E

    def run(tensors, ptrs, num_groups, site=None) -> None:
        rows = row_to_sequence(tensors[4], T)
        _NAIVE(key, (T, H), (*tensors[:5], rows, *tensors[5:], *ints, scale_log2), constexprs)

    return run
