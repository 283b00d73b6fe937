"""The contract of tree-verify MLA attention: its dimensions and the checks of its inputs.

The lowest layer of :mod:`kdtree_engine.verify`: imports only torch and :mod:`kdtree_engine.masks`.
Shape, dtype, device and layout checks (:func:`check_inputs`) read no tensor content and never
sync; the content checks (:func:`check_lengths` on host lengths, :func:`check_content` on
everything) do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..masks import MAX_TREE_NODES

D_QK = 576  # 512 latent (c_kv) + 64 rope (k_pe)
D_V = 512  # V is the latent part of the same cache row
D_ROPE = D_QK - D_V
MAX_HEADS = 128
MAX_KV_LEN = 1 << 30  # positions, tile ends and lengths are int32 in the kernels (and the plan's tables)

__all__ = ["D_QK", "D_V", "D_ROPE", "MAX_HEADS", "MAX_KV_LEN", "VerifyInputs", "Signature", "InputCheck", "check_inputs", "kernel_ints", "check_lengths", "check_content", "host_lengths"]


@dataclass(frozen=True)
class VerifyInputs:
    """Sizes read off validated inputs (host ints only; reading them costs no device sync)."""

    num_rows: int  # T
    num_heads: int  # H
    num_seqs: int  # B
    num_pages: int
    page_size: int
    max_pages: int  # page_table.shape[1]
    mask_words: int  # W


def _check_tensor(name, t, *, dim, dtype=None, dtypes=None, device=None, last=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of q)")
    if last is not None:
        if t.shape[-1] != last:
            raise ValueError(f"{name} must have last dimension {last}, got shape {tuple(t.shape)}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})")


def _extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last (0 when it has no element)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _check_own_memory(name, t):
    """An output must not write one element twice (zero or interleaved strides)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    reach = 1  # elements covered by the inner dims so far
    for st, n in dims:
        if st < reach:
            raise ValueError(
                f"{name} has overlapping strides {tuple(t.stride())} for shape {tuple(t.shape)}: an output "
                f"must give every element its own memory (each stride past the span of the smaller ones)"
            )
        reach = st * (n - 1) + reach


_NAMES = ("q", "kv_cache", "page_table", "kv_lens", "qo_indptr", "tree_mask", "out", "lse")


def _check_outputs_apart(ptrs, extents):
    """out (the 7th of the eight tensors) must not overlap an input, lse (the 8th) neither an input
    nor out: byte ranges ``[ptrs[i], ptrs[i] + extents[i])`` (0 bytes: absent or empty), whatever
    the storages (distinct allocations never overlap)."""
    for i in (6, 7):
        lo, n = ptrs[i], extents[i]
        if n:
            hi = lo + n
            for j in range(i):
                if extents[j] and lo < ptrs[j] + extents[j] and ptrs[j] < hi:
                    raise ValueError(f"{_NAMES[i]} overlaps {_NAMES[j]} in memory (the byte ranges they span meet: "
                                     f"interleaved buffers are refused too); pass a separate buffer")


