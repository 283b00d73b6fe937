"""Hopper (sm_90a) tree-verify kernel, written in Gluon: a drop-in for the Triton flash kernel's plan.

Same work list as :func:`kdtree_engine.verify.triton_flash.launch` (the plan's segments
``seq, row0, kv_start, kv_end, partial slot``, ``prog_first_seg``, partials ``[P, 64, 512]`` fp32 with
log2-sum-exp, and :mod:`.combine`), different tile code:

- one program = a list of segments, each 64 packed query rows (row r = node r // H, head r % H)
  x a KV range, 8 warps = 2 warpgroups; Q ``[64, 512] + [64, 64]`` stays in shared memory;
- KV tiles of 64 rows are gathered row by row through the page table with cp.async (any page
  size, 1 included; the page ids are loaded a tile ahead) into 128-byte-swizzled shared memory,
  two stages;
- ``S = Q K^T`` on wgmma with warps ``[4, 2]``: each warpgroup computes its own 32 keys of the tile
  (no duplicated QK work); P (bf16) goes through shared memory; ``O[64, 512] += P V`` with each
  warpgroup owning 256 output columns (128 fp32 registers per thread); V = the latent columns of
  the same shared tile;
- prefix tiles run unmasked; only tiles that reach the tree nodes or the segment's end read mask words.

Measured on the H200 against the Triton flash kernel and FlashMLA: docs/perf_log.md, run 14.
Requires Triton with Gluon's Hopper API (3.6 seen working) and an sm_90 GPU: :func:`available`
says whether this module can run; importing it never fails (no Gluon: ``HAVE_GLUON = False``).
"""

from __future__ import annotations

import torch

try:  # Gluon is experimental: its absence (or a renamed API) must not break ``import kdtree_engine``
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from .combine import combine
from .contract import D_ROPE, D_V as D_LAT, kernel_ints
from .launch import Launcher, spec_key

LOG2E = 1.4426950408889634
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 64, 8
# row sums per element instead of a cross-warpgroup reduction per tile (see the kernel's docstring):
# 1-5% faster on the H200 (docs/perf_log.md, run 14)
L_ELEM = True

