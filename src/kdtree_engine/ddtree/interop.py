"""Interop with SGLang's EAGLE tree formats, so a server that builds EAGLE trees can call verify_attention.

Layouts (read from SGLang's ``eagle_utils`` / ``build_tree_kernel_efficient``; facts, not code):

* Every sequence of a batch has the same number of tree nodes ``n`` (``num_draft_tokens``,
  root included); node 0 is the root (the verified token) and a parent precedes its children.
* ``TreeMaskMode.FULL_MASK`` (0): one flat bool tensor; sequence b owns ``n * (P_b + n)`` entries
  starting at ``sum_{b' < b} n * (P_b' + n)``, row-major ``[n, P_b + n]``: columns ``0..P_b-1``
  are the prefix (True), column ``P_b + j`` is True iff node j is an ancestor of the row's node
  or the node itself.
* ``TreeMaskMode.QLEN_ONLY`` (1): flat bool ``[B * n * n]``, row-major ``[n, n]`` per sequence,
  the tree columns only.
* ``TreeMaskMode.QLEN_ONLY_BITPACKING`` (2): flat ``[B * n]``, one integer per row: uint8 for
  n <= 8, uint16 for n <= 16, uint32 for n <= 32 (larger n is not supported by SGLang); bit j
  (little endian) is tree column j.
* ``retrive_index [B, n]`` int64 = ``b * n + j``; ``retrive_next_token [B, n]`` int64 = the
  first (smallest-index) child, -1 if none; ``retrive_next_sibling [B, n]`` int64 = the next
  larger-index child of the same parent, -1 if none.
* ``positions [B * n]`` int64 = P_b + depth.
* EAGLE selection lists: ``selected_index [B, n-1]`` indexes the flattened draft score list of
  node j+1; ``s // topk`` indexes ``parent_list [B, topk*(depth-1)+1]``, whose entry is the score
  index of the parent (looked up in ``selected_index``), 0 meaning the root.
* Greedy verify output: ``accept_index [B, spec_steps+1]`` int32 of flat rows (``b * n + j``),
  root first, -1 padded; ``accept_length [B]`` int32 = accepted draft tokens (root excluded);
  ``predicts [B * n]`` int32, at each accepted row the target's next token.

This project's contract mask is ``[B * n, W]`` int32, bit ``j % 32`` of word ``j // 32``
(:mod:`kdtree_engine.masks`). Conversions go through a bool ``visible [B, n, n]`` relation.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from ..masks import check_words, host_ints, is_int, is_int_tensor, unpack_tree_mask
from .accept import AcceptResult
from .tree import DraftTree, _prefix_tensor, ancestor_words, tree_from_parents, tree_links

__all__ = [
    "TreeMaskMode",
    "tree_visible",
    "pack_visible",
    "unpack_visible",
    "to_sglang_tree_mask",
    "from_sglang_tree_mask",
    "sglang_mask_to_contract",
    "contract_to_sglang_mask",
    "parents_from_visible",
    "sglang_retrieve_arrays",
    "parents_from_sglang_retrieve",
    "parents_from_sglang_eagle",
    "to_sglang_verify_input",
    "tree_from_sglang",
    "accept_to_sglang",
]


class TreeMaskMode(IntEnum):
    """SGLang's tree mask modes (same values as ``sglang.srt.speculative.eagle_utils.TreeMaskMode``)."""

    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


_PACKED_DTYPES = ((8, torch.uint8), (16, torch.uint16), (32, torch.uint32))


def _mode(mode) -> TreeMaskMode:
    if is_int(mode) and int(mode) in (m.value for m in TreeMaskMode):  # (1.7 and "1" read as 1)
        return TreeMaskMode(int(mode))
    raise ValueError(f"mode must be a TreeMaskMode (0, 1 or 2), got {mode!r}")


def _packed_dtype(n: int) -> torch.dtype:
    for bits, dtype in _PACKED_DTYPES:
        if n <= bits:
            return dtype
    raise ValueError(f"QLEN_ONLY_BITPACKING holds at most 32 nodes per tree, got num_draft_tokens={n}")


