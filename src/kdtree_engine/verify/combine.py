"""Merging the KV splits of a plan's split row blocks into ``out`` / ``lse``.

Shared by every kernel that consumes a :class:`~kdtree_engine.verify.plan.VerifyPlan` (the Triton
flash kernel, the Hopper kernel): a segment that covers only part of its row block's KV writes a
normalised partial ``[BLOCK_M, 512]`` fp32 and its log2-sum-exp; the splits are then merged row by
row, each row's splits in slot order (bitwise deterministic), in one of two ways:

- fused (on a GPU, when the plan's grid is at most one program per SM): the kernel itself, launched
  cooperatively (every program resident at once), meets at a grid barrier (:func:`grid_barrier`)
  after its segments and merges with its own programs (:func:`combine_items`): ONE launch per call;
- otherwise (Triton's interpreter, which runs programs one after another; larger grids; and, for
  a kernel that sets a limit, calls that split more row blocks than it, where the combine kernel
  measured faster: ``hopper.FUSED_MERGE_MAX_GROUPS``): the combine kernel (:func:`_combine_kernel`)
  after the kernel, on a fixed grid.

:func:`prepare_planned` lays out the launches of such a kernel once per signature of the caller's
tensors (:class:`~kdtree_engine.verify.launch.Launch`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..backend import interpreting
from .contract import D_V, kernel_ints
from .launch import Launch, Launcher, spec_key
from .plan import FlashTables

__all__ = ["PlannedLaunch", "prepare_planned", "grid_barrier", "combine_items", "fuses"]

LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# partials [SPLITS_PER_ROUND, ROWS_PER_ITEM, 512] fp32 loaded at once: 64 registers per thread at 4 warps
SPLITS_PER_ROUND = 4
ROWS_PER_ITEM = 4
FUSED_COMBINE = True  # merge inside the kernel where it can (False: always the combine kernel; for A/B and tests)


@triton.jit
def grid_barrier(word, me, parties):
    """Wait until all ``parties`` callers have reached this point (``me``: this one's index in
    ``0..parties-1``: the program's in a grid, or a warp group's when each program's warp groups
    arrive apart); what each wrote before is visible to all after. The launch must be cooperative
    (a program that never runs would hang the others). Also called from Gluon kernels and their
    partitions (scalar code only).

    ``word``: an int32 that only this barrier changes, 0 or ``-2^31`` at the start (its low 31 bits
    zero; a new plan's is 0). Sense reversal on its top bit (as CUDA's cooperative groups do):
    party 0 adds ``2^31 - (parties - 1)``, the others 1, so the low bits carry into the top bit
    exactly when the last arrives and come back to zero: no reset, no overflow, reusable by the
    next launch. One release add per party (after a barrier of its threads, so that it publishes
    all their writes), then acquire reads until the flip."""
    top = -2147483647 - 1
    tl.debug_barrier()
    seen = tl.atomic_add(word, tl.where(me == 0, (1 - parties) ^ top, 1), sem="release", scope="gpu")
    now = seen
    while (now ^ seen) >= 0:  # same top bit: not every party has arrived
        now = tl.atomic_add(word, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def group_entries(i_g, group_first, group_splits, group_seq, group_row0):
    """Split group ``i_g``'s entries: its first partial slot, split count, sequence and first packed row."""
    return tl.load(group_first + i_g), tl.load(group_splits + i_g), tl.load(group_seq + i_g), tl.load(group_row0 + i_g)


