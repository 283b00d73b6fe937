"""Tree acceptance: greedy and lossless sampling, batched on the device without host syncs.

The target model scored every tree node in one verify forward; row ``qo_indptr[b] + j`` of the
target logits ``[T, V]`` is its next-token distribution after node j of sequence b.

* **Greedy**: the target's token at each node is its argmax (first index among ties).
* **Sampling**: the target's token at each node is one sample of the target distribution after
  :func:`filter_probs` (temperature, top-k, top-p); only the nodes the walk reaches are sampled
  (the others' samples could not change the walk).

Then the walk: start at the root; while the current node has a child whose token equals the
target's token at the current node, move to that child. The accepted path (root first) and the
target's token at the last accepted node (the bonus token) are the step's output. Sampled this
way the output is exactly a sample of the (filtered) target: each emitted token is the target's
own sample in the context of the tokens before it; the draft only decides how many of them one
verify step yields. Children of a node must carry distinct tokens (DDTree and EAGLE trees do).

On CUDA (and on the CPU under Triton's interpreter) the walk is one kernel, one program per
sequence, which for sampling also filters and samples the rows it reaches
(:mod:`.kernels`). The tensor-op walk of the CPU without the interpreter has no loop over depth:
a node is on the accepted path iff every edge from the root to it matches (child token ==
target token at the parent), an AND along the path evaluated by pointer jumping in
``log2(max_depth)`` rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backend import interpreting
from ..masks import is_int_tensor
from .kernels import MAX_FUSED_TOP_K, greedy_walk, sample_walk, walk
from .tree import DraftTree, _jump_iters, _prefix_tensor

_FLOAT32_MAX = torch.finfo(torch.float32).max

__all__ = [
    "AcceptResult",
    "filter_logits",
    "filter_probs",
    "sample_from_probs",
    "sample_from_logits",
    "target_tokens_greedy",
    "target_tokens_sampled",
    "accept_tokens",
    "accept_greedy",
    "greedy_workspace",
    "accept_sampling",
    "accept_reference",
    "commit_positions",
]


@dataclass(frozen=True)
class AcceptResult:
    """Accepted paths of a batch, on the device.

    accepted: ``[B, max_depth+1]`` int64 node indices in path order (root first), -1 padded.
    lengths:  ``[B]`` int64 number of accepted nodes including the root (>= 1).
    bonus:    ``[B]`` int64 the target's token at the last accepted node.
    accepted_tokens: ``[B, max_depth+1]`` int64 tokens of the accepted nodes, -1 padded.
    new_tokens: ``[B, max_depth+1]`` int64 the tokens this step appends to each sequence: the
        accepted draft tokens (root excluded) then the bonus; ``lengths[b]`` of them, -1 padded.
    """

    accepted: torch.Tensor
    lengths: torch.Tensor
    bonus: torch.Tensor
    accepted_tokens: torch.Tensor
    new_tokens: torch.Tensor


# ----------------------------------------------------------------------------------------------
# target tokens per node


def _check_param(name, value, rows: int, device):
    """A per-row parameter as given: None, a number, or a ``[rows]`` tensor on ``device`` (a 0-d
    tensor is broadcast)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real-valued tensor, got {value.dtype}")
        if value.dim() == 0:
            value = value.reshape(1).expand(rows)
        if value.dim() != 1 or value.shape[0] != rows:
            raise ValueError(f"{name} must be a scalar or a [{rows}] tensor, got shape {tuple(value.shape)}")
        if value.device != torch.device(device):
            raise ValueError(f"{name} is on {value.device}, expected {device} (the logits' device)")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    return value