def _host_lens(name: str, lens, batch: int | None) -> list[int]:
    if lens is None:
        raise ValueError(f"{name} is required for FULL_MASK (its rows include the prefix)")
    lens = host_ints(name, lens)  # a sync for a GPU tensor: FULL_MASK sizes depend on it
    if batch is not None and len(lens) != batch:
        raise ValueError(f"{name} has {len(lens)} entries for {batch} sequences")
    if any(x < 0 for x in lens):
        raise ValueError(f"{name} must be >= 0, got {lens}")
    if any(x >= 2**31 for x in lens):  # (the mask's size follows them to the allocator)
        raise ValueError(f"{name} must be < 2**31 (KV lengths are int32), got {lens}")
    return lens


# ----------------------------------------------------------------------------------------------
# visible relation <-> contract mask


def tree_visible(tree: DraftTree) -> torch.Tensor:
    """``[B, n, n]`` bool ancestor-or-self relation of the trees (padding rows/columns False)."""
    words = ancestor_words(tree)  # [B, n, W]
    B, n, W = words.shape
    return unpack_tree_mask(words.reshape(B * n, W), n).view(B, n, n)


def _check_visible(visible) -> tuple[int, int]:
    """``(B, n)`` of a bool ``[B, n, n]`` relation (``TypeError`` / ``ValueError``)."""
    if not isinstance(visible, torch.Tensor) or visible.dtype != torch.bool:
        raise TypeError("visible must be a bool torch.Tensor")
    if visible.dim() != 3 or visible.shape[1] != visible.shape[2]:
        raise ValueError(f"visible must be [B, n, n], got shape {tuple(visible.shape)}")
    return visible.shape[0], visible.shape[1]


