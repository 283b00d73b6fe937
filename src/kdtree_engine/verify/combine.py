"""The combine kernel: merges the KV splits of a plan's split row blocks into ``out`` / ``lse``.

Shared by every kernel that consumes a :class:`~kdtree_engine.verify.plan.VerifyPlan` (the Triton
flash kernel, the Hopper kernel): a segment that covers only part of its row block's KV writes a
normalised partial ``[BLOCK_M, 512]`` fp32 and its log2-sum-exp; a fixed grid of programs merges
them row by row. No atomics: bitwise deterministic.

:func:`prepare_planned` lays out the launches of such a kernel and the combine once per signature
of the caller's tensors (:class:`~kdtree_engine.verify.launch.Launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contract import D_V, kernel_ints
from .launch import Launch, Launcher, spec_key
from .plan import FlashTables

__all__ = ["PlannedLaunch", "prepare_planned"]

LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
SPLITS_PER_ROUND = 8  # partial rows [8, 512] fp32 loaded at once: 32 registers per thread at 4 warps


@triton.jit
def _combine_kernel(
    partial_out, partial_lse, out, lse, qo_indptr,
    group_seq, group_row0, group_first, group_count, num_groups,
    stride_qo, stride_ot, stride_oh, stride_lt, stride_lh,
    H: tl.constexpr, BLOCK_M: tl.constexpr, D_LATENT: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the KV splits of packed rows: program p takes the rows ``p, p + grid, ...`` of the
    ``num_groups[0] x BLOCK_M`` (split group, row of the block) items, so a fixed grid (graph-safe)
    has no programs that only exit. Per row, the splits' log2-sum-exps are read ``BLOCK_S`` at a time
    for their maximum, then the partials ``[BLOCK_S, 512]`` at a time, weighted against it: loads
    that do not wait on each other (a split count of 44 is 6 rounds, not 44 dependent ones)."""
    o_d = tl.arange(0, D_LATENT)
    o_s = tl.arange(0, BLOCK_S)
    n_items = tl.load(num_groups) * BLOCK_M
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        i_g = item // BLOCK_M
        i_r = item % BLOCK_M
        i_b = tl.load(group_seq + i_g)
        row = tl.load(group_row0 + i_g) + i_r
        qo_start = tl.load(qo_indptr + i_b * stride_qo)
        n_nodes = tl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start
        if row < n_nodes * H:
            first = tl.load(group_first + i_g)
            count = tl.load(group_count + i_g)
            b_m = tl.full([], float("-inf"), tl.float32)
            for s0 in range(0, count, BLOCK_S):
                o_p = (first + s0 + o_s).to(tl.int64) * BLOCK_M + i_r
                b_lse2 = tl.load(partial_lse + o_p, mask=s0 + o_s < count, other=float("-inf"))
                b_m = tl.maximum(b_m, tl.max(b_lse2, 0))
            b_m_use = tl.where(b_m == float("-inf"), 0.0, b_m)
            b_l = tl.zeros([], tl.float32)
            b_acc = tl.zeros([D_LATENT], tl.float32)
            for s0 in range(0, count, BLOCK_S):
                m_s = s0 + o_s < count
                o_p = (first + s0 + o_s).to(tl.int64) * BLOCK_M + i_r
                b_w = tl.exp2(tl.load(partial_lse + o_p, mask=m_s, other=float("-inf")) - b_m_use)
                b_part = tl.load(partial_out + o_p[:, None] * D_LATENT + o_d[None, :], mask=m_s[:, None], other=0.0)
                b_acc += tl.sum(b_w[:, None] * b_part, 0)
                b_l += tl.sum(b_w, 0)
            has_key = b_l > 0
            b_l_safe = tl.where(has_key, b_l, 1.0)
            o_t = (qo_start + row // H).to(tl.int64)
            head = row % H
            tl.store(out + o_t * stride_ot + head * stride_oh + o_d, (b_acc / b_l_safe).to(out.dtype.element_ty))
            tl.store(lse + o_t * stride_lt + head * stride_lh, tl.where(has_key, (b_m + tl.log2(b_l_safe)) * LN2, float("-inf")))


_COMBINE = Launcher(_combine_kernel)


class PlannedLaunch:
    """The launches of one call signature of a kernel that reads a plan: the kernel, then the
    combine kernel (:func:`prepare_planned`)."""

    __slots__ = ("_main", "_merge", "_cuda")

    def __init__(self, main: Launch, merge: Launch, cuda: bool):
        self._main, self._merge, self._cuda = main, merge, cuda

    def __call__(self, tensors: tuple, ptrs: tuple, num_groups: int | None,
                 site: tuple[int, int] | None = None) -> None:
        """Launch on ``tensors`` = ``(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out,
        lse)`` of the prepared signature, ``ptrs`` their data pointers. The combine is skipped only
        when the host knows the plan split no row block (``num_groups == 0``) and no CUDA graph is
        being captured (a captured graph must merge whatever a later plan splits). ``site``: where
        the launch before them went (see :class:`~kdtree_engine.verify.launch.Launch`; None: read
        here); the combine launches where the kernel did."""
        site = self._main(tensors, ptrs, site)
        if num_groups != 0 or (self._cuda and torch.cuda.is_current_stream_capturing()):
            self._merge(tensors, ptrs, site)


def prepare_planned(launcher: Launcher, key, q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale: float,
                    out, lse, plan: FlashTables, constexprs: dict) -> PlannedLaunch:
    """The launches of a kernel that reads the plan's tables (the Triton flash kernel, the Hopper
    kernel: both take ``(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse,
    prog_first_seg, 5 segment rows, partial_out, partial_lse, the contract's ints
    (:func:`~kdtree_engine.verify.contract.kernel_ints`), sm_scale * log2(e))`` then ``constexprs``)
    on ``plan.num_programs`` programs, then the combine kernel, for every call with the signature
    of these tensors (dtypes, 16-byte alignment, shapes and strides; inputs already checked).
    ``key``: what else determines the kernel's compilation. The plan's tables are int32 / float32
    and 16-byte aligned (VerifyPlan allocates them so): not in the key."""
    tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
    ints = kernel_ints(*tensors)
    main = Launch(launcher, (spec_key(tensors, ints), *key), (plan.num_programs,), (), tuple(range(8)),
                  (plan.prog_first_seg, *plan.segment_rows, plan.partial_out, plan.partial_lse, *ints,
                   sm_scale * LOG2E), constexprs)
    g = plan.group_rows
    ints = (qo_indptr.stride(0), *out.stride()[:2], *lse.stride())
    H, bm = q.shape[1], plan.config.block_m
    merge = Launch(_COMBINE, (spec_key((out, lse, qo_indptr), ints), H, bm),
                   (min(plan.groups.shape[1] * bm, 4 * plan.num_programs),),
                   (plan.partial_out, plan.partial_lse), (6, 7, 4), (*g, plan.group_count, *ints),
                   dict(H=H, BLOCK_M=bm, D_LATENT=D_V, BLOCK_S=SPLITS_PER_ROUND, num_warps=4))
    return PlannedLaunch(main, merge, q.is_cuda)