def check_inputs(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out=None, lse=None):
    """Check ranks, sizes, dtypes, devices and layouts of the contract's tensors. No device sync.

    Layouts: every stride of every argument is honoured, except that q, kv_cache and out need
    their last dimension contiguous, and out / lse must not overlap themselves or an input.
    Returns the sizes as a :class:`VerifyInputs`. Raises ``TypeError`` / ``ValueError`` naming
    the offending argument.
    """
    _check_tensor("q", q, dim=3, dtypes=(torch.bfloat16, torch.float16), last=D_QK)
    dev = q.device
    _check_tensor("kv_cache", kv_cache, dim=3, dtype=q.dtype, device=dev, last=D_QK)
    _check_tensor("page_table", page_table, dim=2, dtype=torch.int32, device=dev)
    _check_tensor("kv_lens", kv_lens, dim=1, dtype=torch.int32, device=dev)
    _check_tensor("qo_indptr", qo_indptr, dim=1, dtype=torch.int32, device=dev)
    _check_tensor("tree_mask", tree_mask, dim=2, dtype=torch.int32, device=dev)
    T, H, _ = q.shape
    B = kv_lens.shape[0]
    if T < 1:
        raise ValueError("q has no rows (every sequence needs at least its root node)")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q has {H} heads; 1..{MAX_HEADS} are supported")
    if B < 1:
        raise ValueError("kv_lens must hold at least one sequence")
    if page_table.shape[0] != B:
        raise ValueError(f"page_table has {page_table.shape[0]} rows but kv_lens has {B} sequences")
    if page_table.shape[1] < 1:
        raise ValueError("page_table must have at least one column")
    if qo_indptr.shape[0] != B + 1:
        raise ValueError(f"qo_indptr must have B+1={B + 1} entries, got {qo_indptr.shape[0]}")
    if tree_mask.shape[0] != T:
        raise ValueError(f"tree_mask has {tree_mask.shape[0]} rows but q has T={T} rows")
    if tree_mask.shape[1] < 1:
        raise ValueError("tree_mask must have at least one word per row")
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        raise ValueError(f"kv_cache must hold at least one page and one slot, got {tuple(kv_cache.shape)}")
    if out is not None:
        _check_tensor("out", out, dim=3, dtype=q.dtype, device=dev, last=D_V)
        if tuple(out.shape[:2]) != (T, H):
            raise ValueError(f"out must have shape {(T, H, D_V)}, got {tuple(out.shape)}")
        if not torch.compiler.is_compiling():  # (traced strides may be symbolic: checked when run eagerly)
            _check_own_memory("out", out)
    if lse is not None:
        _check_tensor("lse", lse, dim=2, dtype=torch.float32, device=dev)
        if tuple(lse.shape) != (T, H):
            raise ValueError(f"lse must have shape {(T, H)}, got {tuple(lse.shape)}")
        if not torch.compiler.is_compiling():  # (traced strides may be symbolic: checked when run eagerly)
            _check_own_memory("lse", lse)
    if (out is not None or lse is not None) and not torch.compiler.is_compiling():  # (traced: no addresses)
        tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
        _check_outputs_apart([0 if t is None else t.data_ptr() for t in tensors],
                             [0 if t is None else _extent(t) for t in tensors])
    return VerifyInputs(
        num_rows=T,
        num_heads=H,
        num_seqs=B,
        num_pages=kv_cache.shape[0],
        page_size=kv_cache.shape[1],
        max_pages=page_table.shape[1],
        mask_words=tree_mask.shape[1],
    )


def kernel_ints(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse) -> tuple[int, ...]:
    """The integer arguments every verify kernel takes after its tensors, in its order: the strides
    of q (2), kv_cache (2), page_table (2), kv_lens, qo_indptr, tree_mask (2), its width W, out (2)
    and lse (2). One ``stride()`` per tensor (host time)."""
    qs, ks, ms, os_ = q.stride(), kv_cache.stride(), tree_mask.stride(), out.stride()
    return (qs[0], qs[1], ks[0], ks[1], *page_table.stride(), kv_lens.stride(0), qo_indptr.stride(0), ms[0], ms[1],
            tree_mask.shape[1], os_[0], os_[1], *lse.stride())


class Signature:
    """What :class:`InputCheck` keeps per signature of the eight tensors: their sizes (``info``),
    their byte extents (``extents``, 0 for an absent one) and, for the caller, ``prepared``: what
    it derives from the signature alone (e.g. a prepared launch), by its own key."""

    __slots__ = ("info", "extents", "prepared")

    def __init__(self, info: VerifyInputs, extents: tuple):
        self.info, self.extents, self.prepared = info, extents, {}


