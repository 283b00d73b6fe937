"""Issue 11 spike: a Hopper (sm_90a) tree-verify attention kernel in Gluon, measured in one run.

    PYTHONPATH=src python3 scripts/spike_hopper_verify.py --compile-report      # CPU: sm_90a compile only
    PYTHONPATH=src python3 scripts/spike_hopper_verify.py --out DIR             # GPU: check + time all

Self-contained on purpose (the package's verify/ is being restructured): the kernel, a trivial
split-KV schedule in the same work-list format as the Triton flash kernel's plan (segments
``seq, row0, kv_start, kv_end, partial slot`` + ``prog_first_seg``, partials ``[P, 64, 512]`` fp32
and log2-sum-exp), a small Triton combine, a float32 torch reference, and the timing of (a) this
kernel, (b) the Triton flash kernel through ``kdtree_engine.verify_attention(kernel="flash")`` and
(c) FlashMLA (chain tree = its causal mask, page 64), with the measured matmul and copy ceilings.

Kernel design (one CTA = 64 packed query rows x a KV range, 8 warps = 2 warpgroups):
- Q ``[64, 512]`` + ``[64, 64]`` stays in shared memory (A operand of wgmma), loaded by cp.async.
- KV tiles of 64 rows (``[64, 512]`` latent + ``[64, 64]`` rope) are gathered row by row through the
  page table with cp.async (any page size, 1 included) into 128-byte-swizzled shared memory,
  double-buffered: the next tile's copies fly while the current tile computes.
- ``S = Q K^T`` with an MMA layout of warps ``[4, 2]``: each warpgroup computes its OWN 32 keys of
  the tile (no duplicated QK work, unlike Triton's ``[8, 1]`` for chained dots); the row max and
  row sum cross the two warpgroups through the compiler's reduction.
- P (bf16) goes to shared memory; ``O[64, 512] += P V`` with warps ``[4, 2]``: each warpgroup owns
  256 output columns (128 fp32 accumulator registers per thread). V = the latent columns of the
  SAME shared K tile (read once from global memory).
- Prefix tiles run unmasked; only a tile that reaches the tree nodes or the segment's ragged end
  reads mask words.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

D_QK, D_V = 576, 512
D_ROPE = D_QK - D_V
LOG2E = 1.4426950408889634
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 64, 8


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------
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
    D_LAT: gl.constexpr, D_ROPE: gl.constexpr, OVERLAP: gl.constexpr, L_ELEM: gl.constexpr,
    ABLATE: gl.constexpr, num_warps: gl.constexpr,
):
    """One persistent program: segments ``prog_first_seg[p] : prog_first_seg[p + 1]`` of the plan.

    OVERLAP=False: per tile, wait for its copies, QK, softmax, PV, with the next tile's copies in
    flight the whole iteration. OVERLAP=True: PV(i) and QK(i+1) are issued back to back (one wgmma
    wait per tile instead of two); the copies of tile i+2 then fly during softmax(i+1) and PV(i+1).
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
        if OVERLAP:
            if n_tiles > 1:
                _issue_kv_tile(kv, pg_l, pg_r, kv_start + BLOCK_N, kv_end, stride_kvp, stride_kvs, s_k_lat.index(1),
                               s_k_rope.index(1), PAGE_SIZE, BLOCK_N, D_LAT, D_ROPE, LAT_L, ROPE_L)
            async_copy.commit_group()
            pg_l, pg_r = _tile_pages(p_pages, kv_start + 2 * BLOCK_N, kv_end, stride_pp, PAGE_SIZE, BLOCK_N,
                                     LAT_L, ROPE_L)
            async_copy.wait_group(1)
            fence_async_shared()
            gl.thread_barrier()
            b_s = _qk(s_q_lat, s_q_rope, s_k_lat.index(0), s_k_rope.index(0), BLOCK_M, BLOCK_N, S_L)
            b_s = warpgroup_mma_wait(0, deps=[b_s])
            for i in range(n_tiles):
                start = kv_start + i * BLOCK_N
                stage = i % 2
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
                acc_tok = warpgroup_mma(s_p, s_k_lat.index(stage), acc, is_async=True)
                if i + 1 < n_tiles:
                    async_copy.wait_group(0)  # tile i+1
                    fence_async_shared()
                    gl.thread_barrier()
                    s_tok = _qk(s_q_lat, s_q_rope, s_k_lat.index(1 - stage), s_k_rope.index(1 - stage),
                                BLOCK_M, BLOCK_N, S_L)
                    acc, b_s = warpgroup_mma_wait(0, deps=[acc_tok, s_tok])
                else:
                    acc = warpgroup_mma_wait(0, deps=[acc_tok])
                gl.thread_barrier()  # PV(i) done in both warpgroups: stage and P are free
                if i + 2 < n_tiles:
                    _issue_kv_tile(kv, pg_l, pg_r, start + 2 * BLOCK_N, kv_end, stride_kvp, stride_kvs,
                                   s_k_lat.index(stage), s_k_rope.index(stage), PAGE_SIZE, BLOCK_N, D_LAT, D_ROPE,
                                   LAT_L, ROPE_L)
                async_copy.commit_group()
                pg_l, pg_r = _tile_pages(p_pages, start + 3 * BLOCK_N, kv_end, stride_pp, PAGE_SIZE, BLOCK_N,
                                         LAT_L, ROPE_L)
        else:
            for i in range(n_tiles):
                start = kv_start + i * BLOCK_N
                stage = i % 2
                if ABLATE != 3:  # ABLATE 3, timing experiment: no KV copies after the first tile
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
                if ABLATE == 1:  # timing experiment: no QK
                    b_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L) + i
                else:
                    b_s = _qk(s_q_lat, s_q_rope, s_k_lat.index(stage), s_k_rope.index(stage), BLOCK_M, BLOCK_N, S_L)
                    b_s = warpgroup_mma_wait(0, deps=[b_s])
                if ABLATE == 4:  # timing experiment: no softmax
                    b_p = b_s
                    alpha = gl.full([BLOCK_M], 1.0, gl.float32, layout=ROW_S)
                else:
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
                if ABLATE != 2:  # ABLATE 2, timing experiment: no PV
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


