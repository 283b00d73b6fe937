"""Host-side records of defragmentation: fragmentation statistics, the plan, the report and the
trigger policy."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .schedule import MoveSchedule

__all__ = ["FragStats", "DefragPlan", "DefragReport", "ThresholdPolicy"]


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
    pool: object  # the token of the pool that made the plan (another pool refuses it)
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
