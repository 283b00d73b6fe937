"""Paged KV pool for tree speculative decoding on MLA: tree slots, commit of accepted tokens,
defragmentation.

Modules, one concern each (each imports only those above it in this list):

- :mod:`.errors`: the exceptions.
- :mod:`.schedule`: the pure host move scheduler of defragmentation (numpy).
- :mod:`.defrag`: fragmentation statistics, defragmentation plan, report and trigger policy.
- :mod:`.kernels`: the Triton kernels (commit, page copy) and their launchers.
- :mod:`.step`: :class:`VerifyStep`, one decode step's verify inputs, handed out together.
- :mod:`.pool`: :class:`KVPool`, the pool itself.

Layout (docs/kvpool.md, "Layout and the verify contract"). The pool holds ``num_layers`` caches, each
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
- A step captured in a CUDA graph: :meth:`KVPool.book_tree` (host counts only) before it, then
  inside it :meth:`KVPool.place_tree` (the reservation's device half), :meth:`KVPool.step_inputs`
  (the verify inputs) and :meth:`KVPool.commit`: no sync, no host-to-device copy, fixed shapes;
  after each replay :meth:`KVPool.replayed_commit` books the commit's host half.
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

from .defrag import DefragPlan, DefragReport, FragStats, ThresholdPolicy
from .errors import KVPoolError, PoolFullError, PoolInvariantError, SequenceTooLongError, StalePlanError
from .pool import KVPool
from .schedule import MoveSchedule, ScheduleError, check_schedule, schedule_moves
from .step import VerifyStep

__all__ = [
    "KVPool",
    "VerifyStep",
    "KVPoolError",
    "PoolFullError",
    "PoolInvariantError",
    "SequenceTooLongError",
    "StalePlanError",
    "FragStats",
    "DefragPlan",
    "DefragReport",
    "MoveSchedule",
    "ScheduleError",
    "ThresholdPolicy",
    "schedule_moves",
    "check_schedule",
]