@triton.jit
def combine_items(
    first_item, item_step, partial_out, partial_lse, out, lse, qo_indptr,
    group_seq, group_row0, group_first, group_splits, num_groups,
    stride_qo, stride_ot, stride_oh, stride_lt, stride_lh,
    H: tl.constexpr, BLOCK_M: tl.constexpr, D_LATENT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Merge the KV splits of packed rows: the items ``first_item, first_item + item_step, ...`` of
    the ``num_groups[0] x BLOCK_M / BLOCK_R`` (split group, ``BLOCK_R`` consecutive rows of its block),
    so a fixed grid (graph-safe) has no programs that only exit. Per item, the splits are read
    ``BLOCK_S`` at a time, log2-sum-exps ``[BLOCK_S, BLOCK_R]`` and partials ``[BLOCK_S, BLOCK_R, 512]``
    at once, folded in slot order into a running max, sum and output (the rescale of online
    softmax). Latency, not bandwidth, bounds a merge on few programs (a fused kernel's: one per SM),
    so an item waits for one round trip to L2 per ``BLOCK_S`` splits and no more: its group's table
    entries were loaded by the item before. An item whose rows are all past the sequence's last
    (a row block's padding: H x nodes not a multiple of ``BLOCK_M``) reads nothing; in an item that
    holds the last row, the rows past it are read (their slots exist: zeroed when the plan made
    them, or left by earlier calls) and only their stores masked.
    The partials are read past L1 (``.cg``): in a fused kernel other programs wrote them."""
    o_d = tl.arange(0, D_LATENT)
    o_s = tl.arange(0, BLOCK_S)
    chunks: tl.constexpr = BLOCK_M // BLOCK_R
    n_items = tl.load(num_groups) * chunks
    # the group entries of the program's first item; each item loads its successor's (past the
    # last: group 0's) before its own data, so those loads wait for nothing the item waits for
    i_g = first_item // chunks * (first_item < n_items)
    first, count, i_b, row0 = group_entries(i_g, group_first, group_splits, group_seq, group_row0)
    for item in range(first_item, n_items, item_step):
        o_r = (item % chunks) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of the block
        qo_start = tl.load(qo_indptr + i_b * stride_qo)
        n_rows = (tl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start) * H
        row = row0 + o_r
        g_next = (item + item_step) // chunks * (item + item_step < n_items)
        first_next, count_next, i_b_next, row0_next = group_entries(g_next, group_first, group_splits, group_seq,
                                                                    group_row0)
        b_m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_R], tl.float32)
        b_acc = tl.zeros([BLOCK_R, D_LATENT], tl.float32)
        # an item wholly past its sequence's rows (the padding of a block that is not full) reads nothing
        n_splits = tl.where(row0 + (item % chunks) * BLOCK_R < n_rows, count, 0)
        for s0 in range(0, n_splits, BLOCK_S):
            m_s = s0 + o_s < count
            o_p = (first + s0 + o_s).to(tl.int64)[:, None] * BLOCK_M + o_r[None, :]  # [S, R]
            b_lse2 = tl.load(partial_lse + o_p, mask=m_s[:, None], other=float("-inf"), cache_modifier=".cg")
            b_part = tl.load(partial_out + o_p[:, :, None] * D_LATENT + o_d[None, None, :], mask=m_s[:, None, None],
                             other=0.0, cache_modifier=".cg")  # [S, R, D]
            b_m_new = tl.maximum(b_m, tl.max(b_lse2, 0))
            b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # rows with no key so far
            b_alpha = tl.exp2(b_m - b_m_use)
            b_w = tl.exp2(b_lse2 - b_m_use[None, :])
            b_acc = b_acc * b_alpha[:, None] + tl.sum(b_w[:, :, None] * b_part, 0)
            b_l = b_l * b_alpha + tl.sum(b_w, 0)
            b_m = b_m_new
        has_key = b_l != 0  # a NaN part propagates
        b_l_safe = tl.where(has_key, b_l, 1.0)
        o_t = (qo_start + row // H).to(tl.int64)
        p_out = out + (o_t * stride_ot + (row % H) * stride_oh)[:, None] + o_d[None, :]
        tl.store(p_out, (b_acc / b_l_safe[:, None]).to(out.dtype.element_ty), mask=(row < n_rows)[:, None])
        tl.store(lse + o_t * stride_lt + (row % H) * stride_lh,
                 tl.where(has_key, (b_m + tl.log2(b_l_safe)) * LN2, float("-inf")), mask=row < n_rows)
        first, count, i_b, row0 = first_next, count_next, i_b_next, row0_next


@triton.jit
def _combine_kernel(
    partial_out, partial_lse, out, lse, qo_indptr,
    group_seq, group_row0, group_first, group_splits, num_groups,
    stride_qo, stride_ot, stride_oh, stride_lt, stride_lh,
    H: tl.constexpr, BLOCK_M: tl.constexpr, D_LATENT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """The combine as a kernel of its own (:func:`combine_items`, program p taking the items
    ``p, p + grid, ...``)."""
    combine_items(tl.program_id(0), tl.num_programs(0), partial_out, partial_lse, out, lse, qo_indptr,
                  group_seq, group_row0, group_first, group_splits, num_groups,
                  stride_qo, stride_ot, stride_oh, stride_lt, stride_lh, H, BLOCK_M, D_LATENT, BLOCK_S, BLOCK_R)


_COMBINE = Launcher(_combine_kernel)


def fuses(plan: FlashTables, device: torch.device) -> bool:
    """Whether a kernel on ``plan`` merges its splits itself (see the module docstring): compiled
    for a GPU, :data:`FUSED_COMBINE`, and a grid of at most one program per SM, which any kernel that
    runs at all keeps resident at once (what its cooperative launch requires; the driver refuses a
    larger one rather than hang)."""
    return (FUSED_COMBINE and device.type == "cuda" and not interpreting()
            and plan.num_programs <= _sm_count(device.index))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class PlannedLaunch:
    """The launches of one call signature of a kernel that reads a plan (:func:`prepare_planned`):
    the kernel that merges its splits itself (``fused``, a cooperative launch; None where it cannot),
    or the kernel that leaves them (``split``; None where the fused one merges every group count)
    followed by the combine kernel (``merge``). A call whose host plan split more than
    ``max_fused_groups`` row blocks takes the second form."""

    __slots__ = ("_fused", "_split", "_merge", "_cuda", "_max_fused")

    def __init__(self, fused: Launch | None, split: Launch | None, merge: Launch | None, cuda: bool,
                 max_fused_groups: int = 0):
        self._fused, self._split, self._merge, self._cuda = fused, split, merge, cuda
        self._max_fused = max_fused_groups

    def __call__(self, tensors: tuple, ptrs: tuple, num_groups: int | None,
                 site: tuple[int, int] | None = None) -> None:
        """Launch on ``tensors`` = ``(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out,
        lse)`` of the prepared signature, ``ptrs`` their data pointers. ``num_groups``: the plan's
        split groups when the host knows them (None: a device plan; the fused form where there is
        one). The form is chosen per call; a CUDA graph keeps the form of its capture, and either
        form merges whatever a later plan splits. A separate combine is skipped when the host knows
        the plan split no row block (``num_groups == 0``) and no CUDA graph is being captured; a
        fused kernel reads the count itself. ``site``: where the launch before them went (see
        :class:`~kdtree_engine.verify.launch.Launch`; None: read here); the combine launches where
        the kernel did."""
        if self._fused is not None and (self._split is None or num_groups is None or num_groups <= self._max_fused):
            self._fused(tensors, ptrs, site)
            return
        site = self._split(tensors, ptrs, site)
        if num_groups != 0 or (self._cuda and torch.cuda.is_current_stream_capturing()):
            self._merge(tensors, ptrs, site)


def prepare_planned(launcher: Launcher, key, q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale: float,
                    out, lse, plan: FlashTables, constexprs: dict, max_fused_groups: int | None = None) -> PlannedLaunch:
    """The launches of a kernel that reads the plan's tables (the Triton flash kernel, the Hopper
    kernel: both take ``(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse,
    prog_first_seg, 5 segment rows, partial_out, partial_lse, 4 group rows, group_count,
    grid_barrier, the contract's ints (:func:`~kdtree_engine.verify.contract.kernel_ints`),
    sm_scale * log2(e), merge_splits)`` then ``constexprs`` and ``FUSE_COMBINE``, ``BLOCK_S``,
    ``BLOCK_R`` (the merge's tile, which ``constexprs`` may set), ``IN_KERNEL`` (``plan.in_kernel``:
    the kernel schedules a one-sequence step itself,
    :func:`~kdtree_engine.verify.scheduler.work_range`)) on ``plan.num_programs`` programs, for
    every call with the signature of these tensors (dtypes, 16-byte alignment, shapes and strides;
    inputs already checked). ``key``: what else determines the kernel's compilation. The plan's
    tables are int32 / float32 and 16-byte aligned (VerifyPlan allocates them so): not in the key.

    ``FUSE_COMBINE`` (:func:`fuses`: a cooperative launch) lets the kernel merge its splits after a
    grid barrier; ``merge_splits`` (a run-time 0 / 1: one compiled kernel either way) says whether
    this launch does. Without ``FUSE_COMBINE``, the combine kernel always follows. With it, the
    kernel merges every call's splits (``max_fused_groups`` None), or those of calls of at most
    ``max_fused_groups`` split groups, the combine kernel (compiled here, so that no call compiles
    it mid-decode) following the others (:class:`PlannedLaunch`).
    """
    tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
    ints = kernel_ints(*tensors)
    fused = fuses(plan, q.device)
    g = plan.group_rows

    def main(merge_splits: int) -> Launch:
        return Launch(launcher, (spec_key(tensors, ints), *key, fused, plan.in_kernel), (plan.num_programs,), (),
                      tuple(range(8)),
                      (plan.prog_first_seg, *plan.segment_rows, plan.partial_out, plan.partial_lse, *g,
                       plan.group_count, plan.grid_barrier, *ints, sm_scale * LOG2E, merge_splits),
                      {"FUSE_COMBINE": fused, "BLOCK_S": SPLITS_PER_ROUND, "BLOCK_R": ROWS_PER_ITEM,
                       "IN_KERNEL": plan.in_kernel, **constexprs,
                       **({"launch_cooperative_grid": True} if fused else {})})

    if fused and max_fused_groups is None:
        return PlannedLaunch(main(1), None, None, True)
    merge = combine_launch(q, out, lse, qo_indptr, plan)
    if fused:
        merge.warmup(tensors)
    return PlannedLaunch(main(1) if fused else None, main(0), merge, q.is_cuda, max_fused_groups or 0)


def combine_launch(q, out, lse, qo_indptr, plan: FlashTables) -> Launch:
    """The combine kernel's launch that merges the split row blocks of ``plan`` (its partials) into
    ``out`` / ``lse``, for every call with the signature of these tensors, which it takes at the
    positions of :class:`PlannedLaunch`'s ``tensors`` (6, 7, 4)."""
    ints = (qo_indptr.stride(0), *out.stride()[:2], *lse.stride())
    H, bm = q.shape[1], plan.config.block_m
    return Launch(_COMBINE, (spec_key((out, lse, qo_indptr), ints), H, bm),
                  (min(plan.groups.shape[1] * bm // ROWS_PER_ITEM, 4 * plan.num_programs),),
                  (plan.partial_out, plan.partial_lse), (6, 7, 4), (*plan.group_rows, plan.group_count, *ints),
                  dict(H=H, BLOCK_M=bm, D_LATENT=D_V, BLOCK_S=SPLITS_PER_ROUND, BLOCK_R=ROWS_PER_ITEM, num_warps=4))
