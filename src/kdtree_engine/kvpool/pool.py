"""The KV pool: :class:`KVPool` (design and sync points in the package docstring,
:mod:`kdtree_engine.kvpool`, and in docs/kvpool.md)."""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..backend import interpreting
from ..ddtree.tree import DraftTree, compile_tree
from ..masks import is_int, mask_words
from ..verify.contract import D_QK
from .defrag import DefragPlan, DefragReport, FragStats, ThresholdPolicy
from .errors import PoolFullError, PoolInvariantError, SequenceTooLongError, StalePlanError
from .kernels import copy_pages, launch_commit, launch_pop_pages, launch_step_inputs
from .schedule import schedule_moves
from .step import VerifyStep

__all__ = ["KVPool"]

D = D_QK  # 576 values per cached token
_DTYPES = (torch.bfloat16, torch.float16)


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
    if not (isinstance(device, (str, torch.device)) or is_int(device)):
        raise TypeError(f"device must be a str, torch.device or CUDA index, got {type(device).__name__}")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {device}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device}: no such CUDA device ({torch.cuda.device_count()} available)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "cpu" and device.index is not None:
        device = torch.device("cpu")  # CPU tensors report plain "cpu"
    return device


def _cdiv(a, b):
    return -(-a // b)


def _host_ints(name: str, x, squeeze: bool = True) -> np.ndarray:
    """``x`` (an int, a list, a numpy array or a CPU tensor of integers) as int64 numpy, at least
    1-D (``squeeze=False``: as given); ``TypeError`` naming ``name`` for anything else (floats
    were truncated, strings parsed)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be host values (a list, numpy array or CPU tensor), got one on {x.device}")
        x = x.numpy()
    a = np.asarray(x)
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    a = a.astype(np.int64)
    return np.atleast_1d(a) if squeeze else a


def _accepted_counts(counts, num_seqs: int) -> np.ndarray:
    """``num_accepted_host`` (host or device integers) as ``[num_seqs]`` int64 numpy."""
    if isinstance(counts, torch.Tensor):
        counts = counts.cpu()
    a = _host_ints("num_accepted_host", counts).reshape(-1)
    if a.shape != (num_seqs,):
        raise ValueError(f"num_accepted_host has {a.size} entries for {num_seqs} sequences")
    return a


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
            pages with NaN, so a kernel that reads a freed slot produces NaN. On the CPU the
            input checks (accepted paths, a commit's ``rows``) run always (the read costs no sync).
        use_triton: fused kernels for commit, page pops and moves and a step's verify inputs
            (default on CUDA); otherwise torch ops (on the CPU, or under ``TRITON_INTERPRET=1`` for
            testing the kernels).
        defrag_scratch_bytes: the scratch buffer a defragmentation may allocate.

    Sequence ids are small integers (rows of the page table) from :meth:`add_sequence`.
    """

    def __init__(self, num_pages: int, page_size: int = 1, *, num_layers: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device=None, max_seqs: int = 64,
                 max_seq_len: int | None = None, debug: bool = False, use_triton: bool | None = None,
                 defrag_scratch_bytes: int = 256 << 20):
        sizes = dict(num_pages=num_pages, page_size=page_size, num_layers=num_layers, max_seqs=max_seqs,
                     max_seq_len=max_seq_len, defrag_scratch_bytes=defrag_scratch_bytes)
        for name, v in sizes.items():
            if not (is_int(v) or v is None and name == "max_seq_len"):
                raise TypeError(f"{name} must be an int, got {v!r}")
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
        self._booking: tuple | None = None  # (ids, tree_size) of a book_tree not placed yet
        self._version = 0
        self._token = object()  # names this pool in its defragmentation plans
        self._steps = 0  # committed steps (finalize_commit calls), for policies
        self._steps_at_check = 0
        self._rows_cache: OrderedDict = OrderedDict()

    # ------------------------------------------------------------------ views and host queries

    def kv_cache(self, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s cache ``[num_pages, page_size, 576]`` (a view; verify's ``kv_cache``)."""
        self._check_layer(layer)
        return self._store[layer, : self.num_pages]

    def _check_layer(self, layer) -> None:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

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
        ids = _host_ints("seq_ids", seq_ids)
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
        if self._booking is not None:
            raise RuntimeError(f"{what}: a book_tree is not placed; call place_tree() first")

    def _check_device(self, name: str, t: torch.Tensor) -> None:
        """Raise unless ``t`` is a tensor on the pool's device (both in canonical form)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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

    @property
    def _reads_inputs(self) -> bool:
        """Whether the input checks that read device data (a commit's accepted paths and
        ``rows``) run: with ``debug``, and always on the CPU, where the read costs no sync."""
        return self.debug or self.device.type == "cpu"

    def _rows_of(self, ids: np.ndarray, rows: torch.Tensor | None) -> torch.Tensor:
        """``rows`` (a caller's ``[B]`` int64 device buffer holding ``ids``, e.g. a captured step's
        input) checked, or :meth:`device_rows` of ``ids``. Its values are checked too where
        :attr:`_reads_inputs` (a host read; not while a CUDA graph is being captured)."""
        if rows is None:
            return self.device_rows(ids)
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64:
            raise TypeError(f"rows must be an int64 tensor, got {getattr(rows, 'dtype', type(rows).__name__)}")
        if tuple(rows.shape) != (len(ids),):
            raise ValueError(f"rows has shape {tuple(rows.shape)}, expected ({len(ids)},): one row per sequence")
        self._check_device("rows", rows)
        capturing = rows.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self._reads_inputs and not capturing and not np.array_equal(rows.cpu().numpy(), ids):
            raise ValueError(f"rows holds {rows.tolist()}, not the sequences {ids.tolist()}")
        return rows.contiguous()  # a strided view: copied (in a graph, the copy is captured too)

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
        if not is_int(new_len):
            raise TypeError(f"new_len must be an int, got {new_len!r}")
        seq_id, new_len = int(ids[0]), int(new_len)
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

    def book_tree(self, seq_ids, tree_size: int) -> None:
        """The host half of ``reserve_tree(seq_ids, [tree_size] * B)``: the checks (raising
        :class:`PoolFullError` / :class:`SequenceTooLongError` before changing anything) and the
        host counts, no device work. :meth:`place_tree` with the same arguments must follow, before
        anything reads these sequences on the device; until then every other mutation raises
        (``RuntimeError``), as while a commit is pending."""
        if not is_int(tree_size):
            raise TypeError(f"tree_size must be an int, got {tree_size!r}")
        self._grow(seq_ids, tree_size, tree=True, device=False)
        self._booking = (self._ids(seq_ids), int(tree_size))

    def place_tree(self, seq_ids, tree_size: int, *, rows: torch.Tensor | None = None) -> None:
        """The device half of a :meth:`book_tree`: pops the pages the trees need from the free stack
        into the sequences' table rows and sets their device lengths and tree sizes. Derived from
        the device lengths alone, with shapes fixed by (B, ``tree_size``) and no host-to-device copy
        once :meth:`device_rows` has seen ``seq_ids``: it can be captured in a CUDA graph.
        ``rows``: the sequences' rows as a ``[B]`` int64 device tensor the caller keeps (default
        :meth:`device_rows`); a CUDA graph captured with a buffer here serves any B sequences whose
        rows are copied into that buffer before each replay. ``seq_ids`` and ``tree_size`` must be
        the booking's (``ValueError``; without a booking, ``RuntimeError``)."""
        if self._booking is None:
            raise RuntimeError("place_tree: no book_tree to place")
        ids = self._ids(seq_ids)
        booked, size = self._booking
        if not np.array_equal(ids, booked) or not is_int(tree_size) or tree_size != size:
            raise ValueError(f"place_tree({ids.tolist()}, {tree_size!r}) must place the booking, "
                             f"book_tree({booked.tolist()}, {size})")
        self._pop_pages(self._rows_of(ids, rows), size, _cdiv(size, self.page_size), tree=True)
        self._booking = None

    def _pop_pages(self, rows: torch.Tensor, counts, max_pages: int, tree: bool) -> None:
        """Device half of a grow: sequence rows ``rows [B]`` gain ``counts`` (an int, or ``[B]``
        int64 on the device) positions, the pages they need (at most ``max_pages`` each) popped
        from the free stack into their table rows in order; lengths (and tree sizes) updated.
        One kernel with ``use_triton``, else tensor ops (the same result)."""
        if self.use_triton:
            launch_pop_pages(self._table, self._lens_d, self._tree_d, self._stack, self._top, rows, counts,
                             max_pages, self.page_size, tree)
            return
        ps, C = self.page_size, self._cols
        old = self._lens_d.index_select(0, rows).long()
        new = old + counts
        old_p = (old + ps - 1) // ps
        k = (new + ps - 1) // ps - old_p  # [B] pages gained
        j = torch.arange(max_pages, device=self.device)
        take = j[None, :] < k[:, None]  # [B, K]
        flat = take.reshape(-1)
        rank = torch.cumsum(flat, 0) - flat.long()  # pops in (sequence, page) order: top of the stack first
        src = torch.where(flat, self._top.long() - 1 - rank, self.num_pages)  # entry N: the stack's trash slot
        dst = torch.where(take, rows[:, None] * C + old_p[:, None] + j, rows[:, None] * C + (C - 1))  # col C-1: trash
        self._table.view(-1)[dst.reshape(-1)] = self._stack[src]
        self._top.sub_(k.sum().to(torch.int32))
        self._lens_d[rows] = new.to(torch.int32)
        if tree:
            if isinstance(counts, torch.Tensor):
                self._tree_d[rows] = counts.to(torch.int32)
            else:  # a scalar as a kernel argument (see _commit_torch)
                self._tree_d.index_fill_(0, rows, counts)

    def _grow(self, seq_ids, counts, tree: bool, device: bool = True) -> torch.Tensor | None:
        self._require_idle("reserve_tree" if tree else "extend")
        ids = self._ids(seq_ids)
        name = "tree_sizes" if tree else "num_tokens"
        try:
            counts = np.broadcast_to(_host_ints(name, counts, squeeze=False), ids.shape).copy()
        except ValueError as e:
            raise ValueError(f"{name} must be one count or one per sequence ({len(ids)}): {e}") from None
        if (counts < (1 if tree else 0)).any():
            raise ValueError(f"{'tree sizes must be >= 1' if tree else 'num_tokens must be >= 0'}, got {counts.tolist()}")
        if self._tree[ids].any():
            s = int(ids[self._tree[ids] > 0][0])
            raise ValueError(f"sequence {s} has a tree reserved: commit it (or truncate) first")
        old = self._len[ids]
        if (counts > self.max_seq_len - old).any():  # (compared before adding: no int64 overflow)
            i = int(np.argmax(counts > self.max_seq_len - old))
            raise SequenceTooLongError(f"sequence {int(ids[i])} would hold {int(old[i])} + {int(counts[i])} tokens; "
                                       f"max_seq_len is {self.max_seq_len}")
        new = old + counts
        k = self._pages_of(new) - self._pages_of(old)
        total = int(k.sum())
        if total > self._num_free:
            raise PoolFullError(
                f"KV pool full: {total} pages needed, {self._num_free} free of {self.num_pages} "
                f"(page_size {self.page_size})", total, self._num_free)
        slots = None
        if device:
            ps = self.page_size
            ntok = int(counts.sum())
            segt = np.repeat(np.arange(len(ids)), counts)
            pos = old[segt] + np.arange(ntok) - np.repeat(np.cumsum(counts) - counts, counts)
            ttok_d, off_d, cnt_d = self._to_device(ids[segt] * self._cols + pos // ps, pos % ps, counts)
            self._pop_pages(self.device_rows(ids), cnt_d, int(k.max()) if len(k) else 0, tree)
            slots = self._table.view(-1)[ttok_d].long() * ps + off_d
        if tree:
            self._tree[ids] = counts
        self._len[ids] = new
        self._num_free -= total
        self._version += 1
        return slots

    def write(self, slots: torch.Tensor, rows: torch.Tensor, layer: int | None = 0) -> None:
        """Scatter KV rows to slots in one op: ``rows [T, 576]`` into ``layer``, or
        ``rows [num_layers, T, 576]`` into every layer with ``layer=None``. ``slots [T]`` int64 in
        ``[0, num_pages * page_size)``: checked on the CPU (``ValueError``); on a GPU they are not
        read (a sync), and one past the cache is a device-side assert.
        Any strides (broadcast rows included); ``rows`` must not be a view of the pool's own cache
        (``ValueError``: it would be read while written; gather a copy first)."""
        for name, t in (("slots", slots), ("rows", rows)):
            self._check_device(name, t)
        if rows.untyped_storage().data_ptr() == self._store.untyped_storage().data_ptr():
            raise ValueError("rows is a view of the pool's own cache: pass a copy (e.g. kv_cache().view(-1, 576)[idx])")
        if rows.dtype != self.dtype:
            raise TypeError(f"rows must be {self.dtype}, got {rows.dtype}")
        if slots.dim() != 1:
            raise ValueError("slots must be 1-D")
        if slots.dtype != torch.int64:
            raise TypeError(f"slots must be torch.int64, got {slots.dtype}")
        end = self.num_pages * self.page_size
        host = slots.numpy() if slots.device.type == "cpu" else None  # (on a GPU: not read)
        if host is not None and host.size and not 0 <= host.min() <= host.max() < end:
            raise ValueError(f"slots must be in [0, {end}) (num_pages * page_size), got {host.min()}..{host.max()}")
        if layer is not None:
            self._check_layer(layer)
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
        for name, v in (("start", start), ("end", end)):
            if not (is_int(v) or v is None and name == "end"):
                raise TypeError(f"{name} must be an int, got {v!r}")
        end = int(self._len[seq_id]) if end is None else end
        if not 0 <= start <= end <= self._len[seq_id]:
            raise ValueError(f"positions {start}..{end} outside the sequence (length {int(self._len[seq_id])})")
        pos = torch.arange(start, end, device=self.device)
        pages = self._table[seq_id, pos // self.page_size].long()
        return pages * self.page_size + pos % self.page_size

    def gather_kv(self, seq_id: int, layer: int | None = 0) -> torch.Tensor:
        """The sequence's KV in position order: ``[len, 576]`` (or ``[num_layers, len, 576]``)."""
        if layer is not None:
            self._check_layer(layer)
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

    def reserve_step(self, seq_ids, tree: DraftTree) -> VerifyStep:
        """Reserve the draft trees of a decode step and hand back all its verify inputs.

        ``tree``: the B sequences' trees (:class:`~kdtree_engine.ddtree.DraftTree` on the pool's
        device, tree b for ``seq_ids[b]``); node j of sequence b goes to position ``P_b + j``
        (:meth:`reserve_tree`). Returns the :class:`VerifyStep` of :meth:`step_inputs`. No sync;
        raises like :meth:`reserve_tree` before changing anything."""
        ids = self._ids(seq_ids)
        self.reserve_tree(ids, self._tree_sizes(ids, tree))  # (checked before anything changes)
        return self.step_inputs(ids, tree)

    def _tree_sizes(self, ids: np.ndarray, tree) -> np.ndarray:
        """``tree``'s host node counts ``[B]``, after checking it holds one tree per sequence of
        ``ids``, on the pool's device, each within its width."""
        if not isinstance(tree, DraftTree):
            raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
        if tree.batch_size != len(ids):
            raise ValueError(f"tree holds {tree.batch_size} trees for {len(ids)} sequences")
        self._check_device("tree", tree.tokens)
        sizes = np.asarray(tree.num_nodes_host, np.int64)
        if sizes.shape != ids.shape or (sizes > tree.width).any():
            raise ValueError(f"tree.num_nodes_host {sizes.tolist()} must be one count per tree, each at most "
                             f"the tree's width {tree.width}")
        return sizes

    def step_inputs(self, seq_ids, tree: DraftTree, *, rows: torch.Tensor | None = None) -> VerifyStep:
        """The :class:`VerifyStep` of trees already reserved with :meth:`reserve_tree` (sizes
        ``tree.num_nodes_host``): slots, page table ``[B, max_pages_per_seq]`` (every column: a
        fixed shape), lengths, ``qo_indptr``, mask, node tokens, RoPE positions, host lengths.

        Device work only, with shapes fixed by (B, ``tree.width``) and no host-to-device copy once
        :meth:`device_rows` has seen ``seq_ids``: it can be captured in a CUDA graph, whose
        replays recompute the device tensors from the pool's state and the tree's tensors then
        (the host fields stay those of the capture: plan a replayed step from :meth:`seq_len`).
        ``rows``: the sequences' rows as a ``[B]`` int64 device tensor the caller keeps (default
        :meth:`device_rows`); a CUDA graph captured with a buffer here serves any B sequences whose
        rows are copied into that buffer before each replay."""
        ids = self._ids(seq_ids)
        sizes = self._tree_sizes(ids, tree)
        if not np.array_equal(self._tree[ids], sizes):
            raise ValueError(f"tree sizes {sizes.tolist()} are not the reserved ones {self._tree[ids].tolist()}: "
                             f"call reserve_tree(seq_ids, tree.num_nodes_host) first")
        rows = self._rows_of(ids, rows)
        if self.use_triton:
            tokens, rope_pos, slots, page_table, kv_lens, qo_indptr, tree_mask = launch_step_inputs(
                self._table, self._lens_d, self._tree_d, rows, tree.tokens.contiguous(), tree.parents.contiguous(),
                tree.depths.contiguous(), tree.num_nodes.contiguous(), int(sizes.sum()), tree.max_depth,
                self.max_pages_per_seq, self.page_size, mask_words(tree.width))
        else:
            tokens, rope_pos, slots, page_table, kv_lens, qo_indptr, tree_mask = self._step_inputs_torch(rows, tree)
        return VerifyStep(
            seq_ids=tuple(int(s) for s in ids),
            tokens=tokens,
            rope_pos=rope_pos,
            slots=slots,
            page_table=page_table,
            kv_lens=kv_lens,
            qo_indptr=qo_indptr,
            tree_mask=tree_mask,
            kv_lens_host=tuple(int(x) for x in self._len[ids]),
            qo_indptr_host=tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)])),
        )

    def _step_inputs_torch(self, rows: torch.Tensor, tree: DraftTree) -> tuple:
        """:meth:`step_inputs`' device tensors with torch ops (:func:`~kdtree_engine.ddtree.compile_tree`,
        about 80 of them); the same result as the kernel of ``use_triton``."""
        page_table = self._table[:, : self.max_pages_per_seq].index_select(0, rows)
        kv_lens = self._lens_d.index_select(0, rows)
        prefix = (kv_lens - self._tree_d.index_select(0, rows)).to(torch.int64)  # [B]
        vb = compile_tree(tree, prefix)
        # slot of tree node (b, j) at position P_b + j, scattered to its flat row (padding to row T)
        T, ps = vb.num_rows, self.page_size
        pos = prefix[:, None] + torch.arange(tree.width, device=self.device)  # [B, n]
        col = (pos // ps).clamp_(max=self.max_pages_per_seq - 1)
        node_slot = page_table.gather(1, col).long() * ps + pos % ps
        slots = torch.empty(T + 1, dtype=torch.int64, device=self.device)
        slots.scatter_(0, torch.where(vb.row_index >= 0, vb.row_index, T).view(-1), node_slot.view(-1))
        return vb.input_ids, vb.positions, slots[:T], page_table, kv_lens, vb.qo_indptr, vb.tree_mask

    # ------------------------------------------------------------------ commit

    def commit(self, seq_ids, accepted: torch.Tensor, num_accepted: torch.Tensor, *,
               num_accepted_host=None, rows: torch.Tensor | None = None) -> None:
        """Commit the accepted path of each sequence's reserved tree. No host sync.

        Args:
            seq_ids: host ids of sequences with a reserved tree (B of them).
            accepted: ``[B, A]`` int32/int64 on the pool's device: node indices of the accepted
                path, root first, then the path in order; distinct, in ``[0, n_b)`` (checked on
                the CPU and with ``debug``: ``ValueError``, the pool unchanged; on a GPU not read:
                indices are clamped into range and a repeated node's later positions get other
                slots, their KV unspecified, the pool consistent); entries past
                ``num_accepted[b]`` are ignored (pad with -1).
            num_accepted: ``[B]`` int on the device, ``1 <= num_accepted[b] <= min(n_b, A)``
                (values outside are clamped into that range, on host and device alike).
            num_accepted_host: the same lengths on the host, if known: finalizes at once
                (compared with ``num_accepted`` on the CPU and with ``debug``: ``ValueError``,
                the pool unchanged).
            rows: see :meth:`place_tree`.

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
        self._check_int_tensor("accepted", accepted, 2, len(ids))
        self._check_int_tensor("num_accepted", num_accepted, 1, len(ids))
        A = accepted.shape[1]
        if A < 1:
            raise ValueError("accepted needs at least one column (the root)")
        if accepted.stride(1) != 1:
            accepted = accepted.contiguous()
        num_accepted = num_accepted.contiguous()
        if num_accepted_host is not None:  # checked before the commit runs: a refused call changes nothing
            num_accepted_host = _accepted_counts(num_accepted_host, len(ids))
        if self._reads_inputs:
            na = num_accepted.cpu().numpy()  # (one read for both checks)
            self._check_accepted(ids, accepted, na, strict=self.debug)
            if num_accepted_host is not None:
                self._check_host_counts(num_accepted_host, na, n, A)
        rows = self._rows_of(ids, rows)
        if self.use_triton:
            launch_commit(self._store, self._table, self._lens_d, self._tree_d, self._stack, self._top, self._done,
                          self._marks, rows, accepted, num_accepted, int(n.max()))
        else:
            self._commit_torch(rows, accepted, num_accepted, int(n.max()))
        self._pending = _Pending(ids, n.copy(), num_accepted, A)
        self._version += 1
        if num_accepted_host is not None:
            self._finalize(num_accepted_host)  # (checked above)

    def replayed_commit(self, seq_ids, num_accepted: torch.Tensor, accepted_width: int, *,
                        num_accepted_host=None) -> None:
        """The host half of :meth:`commit` for a commit captured in a CUDA graph, after each
        replay of that graph (a replay runs the commit's kernel but no Python): marks the commit
        of ``seq_ids``' reserved trees pending, exactly as :meth:`commit` with an ``accepted`` of
        ``accepted_width`` columns and this ``num_accepted`` (the captured ``[B]`` device tensor)
        would. ``num_accepted_host``: finalizes at once, as in :meth:`commit`. A :meth:`book_tree`
        of ``seq_ids`` before the replay counts as placed (the graph holds its :meth:`place_tree`)."""
        ids = self._ids(seq_ids)
        if self._booking is not None and np.array_equal(self._booking[0], ids):
            self._booking = None
        self._require_idle("replayed_commit")
        n = self._tree[ids]
        if len(ids) == 0 or (n < 1).any():
            raise ValueError("seq_ids must be sequences with a tree reserved")
        if not is_int(accepted_width) or accepted_width < 1:
            raise ValueError(f"accepted_width must be a positive int, got {accepted_width!r}")
        self._check_int_tensor("num_accepted", num_accepted, 1, len(ids))
        self._pending = _Pending(ids, n.copy(), num_accepted, int(accepted_width))
        self._version += 1
        if num_accepted_host is not None:
            self.finalize_commit(num_accepted_host)

    def finalize_commit(self, num_accepted_host=None) -> None:
        """Host bookkeeping of the pending commit: new lengths and free count.

        ``num_accepted_host``: the accepted lengths on the host (as passed to :meth:`commit`);
        without it they are read from the device (one sync). On the CPU and with ``debug`` they
        are compared with the device's first: ``ValueError``, the commit still pending."""
        p = self._pending
        if p is None:
            raise RuntimeError("no commit is pending")
        if num_accepted_host is None:
            a = _accepted_counts(p.num_accepted.cpu(), len(p.ids))
        else:
            a = _accepted_counts(num_accepted_host, len(p.ids))
            if self._reads_inputs:  # before any change: a refused call leaves the commit pending
                self._check_host_counts(a, p.num_accepted.cpu().numpy(), p.tree, p.max_acc)
        self._finalize(a)

    def _finalize(self, a: np.ndarray) -> None:
        """:meth:`finalize_commit` with the pending commit's accepted lengths ``a [B]`` (host)."""
        p = self._pending
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
                raise PoolInvariantError(
                    f"host and device disagree after commit (host free {self._num_free}, device top "
                    f"{top}; host lens {new.tolist()}, device {lens.tolist()})")
            self._poison(self._stack[nf: self._num_free])
            self._poison_tails(p.ids)

    def _check_int_tensor(self, name: str, t, dim: int, num_seqs: int) -> None:
        """``t``: a ``dim``-D int32/int64 tensor on the pool's device with one row per sequence."""
        if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be a {dim}-D int32/int64 tensor")
        self._check_device(name, t)
        if t.shape[0] != num_seqs:
            raise ValueError(f"{name} has {t.shape[0]} rows for {num_seqs} sequences")

    @staticmethod
    def _check_host_counts(host: np.ndarray, num_accepted: np.ndarray, tree: np.ndarray, width: int) -> None:
        """``num_accepted_host`` against the device's ``num_accepted``, both clamped into
        ``[1, min(n_b, A)]`` as the commit clamps them (``ValueError``): a wrong host count would
        leave the host's lengths and free count apart from the device's."""
        most = np.minimum(tree, width)
        host = np.clip(host, 1, most)
        dev = np.clip(num_accepted.astype(np.int64), 1, most)
        if not np.array_equal(host, dev):
            raise ValueError(f"num_accepted_host {host.tolist()} differs from num_accepted {dev.tolist()} "
                             f"(both clamped into [1, min(tree size, {width})])")

    def _check_accepted(self, ids, accepted, na: np.ndarray, *, strict: bool) -> None:
        """Each accepted path on the host: distinct nodes in ``[0, n_b)`` (``ValueError``); its
        length ``na[b]`` (``num_accepted`` read to the host) in ``[1, min(n_b, A)]`` where
        ``strict``, else clamped into it as the commit does."""
        acc = accepted.cpu().numpy()
        for b, s in enumerate(ids):
            n, a = int(self._tree[s]), int(na[b])
            most = min(n, acc.shape[1])
            if strict and not 1 <= a <= most:
                raise ValueError(f"num_accepted[{b}]={a} outside [1, min(n={n}, A={acc.shape[1]})]")
            a = min(max(a, 1), most)
            path = acc[b, :a]
            if (path < 0).any() or (path >= n).any() or len(np.unique(path)) != a:
                raise ValueError(f"accepted[{b}, :{a}]={path.tolist()} must be distinct nodes in [0, {n})")

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
            node_or_pad = torch.where(valid, acc, n_max)
            first_pos = torch.full((B, n_max + 1), A, device=dev).scatter_reduce_(1, node_or_pad, o_a.expand(B, A), "amin")
            first = valid & (first_pos.gather(1, node_or_pad) == o_a)  # a repeated node's later positions: not
            rej = in_tree & (first_pos[:, :n_max] == A)
            rej_rank = torch.cumsum(rej, 1) - rej.long()
            dup = valid & ~first
            n_dup = dup.sum(1, keepdim=True)
            # as the kernel: repeated positions take the first rejected slots, the others are freed
            spare = torch.zeros(B, n_max + 1, dtype=node_slot.dtype, device=dev)
            spare.scatter_(1, torch.where(rej & (rej_rank < n_dup), rej_rank, n_max), node_slot)
            pos_slot = torch.where(first, acc_slot, spare.gather(1, (torch.cumsum(dup, 1) - dup.long()).clamp(max=n_max)))
            fr = (rej & (rej_rank >= n_dup)).reshape(-1)
            rank = torch.cumsum(fr, 0) - fr.long()
            pos = torch.where(fr, self._top.long() + rank, self.num_pages)
            self._stack[pos] = node_slot.reshape(-1)
            tflat[torch.where(valid, rbase + P[:, None] + o_a, trash_col).reshape(-1)] = pos_slot.reshape(-1)
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
        """Verify the invariants (one device read); raise :class:`PoolInvariantError` naming the
        first violation: every page is either in exactly one live sequence or on the free stack
        exactly once; device lengths, tree sizes and stack top equal the host's."""
        self._require_idle("check")
        ids = self._ids(self.live_sequences())
        pages, _ = self._read_tables(ids)
        nf = self._num_free
        free = self._stack[:nf].cpu().numpy().astype(np.int64)
        top = int(self._top.item())
        if top != nf:
            raise PoolInvariantError(f"device stack top {top} != host free count {nf}")
        if int(self._done.item()) != 0:
            raise PoolInvariantError("commit counter not reset")
        if int(self._marks.abs().sum().item()) != 0:
            raise PoolInvariantError("commit marks not cleared")
        both = np.concatenate([pages, free])
        if both.size and (both.min() < 0 or both.max() >= self.num_pages):
            raise PoolInvariantError(f"page id out of range [0, {self.num_pages}): {int(both.min())}..{int(both.max())}")
        cnt = np.bincount(both, minlength=self.num_pages)
        if (cnt != 1).any():
            p = int(np.flatnonzero(cnt != 1)[0])
            raise PoolInvariantError(
                f"page {p} appears {int(cnt[p])} times (in use {int((pages == p).sum())}, free {int((free == p).sum())})")
        lens = self._lens_d.cpu().numpy()
        tree = self._tree_d.cpu().numpy()
        if not np.array_equal(lens[self._live], self._len[self._live]):
            raise PoolInvariantError("device lengths != host lengths")
        if not np.array_equal(tree[self._live], self._tree[self._live]):
            raise PoolInvariantError("device tree sizes != host")
        if (self._len[self._live] > self.max_seq_len).any():
            raise PoolInvariantError(f"a sequence is longer than max_seq_len={self.max_seq_len}")

    def shuffle_free_pages(self, seed: int = 0) -> None:
        """Randomly permute the free stack (tests and benchmarks: the state after many steps,
        where consecutive allocations get scattered pages)."""
        self._require_idle("shuffle_free_pages")
        if not is_int(seed):
            raise TypeError(f"seed must be an int, got {seed!r}")
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
            pool=self._token,
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
            copy_pages(self._store, scratch, ssrc_d, seq, self.use_triton)
        for k in range(s.levels):
            lo, hi = int(s.level_bounds[k]), int(s.level_bounds[k + 1])
            copy_pages(self._store, self._store, src_d[lo:hi], dst_d[lo:hi], self.use_triton)
        if ns:
            copy_pages(scratch, self._store, seq, sdst_d, self.use_triton)

    def apply_defragment(self, plan: DefragPlan) -> DefragReport:
        """Run a plan: the page moves (scratch gather, one launch per level, scratch scatter),
        then the rewrite of the moved tables and the free stack, all on the device. No sync."""
        self._require_idle("apply_defragment")
        if not isinstance(plan, DefragPlan):
            raise TypeError(f"plan must be a DefragPlan (from plan_defragment), got {type(plan).__name__}")
        if plan.pool is not self._token:
            raise ValueError("plan was made by another pool: plan with this pool's plan_defragment()")
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
        policy = ThresholdPolicy() if policy is None else policy
        if not isinstance(policy, ThresholdPolicy):
            raise TypeError(f"policy must be a ThresholdPolicy, got {type(policy).__name__}")
        busy = self._pending is not None or self._booking is not None
        if self._steps - self._steps_at_check < policy.check_every or busy:
            return None
        self._steps_at_check = self._steps
        chosen = policy.select(self.fragmentation())
        if not chosen:
            return None
        return self.defragment(chosen, fallback_pack=True)