if HAVE_GLUON:

    @gluon.jit
    def _tile_pages(p_pages, start, kv_end, stride_pp, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                    LAT_L: gl.constexpr, ROPE_L: gl.constexpr):
        """Page ids of the KV rows ``[start, start + BLOCK_N)`` (0 past kv_end), in both copy layouts;
        one scalar when a tile never straddles pages. Loaded a tile ahead of its copies, so the
        page-table latency never sits in front of a cp.async."""
        if PAGE_SIZE % BLOCK_N == 0:
            pg = gl.load(p_pages + (start // PAGE_SIZE) * stride_pp, mask=start < kv_end, other=0)
            return pg, pg
        else:
            o_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAT_L))
            pg_l = gl.load(p_pages + (o_n // PAGE_SIZE) * stride_pp, mask=o_n < kv_end, other=0)
            o_n2 = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
            pg_r = gl.load(p_pages + (o_n2 // PAGE_SIZE) * stride_pp, mask=o_n2 < kv_end, other=0)
            return pg_l, pg_r


    @gluon.jit
    def _issue_kv_tile(kv, pg_l, pg_r, start, kv_end, stride_kvp, stride_kvs, k_lat, k_rope,
                       PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr,
                       LAT_L: gl.constexpr, ROPE_L: gl.constexpr):
        """cp.async the KV rows ``[start, start + BLOCK_N)`` (rows past kv_end zero-filled) into one stage."""
        o_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAT_L))  # [BN]
        m_n = o_n < kv_end
        p_row = kv + pg_l.to(gl.int64) * stride_kvp + (o_n % PAGE_SIZE).to(gl.int64) * stride_kvs  # [BN]
        o_d = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, LAT_L))
        async_copy.async_copy_global_to_shared(
            k_lat, gl.expand_dims(p_row, 1) + gl.expand_dims(o_d, 0), mask=gl.expand_dims(m_n, 1))  # [BN, D_LAT]
        o_n2 = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
        m_n2 = o_n2 < kv_end
        p_row2 = kv + pg_r.to(gl.int64) * stride_kvp + (o_n2 % PAGE_SIZE).to(gl.int64) * stride_kvs + D_LAT
        o_r = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ROPE_L))
        async_copy.async_copy_global_to_shared(
            k_rope, gl.expand_dims(p_row2, 1) + gl.expand_dims(o_r, 0), mask=gl.expand_dims(m_n2, 1))  # [BN, D_ROPE]


    @gluon.jit
    def _qk(s_q_lat, s_q_rope, k_lat, k_rope, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, S_L: gl.constexpr):
        """Issue S = Q_lat K_lat^T + Q_rope K_rope^T (async; each warpgroup its own BLOCK_N / 2 keys)."""
        b_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
        b_s = warpgroup_mma(s_q_lat, k_lat.permute((1, 0)), b_s, use_acc=False, is_async=True)
        return warpgroup_mma(s_q_rope, k_rope.permute((1, 0)), b_s, is_async=True)


    @gluon.jit
    def _softmax_tile(b_s, m_i, start, clean_end, kv_end, prefix, p_mask_rows, m_rows_s, mask_words, stride_mw,
                      scale_log2, BLOCK_N: gl.constexpr, S_L: gl.constexpr):
        """Online-softmax step of one tile: returns P (fp32), alpha, new m. Only tiles past
        clean_end (tree nodes, ragged end) read mask words."""
        b_s = b_s * scale_log2
        if start + BLOCK_N > clean_end:
            o_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
            o_j = o_n - prefix  # tree node of each position (negative: prefix)
            o_jc = gl.maximum(o_j, 0)
            m_tree = (o_n < kv_end) & (o_j >= 0) & (o_jc // 32 < mask_words)
            b_word = gl.load(gl.expand_dims(p_mask_rows, 1) + gl.expand_dims((o_jc // 32) * stride_mw, 0),
                             mask=gl.expand_dims(m_rows_s, 1) & gl.expand_dims(m_tree, 0), other=0)
            b_bit = (b_word >> gl.expand_dims(o_jc % 32, 0)) & 1
            m_vis = gl.expand_dims(o_n < kv_end, 0) & (gl.expand_dims(o_j < 0, 0) | (b_bit != 0))
            b_s = gl.where(m_vis, b_s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(b_s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        b_p = gl.exp2(b_s - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        return b_p, alpha, m_new


    @gluon.jit(do_not_specialize=["stride_pt", "stride_mt", "mask_words"])
    def _hopper_verify_kernel(
        q, kv, page_table, kv_lens, qo_indptr, tree_mask, out, lse,
        prog_first_seg, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial,
        partial_out, partial_lse,
        stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_pp, stride_kl, stride_qo,
        stride_mt, stride_mw, mask_words, stride_ot, stride_oh, stride_lt, stride_lh,
        scale_log2,
        H: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, L_ELEM: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """One persistent program: segments ``prog_first_seg[p] : prog_first_seg[p + 1]`` of the plan.

        Per tile: wait for its copies, QK, softmax, PV, with the next tile's copies (and the page ids of
        the one after) in flight the whole iteration. L_ELEM keeps the row sums per element (summed
        once per segment) instead of reducing across the warpgroups every tile.
        """
        gl.static_assert(num_warps == 8)
        # register layouts of the cp.async address tensors (16-byte vectors along the row)
        LAT_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        # wgmma accumulators: warpgroup 0 / 1 = columns [0, N/2) / [N/2, N)
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_N // 2, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, D_LAT // 2, 16])
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        COL_O: gl.constexpr = gl.SliceLayout(0, O_L)
        dt: gl.constexpr = kv.dtype.element_ty
        QL_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_LAT], dt)
        QR_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_ROPE], dt)
        KL_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LAT], dt)
        KR_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dt)
        P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt)

        s_q_lat = gl.allocate_shared_memory(dt, [BLOCK_M, D_LAT], QL_S)
        s_q_rope = gl.allocate_shared_memory(dt, [BLOCK_M, D_ROPE], QR_S)
        s_k_lat = gl.allocate_shared_memory(dt, [2, BLOCK_N, D_LAT], KL_S)
        s_k_rope = gl.allocate_shared_memory(dt, [2, BLOCK_N, D_ROPE], KR_S)
        s_p = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], P_S)

        i_p = gl.program_id(0)
        for i_s in range(gl.load(prog_first_seg + i_p), gl.load(prog_first_seg + i_p + 1)):
            i_b = gl.load(seg_seq + i_s)
            row0 = gl.load(seg_row0 + i_s)
            kv_start = gl.load(seg_kv_start + i_s)
            kv_end = gl.load(seg_kv_end + i_s)
            i_part = gl.load(seg_partial + i_s)
            qo_start = gl.load(qo_indptr + i_b * stride_qo)
            n_nodes = gl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start
            prefix = gl.load(kv_lens + i_b * stride_kl) - n_nodes
            p_pages = page_table + i_b.to(gl.int64) * stride_pt
            n_tiles = gl.cdiv(kv_end - kv_start, BLOCK_N)
            # tiles starting below clean_end hold prefix keys only and need no mask
            clean_end = kv_start + gl.maximum(gl.minimum(kv_end, prefix) - kv_start, 0) // BLOCK_N * BLOCK_N

            pg_l, pg_r = _tile_pages(p_pages, kv_start, kv_end, stride_pp, PAGE_SIZE, BLOCK_N, LAT_L, ROPE_L)
            # Q rows -> shared memory (rows past n_nodes * H zero-filled); same cp.async group as tile 0
            o_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAT_L))
            m_rows = o_m < n_nodes * H
            o_t = (qo_start + gl.minimum(o_m // H, n_nodes - 1)).to(gl.int64)
            p_q = q + o_t * stride_qt + (o_m % H) * stride_qh  # [BM]
            o_d = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, LAT_L))
            async_copy.async_copy_global_to_shared(
                s_q_lat, gl.expand_dims(p_q, 1) + gl.expand_dims(o_d, 0), mask=gl.expand_dims(m_rows, 1))
            o_m2 = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ROPE_L))
            m_rows2 = o_m2 < n_nodes * H
            o_t2 = (qo_start + gl.minimum(o_m2 // H, n_nodes - 1)).to(gl.int64)
            p_q2 = q + o_t2 * stride_qt + (o_m2 % H) * stride_qh + D_LAT
            o_r = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ROPE_L))
            async_copy.async_copy_global_to_shared(
                s_q_rope, gl.expand_dims(p_q2, 1) + gl.expand_dims(o_r, 0), mask=gl.expand_dims(m_rows2, 1))
            _issue_kv_tile(kv, pg_l, pg_r, kv_start, kv_end, stride_kvp, stride_kvs, s_k_lat.index(0),
                           s_k_rope.index(0), PAGE_SIZE, BLOCK_N, D_LAT, D_ROPE, LAT_L, ROPE_L)
            async_copy.commit_group()
            pg_l, pg_r = _tile_pages(p_pages, kv_start + BLOCK_N, kv_end, stride_pp, PAGE_SIZE, BLOCK_N, LAT_L, ROPE_L)

            # mask-row data in the S layout
            o_ms = row0 + gl.arange(0, BLOCK_M, layout=ROW_S)
            m_rows_s = o_ms < n_nodes * H
            o_ts = (qo_start + gl.minimum(o_ms // H, n_nodes - 1)).to(gl.int64)
            p_mask_rows = tree_mask + o_ts * stride_mt  # [BM]

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
            l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=ROW_S)
            l_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
            acc = gl.zeros([BLOCK_M, D_LAT], gl.float32, layout=O_L)
            for i in range(n_tiles):
                start = kv_start + i * BLOCK_N
                stage = i % 2
                if i + 1 < n_tiles:
                    _issue_kv_tile(kv, pg_l, pg_r, start + BLOCK_N, kv_end, stride_kvp, stride_kvs,
                                   s_k_lat.index(1 - stage), s_k_rope.index(1 - stage),
                                   PAGE_SIZE, BLOCK_N, D_LAT, D_ROPE, LAT_L, ROPE_L)
                async_copy.commit_group()
                pg_l, pg_r = _tile_pages(p_pages, start + 2 * BLOCK_N, kv_end, stride_pp, PAGE_SIZE, BLOCK_N,
                                         LAT_L, ROPE_L)
                async_copy.wait_group(1)  # this thread's copies of tile i (and Q) have landed
                fence_async_shared()  # generic-proxy writes -> visible to wgmma (async proxy)
                gl.thread_barrier()  # ... and every thread's
                b_s = _qk(s_q_lat, s_q_rope, s_k_lat.index(stage), s_k_rope.index(stage), BLOCK_M, BLOCK_N, S_L)
                b_s = warpgroup_mma_wait(0, deps=[b_s])
                b_p, alpha, m_i = _softmax_tile(b_s, m_i, start, clean_end, kv_end, prefix, p_mask_rows,
                                                m_rows_s, mask_words, stride_mw, scale_log2, BLOCK_N, S_L)
                if L_ELEM:  # row sums kept per element: no cross-warpgroup reduction per tile
                    l_acc = l_acc * gl.expand_dims(alpha, 1) + b_p
                else:
                    l_i = l_i * alpha + gl.sum(b_p, axis=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
                s_p.store(b_p.to(dt))
                fence_async_shared()
                gl.thread_barrier()
                acc = warpgroup_mma(s_p, s_k_lat.index(stage), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                gl.thread_barrier()  # stage and P are free for the next iteration's copies / store
            async_copy.wait_group(0)
            if L_ELEM:
                l_i = gl.sum(l_acc, axis=1)

            has_key = l_i > 0
            l_safe = gl.where(has_key, l_i, 1.0)
            lse2 = gl.where(has_key, m_i + gl.log2(l_safe), float("-inf"))  # log2-sum-exp2
            b_o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, ROW_O), 1)
            o_mo = row0 + gl.arange(0, BLOCK_M, layout=ROW_O)
            m_rows_o = o_mo < n_nodes * H
            o_do = gl.arange(0, D_LAT, layout=COL_O)
            if i_part < 0:
                o_to = (qo_start + gl.minimum(o_mo // H, n_nodes - 1)).to(gl.int64)
                p_out = out + gl.expand_dims(o_to * stride_ot + (o_mo % H) * stride_oh, 1) + gl.expand_dims(o_do, 0)
                gl.store(p_out, b_o.to(out.dtype.element_ty), mask=gl.expand_dims(m_rows_o, 1))
                gl.store(lse + o_ts * stride_lt + (o_ms % H) * stride_lh, lse2 * 0.6931471805599453, mask=m_rows_s)
            else:
                o_po = i_part.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_O)
                gl.store(partial_out + gl.expand_dims(o_po * D_LAT, 1) + gl.expand_dims(o_do, 0), b_o,
                         mask=gl.expand_dims(m_rows_o, 1))
                o_ps = i_part.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_S)
                gl.store(partial_lse + o_ps, lse2, mask=m_rows_s)


def available(device: torch.device | str | None = None) -> bool:
    """True when this kernel can run on ``device``: Gluon present and an sm_90 (Hopper) GPU."""
    if not HAVE_GLUON or not torch.cuda.is_available():
        return False
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def supports_plan(config) -> bool:
    """True when a plan's tile config suits this kernel: 64-row blocks (the partial buffers' rows)
    and KV tiles a multiple of 64 (segments start on a 64-position boundary)."""
    return config.block_m == BLOCK_M and config.block_n % BLOCK_N == 0


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """True when the inputs' layout suits the kernel's 16-byte cp.async copies: q and kv_cache
    16-byte aligned with their two outer strides multiples of 16 elements (Triton specialises on
    that; without it the copies would need 2-byte transfers, which cp.async cannot do and the
    compile fails). The contract's dense layouts (576-wide rows) always qualify."""
    return (q.data_ptr() % 16 == 0 and kv_cache.data_ptr() % 16 == 0
            and all(s % 16 == 0 for s in (q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1))))