def _filter_args(logits, temperature, top_k, top_p, name: str = "logits"):
    """Checked filter parameters of ``logits [R, V]`` (called ``name`` in errors):
    ``(temperature, k_static, k_rows, top_p)``; temperature and top_p a number or a ``[R]``
    tensor (top_p None: off), ``k_static`` the int top-k when it filters (``0 < top_k < V``) else
    None, ``k_rows`` a ``[R]`` tensor top-k or None."""
    _check_rows(name, logits)
    R, V = logits.shape
    dev = logits.device
    temperature = _check_param("temperature", temperature, R, dev)
    if isinstance(temperature, torch.Tensor):  # a row not above 0 (NaN too) is greedy; inf: float32's largest
        temperature = torch.where(temperature > 0, temperature.float().clamp(max=_FLOAT32_MAX), 0.0)
    elif temperature is not None and not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number, got {temperature!r}")
    k_static = k_rows = None
    if isinstance(top_k, int) and not isinstance(top_k, bool):
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        k_static = top_k if 0 < top_k < V else None
    elif is_int_tensor(top_k):
        k_rows = _check_param("top_k", top_k, R, dev)
        if k_rows.device.type == "cpu" and bool((k_rows < 0).any()):  # host values: read (a GPU's: the caller's)
            raise ValueError(f"top_k must be >= 0, got {k_rows.tolist()}")
    elif top_k is not None:
        raise TypeError(f"top_k must be an int or an integer [R] tensor, got {top_k!r}")
    if top_p is not None and not isinstance(top_p, torch.Tensor):
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    top_p = _check_param("top_p", top_p, R, dev)
    if isinstance(top_p, torch.Tensor):  # a row not above 0 (NaN too) keeps its most probable token alone
        top_p = torch.where(top_p > 0, top_p.float(), torch.finfo(torch.float32).tiny)
    return temperature, k_static, k_rows, top_p


def _check_rows(name: str, logits) -> None:
    """``logits`` a floating-point ``[R, V]`` tensor with ``V >= 1`` (``TypeError`` / ``ValueError``)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"{name} must be [R, V], got shape {tuple(logits.shape)}")


def _rows(value, rows: int, device, dtype, default):
    """A checked per-row parameter as a ``[rows, 1]`` tensor, or None when it is ``default`` (off)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.to(dtype)[:, None]
    if value == default:
        return None
    return torch.full((rows, 1), value, dtype=dtype, device=device)