def pack_visible(visible: torch.Tensor, words: int | None = None) -> torch.Tensor:
    """Bool ``[B, n, n]`` -> the contract's ``[B * n, W]`` int32 mask (each tree's own bit space)."""
    B, n = _check_visible(visible)
    W = check_words(words, n)
    bits = torch.zeros(B * n, W * 32, dtype=torch.int64, device=visible.device)
    bits[:, :n] = visible.reshape(B * n, n).to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=visible.device),
                                       torch.arange(32, device=visible.device))
    packed = (bits.view(B * n, W, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_visible(tree_mask: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """The contract's ``[B * n, W]`` int32 mask of uniform trees -> bool ``[B, n, n]``."""
    n = num_draft_tokens
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.int32 or tree_mask.dim() != 2:
        raise TypeError("tree_mask must be an int32 [B * n, W] tensor")
    if n < 1 or tree_mask.shape[0] % n:
        raise ValueError(f"tree_mask has {tree_mask.shape[0]} rows, not a multiple of num_draft_tokens={n}")
    return unpack_tree_mask(tree_mask, n).view(-1, n, n)


def parents_from_visible(visible: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` int64 parents from an ancestor-or-self relation (-1 where a row has no proper ancestor).

    The parent is the deepest proper ancestor (depth = number of ancestors); any node order.
    """
    B, n = _check_visible(visible)
    eye = torch.eye(n, dtype=torch.bool, device=visible.device)
    proper = visible & ~eye
    depth = proper.sum(-1)  # [B, n]
    score = torch.where(proper, depth[:, None, :], -1)  # [B, n(row), n(col)]
    best, parent = score.max(-1)
    return torch.where(best >= 0, parent, -1)


# ----------------------------------------------------------------------------------------------
# SGLang tree masks


def to_sglang_tree_mask(visible: torch.Tensor, mode, prefix_lens=None) -> torch.Tensor:
    """Bool ``[B, n, n]`` relation -> SGLang's flat tree mask of ``mode`` (see the module doc).

    ``prefix_lens`` (list or tensor, [B]) is needed for FULL_MASK only; a GPU tensor costs a sync.
    """
    mode = _mode(mode)
    B, n = _check_visible(visible)
    dev = visible.device
    if mode == TreeMaskMode.QLEN_ONLY:
        return visible.reshape(-1).clone()
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        dtype = _packed_dtype(n)
        w = torch.bitwise_left_shift(torch.ones(n, dtype=torch.int64, device=dev), torch.arange(n, device=dev))
        return (visible.reshape(B * n, n).to(torch.int64) * w).sum(-1).to(dtype)
    P = _host_lens("prefix_lens", prefix_lens, B)
    total = sum(n * (p + n) for p in P)
    out = torch.ones(total, dtype=torch.bool, device=dev)
    out[_full_mask_index(P, n, dev)] = visible
    return out


def _full_mask_index(P: list[int], n: int, device) -> torch.Tensor:
    """``[B, n, n]`` flat FULL_MASK positions of the tree columns."""
    Pt = torch.tensor(P, dtype=torch.int64).to(device)
    row_len = Pt + n
    off = torch.cumsum(n * row_len, 0) - n * row_len
    i = torch.arange(n, device=device)
    return off[:, None, None] + i[None, :, None] * row_len[:, None, None] + Pt[:, None, None] + i[None, None, :]


def from_sglang_tree_mask(
    tree_mask: torch.Tensor, mode, num_draft_tokens: int, prefix_lens=None, *, check_prefix: bool = False
) -> torch.Tensor:
    """SGLang's flat tree mask of ``mode`` -> bool ``[B, n, n]`` (n = ``num_draft_tokens``).

    FULL_MASK needs ``prefix_lens``; ``check_prefix=True`` also requires its prefix columns to be
    True (raises ``ValueError`` otherwise; a sync). A CPU QLEN_ONLY_BITPACKING mask with a bit at or
    past ``n`` set raises ``ValueError`` (a device one is not read).
    """
    mode = _mode(mode)
    n = num_draft_tokens
    if not is_int(n) or n < 1:
        raise ValueError(f"num_draft_tokens must be a positive int, got {n!r}")
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_mask must be a torch.Tensor, got {type(tree_mask).__name__}")
    flat = tree_mask.reshape(-1)
    dev = flat.device
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        dtype = _packed_dtype(n)
        if flat.dtype != dtype:
            raise TypeError(f"tree_mask must be {dtype} for {n} nodes in QLEN_ONLY_BITPACKING, got {flat.dtype}")
        if flat.numel() % n:
            raise ValueError(f"tree_mask has {flat.numel()} rows, not a multiple of num_draft_tokens={n}")
        v = flat.to(torch.int64)
        if dev.type == "cpu" and bool((v >> n).any()):  # (a device tensor is not read: a sync)
            raise ValueError(f"tree_mask has a row with a bit at or past num_draft_tokens={n} set")
        bit = torch.bitwise_and(torch.bitwise_right_shift(v[:, None], torch.arange(n, device=dev)), 1)
        return bit.bool().view(-1, n, n)
    if flat.dtype != torch.bool:
        raise TypeError(f"tree_mask must be torch.bool for {mode.name}, got {flat.dtype}")
    if mode == TreeMaskMode.QLEN_ONLY:
        if flat.numel() % (n * n):
            raise ValueError(f"tree_mask has {flat.numel()} entries, not a multiple of n*n={n * n}")
        return flat.view(-1, n, n).clone()
    P = _host_lens("prefix_lens", prefix_lens, None)
    total = sum(n * (p + n) for p in P)
    if flat.numel() != total:
        raise ValueError(f"tree_mask has {flat.numel()} entries; FULL_MASK with these prefix_lens needs {total}")
    if check_prefix and P and max(P) > 0:
        col_ok = torch.ones(total, dtype=torch.bool, device=dev)
        col_ok[_full_mask_index(P, n, dev)] = False  # only prefix columns remain
        if bool((~flat & col_ok).any()):
            raise ValueError("tree_mask has a False prefix column (FULL_MASK prefix must be visible)")
    return flat[_full_mask_index(P, n, dev)]


def sglang_mask_to_contract(
    tree_mask: torch.Tensor, mode, num_draft_tokens: int, prefix_lens=None, *, words: int | None = None
) -> torch.Tensor:
    """SGLang tree mask -> the ``tree_mask [B * n, W]`` int32 of :func:`kdtree_engine.verify_attention`."""
    return pack_visible(from_sglang_tree_mask(tree_mask, mode, num_draft_tokens, prefix_lens), words)


def contract_to_sglang_mask(tree_mask: torch.Tensor, num_draft_tokens: int, mode, prefix_lens=None) -> torch.Tensor:
    """The contract's ``[B * n, W]`` mask of uniform trees -> SGLang's flat mask of ``mode``."""
    return to_sglang_tree_mask(unpack_visible(tree_mask, num_draft_tokens), mode, prefix_lens)


# ----------------------------------------------------------------------------------------------
# retrieve arrays and parent lists


def sglang_retrieve_arrays(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(retrive_index, retrive_next_token, retrive_next_sibling)``, each ``[B, n]`` int64."""
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    B, n = tree.batch_size, tree.width
    first_child, next_sibling = tree_links(tree)
    index = torch.arange(B * n, device=tree.device).view(B, n)
    return index, first_child, next_sibling


def parents_from_sglang_retrieve(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` int64 parents from first-child / next-sibling arrays (node 0 = root, parent -1).

    Pointer jumping along sibling chains (``log2 n`` rounds); no host sync. Nodes reached by no
    link get -1. Entries are node indices or -1: checked on the CPU; on a GPU they are the
    caller's (not read: an index past ``n`` faults).
    """
    for name, t in (("next_token", next_token), ("next_sibling", next_sibling)):
        if not is_int_tensor(t) or t.dim() != 2:
            raise TypeError(f"{name} must be an integer [B, n] tensor")
        if t.device.type == "cpu" and bool(((t < -1) | (t >= t.shape[1])).any()):
            raise ValueError(f"{name} holds an index outside [-1, {t.shape[1]})")
    if next_token.shape != next_sibling.shape or next_token.device != next_sibling.device:
        raise ValueError("next_token and next_sibling must have the same shape and device")
    B, n = next_token.shape
    dev = next_token.device
    nt, ns = next_token.to(torch.int64), next_sibling.to(torch.int64)
    ar = torch.arange(n, device=dev).expand(B, n)
    par = torch.full((B, n + 1), -1, dtype=torch.int64, device=dev)
    par.scatter_(1, torch.where(nt >= 0, nt, n), torch.where(nt >= 0, ar, -1))
    prev = torch.full((B, n + 1), -1, dtype=torch.int64, device=dev)
    prev.scatter_(1, torch.where(ns >= 0, ns, n), torch.where(ns >= 0, ar, -1))
    par, prev = par[:, :n], prev[:, :n]
    head = torch.where(prev >= 0, prev, ar)
    for _ in range(max(n - 1, 0).bit_length()):
        head = head.gather(1, head)
    return par.gather(1, head)


def parents_from_sglang_eagle(parent_list: torch.Tensor, selected_index: torch.Tensor, topk: int) -> torch.Tensor:
    """``[B, n]`` int64 parents (n = selected + 1, root 0) from EAGLE's selection lists.

    ``selected_index [B, n-1]`` (score-list index of node j+1), ``parent_list [B, topk*(depth-1)+1]``.
    A node whose parent is not among the selected nodes gets -1 (SGLang drops it with a warning).
    ``selected_index`` entries must be in ``[0, topk * parent_list.shape[1])``: checked on the CPU;
    on a GPU they are the caller's (not read; clamped into that range). ``n - 1 = 0`` selected
    nodes give the root alone.
    """
    if not is_int(topk) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    for name, t in (("parent_list", parent_list), ("selected_index", selected_index)):
        if not is_int_tensor(t) or t.dim() != 2:
            raise TypeError(f"{name} must be an integer [B, *] tensor")
    if parent_list.shape[0] != selected_index.shape[0] or parent_list.device != selected_index.device:
        raise ValueError("parent_list and selected_index must have the same batch size and device")
    sel = selected_index.to(torch.int64)
    B, m = sel.shape
    dev = sel.device
    width = parent_list.shape[1]
    if dev.type == "cpu" and bool(((sel < 0) | (sel >= topk * width)).any()):
        raise ValueError(f"selected_index holds a score index outside [0, topk * {width}) (parent_list's columns)")
    root = torch.full((B, 1), -1, dtype=torch.int64, device=dev)
    if m == 0:
        return root
    ptb = sel // topk  # [B, m]
    if width == 0:
        ptok = torch.full_like(ptb, -1)
    else:
        ptok = parent_list.to(torch.int64).gather(1, ptb.clamp(0, width - 1))
    eq = sel[:, None, :] == ptok[:, :, None]  # [B, m(node), m(candidate parent)]
    found = eq.any(-1)
    pos = eq.to(torch.int8).argmax(-1) + 1
    body = torch.where(ptb == 0, 0, torch.where(found, pos, -1))
    return torch.cat([root, body], 1)


# ----------------------------------------------------------------------------------------------
# whole verify inputs / outputs


def to_sglang_verify_input(tree: DraftTree, prefix_lens, mode=TreeMaskMode.FULL_MASK) -> dict[str, torch.Tensor]:
    """A DDTree batch in SGLang's EAGLE verify layout.

    Returns a dict: ``draft_token [B*n]`` int64, ``positions [B*n]`` int64, ``tree_mask`` (mode's
    layout), ``retrive_index``, ``retrive_next_token``, ``retrive_next_sibling`` (``[B, n]`` int64).
    The trees must all have n nodes (DDTree batches do). ``prefix_lens``: ``[B]`` integers >= 0,
    host values or a tensor on any device (checked on the host; a GPU tensor's values are not
    read, except by FULL_MASK, whose size depends on them).
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    if not tree.uniform:
        raise ValueError("SGLang needs the same number of nodes in every tree of a batch")
    mode = _mode(mode)
    P = _prefix_tensor(prefix_lens, tree.batch_size, None)
    index, nxt, sib = sglang_retrieve_arrays(tree)
    return {
        "draft_token": tree.tokens.reshape(-1).clone(),
        "positions": (P.to(tree.device)[:, None] + tree.depths).reshape(-1),
        "tree_mask": to_sglang_tree_mask(tree_visible(tree), mode, prefix_lens if mode == 0 else None),
        "retrive_index": index,
        "retrive_next_token": nxt,
        "retrive_next_sibling": sib,
    }


def tree_from_sglang(
    draft_token: torch.Tensor,
    tree_mask: torch.Tensor,
    mode,
    num_draft_tokens: int,
    prefix_lens=None,
    *,
    max_depth: int | None = None,
) -> DraftTree:
    """A :class:`DraftTree` from SGLang's verify inputs (``draft_token [B*n]`` and its tree mask).

    ``max_depth`` (EAGLE's spec_steps) bounds the accepted path; default ``n - 1`` (no sync).
    On the CPU the mask is checked to be the ancestor-or-self relation of trees rooted at node 0
    and their depth to be at most ``max_depth`` (``ValueError``); on a GPU both are the caller's
    (not read: a sync; :func:`check_tree` verifies the tree): a mask that is not a tree, or a
    ``max_depth`` below the trees' depth, gives a wrong acceptance.
    """
    n = num_draft_tokens
    visible = from_sglang_tree_mask(tree_mask, mode, n, prefix_lens)
    B = visible.shape[0]
    if not isinstance(draft_token, torch.Tensor) or draft_token.numel() != B * n:
        raise ValueError(f"draft_token must hold B*n = {B * n} tokens")
    parents = parents_from_visible(visible)
    tree = tree_from_parents(parents, draft_token.reshape(B, n), max_depth=n - 1 if max_depth is None else max_depth)
    if visible.device.type == "cpu" and not torch.equal(tree_visible(tree), visible):  # (roots, cycles, depth: above)
        raise ValueError("tree_mask is not the ancestor-or-self relation of a tree")
    return tree


def accept_to_sglang(result: AcceptResult, num_draft_tokens: int) -> dict[str, torch.Tensor]:
    """An :class:`AcceptResult` in SGLang's verify output layout.

    Returns ``accept_index [B, D+1]`` int32 (flat rows ``b*n + j``, root first, -1 padded),
    ``accept_length [B]`` int32 (accepted drafts, root excluded), ``predicts [B*n]`` int32 (the
    target's next token at each accepted row, 0 elsewhere) and ``bonus [B]`` int64.
    ``num_draft_tokens`` must be the trees' node count (every accepted node below it): checked on
    the CPU; on a GPU the caller's (not read: a sync).
    """
    if not isinstance(result, AcceptResult):
        raise TypeError(f"result must be an AcceptResult, got {type(result).__name__}")
    if not is_int(num_draft_tokens) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be the trees' node count n (a positive int), got {num_draft_tokens!r}")
    n = int(num_draft_tokens)
    B = result.accepted.shape[0]
    dev = result.accepted.device
    if dev.type == "cpu" and bool((result.accepted >= n).any()):  # (rows of b would overlap b + 1's)
        raise ValueError(f"num_draft_tokens={n} is below an accepted node index {int(result.accepted.max())}")
    base = torch.arange(B, device=dev)[:, None] * n
    on = result.accepted >= 0
    index = torch.where(on, base + result.accepted, -1)
    predicts = torch.zeros(B * n + 1, dtype=torch.int64, device=dev)
    predicts.scatter_(0, torch.where(on, index, B * n).reshape(-1), torch.where(on, result.new_tokens, 0).reshape(-1))
    return {
        "accept_index": index.to(torch.int32),
        "accept_length": (result.lengths - 1).to(torch.int32),
        "predicts": predicts[: B * n].to(torch.int32),
        "bonus": result.bonus,
    }
