"""Flash tree-verify kernel: every head and tree node of a sequence against ONE read of its KV.

MLA in absorbed form has one latent KV head, so the ``n_b x H`` query rows of a sequence form one
matrix problem ``[n_b*H, 576] x [576, kv_len]``. Rows are packed (row ``r`` = node ``r // H``, head
``r % H``) into blocks of ``BLOCK_M``. The kernel is persistent: the plan cuts all (sequence, row
block, KV tile) work into as many near-equal shares as the GPU runs programs at once, so even one
sequence fills the GPU and no wave runs part-empty. A share is a list of segments, each a row
block of a sequence against a KV range:

- for each ``BLOCK_N``-position KV tile (rows gathered through the page table, each 1152-byte
  cache row contiguous): ``S = Q_lat K_lat^T + Q_rope K_rope^T`` on tensor cores, fp32 online
  softmax in base 2 (log2(e) folded into the scale), ``O += P V`` with V = the latent columns of
  the SAME tile (never loaded twice);
- only tiles that reach the last ``n_b`` positions (the tree) or the end of the split apply a mask;
  prefix tiles run unmasked;
- a segment that covers its row block's whole KV writes the final ``out``/``lse``; otherwise it
  writes a normalised partial and its log2-sum-exp, merged after a grid barrier by the kernel's
  own programs, or by the combine kernel (:mod:`.combine` says which).

The work list comes from a :class:`~kdtree_engine.verify.plan.VerifyPlan` (the layer below),
computed on the host once per model step and reused by every layer; a launch does no host sync,
both grids are fixed by the plan's buffers (programs without work exit), so a CUDA graph captured
around it replays correctly after a new plan. Bitwise deterministic (the only atomics are the
grid barrier's; every sum has a fixed order).

Imports the contract and the plan; never the API.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..backend import interpreting
from .combine import PlannedLaunch, combine_items, grid_barrier, prepare_planned
from .contract import D_QK, D_V
from .launch import Launcher
from .plan import FlashTables
from .scheduler import one_sequence_groups, work_range, work_segment

__all__ = ["prepare"]

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _attend_tile(
    b_q, b_qr, b_m, b_l, b_acc,
    kv, p_pages, p_mask_rows, m_rows,
    start, kv_end, prefix, mask_words, stride_kvp, stride_kvs, stride_pp, stride_mw, scale_log2,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_LATENT: tl.constexpr, D_ROPE: tl.constexpr,
    MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One KV tile of the online softmax. MASKED tiles bound-check and apply the tree mask."""
    o_n = start + tl.arange(0, BLOCK_N)  # [BN] positions
    o_d = tl.arange(0, D_LATENT)
    o_r = tl.arange(0, D_ROPE)
    if PAGE_SIZE % BLOCK_N == 0:
        # the tile lies inside one page: one page id, contiguous rows
        b_page = tl.load(p_pages + (start // PAGE_SIZE) * stride_pp).to(tl.int64)
        p_row = kv + b_page * stride_kvp + (o_n % PAGE_SIZE) * stride_kvs  # [BN]
    else:
        if MASKED:
            b_pages = tl.load(p_pages + (o_n // PAGE_SIZE) * stride_pp, mask=o_n < kv_end, other=0)
        else:
            b_pages = tl.load(p_pages + (o_n // PAGE_SIZE) * stride_pp)
        p_row = kv + b_pages.to(tl.int64) * stride_kvp + (o_n % PAGE_SIZE) * stride_kvs  # [BN]
    if MASKED:
        m_n = o_n < kv_end
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)  # [BN, D_LATENT]
        b_kr = tl.load(p_row[:, None] + D_LATENT + o_r[None, :], mask=m_n[:, None], other=0.0)  # [BN, D_ROPE]
    else:
        b_k = tl.load(p_row[:, None] + o_d[None, :])
        b_kr = tl.load(p_row[:, None] + D_LATENT + o_r[None, :])
    if DOT_FP32:
        b_k = b_k.to(tl.float32)
        b_kr = b_kr.to(tl.float32)
    b_s = tl.dot(b_q, tl.trans(b_k))  # [BM, BN]
    b_s = tl.dot(b_qr, tl.trans(b_kr), b_s)
    b_s = b_s * scale_log2
    if MASKED:
        o_j = o_n - prefix  # tree node index of each position (negative: prefix)
        o_jc = tl.maximum(o_j, 0)
        m_tree = m_n & (o_j >= 0) & (o_jc // 32 < mask_words)
        b_word = tl.load(p_mask_rows[:, None] + (o_jc // 32)[None, :] * stride_mw,
                         mask=m_rows[:, None] & m_tree[None, :], other=0)  # [BM, BN]
        b_bit = (b_word >> (o_jc % 32)[None, :]) & 1
        m_vis = m_n[None, :] & ((o_j < 0)[None, :] | (b_bit != 0))
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # rows with nothing visible yet
    else:
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = b_m_new
    b_p = tl.exp2(b_s - b_m_use[:, None])  # [BM, BN]
    b_alpha = tl.exp2(b_m - b_m_use)  # [BM]
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None]
    b_acc = tl.dot(b_p.to(b_k.dtype), b_k, b_acc)  # [BM, D_LATENT]
    return b_m_new, b_l, b_acc


@triton.jit
def _attend_segment(
    q, kv, page_table, kv_lens, qo_indptr, tree_mask, out, lse, partial_out, partial_lse,
    i_b, row0, kv_start, kv_end, i_part,
    stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_pp, stride_kl, stride_qo,
    stride_mt, stride_mw, mask_words, stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
    H: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Rows ``row0 : row0 + BLOCK_M`` of sequence ``i_b`` against KV positions ``[kv_start, kv_end)``."""
    qo_start = tl.load(qo_indptr + i_b * stride_qo)
    n_nodes = tl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start
    prefix = tl.load(kv_lens + i_b * stride_kl) - n_nodes

    o_m = row0 + tl.arange(0, BLOCK_M)  # packed rows of this sequence: node = r // H, head = r % H
    m_rows = o_m < n_nodes * H
    o_node = tl.minimum(o_m // H, n_nodes - 1)
    o_head = o_m % H
    o_t = (qo_start + o_node).to(tl.int64)  # [BM] q rows
    o_d = tl.arange(0, D_LATENT)
    o_r = tl.arange(0, D_ROPE)
    p_q = q + o_t * stride_qt + o_head * stride_qh  # [BM]
    b_q = tl.load(p_q[:, None] + o_d[None, :], mask=m_rows[:, None], other=0.0)  # [BM, D_LATENT]
    b_qr = tl.load(p_q[:, None] + D_LATENT + o_r[None, :], mask=m_rows[:, None], other=0.0)  # [BM, D_ROPE]
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
        b_qr = b_qr.to(tl.float32)
    p_pages = page_table + i_b.to(tl.int64) * stride_pt
    p_mask_rows = tree_mask + o_t * stride_mt  # [BM]

    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, D_LATENT], tl.float32)
    # full prefix tiles: no bounds, no tree mask
    clean_end = kv_start + tl.maximum(tl.minimum(kv_end, prefix) - kv_start, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_start, clean_end, BLOCK_N):
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_qr, b_m, b_l, b_acc, kv, p_pages, p_mask_rows, m_rows,
            start, kv_end, prefix, mask_words, stride_kvp, stride_kvs, stride_pp, stride_mw, scale_log2,
            PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, False, DOT_FP32,
        )
    # the segment's ragged end and the tree: bounds and tree mask. One or two tiles: not pipelined,
    # so its buffers (K tiles, mask words) do not add to the prefix loop's shared memory.
    for start in tl.range(clean_end, kv_end, BLOCK_N, num_stages=1):
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_qr, b_m, b_l, b_acc, kv, p_pages, p_mask_rows, m_rows,
            start, kv_end, prefix, mask_words, stride_kvp, stride_kvs, stride_pp, stride_mw, scale_log2,
            PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, True, DOT_FP32,
        )

    has_key = b_l != 0  # NaN (a NaN score of a visible key) propagates: NaN out and lse
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_out = tl.where(has_key[:, None], b_acc / b_l_safe[:, None], 0.0)
    b_lse2 = tl.where(has_key, b_m + tl.log2(b_l_safe), float("-inf"))  # log2-sum-exp2
    if i_part < 0:
        p_out = out + o_t[:, None] * stride_ot + o_head[:, None] * stride_oh + o_d[None, :]
        tl.store(p_out, b_out.to(out.dtype.element_ty), mask=m_rows[:, None])
        tl.store(lse + o_t * stride_lt + o_head * stride_lh, b_lse2 * LN2, mask=m_rows)
    else:
        o_p = i_part.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(partial_out + o_p[:, None] * D_LATENT + o_d[None, :], b_out, mask=m_rows[:, None])
        tl.store(partial_lse + o_p, b_lse2, mask=m_rows)


# Arguments that vary call to call (page-table width, mask words, whether this launch merges) are not
# specialised: a new value must never trigger a multi-second recompile in the middle of a decode loop.
@triton.jit(do_not_specialize=["stride_pt", "stride_mt", "mask_words", "merge_splits"])
def _verify_flash_kernel(
    q, kv, page_table, kv_lens, qo_indptr, tree_mask, out, lse,
    prog_first_seg, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial,
    partial_out, partial_lse,
    group_seq, group_row0, group_first, group_splits, num_groups, barrier_word,
    stride_qt, stride_qh,
    stride_kvp, stride_kvs,
    stride_pt, stride_pp,
    stride_kl, stride_qo,
    stride_mt, stride_mw, mask_words,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    scale_log2,
    merge_splits,
    H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_ROPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FUSE_COMBINE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IN_KERNEL: tl.constexpr,
):
    """One persistent program: the plan's segments ``prog_first_seg[p] : prog_first_seg[p+1]``
    (with ``IN_KERNEL``: a one-sequence step's, scheduled here from its device lengths, see
    :func:`~kdtree_engine.verify.scheduler.one_sequence_shape`; the program's split groups written
    for the merge), then with ``FUSE_COMBINE`` (a cooperative launch) and ``merge_splits`` the grid
    barrier and its share of the merge of the split row blocks (:mod:`.combine`), when the plan
    split any."""
    i_p = tl.program_id(0)
    first, end, step, kv_len, R, T, S = work_range(i_p, tl.num_programs(0), prog_first_seg, kv_lens, qo_indptr,
                                                   stride_qo, H, BLOCK_M, BLOCK_N, IN_KERNEL)
    for i_s in range(first, end, step):
        i_b, row0, kv_start, kv_end, i_part = work_segment(i_s, kv_len, R, T, S, seg_seq, seg_row0, seg_kv_start,
                                                           seg_kv_end, seg_partial, BLOCK_M, BLOCK_N, IN_KERNEL)
        _attend_segment(
            q, kv, page_table, kv_lens, qo_indptr, tree_mask, out, lse, partial_out, partial_lse,
            i_b, row0, kv_start, kv_end, i_part,
            stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_pp, stride_kl, stride_qo,
            stride_mt, stride_mw, mask_words, stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
            H, PAGE_SIZE, BLOCK_M, BLOCK_N, D_LATENT, D_ROPE, DOT_FP32,
        )
    if IN_KERNEL:
        n_groups = one_sequence_groups(i_p, R, S, group_seq, group_row0, group_first, group_splits, num_groups,
                                       BLOCK_M)
    if FUSE_COMBINE:
        if not IN_KERNEL:
            n_groups = tl.load(num_groups)
        if (n_groups > 0) & (merge_splits != 0):
            grid_barrier(barrier_word, i_p, tl.num_programs(0))
            combine_items(i_p, tl.num_programs(0), partial_out, partial_lse, out, lse, qo_indptr,
                          group_seq, group_row0, group_first, group_splits, num_groups,
                          stride_qo, stride_ot, stride_oh, stride_lt, stride_lh, H, BLOCK_M, D_LATENT, BLOCK_S,
                          BLOCK_R)


_FLASH = Launcher(_verify_flash_kernel)
_DOT_FP32 = interpreting()  # decided once, before Triton loaded (backend.select_device)


def prepare(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse,
            plan: FlashTables) -> PlannedLaunch:
    """The flash kernel on ``plan.num_programs`` programs (and the combine kernel), laid out for
    every call with the signature of these tensors (see :func:`~.combine.prepare_planned`).

    Inputs already checked against the contract (:func:`~kdtree_engine.verify.contract.check_inputs`)
    and against the plan (heads, rows, sequences). ``plan``: the plan's tables
    (:attr:`VerifyPlan.tables <kdtree_engine.verify.plan.VerifyPlan>`).
    """
    H, page_size, cfg = q.shape[1], kv_cache.shape[1], plan.config
    return prepare_planned(_FLASH, (H, page_size, cfg), q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask,
                           sm_scale, out, lse, plan,
                           dict(H=H, PAGE_SIZE=page_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D_LATENT=D_V,
                                D_ROPE=D_QK - D_V, DOT_FP32=_DOT_FP32, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages))