def filter_logits(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The one filtering rule (used by :func:`filter_probs` and by sampling acceptance).

    Temperature, then top-k, then top-p; returns float32 ``[R, V]`` scaled logits with every
    filtered token at -inf (the sampling distribution is their softmax).

    Args:
        logits: ``[R, V]`` float (any float dtype; computed in float32 on a copy).
        temperature: scalar (finite) or ``[R]``; a row with temperature <= 0 (in a tensor: or
            NaN) is greedy: only its argmax (the first index among ties) survives.
        top_k: int or ``[R]`` int tensor, >= 0; keep the tokens whose logit is >= the k-th
            largest (ties at the boundary are kept). None, 0 or >= V: off for that row. A
            tensor's entries are checked on the CPU; on a GPU they are the caller's (not read:
            a negative one reads as off).
        top_p: float or ``[R]`` tensor in (0, 1]; on the top-k-renormalised distribution, keep the
            smallest set of most probable tokens whose mass reaches top_p, plus every token tied
            with the least probable one kept. None or >= 1: off. A tensor entry <= 0 or NaN keeps
            the most probable token(s) alone (the limit top_p -> 0).

    An int ``top_k`` uses ``torch.topk(top_k)``; a tensor ``top_k`` or a top-p without top-k sorts
    the whole row (costly at V = 163840; prefer an int top_k alongside top_p). No host sync.
    """
    temperature, k_static, k_row, top_p = _filter_args(logits, temperature, top_k, top_p)
    R, V = logits.shape
    dev = logits.device
    temp = _rows(temperature, R, dev, torch.float32, 1.0)
    if k_row is not None:
        k_row = k_row.to(torch.int64)[:, None]
        k_row = torch.where((k_row <= 0) | (k_row > V), V, k_row)
    p_row = _rows(top_p, R, dev, torch.float32, 1.0)
    if p_row is not None:  # top_p >= 1 is off (cumsum rounding must not drop the tail)
        p_row = torch.where(p_row >= 1, float("inf"), p_row)

    x = torch.empty(logits.shape, dtype=torch.float32, device=dev).copy_(logits)  # contiguous whatever logits' layout
    greedy = None
    if temp is not None:
        greedy = temp <= 0  # [R, 1]
        x.div_(torch.where(greedy, torch.ones_like(temp), temp))
    if k_static is not None or k_row is not None or p_row is not None:
        width = k_static if k_static is not None else V
        vals = x.topk(width, dim=1, sorted=True).values if width < V else x.sort(dim=1, descending=True).values
        thresh = vals.gather(1, k_row - 1) if k_row is not None else vals[:, -1:]  # [R, 1]
        if p_row is not None:
            # mass of the top-k set, boundary ties past `width` included
            lse = torch.logsumexp(x.masked_fill(x < thresh, float("-inf")), dim=1, keepdim=True)
            p_sorted = torch.exp(vals - lse).masked_fill(vals < thresh, 0.0)  # [R, width]
            before = torch.cumsum(p_sorted, dim=1) - p_sorted
            n_keep = ((before < p_row) & (vals >= thresh)).sum(1, keepdim=True).clamp(min=1)
            thresh = torch.maximum(thresh, vals.gather(1, n_keep - 1))
        x.masked_fill_(x < thresh, float("-inf"))
    if greedy is not None:
        top1 = torch.zeros_like(x, dtype=torch.bool).scatter_(1, logits.argmax(1, keepdim=True), True)
        x.masked_fill_(greedy & ~top1, float("-inf"))
    return x


def filter_probs(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(filter_logits(...))``: ``[R, V]`` float32 probabilities, filtered tokens exactly 0."""
    return torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs [R, V]`` (non-negative, rows need not be normalised): ``[R]`` int64.

    Exponential race: argmax(p / E), E ~ Exp(1) i.i.d. (``torch.multinomial``'s method for one
    sample); a zero-probability token is never drawn; no host sync. ``probs`` is a floating-point
    tensor; its values are not read (as the logits of :func:`sample_from_logits`): a row without
    positive mass, or with a negative or NaN entry, gives an unspecified token.
    """
    _check_rows("probs", probs)
    e = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(generator=generator)
    return (probs.float() / e.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=1)


def sample_from_logits(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One sample per row of ``softmax(x)`` for float32 ``x [R, V]`` (-inf = excluded): ``[R]`` int64.

    The same exponential race in log space, ``argmax(x - log E)`` (Gumbel-max), without the
    softmax; ``x`` is overwritten. Its values are not read: a row of -inf or NaN only gives an
    unspecified token.
    """
    _check_rows("x", x)
    e = torch.empty(x.shape, dtype=x.dtype, device=x.device).exponential_(generator=generator)  # x's layout aside
    return x.sub_(e.clamp_(min=torch.finfo(torch.float32).tiny).log_()).argmax(dim=1)


def target_tokens_greedy(target_logits: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64 argmax of each row of ``target_logits [T, V]`` (first index among ties)."""
    _check_rows("target_logits", target_logits)
    return target_logits.argmax(dim=1)


def target_tokens_sampled(
    target_logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[T]`` int64, one sample per row of the filtered target distribution (:func:`filter_logits`)."""
    return sample_from_logits(filter_logits(target_logits, temperature, top_k, top_p), generator)


# ----------------------------------------------------------------------------------------------
# the walk


def _check_targets(tree: DraftTree, target_tokens: torch.Tensor) -> bool:
    """Validate ``target_tokens`` (``[T]`` flat rows or ``[B, n]``) against ``tree``; True when flat."""
    if not isinstance(target_tokens, torch.Tensor):
        raise TypeError(f"target_tokens must be a torch.Tensor, got {type(target_tokens).__name__}")
    if not is_int_tensor(target_tokens):
        raise TypeError(f"target_tokens must be an integer tensor, got {target_tokens.dtype}")
    if target_tokens.device != tree.device:
        raise ValueError(f"target_tokens is on {target_tokens.device}, expected {tree.device}")
    B, n = tree.batch_size, tree.width
    if target_tokens.dim() == 2:
        if tuple(target_tokens.shape) != (B, n):
            raise ValueError(f"target_tokens must be [T] or [{B}, {n}], got {tuple(target_tokens.shape)}")
        return False
    T = sum(tree.num_nodes_host)
    if target_tokens.dim() != 1 or target_tokens.shape[0] != T:
        raise ValueError(f"target_tokens must be [T={T}] or [{B}, {n}], got {tuple(target_tokens.shape)}")
    return True


def _padded_targets(tree: DraftTree, target_tokens: torch.Tensor) -> torch.Tensor:
    """Target tokens ``[B, n]`` from flat rows ``[T]`` (row of (b, j) = qo_indptr[b] + j) or ``[B, n]``."""
    if not _check_targets(tree, target_tokens):
        return target_tokens.to(torch.int64)
    B, n = tree.batch_size, tree.width
    T = target_tokens.shape[0]
    if tree.uniform:
        return target_tokens.view(B, n).to(torch.int64)
    start = torch.cumsum(tree.num_nodes, 0) - tree.num_nodes
    rows = (start[:, None] + torch.arange(n, device=tree.device)).clamp(max=T - 1)
    return torch.where(tree.node_mask(), target_tokens.to(torch.int64)[rows], -1)


def accept_tokens(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """Accept along the tree given the target's token at every node.

    Args:
        tree: the verified trees.
        target_tokens: ``[T]`` (flat verify rows, row of node j of tree b = qo_indptr[b] + j) or
            ``[B, n]``; int.

    Returns an :class:`AcceptResult`. On CUDA (and on the CPU under Triton's interpreter) one
    kernel launch, one program per sequence walking ``max_depth`` steps; otherwise tensor ops,
    ``log2(max_depth)`` pointer-jumping rounds. No host sync either way.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    flat = _check_targets(tree, target_tokens)  # (before reading it: a list raised AttributeError)
    if tree.device.type == "cuda" or interpreting():
        tgt = target_tokens.to(torch.int64)
        starts = None
        if not flat:
            tgt = tgt.contiguous() if tgt.stride(1) != 1 else tgt
        elif tree.uniform:
            tgt = tgt.contiguous().view(tree.batch_size, tree.width)
        else:
            tgt = tgt.contiguous()
            starts = _row_starts(tree)
        return _walk_result(walk(*_walk_trees(tree), tgt, starts, tree.max_depth))
    return _accept_tokens_torch(tree, _padded_targets(tree, target_tokens))


def _walk_trees(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens``, ``parents`` ``[B, n]`` and ``num_nodes`` ``[B]`` contiguous, as the walk kernels
    index them."""
    return tree.tokens.contiguous(), tree.parents.contiguous(), tree.num_nodes.contiguous()


def _row_starts(tree: DraftTree) -> torch.Tensor | None:
    """Each tree's first row among the ``[T]`` flat node rows; None for uniform trees (row ``b * n + j``)."""
    return None if tree.uniform else torch.cumsum(tree.num_nodes, 0) - tree.num_nodes


def _walk_result(outputs: tuple) -> AcceptResult:
    """An :class:`AcceptResult` from a walk launcher's ``(acc, acc_tok, new_tok, lengths, bonus)``."""
    acc, acc_tokens, new_tokens, lengths, bonus = outputs
    return AcceptResult(accepted=acc, lengths=lengths, bonus=bonus, accepted_tokens=acc_tokens, new_tokens=new_tokens)


def _check_target_rows(tree: DraftTree, target_logits: torch.Tensor) -> None:
    """``target_logits`` on the tree's device with one row per node (``ValueError``)."""
    if target_logits.device != tree.device:
        raise ValueError(f"target_logits is on {target_logits.device}, expected {tree.device}")
    T = sum(tree.num_nodes_host)
    if target_logits.shape[0] != T:
        raise ValueError(f"target_logits must have T={T} rows, got {target_logits.shape[0]}")


def _accept_tokens_torch(tree: DraftTree, tgt: torch.Tensor) -> AcceptResult:
    """:func:`accept_tokens` with tensor ops (``tgt``: ``[B, n]`` int64): a node is accepted iff
    every edge of its root path matches, an AND by pointer jumping; one accepted node per depth."""
    B, n = tree.batch_size, tree.width
    D = tree.max_depth
    dev = tree.device
    valid = tree.node_mask()
    par = tree.parents
    has_parent = (par >= 0) & valid
    jump = torch.where(has_parent, par, 0)
    # ok[c]: the edge into c matches; the root's is true, padding's false
    ok = torch.where(has_parent, tree.tokens == tgt.gather(1, jump), valid & (par < 0))
    ok = ok & valid
    for _ in range(_jump_iters(D)):
        ok = ok & ok.gather(1, jump)
        jump = jump.gather(1, jump)
    ar = torch.arange(n, device=dev).expand(B, n)
    slot = torch.where(ok, tree.depths, D + 1)  # one accepted node per depth (distinct siblings)
    acc = torch.full((B, D + 2), -1, dtype=torch.int64, device=dev)
    acc.scatter_(1, slot, torch.where(ok, ar, -1))
    acc = acc[:, : D + 1].contiguous()
    lengths = ok.sum(1)
    last = acc.gather(1, (lengths - 1)[:, None])  # [B, 1]
    bonus = tgt.gather(1, last)[:, 0]
    acc_tokens = torch.where(acc >= 0, tree.tokens.gather(1, acc.clamp(min=0)), -1)
    col = torch.arange(D + 1, device=dev)[None, :]
    shifted = torch.cat([acc_tokens[:, 1:], torch.full((B, 1), -1, dtype=torch.int64, device=dev)], 1)
    new_tokens = torch.where(col == (lengths - 1)[:, None], bonus[:, None], shifted)
    return AcceptResult(
        accepted=acc, lengths=lengths, bonus=bonus, accepted_tokens=acc_tokens, new_tokens=new_tokens
    )


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor, *, workspace: torch.Tensor | None = None) -> AcceptResult:
    """Greedy acceptance: the target's argmax at each node, then the walk.

    ``target_logits``: ``[T, V]`` verify rows (row of node j of tree b = qo_indptr[b] + j).
    ``workspace``: optional int32 ``[>= B]`` zeros on the tree's device (:func:`greedy_workspace`),
    which the call leaves zero: calls that pass the same one skip zeroing a counter (one device
    op less per call, a node less in a CUDA graph). Calls sharing a workspace must run one after
    another (one stream, or graphs replayed one after another); its content is not checked
    (that would sync): a nonzero entry gives a wrong result.

    On CUDA (and on the CPU under Triton's interpreter) one kernel launch (plus the zeroing of a
    ``[B]`` counter without ``workspace``): one program per node takes its row's argmax, the last
    of a sequence walks it (:func:`kernels.greedy_walk`). Otherwise :func:`target_tokens_greedy`
    then :func:`accept_tokens` (``workspace`` unused). No host sync either way.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    if workspace is not None:
        if not isinstance(workspace, torch.Tensor):
            raise TypeError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}")
        if workspace.dtype != torch.int32 or workspace.dim() != 1 or not workspace.is_contiguous():
            raise TypeError(f"workspace must be a contiguous 1-D int32 tensor, got {workspace.dtype} of shape "
                            f"{tuple(workspace.shape)}")
        if workspace.device != tree.device or workspace.shape[0] < tree.batch_size:
            raise ValueError(f"workspace must hold >= B={tree.batch_size} entries on {tree.device}, got "
                             f"{workspace.shape[0]} on {workspace.device}")
    if not (tree.device.type == "cuda" or interpreting()):
        return accept_tokens(tree, target_tokens_greedy(target_logits))
    _filter_args(target_logits, 1.0, None, None, "target_logits")
    _check_target_rows(tree, target_logits)
    logits = target_logits if target_logits.stride(1) == 1 else target_logits.contiguous()
    return _walk_result(greedy_walk(*_walk_trees(tree), logits, _row_starts(tree), tree.max_depth, workspace))


def greedy_workspace(max_batch: int, device) -> torch.Tensor:
    """A workspace for :func:`accept_greedy` of up to ``max_batch`` sequences: int32 zeros."""
    return torch.zeros(max_batch, dtype=torch.int32, device=device)


def accept_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Lossless sampling acceptance: the walk, with the target's token at each node one sample of
    the filtered target (:func:`filter_logits`) there.

    Args:
        tree: the verified trees.
        target_logits: ``[T, V]`` verify rows (row of node j of tree b = qo_indptr[b] + j).
        temperature, top_k, top_p: as :func:`filter_logits`; per-row parameters (``[T]``
            tensors) let each sequence use its own settings.
        generator: of the samples; the result is a function of its state (no host sync).

    Only the nodes the walk reaches are sampled (each node's sample is independent of the
    others', so sampling the rest could not change the path). On CUDA (and on the CPU under
    Triton's interpreter), with an int ``top_k <= 1024`` (any top-p) or with neither top-k nor
    top-p: one kernel launch (:func:`kernels.sample_walk`) that filters and samples one row of
    the target per reached node, by inverse CDF at a uniform drawn from ``(seed, row)``, the seed
    one draw of ``generator``; it reads each reached row two or three times and never
    materialises a filtered ``[T, V]``. Otherwise (a tensor top_k, top-p without top-k, the CPU
    without the interpreter): every row filtered by :func:`filter_logits`, sampled by an
    exponential race, then :func:`accept_tokens`. Both draw exactly from the filtered target;
    they use the generator differently, so their samples differ.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    temp, k_static, k_rows, p = _filter_args(target_logits, temperature, top_k, top_p, "target_logits")
    _check_target_rows(tree, target_logits)
    top_p_on = isinstance(p, torch.Tensor) or (p is not None and p < 1)
    fused = k_rows is None and (k_static or 0) <= MAX_FUSED_TOP_K and (k_static is not None or not top_p_on)
    if not fused or not (tree.device.type == "cuda" or interpreting()):
        tokens = target_tokens_sampled(
            target_logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        return accept_tokens(tree, tokens)
    logits = target_logits if target_logits.stride(1) == 1 else target_logits.contiguous()
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=tree.device, generator=generator)

    def rows(x, off):
        if isinstance(x, torch.Tensor):
            return x.to(torch.float32).contiguous()
        return off if x is None else float(x)

    return _walk_result(sample_walk(
        *_walk_trees(tree), logits, _row_starts(tree), tree.max_depth,
        temp=rows(temp, 1.0), top_k=k_static or 0, top_p=rows(p, 2.0), seed=seed,
    ))


# ----------------------------------------------------------------------------------------------
# the reference walk


def accept_reference(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """The walk, literally, one sequence at a time on the host (the oracle of :func:`accept_tokens`).

    From the root, scan the current node's children in index order for the target's token at the
    current node; move there if found, else stop.
    """
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    tgt = _padded_targets(tree, target_tokens).cpu().tolist()
    par = tree.parents.cpu().tolist()
    tok = tree.tokens.cpu().tolist()
    B, D = tree.batch_size, tree.max_depth
    acc = [[-1] * (D + 1) for _ in range(B)]
    acc_tok = [[-1] * (D + 1) for _ in range(B)]
    new = [[-1] * (D + 1) for _ in range(B)]
    lengths, bonus = [], []
    for b in range(B):
        size = tree.num_nodes_host[b]
        path, cur = [0], 0
        while True:
            want = tgt[b][cur]
            nxt = next((c for c in range(size) if par[b][c] == cur and tok[b][c] == want), None)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        for i, node in enumerate(path):
            acc[b][i] = node
            acc_tok[b][i] = tok[b][node]
        emitted = [tok[b][node] for node in path[1:]] + [tgt[b][cur]]
        new[b][: len(emitted)] = emitted
        lengths.append(len(path))
        bonus.append(tgt[b][cur])
    dev = tree.device

    def t(x):
        return torch.tensor(x, dtype=torch.int64).to(dev)

    return AcceptResult(
        accepted=t(acc).view(B, D + 1),
        lengths=t(lengths),
        bonus=t(bonus),
        accepted_tokens=t(acc_tok).view(B, D + 1),
        new_tokens=t(new).view(B, D + 1),
    )


# ----------------------------------------------------------------------------------------------
# committing the accepted path to the KV pool


def commit_positions(result: AcceptResult, prefix_lens: torch.Tensor):
    """Where the accepted nodes' KV lives and where it must go: ``(src, dst, new_prefix_lens)``.

    Verify wrote node j's KV at cache position ``P + j``; the accepted path's i-th node must end
    at position ``P + i``. ``src``/``dst`` are ``[B, max_depth+1]`` int64 positions, -1 padded
    (entries with src == dst need no copy). ``new_prefix_lens = P + lengths`` (root and accepted
    drafts are committed; the bonus token is the next step's root, its KV not yet computed).
    ``prefix_lens``: ``[B]`` integer tensor on the result's device, >= 0 (checked on the CPU; on a
    GPU the caller's).
    """
    if not isinstance(result, AcceptResult):
        raise TypeError(f"result must be an AcceptResult, got {type(result).__name__}")
    if not isinstance(prefix_lens, torch.Tensor):
        raise TypeError(f"prefix_lens must be a [B] tensor, got {type(prefix_lens).__name__}")
    P = _prefix_tensor(prefix_lens, result.accepted.shape[0], result.accepted.device)
    on = result.accepted >= 0
    col = torch.arange(result.accepted.shape[1], device=P.device)[None, :]
    src = torch.where(on, P[:, None] + result.accepted, -1)
    dst = torch.where(on, P[:, None] + col, -1)
    return src, dst, P + result.lengths
