"""Bit-packed tree masks: the mask format of ``verify_attention``.

A draft tree of ``n`` nodes is described by a bool relation ``visible[i, j]`` ("node ``j`` is an
ancestor of node ``i`` or ``i`` itself"). The packed form is an int32 tensor ``[n, W]`` with
``W >= ceil(n / 32)``: bit ``j % 32`` of word ``j // 32`` of row ``i`` is ``visible[i, j]``; every
bit at or past ``n`` is zero. Words are stored as signed int32 (bit 31 set reads negative).

Node order inside a tree is free: nothing here assumes that a parent comes before its children.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "mask_words",
    "pack_tree_mask",
    "unpack_tree_mask",
    "ancestor_matrix",
    "tree_mask_from_parents",
    "concat_tree_masks",
]

MAX_TREE_NODES = 1024
MAX_MASK_WORDS = (MAX_TREE_NODES + 31) // 32  # a wider mask row is zero padding past the largest tree


def mask_words(n: int) -> int:
    """Number of int32 words a packed mask row of an ``n``-node tree needs."""
    return (n + 31) // 32


def pack_tree_mask(visible: torch.Tensor, words: int | None = None) -> torch.Tensor:
    """Pack a bool matrix ``visible [n, n]`` into the contract's int32 mask ``[n, words]``.

    ``words`` defaults to ``ceil(n / 32)``; a larger value pads with zero words (for batching
    trees of different sizes into one ``[T, W]`` tensor).
    """
    if not isinstance(visible, torch.Tensor):
        raise TypeError(f"visible must be a torch.Tensor, got {type(visible).__name__}")
    if visible.dim() != 2 or visible.shape[0] != visible.shape[1]:
        raise ValueError(f"visible must be a square [n, n] matrix, got shape {tuple(visible.shape)}")
    if visible.dtype != torch.bool:
        raise TypeError(f"visible must be torch.bool, got {visible.dtype}")
    n = visible.shape[0]
    words = check_words(words, n)
    bits = torch.zeros(n, words * 32, dtype=torch.int64, device=visible.device)
    bits[:, :n] = visible.to(torch.int64)
    weights = torch.bitwise_left_shift(
        torch.ones(32, dtype=torch.int64, device=visible.device),
        torch.arange(32, device=visible.device),
    )
    packed = (bits.view(n, words, 32) * weights).sum(-1)  # [n, words], values in [0, 2^32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def is_int_tensor(x) -> bool:
    """A tensor of an integer dtype (bool is not one)."""
    return isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def is_int(x) -> bool:
    """An integer that is not a bool (Python, numpy or a 0-d integer tensor): the check of every
    integer argument of the package's public functions."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and is_int_tensor(x)
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def host_ints(name: str, values) -> list[int]:
    """``values`` (a sequence, numpy array or 1-D tensor; a device tensor is copied, a sync) as a
    list of int64-range Python ints: the check of every host integer list of the package's public
    functions. ``TypeError`` naming ``name`` unless every entry is an integer (floats were
    truncated, bools read as 0 / 1), ``ValueError`` for one outside int64."""
    items = values.tolist() if isinstance(values, torch.Tensor) else values
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    items = list(items)
    if not all(is_int(x) for x in items):
        raise TypeError(f"{name} must hold integers, got {items}")
    items = [int(x) for x in items]
    if any(not -(2**63) <= x < 2**63 for x in items):
        raise ValueError(f"{name} holds a value outside int64, got {items}")
    return items


def check_words(words, n: int) -> int:
    """The mask width W for trees of ``n`` nodes: ``words`` (an int in ``[ceil(n / 32),
    MAX_MASK_WORDS]``), ``ceil(n / 32)`` when None."""
    need = mask_words(n)
    if words is None:
        return need
    if not is_int(words):
        raise TypeError(f"words must be an int, got {words!r}")
    words = int(words)
    if words < need:
        raise ValueError(f"words={words} is too narrow for trees of {n} nodes (needs {need})")
    if words > MAX_MASK_WORDS:
        raise ValueError(f"words={words} is wider than the {MAX_MASK_WORDS} words of a {MAX_TREE_NODES}-node tree")
    return words


def _check_mask(name: str, mask) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2 or mask.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 [R, W], got {mask.dtype} {tuple(mask.shape)}")


def unpack_tree_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: int32 ``[R, W]`` -> bool ``[R, n]`` (the first ``n`` bits)."""
    _check_mask("mask", mask)
    if not is_int(n) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    n = int(n)
    if n > mask.shape[1] * 32:
        raise ValueError(f"n={n} exceeds the {mask.shape[1] * 32} bits of the mask")
    j = torch.arange(n, device=mask.device)
    words = mask.to(torch.int64)[:, j // 32]
    return torch.bitwise_and(torch.bitwise_right_shift(words, j % 32), 1).bool()


def ancestor_matrix(parents: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Bool ``[n, n]``: entry ``[i, j]`` is True iff ``j`` is ``i`` or an ancestor of ``i``.

    ``parents[i]`` is the index of node ``i``'s parent, ``-1`` for the root. Exactly one root;
    any node order; cycles and out-of-range parents raise ``ValueError``.
    """
    par = torch.tensor(host_ints("parents", parents), dtype=torch.int64)  # (floats were truncated)
    n = par.numel()
    if n == 0:
        raise ValueError("parents must be a non-empty sequence")
    if n > MAX_TREE_NODES:
        raise ValueError(f"parents describes {n} nodes; at most {MAX_TREE_NODES} are supported")
    if bool(((par < -1) | (par >= n)).any()):
        raise ValueError("parents holds an index outside [-1, n)")
    if int((par == -1).sum()) != 1:
        raise ValueError(f"parents must have exactly one root (-1), found {int((par == -1).sum())}")
    visible = torch.eye(n, dtype=torch.bool)
    rows = torch.arange(n)
    cur = par.clone()
    for _ in range(n):
        alive = cur >= 0
        if not bool(alive.any()):
            return visible
        visible[rows[alive], cur[alive]] = True
        cur[alive] = par[cur[alive]]
    raise ValueError("parents contains a cycle")


def tree_mask_from_parents(
    parents: Sequence[int] | torch.Tensor, words: int | None = None
) -> torch.Tensor:
    """Packed int32 mask ``[n, words]`` of the tree given by a parent array (root's parent = -1)."""
    return pack_tree_mask(ancestor_matrix(parents), words)


def concat_tree_masks(masks: Sequence[torch.Tensor], words: int | None = None) -> torch.Tensor:
    """Stack per-tree packed masks ``[n_b, W_b]`` into one batch mask ``[sum n_b, W]``.

    ``W`` defaults to the widest input; narrower rows are zero-padded.
    """
    if len(masks) == 0:
        raise ValueError("masks must hold at least one tree")
    for b, m in enumerate(masks):
        _check_mask(f"masks[{b}]", m)
    width = max(m.shape[1] for m in masks) if words is None else check_words(words, 0)
    rows = []
    for m in masks:
        if m.shape[1] > width:
            raise ValueError(f"a mask of width {m.shape[1]} does not fit words={width}")
        rows.append(torch.nn.functional.pad(m, (0, width - m.shape[1])))
    return torch.cat(rows, 0)
