"""Paged KV pool for tree speculative decoding on MLA: tree slots, commit of accepted tokens,
defragmentation.

Layout (ENGINEERING.md section 1). The pool holds ``num_layers`` caches, each
``[num_pages, page_size, 576]`` (bf16/fp16; one row = 512 latent + 64 rope values, V is the first
512 of the same row), that share one page table per sequence. ``kv_cache(layer)`` is exactly the
``kv_cache`` argument of :func:`kdtree_engine.verify_attention`, and ``verify_inputs(seq_ids)``
returns its ``(page_table [B, max_pages] int32, kv_lens [B] int32)``. Position ``p`` of a sequence
lives in page ``page_table[b, p // page_size]``, row ``p % page_size``; flat slot
``page * page_size + p % page_size`` indexes ``kv_cache(layer).view(-1, 576)``.

Who knows what (the design in one paragraph). Page *ids* live on the device only: the page
tables, a free stack of page ids with its top as a device scalar, per-sequence lengths and tree
sizes. The host keeps *counts* only: each sequence's length and tree size and the number of free
pages. Every allocation decision (does it fit? how many pages?) is made on the host from counts,
before anything is mutated, so a failing allocation raises :class:`PoolFullError` and leaves the
pool exactly as it was; then the device does the id work (pop from the stack, write the table)
with host-known sizes. Commit needs no host knowledge at all: one kernel reads the accepted path
from device tensors, rewrites the table (page size 1) or moves the accepted rows (larger pages),
pushes the freed ids onto the free stack and updates lengths and the stack top. The host learns
the new lengths when the server reads the accepted lengths (it does, once per step, to emit the
tokens) and hands them to :meth:`KVPool.finalize_commit`.

Sync points (everything else is asynchronous, CUDA-graph capturable where noted):

- :meth:`KVPool.commit`: none (one Triton launch on CUDA; capturable once the sequence set has
  been seen, see :meth:`KVPool.device_rows`).
- :meth:`KVPool.finalize_commit`: none when given the host accepted lengths; otherwise it reads
  them (one sync), which is the sync a server performs anyway.
- ``extend`` / ``reserve_tree`` / ``remove_sequences`` / ``truncate`` / ``verify_inputs``: none
  (small host-to-device copies through pinned memory).
- :meth:`KVPool.plan_defragment`, :meth:`KVPool.fragmentation`, :meth:`KVPool.check`: one
  device-to-host read of the page tables (they plan on the host). ``apply_defragment``: none.
- ``debug=True``: extra checks that read device state (syncs), and NaN poisoning of freed pages.

Page size 1: commit is a remap of table entries (no KV copy). Larger pages: the accepted rows are
moved into positions ``P..P+a-1`` by the same kernel (all rows of a sequence read before any is
written, so any node order is safe), and pages past the new length are freed.

Defragmentation moves whole pages. The plan (host, numpy) places each chosen sequence in a
contiguous ascending page range and schedules the page moves so that a one-pass copy kernel is
safe: a move whose destination is still to be read by another move waits for a later launch
("levels" of the dependency chains), deep chain tails and cycles go through a scratch buffer of
bounded size; a cost model picks the split (see :func:`schedule_moves`).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from .backend import interpreting
from .verify.contract import D_QK

__all__ = [
    "KVPool",
    "KVPoolError",
    "PoolFullError",
    "SequenceTooLongError",
    "StalePlanError",
    "FragStats",
    "DefragPlan",
    "DefragReport",
    "MoveSchedule",
    "ThresholdPolicy",
    "schedule_moves",
    "check_schedule",
]

D = D_QK  # 576 values per cached token
_DTYPES = (torch.bfloat16, torch.float16)

# Cost model of the defragmentation schedule (only its ratios matter): a page moved through the
# scratch buffer costs an extra read + write; every extra launch costs about this long.
PLAN_COPY_BYTES_PER_S = 3.0e12
PLAN_LAUNCH_S = 6e-6


# ----------------------------------------------------------------------------------------------
# Triton kernels


# Integer arguments that change call to call are not specialised (no recompile mid-decode).
@triton.jit(do_not_specialize=["num_moves"])
def _copy_pages_kernel(
    src, dst, src_idx, dst_idx, num_moves,
    stride_src_l, stride_dst_l,
    ROW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """dst[l, dst_idx[i]] = src[l, src_idx[i]] for BLOCK_M moves x one layer; a page is ROW values,
    copied in ceil(ROW / BLOCK_D) tiles [BLOCK_M, BLOCK_D] (a small page in one masked tile).

    One pass: correct only if no page is both read and written by this launch (the schedule
    guarantees it)."""
    i_m = tl.program_id(0)
    i_l = tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < num_moves
    b_src = tl.load(src_idx + o_m, mask=m_m, other=0).to(tl.int64)
    b_dst = tl.load(dst_idx + o_m, mask=m_m, other=0).to(tl.int64)
    p_src = src + i_l.to(tl.int64) * stride_src_l + b_src * ROW  # [BM]
    p_dst = dst + i_l.to(tl.int64) * stride_dst_l + b_dst * ROW  # [BM]
    for i_d in range(0, tl.cdiv(ROW, BLOCK_D)):
        o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        if EVEN_D:
            m_x = m_m[:, None]
        else:
            m_x = m_m[:, None] & (o_d < ROW)[None, :]
        b_x = tl.load(p_src[:, None] + o_d[None, :], mask=m_x)  # [BM, BD]
        tl.store(p_dst[:, None] + o_d[None, :], b_x, mask=m_x)


@triton.jit
def _kept_count(a, n, max_acc):
    """Accepted nodes a commit keeps: at least the root, at most the tree and the path width."""
    return tl.minimum(tl.maximum(a, 1), tl.minimum(n, max_acc))


@triton.jit
def _freed_count(kv_len, n, a, PAGE_SIZE: tl.constexpr):
    """Pages (page size 1: slots) a sequence frees when ``a`` of its ``n`` tree nodes are kept."""
    if PAGE_SIZE == 1:
        return n - a
    else:
        return (kv_len + PAGE_SIZE - 1) // PAGE_SIZE - (kv_len - n + a + PAGE_SIZE - 1) // PAGE_SIZE


@triton.jit(do_not_specialize=["stride_acc", "stride_t", "num_seqs", "max_acc", "num_programs"])
def _commit_kernel(
    rows, accepted, num_accepted, table, lens, tree, stack, top, done, marks, kv,
    stride_acc, stride_t, stride_kv_l,
    num_seqs, max_acc, num_programs,
    PAGE_SIZE: tl.constexpr,
    D_ROW: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Commit of one sequence (program axis 0) for one layer (axis 1; page size 1 has one).

    Accepted node i (root first) becomes position P+i. Page size 1: table[P+i] = slot of node
    accepted[i]; the slots of the other nodes are pushed on the free stack (in node order).
    Larger pages: row P+accepted[i] is copied to row P+i (all reads of a column chunk before its
    writes), pages at or past ceil((P+a)/page_size) are pushed. Freed ids of sequence b go after
    those of sequences 0..b-1 (deterministic). The last program to finish updates lens, tree and
    the stack top (all programs read them first).
    """
    i_b = tl.program_id(0)
    i_l = tl.program_id(1)
    r = tl.load(rows + i_b).to(tl.int64)
    kv_len = tl.load(lens + r)
    n = tl.load(tree + r)
    prefix = kv_len - n
    a = _kept_count(tl.load(num_accepted + i_b).to(tl.int32), n, max_acc)
    o_a = tl.arange(0, BLOCK_A)
    m_a = o_a < a
    b_acc = tl.load(accepted + i_b.to(tl.int64) * stride_acc + o_a, mask=m_a, other=0).to(tl.int32)
    b_acc = tl.minimum(tl.maximum(b_acc, 0), n - 1)  # [BA] node indices
    p_row = table + r * stride_t

    # stack position of this sequence's freed ids: after those of sequences 0..i_b-1
    o_bb = tl.arange(0, BLOCK_B)
    m_bb = o_bb < i_b
    r_bb = tl.load(rows + o_bb, mask=m_bb, other=0).to(tl.int64)
    len_bb = tl.load(lens + r_bb, mask=m_bb, other=0)
    n_bb = tl.load(tree + r_bb, mask=m_bb, other=0)
    a_bb = tl.load(num_accepted + o_bb, mask=m_bb, other=1).to(tl.int32)
    a_bb = _kept_count(a_bb, n_bb, max_acc)
    f_bb = tl.where(m_bb, _freed_count(len_bb, n_bb, a_bb, PAGE_SIZE), 0)
    base = tl.load(top) + tl.sum(f_bb, 0)

    if PAGE_SIZE == 1:
        o_n = tl.arange(0, BLOCK_N)
        m_n = o_n < n
        b_node = tl.load(p_row + prefix + o_n, mask=m_n, other=0)  # [BN] slot of each node
        b_acc_slot = tl.load(p_row + prefix + b_acc, mask=m_a, other=0)  # [BA]
        # membership "node is accepted" through a per-slot scratch flag array (kept all zero)
        tl.store(marks + b_acc_slot, 1, mask=m_a)
        tl.debug_barrier()
        b_is_acc = tl.load(marks + b_node, mask=m_n, other=0, volatile=True)  # other threads' stores
        tl.debug_barrier()
        tl.store(marks + b_acc_slot, 0, mask=m_a)
        m_rej = m_n & (b_is_acc == 0)
        b_rej = m_rej.to(tl.int32)
        b_rank = tl.cumsum(b_rej, 0) - b_rej
        tl.store(stack + base + b_rank, b_node, mask=m_rej)
        tl.store(p_row + prefix + o_a, b_acc_slot, mask=m_a)
    else:
        src_pos = prefix + b_acc
        dst_pos = prefix + o_a
        m_cp = m_a & (src_pos != dst_pos)
        src_slot = tl.load(p_row + src_pos // PAGE_SIZE, mask=m_cp, other=0).to(tl.int64) * PAGE_SIZE + src_pos % PAGE_SIZE
        dst_slot = tl.load(p_row + dst_pos // PAGE_SIZE, mask=m_cp, other=0).to(tl.int64) * PAGE_SIZE + dst_pos % PAGE_SIZE
        p_kv = kv + i_l.to(tl.int64) * stride_kv_l
        for i_d in range(0, D_ROW // BLOCK_D):
            o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
            b_x = tl.load(p_kv + src_slot[:, None] * D_ROW + o_d[None, :], mask=m_cp[:, None])  # [BA, BD]
            tl.debug_barrier()  # every row of this chunk read before any is overwritten
            tl.store(p_kv + dst_slot[:, None] * D_ROW + o_d[None, :], b_x, mask=m_cp[:, None])
        if i_l == 0:
            c_lo = (prefix + a + PAGE_SIZE - 1) // PAGE_SIZE
            c_hi = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
            o_f = tl.arange(0, BLOCK_F)
            m_f = o_f < c_hi - c_lo
            b_page = tl.load(p_row + c_lo + o_f, mask=m_f, other=0)
            tl.store(stack + base + o_f, b_page, mask=m_f)

    # the last program to finish publishes the new lengths and stack top
    tl.debug_barrier()
    n_done = tl.atomic_add(done, 1)
    if n_done == num_programs - 1:
        o_b = tl.arange(0, BLOCK_B)
        m_b = o_b < num_seqs
        r_b = tl.load(rows + o_b, mask=m_b, other=0).to(tl.int64)
        len_b = tl.load(lens + r_b, mask=m_b, other=0)
        n_b = tl.load(tree + r_b, mask=m_b, other=0)
        a_b = tl.load(num_accepted + o_b, mask=m_b, other=1).to(tl.int32)
        a_b = _kept_count(a_b, n_b, max_acc)
        total = tl.sum(tl.where(m_b, _freed_count(len_b, n_b, a_b, PAGE_SIZE), 0), 0)
        tl.store(lens + r_b, len_b - n_b + a_b, mask=m_b)
        tl.store(tree + r_b, n_b * 0, mask=m_b)
        tl.store(top, tl.load(top) + total)
        tl.store(done, 0)


# ----------------------------------------------------------------------------------------------
# Host launchers (Triton) and their torch equivalents (CPU, or use_triton=False)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _pow2_divisor(x: int) -> int:
    return x & -x


def _copy_pages(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                use_triton: bool) -> None:
    """``dst[:, dst_idx] = src[:, src_idx]`` for page stores ``[L, pages, page_size, 576]``.

    Triton: one pass, no temporary (no page may be both read and written). Torch: gather then
    scatter (always safe, two passes)."""
    n = src_idx.numel()
    if n == 0:
        return
    num_layers = src.shape[0]
    row = src.shape[2] * src.shape[3]
    if not use_triton:
        s = src.view(num_layers, src.shape[1], row)
        d = dst.view(num_layers, dst.shape[1], row)
        d[:, dst_idx] = s[:, src_idx]
        return
    # whole pages per tile when they are small (page size 1: [8, 1024] masked to 576 values: a
    # program keeps 8 full rows in flight); else tiles of a power-of-two divisor of the page
    block_d = _pow2(row) if row <= 4096 else min(_pow2_divisor(row), 4096)
    block_m = max(1, 8192 // block_d)
    grid = (triton.cdiv(n, block_m), num_layers)
    _copy_pages_kernel[grid](
        src, dst, src_idx, dst_idx, n,
        src.stride(0), dst.stride(0),
        ROW=row, BLOCK_M=block_m, BLOCK_D=block_d, EVEN_D=row % block_d == 0, num_warps=4,
    )


# ----------------------------------------------------------------------------------------------
# Defragmentation schedule


@dataclass
class MoveSchedule:
    """An order for page moves ``src -> dst`` (all srcs distinct, all dsts distinct) that makes
    each launch hazard-free.

    Stage 0 copies ``scratch_src`` pages into a scratch buffer; stages 1..levels run the direct
    moves of each level (``src[level_bounds[k]:level_bounds[k+1]]``), each launch touching no page
    that another move of the same launch reads or writes; the last stage copies the scratch
    buffer to ``scratch_dst``."""

    src: np.ndarray
    dst: np.ndarray
    level_bounds: np.ndarray  # [levels + 1]
    scratch_src: np.ndarray
    scratch_dst: np.ndarray
    est_seconds: float = 0.0

    @property
    def levels(self) -> int:
        return len(self.level_bounds) - 1

    @property
    def num_moves(self) -> int:
        return len(self.src) + len(self.scratch_src)

    @property
    def launches(self) -> int:
        return self.levels + (2 if len(self.scratch_src) else 0)

    def stages(self):
        """``(read_stage, write_stage)`` per move, moves in the order ``src ++ scratch_src``."""
        lvl = np.repeat(np.arange(self.levels), np.diff(self.level_bounds)) + 1
        s = len(self.scratch_src)
        read = np.concatenate([lvl, np.zeros(s, np.int64)])
        write = np.concatenate([lvl, np.full(s, self.levels + 1, np.int64)])
        return read, write


def _chain_depth(blocker: np.ndarray):
    """List ranking by pointer doubling: distance of each move to the end of its blocker chain.

    Returns ``(depth, on_cycle)``; members of cycles never resolve."""
    m = len(blocker)
    nxt = blocker.copy()
    depth = (nxt >= 0).astype(np.int64)
    for _ in range(max(1, math.ceil(math.log2(m + 1))) + 1):
        act = np.flatnonzero(nxt >= 0)
        if act.size == 0:
            break
        j = nxt[act]
        depth_new = depth[act] + depth[j]
        nxt_new = nxt[j]
        depth[act] = depth_new
        nxt[act] = nxt_new
    return depth, nxt >= 0


def schedule_moves(src, dst, num_pages: int, unit_bytes: int, scratch_budget_bytes: int,
                   *, bytes_per_s: float = PLAN_COPY_BYTES_PER_S, launch_s: float = PLAN_LAUNCH_S
                   ) -> MoveSchedule:
    """Schedule page moves ``src[i] -> dst[i]`` for one-pass copy launches.

    Move ``i`` must not overwrite ``dst[i]`` before the move that reads ``dst[i]`` (its blocker)
    has read it. The blocker relation forms chains and cycles. Depth = distance to the chain's end;
    level k runs the moves of depth k. Cycles are cut by sending one move per cycle through the
    scratch buffer. Moves of depth >= K also go through scratch (read at stage 0, written last);
    K minimizes ``bytes / bytes_per_s + launches * launch_s`` with the scratch within
    ``scratch_budget_bytes`` (cycle cuts are always allowed).
    """
    src = np.asarray(src, np.int64)
    dst = np.asarray(dst, np.int64)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    m = len(src)
    empty = np.zeros(0, np.int64)
    if m == 0:
        return MoveSchedule(empty, empty, np.zeros(1, np.int64), empty, empty, 0.0)
    reader = np.full(num_pages, -1, np.int64)
    reader[src] = np.arange(m)
    blocker = reader[dst]  # the move that reads my destination (must run first); -1 if none
    depth, on_cycle = _chain_depth(blocker)
    is_rep = np.zeros(m, bool)
    if on_cycle.any():
        cyc = np.flatnonzero(on_cycle)
        low = np.arange(m)
        nx = blocker.copy()
        for _ in range(max(1, math.ceil(math.log2(m + 1))) + 1):
            low_new = np.minimum(low[cyc], low[nx[cyc]])
            nx_new = nx[nx[cyc]]
            low[cyc] = low_new
            nx[cyc] = nx_new
        reps = cyc[low[cyc] == cyc]
        is_rep[reps] = True
        blocks = np.full(m, -1, np.int64)  # blocks[j] = the move j blocks
        has = blocker >= 0
        blocks[blocker[has]] = np.flatnonzero(has)
        cut = blocker.copy()
        cut[blocks[reps]] = -1  # the rep's source is saved first: what it blocked is free to go
        depth, on_cycle = _chain_depth(cut)
        assert not on_cycle.any()
    d = np.where(is_rep, -1, depth)
    maxd = int(d.max()) if (~is_rep).any() else -1
    n_rep = int(is_rep.sum())
    counts = np.bincount(d[~is_rep], minlength=maxd + 1) if maxd >= 0 else np.zeros(0, np.int64)
    ge = np.concatenate([np.cumsum(counts[::-1])[::-1], [0]])  # ge[k] = #moves of depth >= k
    ks = np.arange(1, maxd + 2) if maxd >= 0 else np.array([0])
    scratch = n_rep + ge[ks]
    launches = ks + np.where(scratch > 0, 2, 0)
    cost = (2 * m + 2 * scratch) * unit_bytes / bytes_per_s + launches * launch_s
    feasible = (scratch * unit_bytes <= scratch_budget_bytes) | (ks == ks[-1])
    cost = np.where(feasible, cost, np.inf)
    best = int(np.argmin(cost))
    k = int(ks[best])
    direct = (~is_rep) & (d < k)
    idx = np.flatnonzero(direct)
    order = idx[np.argsort(d[idx], kind="stable")]
    bounds = np.searchsorted(d[order], np.arange(k + 1), side="left")
    via = np.flatnonzero(~direct)
    return MoveSchedule(src[order], dst[order], bounds.astype(np.int64), src[via], dst[via], float(cost[best]))


def check_schedule(s: MoveSchedule, num_pages: int) -> None:
    """Raise ``AssertionError`` unless every launch of ``s`` is hazard-free: each page a move
    reads is written (by another move) only at a later stage, and no page is written twice."""
    src = np.concatenate([s.src, s.scratch_src])
    dst = np.concatenate([s.dst, s.scratch_dst])
    read, write = s.stages()
    assert len(np.unique(src)) == len(src), "a page is the source of two moves"
    assert len(np.unique(dst)) == len(dst), "a page is the destination of two moves"
    assert not (src == dst).any(), "a move onto itself"
    assert np.all(np.diff(s.level_bounds) >= 0)
    wstage = np.full(num_pages, np.iinfo(np.int64).max, np.int64)
    wstage[dst] = write
    bad = wstage[src] <= read
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(
            f"move {i} reads page {src[i]} at stage {read[i]} but it is overwritten at stage {wstage[src[i]]}")


# ----------------------------------------------------------------------------------------------
# Errors, reports, policy


class KVPoolError(RuntimeError):
    """Base class of the pool's capacity errors (the pool is left unchanged)."""


class PoolFullError(KVPoolError):
    """Not enough free pages (or sequence rows) for an allocation; nothing was changed."""

    def __init__(self, msg: str, requested: int = 0, available: int = 0):
        super().__init__(msg)
        self.requested = requested
        self.available = available


class SequenceTooLongError(KVPoolError):
    """A sequence would exceed ``max_seq_len`` (its page-table row); nothing was changed."""


class StalePlanError(RuntimeError):
    """A defragmentation plan was applied after the pool changed."""


@dataclass
class FragStats:
    """Fragmentation of the pool (from :meth:`KVPool.fragmentation`).

    ``runs[i]``: maximal runs of consecutive ascending pages in sequence ``seq_ids[i]``'s table
    (1 = contiguous). ``high_water``: 1 + the highest page in use. ``largest_free_run``: the
    longest range of consecutive free pages."""

    seq_ids: list
    tokens: list
    pages: list
    runs: list
    num_pages: int
    free_pages: int
    high_water: int
    free_runs: int
    largest_free_run: int

    @property
    def total_runs(self) -> int:
        return int(sum(self.runs))

    @property
    def frag_ratio(self) -> float:
        """Fraction of page boundaries inside sequences that jump: 0 contiguous, 1 no two adjacent."""
        jumps = sum(max(r - 1, 0) for r in self.runs)
        bounds = sum(max(p - 1, 0) for p in self.pages)
        return jumps / bounds if bounds else 0.0

    def runs_per_1k_tokens(self, i: int) -> float:
        return 1024.0 * self.runs[i] / max(self.tokens[i], 1)


@dataclass
class DefragPlan:
    """Host plan of :meth:`KVPool.apply_defragment` (valid while the pool is unchanged)."""

    version: int
    seq_ids: list  # sequences that move
    new_start: list  # their first page after the move
    skipped: list  # chosen sequences that found no contiguous room (left as they are)
    schedule: MoveSchedule
    moved_pages: np.ndarray  # pages of each moving sequence (its new table: start + arange)
    live_ids: np.ndarray  # every live sequence and ...
    live_pages: np.ndarray  # ... its pages (to rebuild the free stack on the device)
    page_bytes: int  # bytes of one page over all layers
    plan_seconds: float = 0.0
    _dev: list | None = field(default=None, repr=False)  # device copies (upload_plan)

    @property
    def pages_moved(self) -> int:
        return self.schedule.num_moves

    @property
    def bytes_moved(self) -> int:
        """Logical traffic: every moved page read once and written once."""
        return 2 * self.pages_moved * self.page_bytes

    @property
    def bytes_extra(self) -> int:
        """Extra traffic through the scratch buffer."""
        return 2 * len(self.schedule.scratch_src) * self.page_bytes


@dataclass
class DefragReport:
    seq_ids: list
    skipped: list
    pages_moved: int
    bytes_moved: int
    bytes_extra: int
    levels: int
    scratch_pages: int
    launches: int
    plan_seconds: float


@dataclass
class ThresholdPolicy:
    """Defragmentation trigger: every ``check_every`` committed steps, read the fragmentation and
    compact the sequences of at least ``min_tokens`` tokens whose KV is split into more than
    ``max_runs_per_1k_tokens`` runs per 1024 tokens. Page size 1 with fully scattered slots has
    ~1024 runs per 1k tokens; contiguous has ~0.

    The default threshold is provisional: measure with ``python -m kdtree_engine.kvpool_bench``
    (the steps-to-pay-back figure) and set it from that."""

    max_runs_per_1k_tokens: float = 64.0
    min_tokens: int = 4096
    check_every: int = 256

    def select(self, stats: FragStats) -> list:
        return [
            s for i, s in enumerate(stats.seq_ids)
            if stats.tokens[i] >= self.min_tokens and stats.runs_per_1k_tokens(i) > self.max_runs_per_1k_tokens
        ]


@dataclass
class _Pending:
    ids: np.ndarray
    tree: np.ndarray
    num_accepted: torch.Tensor
    max_acc: int


def _canonical_device(device=None) -> torch.device:
    """The device as tensors on it report it: CUDA with an index (``"cuda"`` means the current
    device, as for tensor creation), the CPU without one. ``None``: CUDA if available, else CPU.

    A tensor made with ``device="cuda"`` reports ``cuda:0`` (say), and ``torch.device("cuda") !=
    torch.device("cuda:0")``: the pool keeps this form so ``t.device == pool.device`` is exact."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "cpu" and device.index is not None:
        device = torch.device("cpu")  # CPU tensors report plain "cpu"
    return device


def _cdiv(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# The pool


class KVPool:
    """A paged MLA KV pool: ``num_layers`` caches ``[num_pages, page_size, 576]`` sharing one page
    table per sequence, a free stack of pages, and the speculative-step operations.

    Args:
        num_pages: pages per layer.
        page_size: tokens per page (any positive integer).
        num_layers: caches that share the page tables (every copy moves all layers at once).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        device: default CUDA if available, else CPU. Kept as tensors report it (``"cuda"``
            becomes ``cuda:<current device>``), so inputs are checked with ``t.device == pool.device``.
        max_seqs: sequence rows of the page table.
        max_seq_len: tokens a sequence may hold (its table row has ``ceil(max_seq_len/page_size)``
            entries); default ``num_pages * page_size``. The table costs
            ``4 * max_seqs * max_seq_len / page_size`` bytes.
        debug: check inputs that need a device read (accepted paths, host lengths) and fill freed
            pages with NaN, so a kernel that reads a freed slot produces NaN.
        use_triton: fused kernels for commit and page moves (default on CUDA); otherwise torch ops
            (on the CPU, or under ``TRITON_INTERPRET=1`` for testing the kernels).
        defrag_scratch_bytes: the scratch buffer a defragmentation may allocate.

    Sequence ids are small integers (rows of the page table) from :meth:`add_sequence`.
    """

    def __init__(self, num_pages: int, page_size: int = 1, *, num_layers: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device=None, max_seqs: int = 64,
                 max_seq_len: int | None = None, debug: bool = False, use_triton: bool | None = None,
                 defrag_scratch_bytes: int = 256 << 20):
        if num_pages < 1 or page_size < 1 or num_layers < 1 or max_seqs < 1:
            raise ValueError("num_pages, page_size, num_layers and max_seqs must be positive")
        if num_pages >= 2**31 - 1:
            raise ValueError("num_pages must fit int32")
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be bf16 or fp16, got {dtype}")
        device = _canonical_device(device)
        if max_seq_len is None:
            max_seq_len = num_pages * page_size
        if max_seq_len < 1:
            raise ValueError("max_seq_len must be positive")
        if use_triton is None:
            use_triton = device.type == "cuda"
        if use_triton and device.type == "cpu" and not interpreting():
            raise ValueError("use_triton on the CPU needs TRITON_INTERPRET=1 set before triton is imported")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.num_layers = int(num_layers)
        self.dtype = dtype
        self.device = device
        self.max_seqs = int(max_seqs)
        self.max_pages_per_seq = _cdiv(int(max_seq_len), self.page_size)
        self.max_seq_len = self.max_pages_per_seq * self.page_size
        self.debug = bool(debug)
        self.use_triton = bool(use_triton)
        self.defrag_scratch_bytes = int(defrag_scratch_bytes)
        self.page_bytes = self.num_layers * self.page_size * D * torch.empty(0, dtype=dtype).element_size()

        n, ps, S, C = self.num_pages, self.page_size, self.max_seqs, self.max_pages_per_seq
        # page N (past the end) is a trash page for masked-off writes of the torch paths
        if self.debug:
            self._store = torch.full((num_layers, n + 1, ps, D), float("nan"), dtype=dtype, device=device)
        else:
            self._store = torch.empty((num_layers, n + 1, ps, D), dtype=dtype, device=device)
        self._cols = C + 1  # column C of each table row is a trash entry
        self._table = torch.zeros((S, self._cols), dtype=torch.int32, device=device)
        self._lens_d = torch.zeros(S, dtype=torch.int32, device=device)
        self._tree_d = torch.zeros(S, dtype=torch.int32, device=device)
        # free stack of page ids, bottom..top = [0, num_free); entry N is a trash slot. Descending
        # order so pops (the top k, flipped) hand out ascending contiguous pages.
        self._stack = torch.cat([torch.arange(n - 1, -1, -1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32)]).to(device)
        self._top = torch.full((1,), n, dtype=torch.int32, device=device)
        self._done = torch.zeros(1, dtype=torch.int32, device=device)
        self._marks = torch.zeros(n + 1, dtype=torch.int32, device=device)

        self._len = np.zeros(S, np.int64)  # host: tokens incl. a reserved tree
        self._tree = np.zeros(S, np.int64)  # host: reserved tree size (0 = none)
        self._live = np.zeros(S, bool)
        self._free_rows = list(range(S))
        self._num_free = n
        self._pending: _Pending | None = None
        self._version = 0
        self._steps = 0  # committed steps (finalize_commit calls), for policies
        self._steps_at_check = 0
        self._rows_cache: OrderedDict = OrderedDict()

    # ------------------------------------------------------------------ views and host queries

    def kv_cache(self, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s cache ``[num_pages, page_size, 576]`` (a view; verify's ``kv_cache``)."""
        return self._store[layer, : self.num_pages]

    @property
    def kv_layers(self) -> torch.Tensor:
        """All layers ``[num_layers, num_pages, page_size, 576]`` (a view)."""
        return self._store[:, : self.num_pages]

    @property
    def num_free_pages(self) -> int:
        """Free pages known to the host (a pending commit's frees count after finalize)."""
        return self._num_free

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self._num_free

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def pending_commit(self) -> bool:
        return self._pending is not None

    def live_sequences(self) -> list:
        return [int(i) for i in np.flatnonzero(self._live)]

    def seq_len(self, seq_id: int) -> int:
        """Tokens of the sequence (prefix + reserved tree) as the host knows them."""
        self._ids([seq_id])
        return int(self._len[seq_id])

    def tree_size(self, seq_id: int) -> int:
        self._ids([seq_id])
        return int(self._tree[seq_id])

    # ------------------------------------------------------------------ helpers

    def _ids(self, seq_ids) -> np.ndarray:
        if isinstance(seq_ids, torch.Tensor):
            if seq_ids.device.type != "cpu":
                raise ValueError("seq_ids must be host values (a list, numpy array or CPU tensor)")
            seq_ids = seq_ids.numpy()
        ids = np.atleast_1d(np.asarray(seq_ids, dtype=np.int64))
        if ids.ndim != 1:
            raise ValueError("seq_ids must be one-dimensional")
        if ids.size and (ids.min() < 0 or ids.max() >= self.max_seqs):
            raise ValueError(f"sequence id out of range [0, {self.max_seqs})")
        if ids.size and not self._live[ids].all():
            raise ValueError(f"sequence {int(ids[~self._live[ids]][0])} is not live")
        if len(np.unique(ids)) != len(ids):
            raise ValueError("seq_ids holds a sequence twice")
        return ids

    def _require_idle(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{what}: a commit is pending; call finalize_commit() first")

    def _check_device(self, name: str, t: torch.Tensor) -> None:
        """Raise unless tensor ``t`` is on the pool's device (both in canonical form)."""
        if _canonical_device(t.device) != self.device:
            raise ValueError(f"{name} is on {t.device}, the pool on {self.device}: must be on the pool's device")

    def _to_device(self, *arrays, dtype=np.int64) -> list:
        """Host int arrays -> device tensors with one (pinned, asynchronous) copy."""
        sizes = [len(a) for a in arrays]
        blob = torch.from_numpy(np.concatenate([np.asarray(a, dtype) for a in arrays]) if arrays else np.zeros(0, dtype))
        if self.device.type == "cuda":
            blob = blob.pin_memory().to(self.device, non_blocking=True)
        else:
            blob = blob.to(self.device)
        return list(torch.split(blob, sizes))

    def device_rows(self, seq_ids) -> torch.Tensor:
        """The device int64 tensor of these sequence rows (cached: a CUDA-graph capture of
        :meth:`commit` or :meth:`verify_inputs` needs it made beforehand)."""
        ids = self._ids(seq_ids)
        key = ids.tobytes()
        t = self._rows_cache.get(key)
        if t is None:
            (t,) = self._to_device(ids)
            self._rows_cache[key] = t
            if len(self._rows_cache) > 16:
                self._rows_cache.popitem(last=False)
        else:
            self._rows_cache.move_to_end(key)
        return t

    def _pages_of(self, lens):
        return _cdiv(np.asarray(lens, np.int64), self.page_size)

    def _poison(self, pages: torch.Tensor) -> None:
        if self.debug and pages.numel():
            self._store.index_fill_(1, pages.long(), float("nan"))

    def _poison_tails(self, ids: np.ndarray) -> None:
        """Debug: NaN into the rows past each sequence's length in its last page (page size > 1)."""
        if not self.debug or self.page_size == 1 or len(ids) == 0:
            return
        ps = self.page_size
        lens = self._len[ids]
        k = np.where(lens % ps == 0, 0, ps - lens % ps)
        total = int(k.sum())
        if total == 0:
            return
        seg = np.repeat(np.arange(len(ids)), k)
        pos = lens[seg] + np.arange(total) - np.repeat(np.cumsum(k) - k, k)
        tidx_d, off_d = self._to_device(ids[seg] * self._cols + pos // ps, pos % ps)
        slots = self._table.view(-1)[tidx_d].long() * ps + off_d
        self._store.view(self.num_layers, -1, D).index_fill_(1, slots, float("nan"))

    # ------------------------------------------------------------------ sequences

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id (the lowest free row)."""
        self._require_idle("add_sequence")
        if not self._free_rows:
            raise PoolFullError(f"all {self.max_seqs} sequence rows are in use", 1, 0)
        sid = heapq.heappop(self._free_rows)
        self._live[sid] = True
        self._len[sid] = 0
        self._tree[sid] = 0
        self._version += 1
        return int(sid)

    def remove_sequences(self, seq_ids) -> None:
        """Free all pages of these sequences and their rows."""
        self._require_idle("remove_sequences")
        ids = self._ids(seq_ids)
        self._free_tail(ids, np.zeros(len(ids), np.int64))
        self._live[ids] = False
        for s in ids:
            heapq.heappush(self._free_rows, int(s))

    def remove_sequence(self, seq_id: int) -> None:
        self.remove_sequences([seq_id])

    def truncate(self, seq_id: int, new_len: int) -> None:
        """Drop positions ``new_len..`` of a sequence (frees its unused pages). With a tree
        reserved, ``new_len`` must not exceed the prefix (the tree is dropped)."""
        self._require_idle("truncate")
        ids = self._ids([seq_id])
        old = int(self._len[seq_id])
        if not 0 <= new_len <= old:
            raise ValueError(f"new_len must be in [0, {old}], got {new_len}")
        if self._tree[seq_id] and new_len > old - self._tree[seq_id]:
            raise ValueError("a tree is reserved: truncate to at most the prefix length")
        self._free_tail(ids, np.array([new_len], np.int64))

    def _free_tail(self, ids: np.ndarray, new_lens: np.ndarray) -> None:
        old_p = self._pages_of(self._len[ids])
        new_p = self._pages_of(new_lens)
        k = old_p - new_p
        total = int(k.sum())
        seg = np.repeat(np.arange(len(ids)), k)
        j = np.arange(total) - np.repeat(np.cumsum(k) - k, k)
        tidx = ids[seg] * self._cols + new_p[seg] + j
        tidx_d, rows_d, lens_d = self._to_device(tidx, ids, new_lens)
        nf = self._num_free
        if total:
            pages = self._table.view(-1)[tidx_d]
            self._stack[nf: nf + total] = pages
            self._top.add_(total)
            self._poison(pages)
        self._lens_d[rows_d] = lens_d.to(torch.int32)
        self._tree_d.index_fill_(0, rows_d, 0)  # not `[rows_d] = 0`: see _commit_torch
        self._len[ids] = new_lens
        self._tree[ids] = 0
        self._num_free = nf + total
        self._version += 1
        self._poison_tails(ids)

    def extend(self, seq_ids, num_tokens) -> torch.Tensor:
        """Append ``num_tokens[i]`` positions to sequence ``seq_ids[i]`` (allocating pages).

        Returns the flat slots ``[sum num_tokens]`` int64 of the new positions, sequence by
        sequence in position order (write their KV with :meth:`write`). Raises
        :class:`PoolFullError` / :class:`SequenceTooLongError` before changing anything."""
        return self._grow(seq_ids, num_tokens, tree=False)

    def reserve_tree(self, seq_ids, tree_sizes) -> torch.Tensor:
        """Reserve the ``tree_sizes[i] >= 1`` tree nodes of sequence ``seq_ids[i]`` as its last
        positions (node j at position P+j, P the committed length). Returns their slots
        ``[sum tree_sizes]`` int64 (sequence by sequence, node order). The sequence's
        ``kv_lens`` in :meth:`verify_inputs` then includes the tree."""
        return self._grow(seq_ids, tree_sizes, tree=True)

    def _grow(self, seq_ids, counts, tree: bool) -> torch.Tensor:
        self._require_idle("reserve_tree" if tree else "extend")
        ids = self._ids(seq_ids)
        counts = np.broadcast_to(np.asarray(counts, np.int64), ids.shape).copy()
        if (counts < (1 if tree else 0)).any():
            raise ValueError(f"{'tree sizes must be >= 1' if tree else 'num_tokens must be >= 0'}, got {counts.tolist()}")
        if self._tree[ids].any():
            s = int(ids[self._tree[ids] > 0][0])
            raise ValueError(f"sequence {s} has a tree reserved: commit it (or truncate) first")
        old = self._len[ids]
        new = old + counts
        if (new > self.max_seq_len).any():
            i = int(np.argmax(new > self.max_seq_len))
            raise SequenceTooLongError(
                f"sequence {int(ids[i])} would hold {int(new[i])} tokens; max_seq_len is {self.max_seq_len}")
        old_p, new_p = self._pages_of(old), self._pages_of(new)
        k = new_p - old_p
        total = int(k.sum())
        if total > self._num_free:
            raise PoolFullError(
                f"KV pool full: {total} pages needed, {self._num_free} free of {self.num_pages} "
                f"(page_size {self.page_size})", total, self._num_free)
        ps = self.page_size
        seg = np.repeat(np.arange(len(ids)), k)
        j = np.arange(total) - np.repeat(np.cumsum(k) - k, k)
        tidx = ids[seg] * self._cols + old_p[seg] + j
        ntok = int(counts.sum())
        segt = np.repeat(np.arange(len(ids)), counts)
        pos = old[segt] + np.arange(ntok) - np.repeat(np.cumsum(counts) - counts, counts)
        ttok = ids[segt] * self._cols + pos // ps
        tidx_d, ttok_d, off_d, rows_d, new_d, cnt_d = self._to_device(tidx, ttok, pos % ps, ids, new, counts)
        nf = self._num_free
        if total:
            self._table.view(-1)[tidx_d] = self._stack[nf - total: nf].flip(0)
            self._top.sub_(total)
        slots = self._table.view(-1)[ttok_d].long() * ps + off_d
        self._lens_d[rows_d] = new_d.to(torch.int32)
        if tree:
            self._tree_d[rows_d] = cnt_d.to(torch.int32)
            self._tree[ids] = counts
        self._len[ids] = new
        self._num_free = nf - total
        self._version += 1
        return slots

    def write(self, slots: torch.Tensor, rows: torch.Tensor, layer: int | None = 0) -> None:
        """Scatter KV rows to slots in one op: ``rows [T, 576]`` into ``layer``, or
        ``rows [num_layers, T, 576]`` into every layer with ``layer=None``."""
        for name, t in (("slots", slots), ("rows", rows)):
            self._check_device(name, t)
        if rows.dtype != self.dtype:
            raise TypeError(f"rows must be {self.dtype}, got {rows.dtype}")
        if slots.dim() != 1:
            raise ValueError("slots must be 1-D")
        t = slots.shape[0]
        flat = self._store.view(self.num_layers, -1, D)
        if layer is None:
            if tuple(rows.shape) != (self.num_layers, t, D):
                raise ValueError(f"rows must be [{self.num_layers}, {t}, {D}], got {tuple(rows.shape)}")
            flat.index_copy_(1, slots, rows)
        else:
            if tuple(rows.shape) != (t, D):
                raise ValueError(f"rows must be [{t}, {D}], got {tuple(rows.shape)}")
            flat[layer].index_copy_(0, slots, rows)

    def slots(self, seq_id: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Flat slots ``[end-start]`` int64 of positions ``start..end-1`` of a sequence."""
        self._ids([seq_id])
        end = int(self._len[seq_id]) if end is None else end
        if not 0 <= start <= end <= self._len[seq_id]:
            raise ValueError(f"positions {start}..{end} outside the sequence (length {int(self._len[seq_id])})")
        pos = torch.arange(start, end, device=self.device)
        pages = self._table[seq_id, pos // self.page_size].long()
        return pages * self.page_size + pos % self.page_size

    def gather_kv(self, seq_id: int, layer: int | None = 0) -> torch.Tensor:
        """The sequence's KV in position order: ``[len, 576]`` (or ``[num_layers, len, 576]``)."""
        s = self.slots(seq_id)
        flat = self._store.view(self.num_layers, -1, D)
        return flat[:, s] if layer is None else flat[layer, s]

    # ------------------------------------------------------------------ verify inputs

    def verify_inputs(self, seq_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_table [B, max_pages] int32, kv_lens [B] int32)`` of these sequences, on the
        device, for :func:`kdtree_engine.verify_attention`. ``max_pages`` covers the longest
        (host-known) sequence. Tensor ops only; no sync."""
        ids = self._ids(seq_ids)
        if len(ids) == 0:
            raise ValueError("seq_ids is empty")
        rows = self.device_rows(ids)
        cols = max(1, int(self._pages_of(self._len[ids]).max()))
        page_table = self._table[:, :cols].index_select(0, rows)
        return page_table, self._lens_d.index_select(0, rows)

    def qo_indptr(self, seq_ids) -> torch.Tensor:
        """``[B+1]`` int32 cumulative tree sizes (verify's ``qo_indptr``), from host tree sizes."""
        ids = self._ids(seq_ids)
        n = self._tree[ids]
        if (n < 1).any():
            raise ValueError("every sequence needs a reserved tree")
        (t,) = self._to_device(np.concatenate([[0], np.cumsum(n)]))
        return t.to(torch.int32)

    # ------------------------------------------------------------------ commit

    def commit(self, seq_ids, accepted: torch.Tensor, num_accepted: torch.Tensor, *,
               num_accepted_host=None) -> None:
        """Commit the accepted path of each sequence's reserved tree. No host sync.

        Args:
            seq_ids: host ids of sequences with a reserved tree (B of them).
            accepted: ``[B, A]`` int32/int64 on the pool's device: node indices of the accepted
                path, root first, then the path in order; distinct, in ``[0, n_b)``; entries past
                ``num_accepted[b]`` are ignored (pad with -1).
            num_accepted: ``[B]`` int on the device, ``1 <= num_accepted[b] <= min(n_b, A)``
                (values outside are clamped into that range, on host and device alike).
            num_accepted_host: the same lengths on the host, if known: finalizes at once.

        Accepted node ``accepted[b, i]`` becomes position ``P_b + i``; the other nodes are freed
        (page size 1: their slots; larger pages: pages past the new length). Until
        :meth:`finalize_commit`, the host lengths are stale and other mutations raise.
        """
        self._require_idle("commit")
        ids = self._ids(seq_ids)
        if len(ids) == 0:
            raise ValueError("seq_ids is empty")
        n = self._tree[ids]
        if (n < 1).any():
            raise ValueError(f"sequence {int(ids[n < 1][0])} has no tree reserved")
        B = len(ids)
        for name, t, dim in (("accepted", accepted, 2), ("num_accepted", num_accepted, 1)):
            if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be a {dim}-D int32/int64 tensor")
            self._check_device(name, t)
            if t.shape[0] != B:
                raise ValueError(f"{name} has {t.shape[0]} rows for {B} sequences")
        A = accepted.shape[1]
        if A < 1:
            raise ValueError("accepted needs at least one column (the root)")
        if accepted.stride(1) != 1:
            accepted = accepted.contiguous()
        num_accepted = num_accepted.contiguous()
        if self.debug:
            self._check_accepted(ids, accepted, num_accepted)
        rows = self.device_rows(ids)
        if self.use_triton:
            self._commit_triton(rows, accepted, num_accepted, int(n.max()))
        else:
            self._commit_torch(rows, accepted, num_accepted, int(n.max()))
        self._pending = _Pending(ids, n.copy(), num_accepted, A)
        self._version += 1
        if num_accepted_host is not None:
            self.finalize_commit(num_accepted_host)

    def finalize_commit(self, num_accepted_host=None) -> None:
        """Host bookkeeping of the pending commit: new lengths and free count.

        ``num_accepted_host``: the accepted lengths on the host (as passed to :meth:`commit`);
        without it they are read from the device (one sync)."""
        p = self._pending
        if p is None:
            raise RuntimeError("no commit is pending")
        if num_accepted_host is None:
            num_accepted_host = p.num_accepted.cpu()
        if isinstance(num_accepted_host, torch.Tensor):
            num_accepted_host = num_accepted_host.cpu().numpy()
        a = np.asarray(num_accepted_host, np.int64).reshape(-1)
        if a.shape != p.ids.shape:
            raise ValueError(f"num_accepted_host has {a.size} entries for {len(p.ids)} sequences")
        a = np.clip(a, 1, np.minimum(p.tree, p.max_acc))
        old = self._len[p.ids]
        new = old - p.tree + a
        if self.page_size == 1:
            freed = p.tree - a
        else:
            freed = self._pages_of(old) - self._pages_of(new)
        nf = self._num_free
        self._len[p.ids] = new
        self._tree[p.ids] = 0
        self._num_free = nf + int(freed.sum())
        self._pending = None
        self._steps += 1
        self._version += 1
        if self.debug:
            top = int(self._top.item())
            lens = self._lens_d[torch.from_numpy(p.ids).to(self.device)].cpu().numpy()
            if top != self._num_free or not np.array_equal(lens, new):
                raise AssertionError(
                    f"host and device disagree after commit (host free {self._num_free}, device top "
                    f"{top}; host lens {new.tolist()}, device {lens.tolist()}): was num_accepted_host "
                    f"the same as num_accepted?")
            self._poison(self._stack[nf: self._num_free])
            self._poison_tails(p.ids)

    def _check_accepted(self, ids, accepted, num_accepted) -> None:
        acc = accepted.cpu().numpy()
        na = num_accepted.cpu().numpy()
        for b, s in enumerate(ids):
            n, a = int(self._tree[s]), int(na[b])
            if not 1 <= a <= min(n, acc.shape[1]):
                raise ValueError(f"num_accepted[{b}]={a} outside [1, min(n={n}, A={acc.shape[1]})]")
            path = acc[b, :a]
            if (path < 0).any() or (path >= n).any() or len(np.unique(path)) != a:
                raise ValueError(f"accepted[{b}, :{a}]={path.tolist()} must be distinct nodes in [0, {n})")

    def _commit_triton(self, rows, accepted, num_accepted, n_max: int) -> None:
        B, A = accepted.shape
        ps = self.page_size
        block_a = _pow2(A)
        if ps == 1:
            grid = (B, 1)
            block_d = 64
        else:
            grid = (B, self.num_layers)
            block_d = max(1, min(64, 4096 // block_a))
        _commit_kernel[grid](
            rows, accepted, num_accepted, self._table, self._lens_d, self._tree_d, self._stack,
            self._top, self._done, self._marks, self._store,
            accepted.stride(0), self._table.stride(0), self._store.stride(0),
            B, A, grid[0] * grid[1],
            PAGE_SIZE=ps, D_ROW=D,
            BLOCK_B=_pow2(B), BLOCK_A=block_a, BLOCK_N=_pow2(n_max),
            BLOCK_F=_pow2(_cdiv(n_max, ps) + 1), BLOCK_D=block_d,
            num_warps=4,
        )

    def _commit_torch(self, rows, accepted, num_accepted, n_max: int) -> None:
        """The commit with torch ops only (fixed shapes, no sync); same result as the kernel."""
        dev, ps, C = self.device, self.page_size, self._cols
        B, A = accepted.shape
        tflat = self._table.view(-1)
        L = self._lens_d[rows].long()
        n = self._tree_d[rows].long()
        P = L - n
        a = torch.minimum(num_accepted.long().clamp(min=1), n.clamp(max=A))
        o_a = torch.arange(A, device=dev)
        valid = o_a[None, :] < a[:, None]
        acc = torch.minimum(accepted.long().clamp(min=0), (n - 1)[:, None])
        acc = torch.where(valid, acc, 0)
        rbase = (rows * C)[:, None]
        trash_col = rbase + (C - 1)
        if ps == 1:
            o_n = torch.arange(n_max, device=dev)
            in_tree = o_n[None, :] < n[:, None]
            node_slot = tflat[torch.where(in_tree, rbase + P[:, None] + o_n, trash_col)]  # [B, n_max]
            acc_slot = node_slot.gather(1, acc.clamp(max=n_max - 1))
            is_acc = torch.zeros(B, n_max + 1, dtype=torch.bool, device=dev)
            is_acc.scatter_(1, torch.where(valid, acc, n_max), True)
            rej = (in_tree & ~is_acc[:, :n_max]).reshape(-1)
            rank = torch.cumsum(rej, 0) - rej.long()
            pos = torch.where(rej, self._top.long() + rank, self.num_pages)
            self._stack[pos] = node_slot.reshape(-1)
            tflat[torch.where(valid, rbase + P[:, None] + o_a, trash_col).reshape(-1)] = acc_slot.reshape(-1)
            freed = (n - a).sum()
        else:
            def slot(pos):
                return tflat[rbase + pos // ps].long() * ps + pos % ps

            src_pos = P[:, None] + acc
            dst_pos = P[:, None] + o_a
            move = valid & (src_pos != dst_pos)
            trash_row = self.num_pages * ps
            src = torch.where(move, slot(torch.where(valid, src_pos, P[:, None])), trash_row).reshape(-1)
            dst = torch.where(move, slot(torch.where(valid, dst_pos, P[:, None])), trash_row).reshape(-1)
            flat = self._store.view(self.num_layers, -1, D)
            flat[:, dst] = flat[:, src]
            nf_max = _cdiv(n_max, ps) + 1
            c_lo = _cdiv(P + a, ps)
            c_hi = _cdiv(L, ps)
            cols = c_lo[:, None] + torch.arange(nf_max, device=dev)
            fr = (cols < c_hi[:, None]).reshape(-1)
            pages = tflat[torch.where(cols < c_hi[:, None], rbase + cols, trash_col).reshape(-1)]
            rank = torch.cumsum(fr, 0) - fr.long()
            self._stack[torch.where(fr, self._top.long() + rank, self.num_pages)] = pages
            freed = (c_hi - c_lo).sum()
        self._lens_d[rows] = (P + a).to(torch.int32)
        # Not `self._tree_d[rows] = 0`: on CUDA, a Python scalar assigned through a tensor index
        # becomes a CPU 0-dim tensor that index_put_ copies to the device with a blocking copy (a
        # stream sync: an error under sync_debug_mode("error"), illegal in a CUDA-graph capture).
        # index_fill_ takes the scalar as a kernel argument.
        self._tree_d.index_fill_(0, rows, 0)
        self._top.add_(freed.to(torch.int32))

    # ------------------------------------------------------------------ inspection

    def _read_tables(self, ids: np.ndarray):
        """Host copy of the pages of these sequences (one device read): ``(pages, offsets)``."""
        k = self._pages_of(self._len[ids])
        offs = np.concatenate([[0], np.cumsum(k)])
        total = int(offs[-1])
        seg = np.repeat(np.arange(len(ids)), k)
        tidx = ids[seg] * self._cols + np.arange(total) - offs[:-1][seg]
        if total == 0:
            return np.zeros(0, np.int64), offs
        (tidx_d,) = self._to_device(tidx)
        pages = self._table.view(-1)[tidx_d].cpu().numpy().astype(np.int64)
        return pages, offs

    @staticmethod
    def _runs(pages: np.ndarray, offs: np.ndarray) -> np.ndarray:
        """Maximal runs of consecutive ascending pages per sequence."""
        n = len(offs) - 1
        if len(pages) == 0:
            return np.zeros(n, np.int64)
        brk = np.ones(len(pages), bool)
        brk[1:] = np.diff(pages) != 1
        brk[offs[:-1][offs[:-1] < len(pages)]] = True
        seg = np.repeat(np.arange(n), np.diff(offs))
        return np.bincount(seg[brk], minlength=n).astype(np.int64)

    def fragmentation(self, seq_ids=None) -> FragStats:
        """Runs per sequence, high-water mark, free runs (one device read)."""
        self._require_idle("fragmentation")
        ids = self._ids(self.live_sequences() if seq_ids is None else seq_ids)
        all_ids = self._ids(self.live_sequences())
        pages_all, _ = self._read_tables(all_ids)
        pages, offs = self._read_tables(ids)
        runs = self._runs(pages, offs)
        used = np.zeros(self.num_pages, bool)
        used[pages_all] = True
        free_idx = np.flatnonzero(~used)
        if free_idx.size:
            starts = np.ones(free_idx.size, bool)
            starts[1:] = np.diff(free_idx) != 1
            run_id = np.cumsum(starts) - 1
            free_runs = int(starts.sum())
            largest = int(np.bincount(run_id).max())
        else:
            free_runs, largest = 0, 0
        return FragStats(
            seq_ids=[int(s) for s in ids],
            tokens=[int(x) for x in self._len[ids]],
            pages=[int(x) for x in np.diff(offs)],
            runs=[int(x) for x in runs],
            num_pages=self.num_pages,
            free_pages=int((~used).sum()),
            high_water=int(pages_all.max()) + 1 if pages_all.size else 0,
            free_runs=free_runs,
            largest_free_run=largest,
        )

    def check(self) -> None:
        """Verify the invariants (one device read); raise ``AssertionError`` naming the first
        violation: every page is either in exactly one live sequence or on the free stack exactly
        once; device lengths, tree sizes and stack top equal the host's."""
        self._require_idle("check")
        ids = self._ids(self.live_sequences())
        pages, _ = self._read_tables(ids)
        nf = self._num_free
        free = self._stack[:nf].cpu().numpy().astype(np.int64)
        top = int(self._top.item())
        assert top == nf, f"device stack top {top} != host free count {nf}"
        assert int(self._done.item()) == 0, "commit counter not reset"
        assert int(self._marks.abs().sum().item()) == 0, "commit marks not cleared"
        both = np.concatenate([pages, free])
        assert both.size == 0 or (both.min() >= 0 and both.max() < self.num_pages), "page id out of range"
        cnt = np.bincount(both, minlength=self.num_pages)
        if (cnt != 1).any():
            p = int(np.flatnonzero(cnt != 1)[0])
            raise AssertionError(
                f"page {p} appears {int(cnt[p])} times (in use {int((pages == p).sum())}, free {int((free == p).sum())})")
        lens = self._lens_d.cpu().numpy()
        tree = self._tree_d.cpu().numpy()
        assert np.array_equal(lens[self._live], self._len[self._live]), "device lengths != host lengths"
        assert np.array_equal(tree[self._live], self._tree[self._live]), "device tree sizes != host"
        assert (self._len[self._live] <= self.max_seq_len).all()

    def shuffle_free_pages(self, seed: int = 0) -> None:
        """Randomly permute the free stack (tests and benchmarks: the state after many steps,
        where consecutive allocations get scattered pages)."""
        self._require_idle("shuffle_free_pages")
        nf = self._num_free
        g = torch.Generator().manual_seed(seed)
        (perm,) = self._to_device(torch.randperm(nf, generator=g).numpy())
        self._stack[:nf] = self._stack[:nf][perm]
        self._version += 1

    # ------------------------------------------------------------------ defragmentation

    def plan_defragment(self, seq_ids=None, *, pack: bool = False, scratch_bytes: int | None = None) -> DefragPlan:
        """Plan moving sequences so each occupies contiguous ascending pages (one device read).

        ``seq_ids=None``: every fragmented sequence. Each goes (largest first) to a contiguous run
        of pages that are free or its own or another chosen sequence's: at the place that keeps
        its longest run where it is, when that run holds at least a quarter of it, else at the
        lowest run that fits. Chosen sequences that fit nowhere are ``skipped`` (left unchanged).
        ``pack=True``: all live sequences, packed from page 0 in their current order (the
        high-water mark drops to the pages in use)."""
        self._require_idle("plan_defragment")
        t0 = time.perf_counter()
        N = self.num_pages
        all_ids = self._ids(self.live_sequences())
        pages, offs = self._read_tables(all_ids)
        owned = np.diff(offs)
        runs = self._runs(pages, offs)
        index = {int(s): i for i, s in enumerate(all_ids)}
        if seq_ids is not None:
            req = self._ids(seq_ids)
        placed: dict[int, int] = {}
        skipped: list[int] = []
        if pack:
            order = [i for i in range(len(all_ids)) if owned[i] > 0]
            order.sort(key=lambda i: pages[offs[i]])
            start = 0
            for i in order:
                placed[i] = start
                start += int(owned[i])
        else:
            cand = range(len(all_ids)) if seq_ids is None else [index[int(s)] for s in req]
            chosen = [i for i in cand if owned[i] > 0 and runs[i] > 1]
            while True:
                placed, new_skips = self._place(chosen, pages, offs, owned)
                if not new_skips:
                    break
                skipped += [int(all_ids[i]) for i in new_skips]
                chosen = [i for i in chosen if i not in set(new_skips)]
        mv = sorted(placed)
        src = [pages[offs[i]: offs[i + 1]] for i in mv]
        dst = [placed[i] + np.arange(owned[i]) for i in mv]
        src = np.concatenate(src) if src else np.zeros(0, np.int64)
        dst = np.concatenate(dst) if dst else np.zeros(0, np.int64)
        sched = schedule_moves(src, dst, N, self.page_bytes,
                               self.defrag_scratch_bytes if scratch_bytes is None else scratch_bytes)
        moved = np.array([all_ids[i] for i in mv], np.int64)
        return DefragPlan(
            version=self._version,
            seq_ids=[int(s) for s in moved],
            new_start=[int(placed[i]) for i in mv],
            skipped=skipped,
            schedule=sched,
            moved_pages=owned[mv].astype(np.int64) if mv else np.zeros(0, np.int64),
            live_ids=all_ids,
            live_pages=owned.astype(np.int64),
            page_bytes=self.page_bytes,
            plan_seconds=time.perf_counter() - t0,
        )

    def _place(self, chosen, pages, offs, owned):
        """First-fit-decreasing placement of chosen sequences into contiguous available runs."""
        N = self.num_pages
        avail = np.ones(N, bool)
        chosen_set = set(chosen)
        for i in range(len(owned)):
            if i not in chosen_set:
                avail[pages[offs[i]: offs[i + 1]]] = False
        edges = np.diff(np.concatenate([[0], avail.astype(np.int8), [0]]))
        starts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1)
        placed, skipped = {}, []
        for i in sorted(chosen, key=lambda i: (-owned[i], i)):
            need = int(owned[i])
            p = pages[offs[i]: offs[i + 1]]
            start = None
            # anchor: keep the longest run in place if it is at least a quarter of the sequence
            brk = np.flatnonzero(np.diff(p) != 1) + 1
            rs = np.concatenate([[0], brk])
            re_ = np.concatenate([brk, [need]])
            r = int(np.argmax(re_ - rs))
            if 4 * (re_[r] - rs[r]) >= need:
                s0 = int(p[rs[r]]) - int(rs[r])
                if 0 <= s0 and s0 + need <= N:
                    k = int(np.searchsorted(starts, s0, side="right")) - 1
                    if k >= 0 and ends[k] >= s0 + need:
                        start = s0
            if start is None:
                fit = np.flatnonzero(ends - starts >= need)
                if fit.size == 0:
                    skipped.append(i)
                    continue
                start = int(starts[fit[0]])
            k = int(np.searchsorted(starts, start, side="right")) - 1
            s_k, e_k = int(starts[k]), int(ends[k])
            new_s, new_e = [], []
            if s_k < start:
                new_s.append(s_k)
                new_e.append(start)
            if start + need < e_k:
                new_s.append(start + need)
                new_e.append(e_k)
            starts = np.concatenate([starts[:k], new_s, starts[k + 1:]]).astype(np.int64)
            ends = np.concatenate([ends[:k], new_e, ends[k + 1:]]).astype(np.int64)
            placed[i] = start
        return placed, skipped

    def upload_plan(self, plan: DefragPlan) -> None:
        """Copy the plan's index arrays to the device (one asynchronous copy, int32: 8 bytes per
        moved page); :meth:`apply_defragment` does it if it was not done."""
        if plan._dev is None:
            s = plan.schedule
            plan._dev = self._to_device(
                s.src, s.dst, s.scratch_src, s.scratch_dst, plan.seq_ids, plan.new_start,
                plan.moved_pages, plan.live_ids, plan.live_pages, dtype=np.int32)

    def _segments(self, counts_d: torch.Tensor, total: int):
        """For segments of ``counts_d`` items: (segment of each item, index inside it), on the device."""
        seg = torch.repeat_interleave(torch.arange(counts_d.numel(), device=self.device), counts_d.long(),
                                      output_size=total)
        starts = torch.cumsum(counts_d.long(), 0) - counts_d.long()
        return seg, torch.arange(total, device=self.device) - starts[seg]

    def _run_moves(self, plan: DefragPlan) -> None:
        """The page copies of a plan (no table change): scratch gather, one launch per level,
        scratch scatter."""
        self.upload_plan(plan)
        s = plan.schedule
        src_d, dst_d, ssrc_d, sdst_d = plan._dev[:4]
        if not self.use_triton:
            src_d, dst_d, ssrc_d, sdst_d = (t.long() for t in (src_d, dst_d, ssrc_d, sdst_d))
        ns = len(s.scratch_src)
        if ns:
            scratch = torch.empty((self.num_layers, ns, self.page_size, D), dtype=self.dtype, device=self.device)
            seq = torch.arange(ns, device=self.device, dtype=src_d.dtype)
            _copy_pages(self._store, scratch, ssrc_d, seq, self.use_triton)
        for k in range(s.levels):
            lo, hi = int(s.level_bounds[k]), int(s.level_bounds[k + 1])
            _copy_pages(self._store, self._store, src_d[lo:hi], dst_d[lo:hi], self.use_triton)
        if ns:
            _copy_pages(scratch, self._store, seq, sdst_d, self.use_triton)

    def apply_defragment(self, plan: DefragPlan) -> DefragReport:
        """Run a plan: the page moves (scratch gather, one launch per level, scratch scatter),
        then the rewrite of the moved tables and the free stack, all on the device. No sync."""
        self._require_idle("apply_defragment")
        if plan.version != self._version:
            raise StalePlanError("the pool changed since this plan was made; plan again")
        s = plan.schedule
        report = DefragReport(
            seq_ids=plan.seq_ids, skipped=plan.skipped, pages_moved=plan.pages_moved,
            bytes_moved=plan.bytes_moved, bytes_extra=plan.bytes_extra, levels=s.levels,
            scratch_pages=len(s.scratch_src), launches=s.launches, plan_seconds=plan.plan_seconds)
        if not plan.seq_ids:
            return report  # nothing moves: the pool is left exactly as it is
        self._run_moves(plan)
        mrow_d, mstart_d, mcnt_d, lrow_d, lcnt_d = plan._dev[4:]
        # moved sequences: table row = start, start+1, ...
        tflat = self._table.view(-1)
        seg, j = self._segments(mcnt_d, int(plan.moved_pages.sum()))
        tflat[mrow_d.long()[seg] * self._cols + j] = (mstart_d[seg] + j).to(torch.int32)
        # free stack = pages no live sequence holds, descending (pops hand out the lowest first)
        n = self.num_pages
        seg, j = self._segments(lcnt_d, int(plan.live_pages.sum()))
        used = torch.zeros(n + 1, dtype=torch.bool, device=self.device)
        used.index_fill_(0, tflat[lrow_d.long()[seg] * self._cols + j].long(), True)  # no H2D sync
        free = ~used[:n]
        rank = torch.cumsum(free, 0) - 1
        nf = self._num_free
        self._stack[torch.where(free, nf - 1 - rank, n)] = torch.arange(n, dtype=torch.int32, device=self.device)
        self._top.fill_(nf)
        if self.debug:
            self._poison(self._stack[:nf])
        self._version += 1
        return report

    def defragment(self, seq_ids=None, *, pack: bool = False, fallback_pack: bool | None = None) -> DefragReport:
        """Plan and apply (one device read for the plan).

        ``fallback_pack`` (default: when ``seq_ids`` is None): if a chosen sequence finds no
        contiguous room, pack the whole pool instead (``pack=True``), which always succeeds but
        moves every sequence that is not already in its packed place."""
        plan = self.plan_defragment(seq_ids, pack=pack)
        if fallback_pack is None:
            fallback_pack = seq_ids is None
        if plan.skipped and fallback_pack and not pack:
            plan = self.plan_defragment(None, pack=True)
        return self.apply_defragment(plan)

    def maybe_defragment(self, policy: ThresholdPolicy | None = None) -> DefragReport | None:
        """Policy hook for the serving loop: every ``policy.check_every`` committed steps, read
        the fragmentation (one sync) and compact the sequences the policy selects (packing the
        pool when they find no contiguous room). Returns the report, or None if nothing ran."""
        policy = policy or ThresholdPolicy()
        if self._steps - self._steps_at_check < policy.check_every or self._pending is not None:
            return None
        self._steps_at_check = self._steps
        chosen = policy.select(self.fragmentation())
        if not chosen:
            return None
        return self.defragment(chosen, fallback_pack=True)