class InputCheck:
    """:func:`check_inputs` for the repeated calls of one caller (a plan's layers), in a few
    microseconds: what it reads besides addresses (dtypes, devices, shapes, strides, and each data
    pointer's offset from 16 bytes) is a dictionary key, checked once per signature; the overlap
    checks of ``out`` / ``lse``, which read addresses, run on every call (pointer arithmetic on the
    kept extents). Same errors as :func:`check_inputs`.

    A call returns ``(signature, ptrs)``: the :class:`Signature` (the same object for every call
    of that signature, until the table starts over) and the eight data pointers (0 for an absent
    ``out`` / ``lse``).

    ``lengths``: for a plan's calls, its ``(kv_lens, qo_indptr)`` buffers, of which the calls pass
    views (``[B]`` and ``[B + 1]`` int32 on the plan's device, contiguous, made by the plan): left
    out of the key (B is page_table's first dimension, checked against them on a miss and against
    the plan by the caller), the overlap checks taking the whole buffers."""

    MAX_SIGNATURES = 64  # past this many the table starts over

    def __init__(self, lengths: tuple[torch.Tensor, torch.Tensor] | None = None):
        self._seen: dict[tuple, Signature] = {}
        self._lengths = None if lengths is None else tuple(t.data_ptr() for t in lengths)
        self._length_extents = None if lengths is None else tuple(_extent(t) for t in lengths)

    def __call__(self, q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out=None, lse=None):
        try:
            if self._lengths is None:
                kp, qp = kv_lens.data_ptr(), qo_indptr.data_ptr()
                lengths = (kv_lens.dtype, kv_lens.device, kv_lens.shape, kv_lens.stride(), qo_indptr.dtype,
                           qo_indptr.device, qo_indptr.shape, qo_indptr.stride())
            else:
                (kp, qp), lengths = self._lengths, None
            ptrs = (q.data_ptr(), kv_cache.data_ptr(), page_table.data_ptr(), kp, qp, tree_mask.data_ptr(),
                    0 if out is None else out.data_ptr(), 0 if lse is None else lse.data_ptr())
            odd = (ptrs[0] | ptrs[1] | ptrs[2] | kp | qp | ptrs[5] | ptrs[6] | ptrs[7]) & 15
            key = (q.dtype, q.device, q.shape, q.stride(), kv_cache.dtype, kv_cache.device, kv_cache.shape,
                   kv_cache.stride(), page_table.dtype, page_table.device, page_table.shape, page_table.stride(),
                   tree_mask.dtype, tree_mask.device, tree_mask.shape, tree_mask.stride(), lengths,
                   None if out is None else (out.dtype, out.device, out.shape, out.stride()),
                   None if lse is None else (lse.dtype, lse.device, lse.shape, lse.stride()),
                   odd and tuple([p & 15 for p in ptrs]))
            sig = self._seen.get(key)
        except (AttributeError, TypeError):  # not tensors: check_inputs names the argument
            key = sig = None
        if sig is None:
            tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
            info = check_inputs(*tensors)
            extents = [0 if t is None else _extent(t) for t in tensors]
            ptrs = [0 if t is None else t.data_ptr() for t in tensors]
            if self._lengths is not None:
                ptrs[3:5], extents[3:5] = self._lengths, self._length_extents
            sig = Signature(info, tuple(extents))
            if key is not None:
                if len(self._seen) >= self.MAX_SIGNATURES:
                    self._seen.clear()
                self._seen[key] = sig
            ptrs = tuple(ptrs)
        if out is not None or lse is not None:
            _check_outputs_apart(ptrs, sig.extents)
        return sig, ptrs


def host_lengths(kv_lens, qo_indptr) -> tuple[np.ndarray, np.ndarray]:
    """``kv_lens`` ``[B]`` and ``qo_indptr`` ``[B+1]`` as int64 numpy arrays (lists, numpy arrays
    and CPU tensors are read in place; a CUDA tensor is copied, which syncs)."""
    if isinstance(kv_lens, torch.Tensor):
        kv_lens = kv_lens.cpu().numpy()
    if isinstance(qo_indptr, torch.Tensor):
        qo_indptr = qo_indptr.cpu().numpy()
    kv, qo = np.asarray(kv_lens), np.asarray(qo_indptr)
    if kv.ndim != 1 or kv.shape[0] < 1:
        raise ValueError(f"kv_lens must be 1-D with at least one sequence, got shape {kv.shape}")
    if qo.shape != (kv.shape[0] + 1,):
        raise ValueError(f"qo_indptr must have {kv.shape[0] + 1} entries, got shape {qo.shape}")
    for name, x in (("kv_lens", kv), ("qo_indptr", qo)):
        if x.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got {x.dtype}")
    return kv.astype(np.int64), qo.astype(np.int64)


