"""DDTree draft trees: best-first construction from per-position draft logits, and compilation for verify.

DDTree (arXiv 2604.12989) turns the per-position distributions of a block drafter (draft logits
``[L, V]`` for the next ``L`` positions) into a draft tree under a node budget, by best-first
expansion on the cumulative log-probability of a path. This module builds the trees of a batch
on the device (Triton kernels of :mod:`.kernels`; no host sync, static shapes), keeps a deliberately simple
heap reference beside it, and compiles a tree into the tensors of
:func:`kdtree_engine.verify_attention`.

Conventions (all functions of :mod:`kdtree_engine.ddtree` share them):

* **Node 0 is the root**: the bonus token of the previous step, depth 0. Draft nodes are numbered
  ``1..n-1`` in emission order (the heap's pop order); a parent is always emitted before its
  children, and the children of a node are emitted in rank order (best first).
* **budget = number of draft nodes, root excluded** (as in the paper's code). A tree has
  ``1 + min(budget, #possible nodes)`` nodes, e.g. budget 32 -> 33 verify rows.
* **K = min(topk or budget, V)** tokens per position: the K first by logit (descending), then
  token id (ascending), in that order; of several tokens tied at the K-th logit the lowest ids enter.
* **Scores are fixed point**: ``lp[d, r] = round(2**20 * max(log_softmax(draft_logits[d])[tok], -1000))``
  as int64 (units of 2^-20 nats); a node's score is the exact integer sum of ``lp`` along its path.
  Integer scores make ties exact and the order independent of summation order and device.
* **Order / tie-break**: nodes are emitted by score (descending); ties go to the shallower node,
  then to the node whose parent was emitted first, then to the lower rank. As a heap key:
  ``(-score, depth, parent's node index, rank)``. The heap pops in exactly this order because a
  child's and a next sibling's keys are larger than the key of the node that pushed them.
* The batch is padded: tensors are ``[B, n]``; all trees built by :func:`build_ddtree` have the
  same size; trees from elsewhere (:func:`tree_from_parents`) may be ragged, padding entries are -1.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..backend import interpreting
from ..masks import MAX_TREE_NODES, check_words, host_ints, is_int, is_int_tensor
from .kernels import _bits, expand, topk_logprobs

__all__ = [
    "LOGPROB_SCALE",
    "LOGPROB_FLOOR",
    "DraftTopK",
    "DraftTree",
    "VerifyBatch",
    "draft_topk",
    "expand_topk",
    "expand_topk_reference",
    "build_ddtree",
    "build_ddtree_reference",
    "tree_from_parents",
    "tree_links",
    "ancestor_words",
    "compile_tree",
    "check_tree",
]

LOGPROB_SCALE = 2**20  # fixed-point units per nat
LOGPROB_FLOOR = -1000.0  # log-probs below this are clamped (keeps every score inside int64 keys)
MAX_BUDGET = MAX_TREE_NODES - 1  # draft nodes; the root makes MAX_TREE_NODES


# ----------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class DraftTopK:
    """The K best draft tokens per position, the only input of the expansion.

    token_ids: ``[B, L, K]`` int64, ordered by draft logit (descending), then token id (ascending).
    logprobs:  ``[B, L, K]`` int64 fixed-point log-probabilities (see :data:`LOGPROB_SCALE`),
               non-increasing along K.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, padded to ``[B, n]`` (node 0 = root, entries past ``num_nodes`` = -1).

    tokens:  ``[B, n]`` int64; token of each node (root = last step's bonus token).
    parents: ``[B, n]`` int64; parent node index, -1 for the root and for padding.
    depths:  ``[B, n]`` int64; 0 for the root, -1 for padding.
    num_nodes: ``[B]`` int64 on the device; ``num_nodes_host`` the same as host ints.
    max_depth: host int, an upper bound of every depth (the accepted path has <= max_depth+1 nodes).
    ranks:  ``[B, n]`` int64 or None; a draft node's rank among the K tokens of its depth (root -1).
    scores: ``[B, n]`` int64 or None; cumulative fixed-point log-probability (root 0).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    num_nodes: torch.Tensor
    num_nodes_host: tuple[int, ...]
    max_depth: int
    ranks: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """n, the padded number of nodes per tree."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def uniform(self) -> bool:
        """True when every tree has ``width`` nodes (no padding)."""
        return all(k == self.width for k in self.num_nodes_host)

    def node_mask(self) -> torch.Tensor:
        """``[B, n]`` bool, True on real nodes."""
        ar = torch.arange(self.width, device=self.device)
        return ar[None, :] < self.num_nodes[:, None]


@dataclass(frozen=True)
class VerifyBatch:
    """A compiled batch of trees: the tree-shaped inputs of :func:`kdtree_engine.verify_attention`
    and of the model. Where the KV lives (slots, page table, ``kv_lens = P_b + n_b``) is the KV
    pool's: :meth:`kdtree_engine.kvpool.KVPool.reserve_step` joins both into one
    :class:`~kdtree_engine.kvpool.VerifyStep`.

    Rows: tree node j of sequence b is flat row ``qo_indptr[b] + j`` (T = num_rows rows in all).

    num_rows:     T, a host int.
    input_ids:    ``[T]`` int64, node tokens (the q rows of the verify forward).
    positions:    ``[T]`` int64, RoPE position = prefix_len + depth.
    qo_indptr:    ``[B+1]`` int32.
    tree_mask:    ``[T, W]`` int32, the contract's bit-packed ancestor-or-self mask.
    kv_positions: ``[T]`` int64, cache position of each node's KV = prefix_len + j (the contract
                  places tree node j at position P_b + j).
    row_index:    ``[B, n]`` int64, flat row of (b, j); -1 on padding.
    first_child:  ``[B, n]`` int64, smallest-index child (local index), -1 if none.
    next_sibling: ``[B, n]`` int64, next sibling in index order (local index), -1 if none.
    """

    num_rows: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    qo_indptr: torch.Tensor
    tree_mask: torch.Tensor
    kv_positions: torch.Tensor
    row_index: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor


# ----------------------------------------------------------------------------------------------
# argument checks


def _check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


def _check_logits(name: str, logits) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() == 2:
        logits = logits.unsqueeze(0)
    if logits.dim() != 3:
        raise ValueError(f"{name} must be [L, V] or [B, L, V], got shape {tuple(logits.shape)}")
    if logits.shape[0] < 1 or logits.shape[2] < 1:
        raise ValueError(f"{name} needs at least one sequence and one vocabulary entry, got {tuple(logits.shape)}")
    return logits


def _check_roots(root_tokens, batch: int, device: torch.device) -> torch.Tensor:
    if isinstance(root_tokens, (list, tuple)):
        root_tokens = torch.tensor(host_ints("root_tokens", root_tokens), dtype=torch.int64, device=device)
    if not isinstance(root_tokens, torch.Tensor):
        raise TypeError(f"root_tokens must be a torch.Tensor or a list of ints, got {type(root_tokens).__name__}")
    if not is_int_tensor(root_tokens):
        raise TypeError(f"root_tokens must be an integer tensor, got {root_tokens.dtype}")
    if root_tokens.dim() != 1 or root_tokens.shape[0] != batch:
        raise ValueError(f"root_tokens must have shape [{batch}], got {tuple(root_tokens.shape)}")
    if root_tokens.device != device:
        raise ValueError(f"root_tokens is on {root_tokens.device}, expected {device} (the device of the logits)")
    return root_tokens.to(torch.int64)


# ----------------------------------------------------------------------------------------------
# top-K on the device


def draft_topk(draft_logits: torch.Tensor, k: int) -> DraftTopK:
    """The ``k`` best tokens per position with fixed-point log-probabilities, on the logits' device.

    Args:
        draft_logits: ``[B, L, V]`` (or ``[L, V]`` for one sequence), any float dtype, any
            strides (a row not contiguous in V is copied first, so every layout gives the same bits).
        k: 1 <= k <= V.

    Returns a :class:`DraftTopK` (``[B, L, k]``): the ``k`` first tokens by logit (descending),
    then token id (ascending), so ties at the k-th logit go to the lowest ids; no host sync. On
    CUDA (and on the CPU under Triton's interpreter) the split top-K, two kernels on the logits
    as they are (:func:`kernels.topk_logprobs`: slices of each row, then a merge per row);
    otherwise tensor ops on a float32 copy. Both give the same ids (tested).
    """
    logits = _check_logits("draft_logits", draft_logits)
    B, L, V = logits.shape
    _check_int("k", k, 1, V)
    if logits.device.type == "cuda" or interpreting():
        rows = logits.reshape(B * L, V)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        lp, ids = topk_logprobs(rows, k, LOGPROB_SCALE, LOGPROB_FLOOR)  # [B*L, k]
        return DraftTopK(token_ids=ids.view(B, L, k), logprobs=lp.view(B, L, k))
    return _draft_topk_torch(logits, k)


def _draft_topk_torch(logits: torch.Tensor, k: int) -> DraftTopK:
    """:func:`draft_topk` with tensor ops (``logits [B, L, V]``), for the CPU without the
    interpreter: one top-k of distinct int64 keys ``order key << 32 | (V - 1 - id)`` (the order key
    increases with the float32 logit, -0.0 folded onto +0.0) gives the kernel's order and ties."""
    x = logits.float().contiguous()  # one reduction order for every layout
    V = x.shape[-1]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [B, L, 1]
    bits = (x + 0.0).view(torch.int32)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64) << 32
    key |= torch.arange(V - 1, -1, -1, device=x.device)
    ids = (V - 1) - (key.topk(k, dim=-1).values & 0xFFFFFFFF)  # [B, L, k]
    vals = x.gather(-1, ids)
    lp = (vals - lse).clamp_(min=LOGPROB_FLOOR).double().mul_(LOGPROB_SCALE).round_().to(torch.int64)
    return DraftTopK(token_ids=ids, logprobs=lp)