@triton.jit
def _spike_combine_kernel(partial_out, partial_lse, out, lse, qo_indptr, g_seq, g_row0, g_first, g_count,
                          stride_ot, stride_oh, stride_lt, stride_lh,
                          H: tl.constexpr, BM: tl.constexpr, D: tl.constexpr):
    """out row = sum_s w_s * partial_s, w_s = 2^(lse2_s - lse2) (one program per group x row)."""
    i_g = tl.program_id(0)
    i_r = tl.program_id(1)
    b = tl.load(g_seq + i_g)
    row = tl.load(g_row0 + i_g) + i_r
    t0 = tl.load(qo_indptr + b)
    n = tl.load(qo_indptr + b + 1) - t0
    if row < n * H:
        first = tl.load(g_first + i_g)
        cnt = tl.load(g_count + i_g)
        o_s = tl.arange(0, 64)
        m_s = o_s < cnt
        slot = (first + o_s).to(tl.int64) * BM + i_r
        x = tl.load(partial_lse + slot, mask=m_s, other=float("-inf"))
        mx = tl.max(x, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(x - mx)
        tot = tl.sum(w, 0)
        o_d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        for s in range(cnt):
            ws = tl.sum(tl.where(o_s == s, w, 0.0), 0)
            acc += ws * tl.load(partial_out + ((first + s).to(tl.int64) * BM + i_r) * D + o_d)
        ok = tot > 0
        tot_s = tl.where(ok, tot, 1.0)
        t = (t0 + row // H).to(tl.int64)
        tl.store(out + t * stride_ot + (row % H) * stride_oh + o_d, (acc / tot_s).to(out.dtype.element_ty))
        tl.store(lse + t * stride_lt + (row % H) * stride_lh,
                 tl.where(ok, (mx + tl.log2(tot_s)) * 0.6931471805599453, float("-inf")))


# ----------------------------------------------------------------------------------------------
# trivial schedule (same work-list format as the flash plan) and launcher
# ----------------------------------------------------------------------------------------------
class SpikePlan:
    """Split each (sequence, row block) evenly along KV so that about ``num_programs`` segments exist;
    one segment per program, programs ordered (sequence, KV piece, row block) so that programs
    launched side by side read the same KV (L2 reuse)."""

    def __init__(self, kv_lens, qo_indptr, H, device, num_programs=132, max_splits=64):
        kv, qo = list(kv_lens), list(qo_indptr)
        rb = [math.ceil((qo[b + 1] - qo[b]) * H / BLOCK_M) for b in range(len(kv))]
        tiles = [math.ceil(L / BLOCK_N) for L in kv]
        total = sum(r * t for r, t in zip(rb, tiles))
        segs, groups, nparts = [], [], 0
        for b in range(len(kv)):
            # splits of this sequence: its share of the programs, never a second wave for B = 1
            ns = max(1, min(max_splits, tiles[b], num_programs * tiles[b] // max(total, 1)))
            width = math.ceil(tiles[b] / ns)
            cuts = [(c * width, min((c + 1) * width, tiles[b])) for c in range(ns) if c * width < tiles[b]]
            ns = len(cuts)
            first = {}
            for r in range(rb[b]):
                if ns > 1:
                    first[r] = nparts
                    groups.append([b, r * BLOCK_M, nparts, ns])
                    nparts += ns
            for c, (t0, t1) in enumerate(cuts):
                for r in range(rb[b]):
                    segs.append([b, r * BLOCK_M, t0 * BLOCK_N, min(t1 * BLOCK_N, kv[b]),
                                 first[r] + c if ns > 1 else -1])
        self.num_programs = len(segs)
        self.prog_first_seg = torch.arange(len(segs) + 1, dtype=torch.int32, device=device)
        st = torch.tensor(segs, dtype=torch.int32).T.contiguous().to(device)
        self.segments = [st[i] for i in range(5)]
        self.num_groups = len(groups)
        gt = torch.tensor(groups or [[0, 0, 0, 0]], dtype=torch.int32).T.contiguous().to(device)
        self.groups = [gt[i] for i in range(4)]
        self.partial_out = torch.empty(max(nparts, 1), BLOCK_M, D_V, dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(max(nparts, 1), BLOCK_M, dtype=torch.float32, device=device)


def hopper_verify(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan, overlap=False, l_elem=False, ablate=0):
    T, H, _ = q.shape
    sg = plan.segments
    _hopper_verify_kernel[(plan.num_programs,)](
        q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse,
        plan.prog_first_seg, sg[0], sg[1], sg[2], sg[3], sg[4], plan.partial_out, plan.partial_lse,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        page_table.stride(0), page_table.stride(1), kv_lens.stride(0), qo_indptr.stride(0),
        tree_mask.stride(0), tree_mask.stride(1), tree_mask.shape[1],
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        sm_scale * LOG2E,
        H=H, PAGE_SIZE=kv_cache.shape[1], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D_LAT=D_V, D_ROPE=D_ROPE,
        OVERLAP=overlap, L_ELEM=l_elem, ABLATE=ablate, num_warps=NUM_WARPS,
    )
    if plan.num_groups:
        g = plan.groups
        _spike_combine_kernel[(plan.num_groups, BLOCK_M)](
            plan.partial_out, plan.partial_lse, out, lse, qo_indptr, g[0], g[1], g[2], g[3],
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            H=H, BM=BLOCK_M, D=D_V, num_warps=4,
        )
    return out, lse


# ----------------------------------------------------------------------------------------------
# compiler report (no GPU needed)
# ----------------------------------------------------------------------------------------------
def compile_report(H=64, page_size=1, dump=None, overlap=False, l_elem=False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kern = _hopper_verify_kernel
    constexprs = dict(H=H, PAGE_SIZE=page_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D_LAT=D_V, D_ROPE=D_ROPE,
                      OVERLAP=overlap, L_ELEM=l_elem, ABLATE=0, num_warps=NUM_WARPS)
    ptrs = {"q": "*bf16", "kv": "*bf16", "out": "*bf16", "lse": "*fp32", "partial_out": "*fp32",
            "partial_lse": "*fp32"}
    divisible = ("stride_qt", "stride_qh", "stride_kvp", "stride_kvs", "stride_ot", "stride_oh", "stride_lt")
    sig = {}
    for name in kern.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        elif name == "scale_log2":
            sig[name] = "fp32"
        elif name.startswith("stride") or name == "mask_words":
            sig[name] = "i32"
        else:
            sig[name] = "*i32"
    aligned = [n for n, t in sig.items() if t.startswith("*")] + list(divisible)
    src = GluonASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in constexprs.items()},
                         attrs={(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS))
    ptx = ck.asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ptx)
        r = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                           capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    shapes = {}
    for s in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx):
        shapes[s] = shapes.get(s, 0) + 1
    rep = dict(H=H, page_size=page_size, overlap=overlap, l_elem=l_elem, shared_bytes=ck.metadata.shared,
               regs=int(regs.group(1)) if regs else None,
               spill_stores=int(spills.group(1)) if spills else None,
               spill_loads=int(spills.group(2)) if spills else None,
               wgmma=shapes, cp_async=len(re.findall(r"cp\.async\.cg|cp\.async\.ca", ptx)),
               ptxas_stderr=r.stderr.strip()[-400:])
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        Path(dump, "spike.ttgir").write_text(ck.asm["ttgir"])
        Path(dump, "spike.ptx").write_text(ptx)
    return rep



# ----------------------------------------------------------------------------------------------
# inputs, reference, checks
# ----------------------------------------------------------------------------------------------
def tree_parents(n, kind, gen):
    if kind == "chain":
        return [-1] + list(range(n - 1))
    return [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]


def make_mask(parents_list, W):
    """[T, W] int32: bit j of row t set iff node j is t's ancestor or itself."""
    rows = []
    for parents in parents_list:
        n = len(parents)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for j in range(n):
            anc[j, j] = True
            if parents[j] >= 0:
                anc[j] |= anc[parents[j]]
        words = torch.zeros(n, W, dtype=torch.int64)
        for j in range(n):
            words[:, j // 32] |= anc[:, j].to(torch.int64) << (j % 32)
        rows.append(words)
    m = torch.cat(rows)
    m = torch.where(m >= 2**31, m - 2**32, m)
    return m.to(torch.int32)


def make_inputs(H, nodes, prefixes, page_size, tree="chain", seed=0, device="cuda"):
    """Random bf16 q / KV; page table shuffled over a pool with spare pages; every unused slot NaN."""
    gen = torch.Generator().manual_seed(seed)
    B = len(nodes)
    kv_lens = [p + n for p, n in zip(prefixes, nodes)]
    pages_per = [math.ceil(L / page_size) for L in kv_lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=gen)
    max_pages = max(max(pages_per), 1)
    pt = torch.zeros(B, max_pages, dtype=torch.int32)
    o = 0
    for b in range(B):
        pt[b, : pages_per[b]] = perm[o: o + pages_per[b]].to(torch.int32)
        o += pages_per[b]
    kv_cache = torch.full((num_pages, page_size, D_QK), float("nan"), dtype=torch.bfloat16, device=device)
    pt_d = pt.to(device)
    for b in range(B):
        L = kv_lens[b]
        pos = torch.arange(L, device=device)
        page = pt_d[b, pos // page_size].long()
        vals = torch.randn(L, D_QK, device=device, dtype=torch.float32,
                           generator=torch.Generator(device=device).manual_seed(seed * 1000 + b)).to(torch.bfloat16)
        kv_cache[page, pos % page_size] = vals
    T = sum(nodes)
    q = torch.randn(T, H, D_QK, device=device, dtype=torch.float32,
                    generator=torch.Generator(device=device).manual_seed(seed + 7)).to(torch.bfloat16)
    W = max(1, math.ceil(max(nodes) / 32))
    parents = [tree_parents(n, tree, gen) for n in nodes]
    tree_mask = make_mask(parents, W).to(device)
    qo = [0]
    for n in nodes:
        qo.append(qo[-1] + n)
    return dict(q=q, kv_cache=kv_cache, page_table=pt_d,
                kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
                qo_indptr=torch.tensor(qo, dtype=torch.int32, device=device),
                tree_mask=tree_mask, kv_lens_host=kv_lens, qo_host=qo, parents=parents, H=H, page_size=page_size)


def reference(inp, scale):
    """float32 (no TF32) softmax(q k^T * scale, tree mask) v per sequence, on the GPU. Returns out, lse."""
    q, kvc, pt = inp["q"], inp["kv_cache"], inp["page_table"]
    H, ps = inp["H"], inp["page_size"]
    outs, lses = [], []
    for b, L in enumerate(inp["kv_lens_host"]):
        t0, t1 = inp["qo_host"][b], inp["qo_host"][b + 1]
        n = t1 - t0
        P = L - n
        pos = torch.arange(L, device=q.device)
        K = kvc[pt[b, pos // ps].long(), pos % ps].float()  # [L, 576]
        words = inp["tree_mask"][t0:t1].long() & 0xFFFFFFFF
        j = torch.arange(n, device=q.device)
        vis_tree = ((words[:, j // 32] >> (j % 32)) & 1).bool()  # [n, n]
        qb = q[t0:t1].float().reshape(n * H, D_QK)
        o_rows, l_rows = [], []
        for r0 in range(0, n * H, 1024):
            qs = qb[r0: r0 + 1024]
            s = (qs @ K.T) * scale
            node = (torch.arange(r0, r0 + qs.shape[0], device=q.device) // H)
            s[:, P:] = torch.where(vis_tree[node], s[:, P:], float("-inf"))
            lse = torch.logsumexp(s, 1)
            o_rows.append(torch.softmax(s, 1) @ K[:, :D_V])
            l_rows.append(lse)
            del s
        outs.append(torch.cat(o_rows).reshape(n, H, D_V))
        lses.append(torch.cat(l_rows).reshape(n, H))
    return torch.cat(outs), torch.cat(lses)


def compare(out, lse, ref_out, ref_lse):
    o = out.float()
    bad_nan = bool(torch.isnan(o).any() or torch.isnan(lse).any())
    d = (o - ref_out).abs()
    rel = float(d.max() / ref_out.abs().max().clamp_min(1e-6))
    lse_err = float((lse - ref_lse).abs().max())
    ok = (not bad_nan) and rel <= 1e-2 and lse_err <= 1e-2
    return dict(ok=ok, nan=bad_nan, max_abs=float(d.max()), rel=rel, lse_abs=lse_err)


def run_ours(inp, plan, scale, out=None, lse=None, overlap=False, l_elem=False, ablate=0):
    T, H = inp["q"].shape[:2]
    if out is None:
        out = torch.full((T, H, D_V), float("nan"), dtype=inp["q"].dtype, device=inp["q"].device)
        lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=inp["q"].device)
    return hopper_verify(inp["q"], inp["kv_cache"], inp["page_table"], inp["kv_lens"], inp["qo_indptr"],
                         inp["tree_mask"], scale, out, lse, plan, overlap=overlap, l_elem=l_elem, ablate=ablate)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
def time_graph(fn, budget_s=0.4, max_reps=200):
    """Median of CUDA-graph replays (one call per replay), each timed by events."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    one = time.perf_counter() - t
    reps = int(max(5, min(max_reps, budget_s / max(one, 1e-6))))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) * 1e3 for a, b in ev)
    return ts[len(ts) // 2]


def ceilings():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = time_graph(lambda: torch.matmul(a, b, out=c), budget_s=0.5)
    tflops = 2 * 8192**3 / (us * 1e-6) / 1e12
    x = torch.empty(2**31 // 4, device="cuda", dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    us_c = time_graph(lambda: y.copy_(x), budget_s=0.5)
    tbps = 2 * x.numel() * 4 / (us_c * 1e-6) / 1e12
    del a, b, c, x, y
    torch.cuda.empty_cache()
    return tflops, tbps


def flops_bytes(inp):
    H = inp["H"]
    fl, by = 0, 0
    for b, L in enumerate(inp["kv_lens_host"]):
        n = inp["qo_host"][b + 1] - inp["qo_host"][b]
        fl += 2 * n * H * L * (D_QK + D_V)
        by += L * D_QK * 2 + n * H * (D_QK + D_V) * 2
    return fl, by


def load_flashmla():
    for d in (Path(".peers/flashmla"), Path("../shared/peers/flashmla")):
        if (d / "flashmla_peer.py").exists():
            sys.path.insert(0, str(d.resolve()))
            from flashmla_peer import load_flashmla as lf
            return lf()
    raise ImportError("flashmla_peer.py not found (.peers/flashmla or ../shared/peers/flashmla)")


def triton_flash_fn(inp, scale):
    import kdtree_engine
    try:
        from kdtree_engine.verify import plan_verify
        plan = plan_verify(inp["kv_lens_host"], inp["qo_host"], inp["H"], "cuda")
    except ImportError:
        plan = None
    T, H = inp["q"].shape[:2]
    out = torch.empty(T, H, D_V, dtype=inp["q"].dtype, device="cuda")
    lse = torch.empty(T, H, dtype=torch.float32, device="cuda")
    args = (inp["q"], inp["kv_cache"], inp["page_table"], inp["kv_lens"], inp["qo_indptr"], inp["tree_mask"], scale)
    if plan is not None:
        fn = lambda: kdtree_engine.verify_attention(*args, kernel="flash", out=out, lse=lse, plan=plan, validate=False)
    else:
        fn = lambda: kdtree_engine.verify_attention(*args, kernel="flash", out=out, lse=lse)
    return fn, out, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile-report", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ablate", action="store_true", help="time the kernel with one stage left out (no checks)")
    a = ap.parse_args()
    if a.ablate:
        # where the time goes: the same kernel with one stage left out (results wrong on purpose)
        res = dict(device=torch.cuda.get_device_name(), ablation=[])
        scale = 1.0 / math.sqrt(D_QK)
        for (H, n, B, P), ps in (((64, 33, 4, 131072), 64), ((64, 33, 4, 131072), 1), ((16, 9, 1, 131072), 64),
                                 ((128, 9, 1, 131072), 64), ((128, 9, 1, 131072), 1)):
            inp = make_inputs(H, [n] * B, [P] * B, ps, "chain", seed=3)
            plan = SpikePlan(inp["kv_lens_host"], inp["qo_host"], H, "cuda")
            row = dict(H=H, nodes=n, B=B, prefix=P, page=ps)
            for name, ab in (("full", 0), ("no_qk", 1), ("no_pv", 2), ("no_kv_loads", 3), ("no_softmax", 4)):
                row[name + "_us"] = time_graph(lambda: run_ours(inp, plan, scale, l_elem=True, ablate=ab), budget_s=0.3)
            try:  # the package module (its default variant) on the package plan, checked against the spike kernel
                from kdtree_engine.verify import hopper as hmod
                from kdtree_engine.verify import plan_verify
                pplan = plan_verify(inp["kv_lens_host"], inp["qo_host"], H, "cuda")
                T = inp["q"].shape[0]
                o1 = torch.full((T, H, D_V), float("nan"), dtype=torch.bfloat16, device="cuda")
                l1 = torch.full((T, H), float("nan"), dtype=torch.float32, device="cuda")
                margs = (inp["q"], inp["kv_cache"], inp["page_table"], inp["kv_lens"], inp["qo_indptr"],
                         inp["tree_mask"], scale, o1, l1, pplan.tables)
                hmod.launch(*margs)
                o2, l2 = run_ours(inp, plan, scale, l_elem=True)
                row["module_l_elem"] = hmod.L_ELEM
                row["module_vs_spike_max_abs"] = float((o1.float() - o2.float()).abs().max())
                row["module_us"] = time_graph(lambda: hmod.launch(*margs), budget_s=0.3)
            except Exception as e:  # noqa: BLE001
                row["module_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["ablation"].append(row)
            print(json.dumps(row), flush=True)
            del inp
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "hopper_spike_ablation.json").write_text(json.dumps(res, indent=1))
        return
    if a.compile_report:
        for ov in (False, True):
            for ps in (1, 64):
                r = compile_report(64, ps, dump=f"/tmp/spike_dump_{int(ov)}" if ps == 1 else None, overlap=ov)
                r.pop("ptxas_stderr")
                print(json.dumps(r))
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               checks=[], bench=[])
    print(f"# {res['device']} torch {res['torch']} triton {res['triton']}", flush=True)
    scale = 1.0 / math.sqrt(D_QK)
    t0 = time.time()

    # 1. correctness on awkward cases (fresh random data, NaN-poisoned unused slots, NaN-filled outputs)
    cases = [
        ("ragged H16 pages1 random", 16, [1, 9, 33, 70], [0, 100, 1000, 5000], 1, "random", 132),
        ("ragged H16 page16 random 7 programs", 16, [1, 9, 33, 70], [0, 100, 1000, 5000], 16, "random", 7),
        ("ragged H16 page64 random 300 programs", 16, [5, 40], [3000, 64], 64, "random", 300),
        ("H7 odd heads page1", 7, [13, 2], [777, 0], 1, "random", 132),
        ("H128 n33 page1 chain", 128, [33], [3000], 1, "chain", 132),
        ("H64 n200 page1 random", 64, [200], [2000], 1, "random", 132),
        ("H1 n1 page1", 1, [1, 1], [10, 0], 1, "chain", 132),
    ]
    for name, H, nodes, prefixes, ps, tree, nprog in cases:
        inp = make_inputs(H, nodes, prefixes, ps, tree, seed=len(res["checks"]) + 1)
        plan = SpikePlan(inp["kv_lens_host"], inp["qo_host"], H, "cuda", num_programs=nprog)
        ro, rl = reference(inp, scale)
        c = {}
        for ov in (False, True):
            out, lse = run_ours(inp, plan, scale, l_elem=ov)
            cc = compare(out, lse, ro, rl)
            out2, lse2 = run_ours(inp, plan, scale, l_elem=ov)
            cc["deterministic"] = bool(torch.equal(out, out2) and torch.equal(lse, lse2))
            c = cc if not ov else {**c, "ok": c["ok"] and cc["ok"], "deterministic": c["deterministic"] and cc["deterministic"], "l_elem": cc}
        c.update(name=name, programs=plan.num_programs, groups=plan.num_groups)
        res["checks"].append(c)
        print(f"check {name}: {'PASS' if c['ok'] and c['deterministic'] else 'FAIL'} {c}", flush=True)
        del inp

    if not all(c["ok"] and c["deterministic"] for c in res["checks"]) and not os.environ.get("SPIKE_BENCH_ANYWAY"):
        (outdir / "hopper_spike.json").write_text(json.dumps(res, indent=1))
        print("# correctness FAILED: no timing")
        sys.exit(1)

    # 2. ceilings
    mm, cp = ceilings()
    res["ceilings"] = dict(matmul_tflops=mm, copy_tbps=cp)
    print(f"# ceilings: bf16 8192^3 matmul {mm:.0f} TFLOP/s, copy {cp:.2f} TB/s", flush=True)

    try:
        fm = load_flashmla()
    except Exception as e:  # noqa: BLE001
        print(f"# FlashMLA not available: {e}", flush=True)
        fm = None

    shapes = [(16, 9, 1, 131072), (64, 33, 1, 16384), (64, 33, 4, 131072), (128, 33, 4, 131072), (128, 9, 1, 131072)]
    runs = [(s, ps, "chain") for s in shapes for ps in (64, 1)] + [((64, 33, 1, 16384), 64, "random"),
                                                                    ((64, 33, 4, 131072), 64, "random"),
                                                                    ((64, 33, 1, 4096), 64, "chain"),
                                                                    ((16, 9, 4, 4096), 64, "chain"),
                                                                    ((128, 1024, 1, 131072), 64, "random"),
                                                                    ((128, 256, 1, 131072), 1, "random")]
    if a.quick:
        runs = runs[:4]
    for (H, n, B, P), ps, tree in runs:
        inp = make_inputs(H, [n] * B, [P] * B, ps, tree, seed=100 + H + n + B)
        fl, by = flops_bytes(inp)
        floor_us = max(fl / (mm * 1e12), by / (cp * 1e12)) * 1e6
        row = dict(H=H, nodes=n, B=B, prefix=P, page=ps, tree=tree, floor_us=floor_us, gflop=fl / 1e9)
        plan = SpikePlan(inp["kv_lens_host"], inp["qo_host"], H, "cuda")
        T = inp["q"].shape[0]
        out = torch.full((T, H, D_V), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((T, H), float("nan"), dtype=torch.float32, device="cuda")
        run_ours(inp, plan, scale, out, lse)
        ro, rl = reference(inp, scale)
        row["check"] = compare(out, lse, ro, rl)
        row["programs"] = plan.num_programs
        row["ours_us"] = time_graph(lambda: run_ours(inp, plan, scale, out, lse))
        # variant: row sums kept per element (no cross-warpgroup sum per tile). The OVERLAP variant
        # (PV(i) and QK(i+1) back to back) measured 1-9% slower in run 2 and is no longer timed.
        out.fill_(float("nan"))
        run_ours(inp, plan, scale, out, lse, l_elem=True)
        row["ovl_check"] = compare(out, lse, ro, rl)
        row["ovl_us"] = time_graph(lambda: run_ours(inp, plan, scale, out, lse, l_elem=True))
        # the package module (verify/hopper.py) on the package's own plan, if importable
        try:
            from kdtree_engine.verify import hopper as hmod
            from kdtree_engine.verify import plan_verify
            pplan = plan_verify(inp["kv_lens_host"], inp["qo_host"], H, "cuda")
            margs = (inp["q"], inp["kv_cache"], inp["page_table"], inp["kv_lens"], inp["qo_indptr"],
                     inp["tree_mask"], scale, out, lse, pplan.tables)
            out.fill_(float("nan"))
            hmod.launch(*margs)
            row["module_check"] = compare(out, lse, ro, rl)
            row["module_us"] = time_graph(lambda: hmod.launch(*margs))
            row["module_programs"] = pplan.num_programs
        except Exception as e:  # noqa: BLE001
            row["module_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            fn, tout, tlse = triton_flash_fn(inp, scale)
            fn()
            row["triton_check"] = compare(tout, tlse, ro, rl)
            row["triton_us"] = time_graph(fn)
        except Exception as e:  # noqa: BLE001
            row["triton_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if fm is not None and ps == 64 and tree == "chain":
            try:
                sk = inp["kv_lens"]
                meta, nsplit = fm.get_mla_metadata(sk, n, H, 1)
                qf = inp["q"].view(B, n, H, D_QK)
                kc = inp["kv_cache"].view(-1, 64, 1, D_QK)

                def fmfn():
                    return fm.dense_decode_fwd(qf, kc, D_V, sk, inp["page_table"], scale, True, meta, nsplit)
                fo, fl_, _, _ = fmfn()
                row["flashmla_check"] = compare(fo.reshape(T, H, D_V), fl_.transpose(1, 2).reshape(T, H), ro, rl)
                row["flashmla_us"] = time_graph(fmfn)
            except Exception as e:  # noqa: BLE001
                row["flashmla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for k in ("ours", "ovl", "module", "triton", "flashmla"):
            if f"{k}_us" in row:
                row[f"{k}_tflops"] = fl / (row[f"{k}_us"] * 1e-6) / 1e12
                row[f"{k}_pct_floor"] = 100 * floor_us / row[f"{k}_us"]
        res["bench"].append(row)
        print(json.dumps(row), flush=True)
        del inp, ro, rl, out, lse
        torch.cuda.empty_cache()

    # dispatch sweep: the package module on the package plan vs the Triton flash kernel, small shapes
    res["sweep"] = []
    if not a.quick:
        try:
            from kdtree_engine.verify import hopper as hmod
            from kdtree_engine.verify import plan_verify
            for H in (16, 64, 128):
                for n in (9, 33):
                    for B in (1, 4):
                        for P in (1024, 4096):
                            inp = make_inputs(H, [n] * B, [P] * B, 1, "random", seed=7 + H + n + B + P)
                            pplan = plan_verify(inp["kv_lens_host"], inp["qo_host"], H, "cuda")
                            T = inp["q"].shape[0]
                            o1 = torch.empty(T, H, D_V, dtype=torch.bfloat16, device="cuda")
                            l1 = torch.empty(T, H, dtype=torch.float32, device="cuda")
                            margs = (inp["q"], inp["kv_cache"], inp["page_table"], inp["kv_lens"], inp["qo_indptr"],
                                     inp["tree_mask"], scale, o1, l1, pplan.tables)
                            hmod.launch(*margs)
                            fn, o2, l2 = triton_flash_fn(inp, scale)
                            fn()
                            diff = float((o1.float() - o2.float()).abs().max())
                            r = dict(H=H, nodes=n, B=B, prefix=P, page=1, module_us=time_graph(lambda: hmod.launch(*margs), budget_s=0.2),
                                     triton_us=time_graph(fn, budget_s=0.2), max_abs_diff_vs_triton=diff)
                            res["sweep"].append(r)
                            print(json.dumps(r), flush=True)
                            del inp
        except Exception as e:  # noqa: BLE001
            print(f"# sweep failed: {type(e).__name__}: {e}", flush=True)

    res["compile"] = [compile_report(64, ps, l_elem=le) for le in (False, True) for ps in (1, 64)]
    res["wall_s"] = time.time() - t0
    (outdir / "hopper_spike.json").write_text(json.dumps(res, indent=1))
    lines = ["| H | nodes | B | prefix | page | tree | ours us (TF/s, %floor) | L_ELEM variant us | module+plan us | Triton flash us | FlashMLA us | best/FlashMLA | Triton/best | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["bench"]:
        f = lambda k: f"{r[k + '_us']:.1f}" if k + "_us" in r else "-"
        best = min(r["ours_us"], r["ovl_us"])
        ratio = f"{best / r['flashmla_us']:.2f}" if "flashmla_us" in r else "-"
        sp = f"{r['triton_us'] / best:.2f}x" if "triton_us" in r else "-"
        ok = r["check"]["ok"] and r["ovl_check"]["ok"] and r.get("module_check", {}).get("ok", True)
        lines.append(f"| {r['H']} | {r['nodes']} | {r['B']} | {r['prefix']} | {r['page']} | {r['tree']} | "
                     f"{r['ours_us']:.1f} ({r['ours_tflops']:.0f}, {r['ours_pct_floor']:.0f}%) | "
                     f"{r['ovl_us']:.1f} ({r['ovl_tflops']:.0f}, {r['ovl_pct_floor']:.0f}%) | {f('module')} | {f('triton')} | "
                     f"{f('flashmla')} | {ratio} | {sp} | {'PASS' if ok else 'FAIL'} rel {r['check']['rel']:.1e} |")
    if res.get("sweep"):
        lines += ["", "| H | nodes | B | prefix | page | module us | Triton flash us | Triton/module | max abs diff |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in res["sweep"]:
            lines.append(f"| {r['H']} | {r['nodes']} | {r['B']} | {r['prefix']} | 1 | {r['module_us']:.1f} | "
                         f"{r['triton_us']:.1f} | {r['triton_us'] / r['module_us']:.2f}x | {r['max_abs_diff_vs_triton']:.1e} |")
    table = "\n".join(lines)
    (outdir / "hopper_spike.md").write_text(
        f"{res['device']}, torch {res['torch']}, triton {res['triton']}; ceilings: matmul {mm:.0f} TFLOP/s, "
        f"copy {cp:.2f} TB/s\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