def launch(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan):
    """Launch the Hopper kernel on the plan's segments, then the combine kernel.

    Same arguments as :func:`kdtree_engine.verify.triton_flash.launch` (inputs already checked
    against the contract and the plan); ``plan`` is a :class:`~kdtree_engine.verify.plan.FlashTables`
    whose config satisfies :func:`supports_plan`, and ``q`` / ``kv_cache`` :func:`supports` (both
    checked by :func:`kdtree_engine.verify.op.resolve`). Writes ``out`` and ``lse``.
    """
    H = q.shape[1]
    tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
    ints = kernel_ints(*tensors)
    page_size = kv_cache.shape[1]
    # the plan's tables: int32 / float32, 16-byte aligned (VerifyPlan allocates them so): not in the key
    _HOPPER((spec_key(tensors, ints), H, page_size), (plan.num_programs,),
            (*tensors, plan.prog_first_seg, *plan.segment_rows, plan.partial_out, plan.partial_lse, *ints,
             sm_scale * LOG2E),
            dict(H=H, PAGE_SIZE=page_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D_LAT=D_LAT, D_ROPE=D_ROPE,
                 L_ELEM=L_ELEM, num_warps=NUM_WARPS))
    combine(q, qo_indptr, out, lse, plan)


_HOPPER = Launcher(_hopper_verify_kernel) if HAVE_GLUON else None
