"""The pure host move scheduler of defragmentation (numpy; no device, no torch).

Page moves ``src[i] -> dst[i]`` are ordered so that one-pass copy launches are hazard-free: a
move whose destination another move still has to read waits for a later launch ("levels" of the
dependency chains); deep chain tails and cycles go through a scratch buffer of bounded size; a
cost model picks the split (:func:`schedule_moves`). :func:`check_schedule` proves a schedule
safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["MoveSchedule", "ScheduleError", "schedule_moves", "check_schedule", "PLAN_COPY_BYTES_PER_S",
           "PLAN_LAUNCH_S"]

# Cost model of the defragmentation schedule (only its ratios matter): a page moved through the
# scratch buffer costs an extra read + write; every extra launch costs about this long.
PLAN_COPY_BYTES_PER_S = 3.0e12
PLAN_LAUNCH_S = 6e-6


class ScheduleError(RuntimeError):
    """A move schedule that is not hazard-free (see :func:`check_schedule`)."""


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
        if on_cycle.any():
            raise ScheduleError("a dependency cycle survived its cut (a bug of schedule_moves)")
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
    """Raise :class:`ScheduleError` unless every launch of ``s`` is hazard-free: each page a move
    reads is written (by another move) only at a later stage, and no page is written twice."""
    src = np.concatenate([s.src, s.scratch_src])
    dst = np.concatenate([s.dst, s.scratch_dst])
    read, write = s.stages()
    if len(np.unique(src)) != len(src):
        raise ScheduleError("a page is the source of two moves")
    if len(np.unique(dst)) != len(dst):
        raise ScheduleError("a page is the destination of two moves")
    if (src == dst).any():
        raise ScheduleError("a move onto itself")
    if (np.diff(s.level_bounds) < 0).any():
        raise ScheduleError(f"level bounds decrease: {s.level_bounds.tolist()}")
    wstage = np.full(num_pages, np.iinfo(np.int64).max, np.int64)
    wstage[dst] = write
    bad = wstage[src] <= read
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ScheduleError(
            f"move {i} reads page {src[i]} at stage {read[i]} but it is overwritten at stage {wstage[src[i]]}")