def _resolve_k(budget: int, vocab: int, topk: int | None) -> int:
    if topk is not None:
        _check_int("topk", topk, 1)
        return min(topk, budget, vocab)
    return min(budget, vocab)


# ----------------------------------------------------------------------------------------------
# vectorised best-first expansion


def _pair_counts(num_parents: int, k: int, budget: int) -> list[int]:
    """Candidate children of each parent slot ``i < num_parents``: ranks r with ``(i+1)(r+1) <= budget``."""
    return [min(k, budget // (i + 1)) for i in range(num_parents)]


def _kept_counts(k: int, depth_cap: int, budget: int) -> list[int]:
    """Nodes each depth can keep: ``min(budget, its candidates)``, the parents being the depth above's."""
    kept, n_par = [], 1
    for _ in range(depth_cap):
        kept.append(min(budget, sum(_pair_counts(n_par, k, budget))))
        n_par = kept[-1]
    return kept


@lru_cache(maxsize=256)
def _pairs(num_parents: int, k: int, budget: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate (parent slot i, rank r) pairs of one depth with ``(i+1)(r+1) <= budget``.

    Parent slots are in key order, so ``(i+1)(r+1)`` nodes of the depth have a key <= that of
    (i, r): a pair past the bound can not be among the ``budget`` best of its depth.
    """
    dev = torch.device(device)
    i = torch.arange(num_parents, device=dev)
    counts = torch.clamp(budget // (i + 1), max=k)
    total = sum(_pair_counts(num_parents, k, budget))
    pi = torch.repeat_interleave(i, counts, output_size=total)
    starts = torch.cumsum(counts, 0) - counts
    pr = torch.arange(total, device=dev) - starts[pi]
    return pi, pr


@lru_cache(maxsize=256)
def _plan(k: int, depth_cap: int, budget: int, device: str):
    """Static layout of one expansion: per-depth pair lists and kept counts, and the columns
    (depth, slot within its depth, offset of the parent depth) of the concatenated kept nodes."""
    dev = torch.device(device)
    kept = _kept_counts(k, depth_cap, budget)
    pairs = [_pairs(n_par, k, budget, device) for n_par in [1] + kept[:-1]]
    depth_col = torch.cat([torch.full((m,), d + 1, dtype=torch.int64, device=dev) for d, m in enumerate(kept)])
    slot_col = torch.cat([torch.arange(m, device=dev) for m in kept])
    offsets = [0]
    for m in kept:
        offsets.append(offsets[-1] + m)
    parent_base = torch.cat(
        [torch.full((m,), offsets[d - 1] if d > 0 else -1, dtype=torch.int64, device=dev) for d, m in enumerate(kept)]
    )
    slot_k = [torch.arange(m, device=dev) * k for m in kept]
    return pairs, kept, depth_col, slot_col, parent_base, slot_k


@lru_cache(maxsize=256)
def _pair_table(k: int, budget: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The expansion kernel's candidate table: ``pairs`` (``parent slot * K + rank`` of every pair
    of :func:`_pairs` with up to ``budget`` parents, by slot then rank) and ``pair_end``
    (``[budget + 1]`` int64, the number of pairs of the slots below each)."""
    pi, pr = _pairs(budget, k, budget, device)
    pair_end = torch.tensor([0] + _pair_counts(budget, k, budget), dtype=torch.int64).cumsum(0).to(torch.device(device))
    return pi * k + pr, pair_end


def expand_topk(top: DraftTopK, budget: int, root_tokens: torch.Tensor) -> DraftTree:
    """Best-first DDTree expansion of a batch on the top-K's device (no host sync).

    Equivalent to :func:`expand_topk_reference` (same nodes, same order, same parents). Per depth d
    it keeps the ``budget`` best nodes of that depth (the global ``budget`` best are among them,
    since a node's parent beats it), choosing among the children of the previous depth's kept
    nodes that can still rank; the kept nodes of all depths are then merged by the global key.
    A node's whole within-depth key is one int64, ``(-score) << S | parent_slot * K + rank``.
    On CUDA (and on the CPU under Triton's interpreter) one kernel launch, one program per
    sequence: per depth a gather, an add and a sort of the candidate keys, then one sort for the
    merge; otherwise tensor ops (``6 L + 15`` launches). Shapes are static for given
    (B, L, K, budget), no host sync: the function can be captured in a CUDA graph.

    Args:
        top: from :func:`draft_topk`, ``[B, L, K]``; its log-probs in
            ``[round(LOGPROB_FLOOR * LOGPROB_SCALE), 0]``, non-increasing along K: checked on
            the CPU, the caller's on a GPU (not read: a sync).
        budget: number of draft nodes (root excluded), 0..1023.
        root_tokens: ``[B]`` integer tensor on the same device.
    """
    return _expand(*_check_topk(top), budget, root_tokens)


def _check_topk(top) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, token_ids)`` of a :class:`DraftTopK` as int64 ``[B, L, K]`` (``TypeError`` /
    ``ValueError``); on the CPU (no sync) also the log-probs :func:`draft_topk` makes: in
    ``[round(LOGPROB_FLOOR * LOGPROB_SCALE), 0]`` (keeps the int64 keys apart) and non-increasing
    along K (the expansion's order relies on it)."""
    if not isinstance(top, DraftTopK):
        raise TypeError(f"top must be a DraftTopK, got {type(top).__name__}")
    lp, ids = top.logprobs, top.token_ids
    for name, t in (("top.logprobs", lp), ("top.token_ids", ids)):
        if not is_int_tensor(t) or t.dim() != 3:
            shown = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an integer [B, L, K] tensor, got {shown}")
    if lp.shape != ids.shape or lp.device != ids.device:
        raise ValueError(f"top.logprobs and top.token_ids must have the same shape and device, got "
                         f"{tuple(lp.shape)} on {lp.device} and {tuple(ids.shape)} on {ids.device}")
    if lp.shape[0] < 1:
        raise ValueError(f"top needs at least one sequence, got shape {tuple(lp.shape)}")
    if lp.device.type == "cpu":
        floor = round(LOGPROB_FLOOR * LOGPROB_SCALE)
        if bool(((lp > 0) | (lp < floor)).any()) or bool((lp[..., 1:] > lp[..., :-1]).any()):
            raise ValueError(f"top.logprobs must be fixed-point log-probabilities in [{floor}, 0], non-increasing "
                             "along K (as draft_topk makes them)")
    return lp.to(torch.int64), ids.to(torch.int64)


def _expand(lp: torch.Tensor, ids: torch.Tensor, budget: int, root_tokens) -> DraftTree:
    """:func:`expand_topk` of checked int64 ``lp, ids [B, L, K]``."""
    _check_int("budget", budget, 0, MAX_BUDGET)
    B, L, K = lp.shape
    dev = lp.device
    roots = _check_roots(root_tokens, B, dev)
    depth_cap = min(L, budget) if K > 0 else 0
    if depth_cap == 0:
        return _root_only(roots)
    if dev.type == "cuda" or interpreting():
        pairs, pair_end = _pair_table(K, budget, str(dev))
        total = sum(_kept_counts(K, depth_cap, budget))  # nodes the per-depth lists can hold
        tokens, parents, depths, ranks, scores, num_nodes = expand(
            lp.contiguous(), ids.contiguous(), roots.contiguous(), pairs, pair_end,
            budget, depth_cap, min(budget, total),
        )
        n = tokens.shape[1]
        return DraftTree(
            tokens=tokens,
            parents=parents,
            depths=depths,
            num_nodes=num_nodes,
            num_nodes_host=(n,) * B,
            max_depth=depth_cap,
            ranks=ranks,
            scores=scores,
        )
    return _expand_topk_torch(lp, ids, roots, budget, depth_cap)


def _expand_topk_torch(lp, ids, roots, budget: int, depth_cap: int) -> DraftTree:
    """:func:`expand_topk` with tensor ops (about ``6 L + 15`` launches), for the CPU without the
    interpreter; the kernel computes the same keys and sorts."""
    B, L, K = lp.shape
    dev = lp.device
    pairs, kept, depth_col, slot_col, parent_base, slot_k = _plan(K, depth_cap, budget, str(dev))

    # within-depth key: (-score) << S | sec, sec = parent slot * K + rank < budget * K <= 2**S;
    # -score < depth * 1000 * 2**20 < 2**40, so keys stay below 2**60
    S = _bits(budget * K)
    low = (1 << S) - 1
    child = torch.bitwise_left_shift(-lp, S) + torch.arange(K, device=dev)  # [B, L, K]
    par = torch.zeros(B, 1, dtype=torch.int64, device=dev)  # the root: score 0, slot 0
    sel = []
    for d in range(depth_cap):
        pi, pr = pairs[d]
        key = par.index_select(1, pi) + child[:, d].index_select(1, pr)  # [B, C], unique per row
        M = kept[d]
        key = key.topk(M, dim=1, largest=False, sorted=True).values if M < key.shape[1] else key.sort(dim=1).values
        sel.append(key)
        par = (key & ~low) + slot_k[d]  # next depth's parent part: score bits + slot * K

    keys = torch.cat(sel, 1)  # [B, total], each depth in key order
    total = keys.shape[1]
    neg = torch.bitwise_right_shift(keys, S)  # -score
    sec = keys & low
    slot_bits, depth_bits = _bits(budget), _bits(depth_cap)
    merged = torch.bitwise_left_shift(neg, slot_bits + depth_bits) | (depth_col << slot_bits) | slot_col
    n_draft = min(budget, total)
    if n_draft < total:
        order = merged.topk(n_draft, dim=1, largest=False, sorted=True).indices
    else:
        order = merged.sort(dim=1).indices
    emit = torch.full((B, total), -1, dtype=torch.int64, device=dev)
    emit.scatter_(1, order, torch.arange(1, n_draft + 1, device=dev).expand(B, n_draft))
    depth = depth_col[order]  # [B, n_draft]
    rank = (sec % K).gather(1, order)
    parent_cand = parent_base[order] + (sec // K).gather(1, order)
    parents = torch.where(depth > 1, emit.gather(1, parent_cand.clamp(min=0)), 0)
    tokens = ids.reshape(B, L * K).gather(1, (depth - 1) * K + rank)
    head = torch.zeros(B, 1, dtype=torch.int64, device=dev)
    n = n_draft + 1
    return DraftTree(
        tokens=torch.cat([roots[:, None], tokens], 1),
        parents=torch.cat([head - 1, parents], 1),
        depths=torch.cat([head, depth], 1),
        num_nodes=torch.full((B,), n, dtype=torch.int64, device=dev),
        num_nodes_host=(n,) * B,
        max_depth=depth_cap,
        ranks=torch.cat([head - 1, rank], 1),
        scores=torch.cat([head, -neg.gather(1, order)], 1),
    )


def _root_only(roots: torch.Tensor) -> DraftTree:
    """One-node trees of the ``[B]`` int64 roots, in four device ops (a plain decoding step's tree)."""
    B = roots.shape[0]
    dev = roots.device
    neg = torch.full((2, B, 1), -1, dtype=torch.int64, device=dev)  # parents, ranks
    zero = torch.zeros(2, B, 1, dtype=torch.int64, device=dev)  # depths, scores
    return DraftTree(
        tokens=roots[:, None].clone(),
        parents=neg[0],
        depths=zero[0],
        num_nodes=torch.ones(B, dtype=torch.int64, device=dev),
        num_nodes_host=(1,) * B,
        max_depth=0,
        ranks=neg[1],
        scores=zero[1],
    )


# ----------------------------------------------------------------------------------------------
# the reference: a heap per sequence on the host


def expand_topk_reference(top: DraftTopK, budget: int, root_tokens: torch.Tensor) -> DraftTree:
    """The DDTree heap, literally: one Python heap per sequence on the host.

    One device->host copy of the top-K for the whole batch, then per sequence: the heap starts with
    (depth 1, rank 0); popping a node emits it and pushes its next sibling (same parent, rank+1)
    and its first child (depth+1, rank 0) while depth < L; stop after ``budget`` pops. Heap key =
    (-score, depth, parent's node index, rank). The result is moved back to the top-K's device.
    """
    lp, ids = _check_topk(top)
    _check_int("budget", budget, 0, MAX_BUDGET)
    B, L, K = lp.shape
    dev = lp.device
    roots = _check_roots(root_tokens, B, dev).cpu().tolist()
    lp_all = lp.cpu().tolist()
    id_all = ids.cpu().tolist()
    rows = []
    for b in range(B):
        lp, ids = lp_all[b], id_all[b]
        tokens, parents, depths, ranks, scores = [roots[b]], [-1], [0], [-1], [0]
        heap = []
        if budget > 0 and L > 0 and K > 0:
            heap.append((-lp[0][0], 1, 0, 0))
        while heap and len(tokens) - 1 < budget:
            neg, depth, parent, rank = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(ids[depth - 1][rank])
            parents.append(parent)
            depths.append(depth)
            ranks.append(rank)
            scores.append(-neg)
            if rank + 1 < K:
                sib = scores[parent] + lp[depth - 1][rank + 1]
                heapq.heappush(heap, (-sib, depth, parent, rank + 1))
            if depth < L:
                heapq.heappush(heap, (-(scores[node] + lp[depth][0]), depth + 1, node, 0))
        rows.append((tokens, parents, depths, ranks, scores))
    n = len(rows[0][0])  # every sequence pops the same number of nodes
    t = [torch.tensor([r[i] for r in rows], dtype=torch.int64).view(B, n).to(dev) for i in range(5)]
    return DraftTree(
        tokens=t[0],
        parents=t[1],
        depths=t[2],
        num_nodes=torch.full((B,), n, dtype=torch.int64, device=dev),
        num_nodes_host=(n,) * B,
        max_depth=min(L, budget) if K > 0 else 0,
        ranks=t[3],
        scores=t[4],
    )


def build_ddtree(
    draft_logits: torch.Tensor, budget: int, root_tokens: torch.Tensor, *, topk: int | None = None
) -> DraftTree:
    """DDTree draft trees for a batch, on the device: :func:`draft_topk` then :func:`expand_topk`.

    Args:
        draft_logits: ``[B, L, V]`` (or ``[L, V]``) draft logits for the L positions after the root.
        budget: number of draft nodes per tree, root excluded (0..1023).
        root_tokens: ``[B]`` integer tensor, the roots (last step's bonus tokens), same device.
        topk: optional cap on the tokens per position (K = min(topk, budget, V)); ``topk=1``
            with ``budget=L`` gives the chain of per-position argmaxes.
    """
    logits = _check_logits("draft_logits", draft_logits)
    _check_int("budget", budget, 0, MAX_BUDGET)
    k = _resolve_k(budget, logits.shape[-1], topk)
    if k == 0 or logits.shape[1] == 0:
        return _root_only(_check_roots(root_tokens, logits.shape[0], logits.device))
    top = draft_topk(logits, k)
    return _expand(top.logprobs, top.token_ids, budget, root_tokens)


def build_ddtree_reference(
    draft_logits: torch.Tensor, budget: int, root_tokens: torch.Tensor, *, topk: int | None = None
) -> DraftTree:
    """:func:`build_ddtree` with the host heap (:func:`expand_topk_reference`)."""
    logits = _check_logits("draft_logits", draft_logits)
    _check_int("budget", budget, 0, MAX_BUDGET)
    k = _resolve_k(budget, logits.shape[-1], topk)
    if k == 0 or logits.shape[1] == 0:
        return _root_only(_check_roots(root_tokens, logits.shape[0], logits.device))
    return expand_topk_reference(draft_topk(logits, k), budget, root_tokens)


# ----------------------------------------------------------------------------------------------
# trees from parent arrays; structure helpers


def _jump_iters(max_depth: int) -> int:
    """Pointer-jumping rounds so that 2**rounds >= max_depth."""
    return max(max_depth - 1, 0).bit_length()


def tree_from_parents(
    parents,
    tokens,
    num_nodes=None,
    *,
    max_depth: int | None = None,
) -> DraftTree:
    """A :class:`DraftTree` from parent arrays (node 0 must be the root).

    Args:
        parents: list of per-tree parent lists (ragged allowed), or an integer tensor ``[B, n]``
            (entries past ``num_nodes`` ignored). ``parents[b][0] == -1``.
        tokens: same layout as ``parents``.
        num_nodes: ``[B]`` ints (list or CPU tensor); default: all ``n`` (or the list lengths).
        max_depth: host bound of the depth; computed on the host when omitted (a device sync when
            the tensors are on a GPU).

    Depths are computed on the device by pointer jumping. Lists and CPU tensors are checked here
    (parents in range, node 0 the only root, no cycle, depth <= ``max_depth``, a node's children
    carrying distinct tokens), GPU tensors too where ``max_depth`` is omitted (their copy to the
    host is made anyway); GPU tensors with a ``max_depth`` are not read (a sync): validate them
    with :func:`check_tree` (out-of-range parents make the gathers fault on a GPU).
    """
    if isinstance(parents, torch.Tensor) != isinstance(tokens, torch.Tensor):
        raise TypeError("parents and tokens must both be tensors or both be lists")
    if not isinstance(parents, torch.Tensor):
        if len(parents) == 0 or len(parents) != len(tokens):
            raise ValueError("parents and tokens must hold the same, non-zero number of trees")
        parents = [host_ints(f"parents[{b}]", p) for b, p in enumerate(parents)]  # (floats were truncated)
        tokens = [host_ints(f"tokens[{b}]", t) for b, t in enumerate(tokens)]
        sizes = [len(p) for p in parents]
        if any(len(t) != s for t, s in zip(tokens, sizes)):
            raise ValueError("parents[b] and tokens[b] must have the same length")
        if min(sizes) < 1:
            raise ValueError("every tree needs at least its root")
        n = max(sizes)
        par = torch.full((len(sizes), n), -1, dtype=torch.int64)
        tok = torch.full((len(sizes), n), -1, dtype=torch.int64)
        for b, (p, t) in enumerate(zip(parents, tokens)):
            par[b, : len(p)] = torch.as_tensor(p, dtype=torch.int64)
            tok[b, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
        num_nodes = sizes if num_nodes is None else num_nodes
    else:
        for name, t in (("parents", parents), ("tokens", tokens)):
            if t.dim() != 2 or not is_int_tensor(t):
                raise TypeError(f"{name} must be an integer tensor [B, n], got {t.dtype} {tuple(t.shape)}")
        if parents.shape != tokens.shape or parents.device != tokens.device:
            raise ValueError("parents and tokens must have the same shape and device")
        par, tok = parents.to(torch.int64), tokens.to(torch.int64)
    B, n = par.shape
    if n < 1 or B < 1:
        raise ValueError(f"parents must be [B>=1, n>=1], got {tuple(par.shape)}")
    if n > MAX_TREE_NODES:
        raise ValueError(f"trees of {n} nodes; at most {MAX_TREE_NODES} are supported")
    if num_nodes is None:
        sizes = [n] * B
    else:
        sizes = host_ints("num_nodes", num_nodes)
        if len(sizes) != B or min(sizes) < 1 or max(sizes) > n:
            raise ValueError(f"num_nodes must hold {B} sizes in [1, {n}], got {sizes}")
    dev = par.device
    nn = torch.tensor(sizes, dtype=torch.int64).to(dev)
    valid = torch.arange(n, device=dev)[None, :] < nn[:, None]
    par = torch.where(valid, par, -1)
    tok = torch.where(valid, tok, -1)
    if max_depth is not None and (not is_int(max_depth) or max_depth < 0):
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    if max_depth is None or dev.type == "cpu":  # on the host (or copied there anyway): checked in full
        par_cpu = par.cpu()
        deepest = _host_max_depth(par_cpu, sizes)
        _host_check_siblings(par_cpu, tok.cpu(), sizes)
        if max_depth is not None and max_depth < deepest:
            raise ValueError(f"the trees are deeper ({deepest}) than max_depth={max_depth}")
        max_depth = deepest if max_depth is None else max_depth
    depths = _depths(par, valid, max_depth)
    return DraftTree(
        tokens=tok,
        parents=par,
        depths=depths,
        num_nodes=nn,
        num_nodes_host=tuple(sizes),
        max_depth=int(max_depth),
    )


def _host_max_depth(par_cpu: torch.Tensor, sizes: list[int]) -> int:
    """Deepest node over the batch, walking parents ``[B, n]`` (padding -1) on the host; a
    ``ValueError`` unless every tree's parents are in range, with node 0 the only root, and
    acyclic (a walk as long as its tree)."""
    nn = torch.tensor(sizes)[:, None]
    col = torch.arange(par_cpu.shape[1])
    valid = col < nn
    bad = valid & ((par_cpu < -1) | (par_cpu >= nn))
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"parents[{b}] holds an index outside [-1, {sizes[b]})")
    bad = valid & ((par_cpu == -1) != (col == 0))
    if bool(bad.any()):
        raise ValueError(f"parents[{int(torch.nonzero(bad)[0, 0])}]: node 0 must be the only root (parent -1)")
    best = 0
    for b, size in enumerate(sizes):
        p = par_cpu[b, :size].tolist()
        for i in range(size):
            j, steps = i, 0
            while p[j] >= 0 and steps < size:
                j, steps = p[j], steps + 1
            if steps == size:
                raise ValueError(f"parents[{b}] contains a cycle")
            best = max(best, steps)
    return best


def _host_check_siblings(par_cpu: torch.Tensor, tok_cpu: torch.Tensor, sizes: list[int]) -> None:
    """A ``ValueError`` where two children of one node carry the same token (``[B, n]`` each, tree b
    of ``sizes[b]`` nodes): acceptance follows the child whose token the target sampled, so it must
    be one."""
    valid = torch.arange(par_cpu.shape[1]) < torch.tensor(sizes)[:, None]
    b, i = torch.nonzero(valid & (par_cpu >= 0), as_tuple=True)
    keys = torch.stack((b, par_cpu[b, i], tok_cpu[b, i]), 1)
    uniq, counts = torch.unique(keys, dim=0, return_counts=True)
    if bool((counts > 1).any()):
        tb, node, token = uniq[counts > 1][0].tolist()
        raise ValueError(f"tree {tb}: node {node} has two children with token {token}")


def _depths(par: torch.Tensor, valid: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Depth by pointer jumping (list ranking): ``log2(max_depth)`` gather rounds, no sync."""
    B, n = par.shape
    ar = torch.arange(n, device=par.device).expand(B, n)
    has_parent = (par >= 0) & valid
    jump = torch.where(has_parent, par, torch.where(valid, torch.zeros_like(par), ar))
    dist = has_parent.to(torch.int64)
    for _ in range(_jump_iters(max_depth)):
        dist = dist + dist.gather(1, jump)
        jump = jump.gather(1, jump)
    return torch.where(valid, dist, -1)


def tree_links(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first_child, next_sibling)``, each ``[B, n]`` int64 of local node indices, -1 for none.

    first_child = the smallest-index child; next_sibling = the next larger-index child of the same
    parent. For DDTree trees that is best-first (rank) order. Matches SGLang's retrive_next_token /
    retrive_next_sibling for trees whose parents precede their children.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    B, n = tree.batch_size, tree.width
    dev = tree.device
    par = tree.parents
    is_child = par >= 0
    ar = torch.arange(n, device=dev).expand(B, n)
    big = n  # "none"
    fc = torch.full((B, n + 1), big, dtype=torch.int64, device=dev)
    fc.scatter_reduce_(1, torch.where(is_child, par, n), torch.where(is_child, ar, big), reduce="amin")
    first_child = torch.where(fc[:, :n] < big, fc[:, :n], -1)
    key = torch.where(is_child, par * n + ar, n * n + ar)  # siblings adjacent, in index order
    order = key.argsort(dim=1)
    p_sorted = par.gather(1, order)
    nxt = torch.cat([order[:, 1:], torch.full((B, 1), -1, dtype=torch.int64, device=dev)], 1)
    p_next = torch.cat([p_sorted[:, 1:], torch.full((B, 1), -2, dtype=torch.int64, device=dev)], 1)
    val = torch.where((p_next == p_sorted) & (p_sorted >= 0), nxt, -1)
    next_sibling = torch.empty_like(val).scatter_(1, order, val)
    return first_child, next_sibling


def _self_bits(n: int, words: int, device: torch.device) -> torch.Tensor:
    """``[n, words]`` int32: row j has only bit j set (bit j % 32 of word j // 32)."""
    j = torch.arange(n, device=device)
    val = torch.bitwise_left_shift(torch.ones_like(j), j % 32)  # int64 in [1, 2^31]
    val = torch.where(val >= 2**31, val - 2**32, val)
    out = torch.zeros(n, words, dtype=torch.int64, device=device)
    out.scatter_(1, (j // 32)[:, None], val[:, None])
    return out.to(torch.int32)


def ancestor_words(tree: DraftTree, words: int | None = None) -> torch.Tensor:
    """Packed ancestor-or-self masks ``[B, n, W]`` int32 in the contract's bit layout (rows of padding = 0).

    Pointer jumping over the packed words: ``log2(max_depth)`` gather + OR rounds, no host sync.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    B, n = tree.batch_size, tree.width
    W = check_words(words, n)
    dev = tree.device
    valid = tree.node_mask()
    own = _self_bits(n, W, dev).expand(B, n, W)
    has_parent = (tree.parents >= 0) & valid
    jump = tree.parents.clamp(min=0)
    m = own | torch.where(has_parent[..., None], own.gather(1, jump[..., None].expand(B, n, W)), 0)
    for _ in range(_jump_iters(tree.max_depth)):
        m = m | m.gather(1, jump[..., None].expand(B, n, W))
        jump = jump.gather(1, jump)
    return torch.where(valid[..., None], m, 0)


# ----------------------------------------------------------------------------------------------
# compile for verify


def _prefix_tensor(prefix_lens, batch: int, device: torch.device | None) -> torch.Tensor:
    """``prefix_lens`` (a ``[batch]`` integer tensor on ``device``, any device where None, or host
    integers) as int64 on that device (host values: on ``device``, the CPU where None). Values
    >= 0 are checked where they are on the host (no sync); a GPU tensor's are the caller's."""
    if not isinstance(prefix_lens, torch.Tensor):
        prefix_lens = torch.tensor(host_ints("prefix_lens", prefix_lens), dtype=torch.int64)  # (floats were truncated)
    elif device is not None and prefix_lens.device != device:
        raise ValueError(f"prefix_lens is on {prefix_lens.device}, expected {device}")
    if not is_int_tensor(prefix_lens):
        raise TypeError(f"prefix_lens must be an integer tensor, got {prefix_lens.dtype}")
    if prefix_lens.dim() != 1 or prefix_lens.shape[0] != batch:
        raise ValueError(f"prefix_lens must have shape [{batch}], got {tuple(prefix_lens.shape)}")
    if prefix_lens.device.type == "cpu" and bool((prefix_lens < 0).any()):
        raise ValueError(f"prefix_lens must be >= 0, got {prefix_lens.tolist()}")
    return prefix_lens.to(prefix_lens.device if device is None else device, torch.int64)


def compile_tree(
    tree: DraftTree,
    prefix_lens,
    *,
    words: int | None = None,
) -> VerifyBatch:
    """Compile a batch of trees into the verify step's tensors (see :class:`VerifyBatch`).

    Args:
        tree: the trees.
        prefix_lens: ``[B]`` committed prefix length P_b >= 0 (tokens before the root), tensor on
            the tree's device or host integers (checked >= 0 on the host; a GPU tensor's values
            are the caller's).
        words: mask width W (default ``ceil(n / 32)``); wider pads with zero words.

    No host sync: T (the number of rows) comes from ``tree.num_nodes_host``.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    B, n = tree.batch_size, tree.width
    dev = tree.device
    P = _prefix_tensor(prefix_lens, B, dev)
    T = sum(tree.num_nodes_host)
    qo = torch.cumsum(tree.num_nodes, 0)
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), qo]).to(torch.int32)
    valid = tree.node_mask()
    ar = torch.arange(n, device=dev)
    row_index = torch.where(valid, qo_indptr[:-1, None].to(torch.int64) + ar, -1)
    if tree.uniform:
        seq = torch.arange(B, device=dev).repeat_interleave(n, output_size=T)
        loc = ar.repeat(B)
    else:
        t = torch.arange(T, device=dev)
        seq = torch.searchsorted(qo_indptr.to(torch.int64), t, right=True) - 1
        loc = t - qo_indptr.to(torch.int64)[seq]
    masks = ancestor_words(tree, words)
    first_child, next_sibling = tree_links(tree)
    return VerifyBatch(
        num_rows=T,
        input_ids=tree.tokens[seq, loc],
        positions=P[seq] + tree.depths[seq, loc],
        qo_indptr=qo_indptr,
        tree_mask=masks[seq, loc],
        kv_positions=P[seq] + loc,
        row_index=row_index,
        first_child=first_child,
        next_sibling=next_sibling,
    )


# ----------------------------------------------------------------------------------------------
# validation (host)


def check_tree(tree: DraftTree) -> None:
    """Host-side structural checks (syncs on a GPU). Raises ``ValueError`` naming the defect.

    Node 0 is the only root; parents are in range and acyclic; depths match the parents and are
    <= max_depth; siblings carry distinct tokens (acceptance relies on it); padding is -1.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    par = tree.parents.cpu()
    tok = tree.tokens.cpu()
    dep = tree.depths.cpu()
    if list(tree.num_nodes.cpu().tolist()) != list(tree.num_nodes_host):
        raise ValueError("num_nodes does not match num_nodes_host")
    for b, size in enumerate(tree.num_nodes_host):
        p = par[b, :size].tolist()
        if p[0] != -1 or any(x < 0 or x >= size for x in p[1:]):
            raise ValueError(f"tree {b}: node 0 must be the only root and parents must be in [0, {size})")
        d = dep[b, :size].tolist()
        if d[0] != 0:
            raise ValueError(f"tree {b}: the root must have depth 0")
        for i in range(1, size):
            j, steps = i, 0
            while j != 0 and steps <= size:
                j, steps = p[j], steps + 1
            if j != 0:
                raise ValueError(f"tree {b}: node {i} is on a cycle")
            if steps > tree.max_depth:
                raise ValueError(f"tree {b}: node {i} is deeper ({steps}) than max_depth={tree.max_depth}")
            if d[i] != steps:
                raise ValueError(f"tree {b}: node {i} has depth {d[i]}, its parents give {steps}")
        if size < tree.width and (bool((par[b, size:] != -1).any()) or bool((dep[b, size:] != -1).any())):
            raise ValueError(f"tree {b}: padding past num_nodes must be -1")
    _host_check_siblings(par, tok, list(tree.num_nodes_host))