def check_lengths(kv_lens_host, qo_indptr_host, info: VerifyInputs | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Content checks on host lengths: ``qo_indptr[0] = 0``, ``1 <= n_b <= 1024``,
    ``kv_len_b >= n_b``; with ``info`` (the sizes of the other tensors) also ``qo_indptr[-1] = T``,
    a mask wide enough for the largest tree, and ``kv_len_b <= max_pages * page_size``.

    Returns the lengths as int64 numpy arrays (see :func:`host_lengths`). Raises ``ValueError``.
    """
    kv, qo = host_lengths(kv_lens_host, qo_indptr_host)
    if qo[0] != 0 or (info is not None and qo[-1] != info.num_rows):
        want = "" if info is None else f" and end at T={info.num_rows}"
        raise ValueError(f"qo_indptr must start at 0{want}, got {int(qo[0])}..{int(qo[-1])}")
    n = qo[1:] - qo[:-1]
    if n.min() < 1:
        raise ValueError(f"qo_indptr gives a sequence with no tree node (n_b = {int(n.min())})")
    n_max = int(n.max())
    if n_max > MAX_TREE_NODES:
        raise ValueError(f"a tree has {n_max} nodes; at most {MAX_TREE_NODES} are supported")
    if kv.max() > MAX_KV_LEN:
        b = int(kv.argmax())
        raise ValueError(f"kv_lens[{b}]={int(kv[b])} is past the kernels' int32 positions (at most {MAX_KV_LEN})")
    short = kv < n
    if short.any():
        b = int(short.argmax())
        raise ValueError(f"kv_lens[{b}]={int(kv[b])} is shorter than its tree ({int(n[b])} nodes)")
    if info is not None:
        if n_max > 32 * info.mask_words:
            raise ValueError(
                f"tree_mask has {info.mask_words} words per row, too narrow for a tree of {n_max} nodes"
            )
        if kv.max() > info.max_pages * info.page_size:
            b = int(kv.argmax())
            raise ValueError(
                f"kv_lens[{b}]={int(kv[b])} exceeds page_table capacity "
                f"({info.max_pages} pages x {info.page_size})"
            )
    return kv, qo


def check_content(page_table, kv_lens, qo_indptr, tree_mask, info: VerifyInputs):
    """All content checks, on host copies (syncs when the tensors are on a GPU).

    Lengths as in :func:`check_lengths`; every page a sequence uses is in ``[0, num_pages)``; each
    node's own bit is set and no bit at or past ``n_b`` is set.
    """
    kv, qo = (torch.from_numpy(x) for x in check_lengths(kv_lens, qo_indptr, info))
    pt = page_table.cpu().to(torch.int64)
    used = (kv + info.page_size - 1) // info.page_size
    col = torch.arange(info.max_pages)
    in_use = col[None, :] < used[:, None]
    bad = in_use & ((pt < 0) | (pt >= info.num_pages))
    if bool(bad.any()):
        b, i = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"page_table[{b}, {i}]={int(pt[b, i])} is outside [0, {info.num_pages}) (num_pages of kv_cache)"
        )
    tm = tree_mask.cpu().to(torch.int64) & 0xFFFFFFFF
    n = qo[1:] - qo[:-1]
    seq = torch.repeat_interleave(torch.arange(info.num_seqs), n)
    node = torch.arange(info.num_rows) - qo[seq]
    own = (tm[torch.arange(info.num_rows), node // 32] >> (node % 32)) & 1
    if bool((own == 0).any()):
        t = int(torch.nonzero(own == 0)[0])
        raise ValueError(f"tree_mask row {t} does not set its own bit (node {int(node[t])})")
    bit = torch.arange(32 * info.mask_words)
    bits = (tm[:, bit // 32] >> (bit % 32)) & 1
    stray = (bits != 0) & (bit[None, :] >= n[seq][:, None])
    if bool(stray.any()):
        t = int(torch.nonzero(stray)[0, 0])
        raise ValueError(f"tree_mask row {t} sets a bit at or past its tree size n_b={int(n[seq[t]])}")
