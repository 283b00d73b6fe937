"""Public entry point of tree-verify MLA attention: the contract, its input checks and dispatch.

The contract (other modules and outside callers use exactly this)::

    out, lse = verify_attention(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask,
                                sm_scale=None, *, kernel="auto", out=None, lse=None)

See :func:`verify_attention` for shapes. The kernels live beside this file: ``naive.py`` (the
oracle), ``flash.py`` (split-KV, heads and tree nodes packed against one read of the KV), and
``reference.py`` (float64, any device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backend import interpreting
from ..masks import MAX_TREE_NODES

D_QK = 576  # 512 latent (c_kv) + 64 rope (k_pe)
D_V = 512  # V is the latent part of the same cache row
D_ROPE = D_QK - D_V
MAX_HEADS = 128
KERNELS = ("naive", "flash")

__all__ = ["verify_attention", "VerifyInputs", "check_inputs", "D_QK", "D_V", "D_ROPE", "KERNELS"]


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


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[first, last)`` that a tensor's elements occupy."""
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _check_writable(name, t, inputs):
    """An output must not write one element twice (zero or interleaved strides) nor into an input."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    reach = 1  # elements covered by the inner dims so far
    for st, n in dims:
        if st < reach:
            raise ValueError(
                f"{name} has overlapping strides {tuple(t.stride())} for shape {tuple(t.shape)}: "
                f"an output must give every element its own memory"
            )
        reach = st * (n - 1) + reach
    lo, hi = _span(t)
    for other_name, other in inputs:
        if other is not None and other.numel() > 0:
            o_lo, o_hi = _span(other)
            if lo < o_hi and o_lo < hi:
                raise ValueError(f"{name} overlaps {other_name} in memory; pass a separate buffer")


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
    inputs = [("q", q), ("kv_cache", kv_cache), ("page_table", page_table), ("kv_lens", kv_lens),
              ("qo_indptr", qo_indptr), ("tree_mask", tree_mask)]
    if out is not None:
        _check_tensor("out", out, dim=3, dtype=q.dtype, device=dev, last=D_V)
        if tuple(out.shape[:2]) != (T, H):
            raise ValueError(f"out must have shape {(T, H, D_V)}, got {tuple(out.shape)}")
        _check_writable("out", out, inputs)
    if lse is not None:
        _check_tensor("lse", lse, dim=2, dtype=torch.float32, device=dev)
        if tuple(lse.shape) != (T, H):
            raise ValueError(f"lse must have shape {(T, H)}, got {tuple(lse.shape)}")
        _check_writable("lse", lse, inputs + [("out", out)])
    return VerifyInputs(
        num_rows=T,
        num_heads=H,
        num_seqs=B,
        num_pages=kv_cache.shape[0],
        page_size=kv_cache.shape[1],
        max_pages=page_table.shape[1],
        mask_words=tree_mask.shape[1],
    )


def check_lengths(kv_lens_host, qo_indptr_host, info: VerifyInputs):
    """Content checks on host copies of the lengths: n_b >= 1, kv_len_b >= n_b, fits the table."""
    kv = torch.as_tensor(kv_lens_host, dtype=torch.int64).cpu()
    qo = torch.as_tensor(qo_indptr_host, dtype=torch.int64).cpu()
    if int(qo[0]) != 0 or int(qo[-1]) != info.num_rows:
        raise ValueError(
            f"qo_indptr must start at 0 and end at T={info.num_rows}, got {int(qo[0])}..{int(qo[-1])}"
        )
    n = qo[1:] - qo[:-1]
    if bool((n < 1).any()):
        raise ValueError(f"qo_indptr gives a sequence with no tree node (n_b = {int(n.min())})")
    if int(n.max()) > MAX_TREE_NODES:
        raise ValueError(f"a tree has {int(n.max())} nodes; at most {MAX_TREE_NODES} are supported")
    if int(n.max()) > 32 * info.mask_words:
        raise ValueError(
            f"tree_mask has {info.mask_words} words per row, too narrow for a tree of {int(n.max())} nodes"
        )
    if bool((kv < n).any()):
        b = int(torch.nonzero(kv < n)[0])
        raise ValueError(f"kv_lens[{b}]={int(kv[b])} is shorter than its tree ({int(n[b])} nodes)")
    if int(kv.max()) > info.max_pages * info.page_size:
        b = int(kv.argmax())
        raise ValueError(
            f"kv_lens[{b}]={int(kv[b])} exceeds page_table capacity "
            f"({info.max_pages} pages x {info.page_size})"
        )


def check_content(page_table, kv_lens, qo_indptr, tree_mask, info: VerifyInputs):
    """All content checks, on host copies (syncs when the tensors are on a GPU).

    Lengths as in :func:`check_lengths`; every page a sequence uses is in ``[0, num_pages)``; each
    node's own bit is set and no bit at or past ``n_b`` is set.
    """
    kv = kv_lens.cpu().to(torch.int64)
    qo = qo_indptr.cpu().to(torch.int64)
    check_lengths(kv, qo, info)
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


def verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float | None = None,
    *,
    kernel: str = "auto",
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    plan=None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-verify attention for MLA (absorbed form: one latent KV head shared by all heads).

    Args:
        q: ``[T, H, 576]`` bf16 or fp16; T = all tree nodes of the batch, H in 1..128. Any strides
            with the last dimension contiguous. Columns 0..511 multiply the latent ``c_kv``,
            512..575 the rope part ``k_pe``.
        kv_cache: ``[num_pages, page_size, 576]``, q's dtype. V is ``kv_cache[..., :512]`` (the same
            rows; it is read once, never copied).
        page_table: ``[B, max_pages]`` int32; ``page_table[b, i]`` holds positions
            ``i*page_size .. (i+1)*page_size-1`` of sequence b. Entries past the pages a sequence
            uses are never read.
        kv_lens: ``[B]`` int32; KV length of sequence b = prefix P_b + its n_b tree nodes. Tree node
            j of sequence b is at position ``P_b + j`` (its KV is already in the cache).
        qo_indptr: ``[B+1]`` int32; the tree nodes of sequence b are q rows
            ``qo_indptr[b]:qo_indptr[b+1]`` (n_b >= 1, n_b <= 1024).
        tree_mask: ``[T, W]`` int32, ``W >= ceil(max n_b / 32)``: bit ``j % 32`` of word ``j // 32``
            of row t is set iff node j of t's tree is visible to t (an ancestor or itself); bits at
            or past n_b are zero. Prefix positions are visible to every node. Node order is free.
            Build it with :mod:`kdtree_engine.masks`.
        sm_scale: softmax scale; default ``1/sqrt(576)``.
        kernel: ``"naive"`` (the oracle), ``"flash"`` or ``"auto"`` (flash).
        out: optional ``[T, H, 512]`` output buffer in q's dtype (last dim contiguous), written
            through its strides; it must not overlap itself or an input.
        lse: optional ``[T, H]`` float32 buffer, any non-overlapping strides.

    Every stride of page_table, kv_lens, qo_indptr and tree_mask is honoured (slices, transposes,
    broadcasts); q and kv_cache need only their last dimension contiguous.
        plan: optional :class:`kdtree_engine.verify.flash.VerifyPlan` from
            :func:`~kdtree_engine.verify.flash.plan_verify`, built once per model step from host
            lengths and reused by every layer; with it the flash launch has no host sync and can
            be captured in a CUDA graph. Without it one is built here from a host copy of the
            lengths (one device sync), and the length checks run on that copy.
        validate: content checks (page ids in range, kv_len >= n_b, self bit set, no stray bits).
            ``None`` (default): run the checks that cost no device sync, i.e. all of them for CPU
            tensors, the length checks (incl. mask width) when the flash path has host lengths.
            The naive kernel on a GPU without validation never reads past the mask's W words, but
            a too-narrow mask then hides nodes instead of raising. ``True``: all checks,
            syncing if needed. ``False``: none. Shape, dtype and device checks always run.

    Returns:
        ``(out, lse)``: out ``[T, H, 512]`` in q's dtype; lse ``[T, H]`` float32, the natural-log
        sum of exp of the scaled scores over the visible keys. A row with no visible key (only
        possible with a malformed mask) gets out = 0 and lse = -inf.
    """
    info = check_inputs(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
    if kernel not in ("auto",) + KERNELS:
        raise ValueError(f"kernel must be one of 'auto', 'naive', 'flash'; got {kernel!r}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D_QK)
    elif not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
    if q.device.type == "cpu" and not interpreting():
        raise ValueError(
            "q is on the CPU: the Triton kernels run there only under the interpreter; "
            "set TRITON_INTERPRET=1 before importing triton (or use kdtree_engine.reference)"
        )
    if kernel != "naive" and plan is None:
        # the flash kernel plans from host lengths: copy them once (the one sync of an unplanned call)
        from .flash import plan_verify

        plan = plan_verify(kv_lens.cpu(), qo_indptr.cpu(), info.num_heads, q.device)
    if validate is None:
        validate = q.device.type == "cpu"
        if not validate and plan is not None:
            check_lengths(plan.kv_lens_host, plan.qo_indptr_host, info)
    if validate:
        check_content(page_table, kv_lens, qo_indptr, tree_mask, info)
    if out is None:
        out = torch.empty(info.num_rows, info.num_heads, D_V, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(info.num_rows, info.num_heads, dtype=torch.float32, device=q.device)
    if kernel == "naive":
        from .naive import verify_attention_naive

        verify_attention_naive(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse)
    else:
        from .flash import verify_attention_flash

        verify_attention_flash(
            q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan=plan
        )
    return out, lse
