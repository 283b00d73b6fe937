"""Drafters: given each sequence's context, logits for the next ``L`` positions.

The interface (all the speculative loop needs)::

    logits = drafter.draft(contexts, num_positions)   # float32 [B, L, vocab], on the CPU

``contexts[b]`` is sequence b's whole token history (prompt + output so far) as a 1-D int64 CPU
tensor; its last token is the root of the next draft tree (emitted, its KV not yet cached). Row
``[b, i]`` of the result is the drafter's belief about the token at depth ``i + 1`` below that
root (one independent distribution per position, as a block / parallel drafter gives them).

A drafter may also draft on the device from the token histories kept there (the speculative loop
then drafts inside the step, in its CUDA graph, with no host work)::

    logits = drafter.draft_tensor(history, lengths, num_positions)   # [B, C] int64, [B] int64 -> [B, L, V]

- :class:`NGramDrafter` (real; needs no weights): prompt lookup. The longest suffix of the context
  (``max_ngram`` down to ``min_ngram`` tokens) that occurred earlier votes, at each of the next
  ``L`` positions, for the tokens that followed its earlier occurrences. Vectorised tensor ops
  with fixed shapes: it drafts on the device (``draft_tensor``).
- :class:`SyntheticDrafter` (SYNTHETIC, for benchmarking only): knows the target's greedy output
  (a reference continuation) and puts the true next token at rank 1 with probability
  ``agreement``, else at rank 2 with probability ``agreement``, ... down to ``max_rank`` (else not
  in its top list). Losslessness does not depend on it: the target still verifies every token.
  Tensor ops with a counter-based hash for its draws: it drafts on the device too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from ..backend import interpreting
from ..masks import is_int_tensor

__all__ = ["Drafter", "NGramDrafter", "SyntheticDrafter", "as_context"]

NEG = -1e4  # logit of "not proposed" (finite: log-softmax stays well defined)


class Drafter(Protocol):
    """Anything with ``name``, ``synthetic`` and ``draft(contexts, num_positions) -> [B, L, V]``;
    optionally ``draft_tensor(history, lengths, num_positions)`` (see the module docstring)."""

    name: str
    synthetic: bool
    vocab_size: int

    def draft(self, contexts: Sequence[torch.Tensor], num_positions: int) -> torch.Tensor: ...


def as_context(tokens) -> torch.Tensor:
    """A 1-D int64 CPU tensor of a token sequence (a list, numpy array or tensor of integers, at
    most 1-D: ``TypeError`` for other values, ``ValueError`` for more dimensions)."""
    t = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(tokens)
    if t.numel() and not is_int_tensor(t):
        raise TypeError(f"token ids must be integers, got {t.dtype}")
    if t.dim() > 1:
        raise ValueError(f"a token sequence must be 1-D, got shape {tuple(t.shape)}")
    return t.to(torch.int64).reshape(-1).cpu()


def pad_contexts(contexts: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences as one zero-padded CPU history ``[B, max(1, longest)]`` int64 and their
    lengths ``[B]`` int64 (the layout of ``draft_tensor``)."""
    ctxs = [as_context(c) for c in contexts]
    lengths = torch.tensor([c.numel() for c in ctxs], dtype=torch.int64)
    history = torch.zeros(len(ctxs), max([1, *(c.numel() for c in ctxs)]), dtype=torch.int64)
    for b, c in enumerate(ctxs):
        history[b, : c.numel()] = c
    return history, lengths


class NGramDrafter:
    """Prompt-lookup drafter (no weights).

    For ``n`` from ``max_ngram`` down to ``min_ngram``: find earlier occurrences of the context's
    last ``n`` tokens (the most recent ``max_matches``); if any, the tokens that followed them vote
    at each of the next ``L`` positions (a vote at position ``i`` needs the occurrence to be
    followed by ``i + 1`` tokens). Logits are log-probabilities of the votes, smoothed by
    ``smoothing`` mass spread over the vocabulary; a position without votes is uniform.
    """

    name = "ngram"
    synthetic = False

    def __init__(self, vocab_size: int, *, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 8,
                 smoothing: float = 0.05, use_triton: bool | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.smoothing = smoothing
        self.use_triton = use_triton

    def draft(self, contexts: Sequence[torch.Tensor], num_positions: int) -> torch.Tensor:
        """:meth:`draft_tensor` of the contexts (:func:`pad_contexts`) on the CPU."""
        return self.draft_tensor(*pad_contexts(contexts), num_positions)

    def draft_tensor(self, history: torch.Tensor, lengths: torch.Tensor, num_positions: int) -> torch.Tensor:
        """The draft logits ``[B, L, V]`` float32 of ``B`` token histories, on their device.

        ``history [B, C]`` int64: sequence b's tokens at ``[b, :lengths[b]]`` (the rest ignored);
        ``lengths [B]`` int64, ``1 <= lengths[b] <= C``. Tensor ops with shapes fixed by (B, C, L,
        V) and no host sync (capturable in a CUDA graph): every position p of the history gets the
        length of the common suffix of ``history[b, :p+1]`` and the context (at most
        ``max_ngram``); the ``max_matches`` most recent positions of the longest length vote.
        Triton kernels or tensor ops (:meth:`_draft_tensor_torch`) as ``use_triton`` picks.
        """
        use = self.use_triton
        if use is None:
            use = history.device.type == "cuda" or interpreting()
        if not use:
            return self._draft_tensor_torch(history, lengths, num_positions)
        from .ngram_kernels import ngram_draft

        return ngram_draft(history, lengths, num_positions, vocab_size=self.vocab_size, max_ngram=self.max_ngram,
                           min_ngram=self.min_ngram, max_matches=self.max_matches, smoothing=self.smoothing)

    def _draft_tensor_torch(self, history: torch.Tensor, lengths: torch.Tensor, num_positions: int) -> torch.Tensor:
        """:meth:`draft_tensor` with tensor ops (about 60): the reference, and the path on the CPU."""
        B, C = history.shape
        V, L, K, M = self.vocab_size, num_positions, self.max_ngram, min(self.max_matches, C)
        dev = history.device
        n = lengths.to(torch.int64)
        pos = torch.arange(C, device=dev)
        back = torch.arange(K, device=dev)
        suffix = history.gather(1, (n[:, None] - 1 - back).clamp_(min=0))  # [B, K]: the last K tokens, newest first
        # alive[b, p]: history[b, p-k..p] == the context's last k+1 tokens, p an earlier position
        alive = (history == suffix[:, :1]) & (pos < n[:, None] - 1)  # [B, C]
        length = alive.to(torch.int32)
        for k in range(1, K):
            alive[:, k:] &= history[:, :-k] == suffix[:, k : k + 1]
            alive[:, :k] = False
            length += alive
        best = length.amax(1, keepdim=True)  # [B, 1]
        key = torch.where((length == best) & (best >= self.min_ngram), pos, -1)
        ends = key.topk(M, dim=1).values  # [B, M]: most recent first, -1 = none
        # follower i of match m: history[ends + 1 + i], while inside the context
        idx = ends[:, None, :] + 1 + torch.arange(L, device=dev)[:, None]  # [B, L, M]
        ok = (ends[:, None, :] >= 0) & (idx < n[:, None, None])
        tok = history.gather(1, idx.clamp(max=C - 1).view(B, L * M)).view(B, L, M)
        votes = ((tok[..., :, None] == tok[..., None, :]) & ok[..., None, :]).sum(-1)  # [B, L, M]: votes for tok
        total = ok.sum(-1)  # [B, L]
        s = self.smoothing
        logp = torch.log((1.0 - s) * votes.double() / total.clamp(min=1)[..., None].double() + s / V).float()
        # every (b, i, m) writes a voted token: a follower past the context writes the first valid one
        first = ok.to(torch.int8).argmax(-1, keepdim=True)  # [B, L, 1]
        voted = total[..., None] > 0
        tok = torch.where(ok, tok, tok.gather(-1, first)).masked_fill_(~voted, 0)
        logp = torch.where(ok, logp, logp.gather(-1, first)).masked_fill_(~voted, 0.0)
        out = torch.where(voted, math.log(s / V), 0.0).to(torch.float32).expand(B, L, V).contiguous()
        return out.scatter_(2, tok, logp)  # a position without votes: uniform (all 0)


class SyntheticDrafter:
    """SYNTHETIC drafter with a set agreement with the target, for benchmarking.

    ``references``: each sequence's full greedy token sequence (prompt + the target's greedy
    continuation), e.g. from a plain-decoding run. A context is matched to the first reference it
    is a proper prefix of. At each draft position the true token's rank is drawn: rank ``r``
    (1-based) with probability ``agreement * (1 - agreement)^(r-1)`` for ``r <= max_rank``, else it
    is not proposed; the other ranks hold distinct random tokens. Rank ``r`` gets logit
    ``-rank_gap * (r - 1)``, tokens not proposed ``-1e4``. Draws are a hash of (``seed``,
    reference, position), so the same request drafts the same trees whatever the kernel, batch or
    device. Past a reference's end, or for a context that matches no reference, all positions are
    uniform.

    The references live in one ``[R, capacity]`` buffer (``capacity``: default the longest), copied
    to a device at its first draft there; :meth:`set_references` rewrites them in place, so a
    captured step that drafts from them stays valid.
    """

    name = "synthetic"
    synthetic = True

    def __init__(self, references: Sequence[Sequence[int]], vocab_size: int, *, agreement: float = 0.7,
                 max_rank: int = 4, rank_gap: float = 1.0, seed: int = 0, capacity: int | None = None):
        if not 0.0 <= agreement <= 1.0:
            raise ValueError(f"agreement must be in [0, 1], got {agreement}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (a true token and another), got {vocab_size}")
        refs = [as_context(r) for r in references]
        if not refs:
            raise ValueError("references is empty")
        longest = max(r.numel() for r in refs)
        capacity = longest if capacity is None else capacity
        if capacity < longest:
            raise ValueError(f"capacity {capacity} is shorter than the longest reference ({longest} tokens)")
        self.vocab_size = vocab_size
        self.agreement = agreement
        self.max_rank = max(1, min(max_rank, vocab_size - 1))
        self.rank_gap = rank_gap
        self.seed = seed
        self.name = f"synthetic(agreement={agreement:g})"
        self._tokens = torch.zeros(len(refs), max(1, capacity), dtype=torch.int64)  # [R, capacity]
        self._lengths = torch.zeros(len(refs), dtype=torch.int64)  # [R]
        self._device_copies: dict = {}  # device -> (tokens, lengths)
        self.set_references(refs)

    def set_references(self, references: Sequence[Sequence[int]]) -> None:
        """Replace the references (as many as before, each within the capacity), in place on every
        device they were copied to."""
        refs = [as_context(r) for r in references]
        R, cap = self._tokens.shape
        if len(refs) != R:
            raise ValueError(f"references: {len(refs)} sequences, this drafter holds {R}")
        if max(r.numel() for r in refs) > cap:
            raise ValueError(f"references: a sequence of {max(r.numel() for r in refs)} tokens exceeds the capacity {cap}")
        self._tokens.zero_()
        for i, r in enumerate(refs):
            self._tokens[i, : r.numel()] = r
            self._lengths[i] = r.numel()
        for tokens, lengths in self._device_copies.values():
            tokens.copy_(self._tokens)
            lengths.copy_(self._lengths)

    def references(self) -> list[list[int]]:
        """The references now (host lists)."""
        return [self._tokens[i, :n].tolist() for i, n in enumerate(self._lengths.tolist())]

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._device_copies:  # normal tensors even when first drafted under inference_mode
            with torch.inference_mode(False):  # (set_references rewrites them outside it)
                self._device_copies[key] = (self._tokens.to(device, copy=True), self._lengths.to(device, copy=True))
        return self._device_copies[key]

    def draft(self, contexts: Sequence[torch.Tensor], num_positions: int) -> torch.Tensor:
        """:meth:`draft_tensor` of the contexts (:func:`pad_contexts`) on the CPU."""
        return self.draft_tensor(*pad_contexts(contexts), num_positions)

    def draft_tensor(self, history: torch.Tensor, lengths: torch.Tensor, num_positions: int) -> torch.Tensor:
        """The draft logits ``[B, L, V]`` float32 of ``B`` token histories (``history [B, C]``
        int64, ``lengths [B]`` int64, as :meth:`NGramDrafter.draft_tensor`), on their device.

        Tensor ops with shapes fixed by (B, C, R, capacity, L, V) and no host sync: capturable in a
        CUDA graph. The prefix match compares ``B x R x min(C, capacity)`` tokens.
        """
        V, L, K = self.vocab_size, num_positions, self.max_rank
        dev = history.device
        refs, ref_lens = self._on(dev)
        n = lengths.to(torch.int64)
        cols = min(history.shape[1], refs.shape[1])
        # reference r matches sequence b: longer than its context, equal on it
        differ = (history[:, None, :cols] != refs[None, :, :cols]) & (torch.arange(cols, device=dev) < n[:, None, None])
        match = ~differ.any(-1) & (ref_lens[None, :] > n[:, None])  # [B, R]
        ref = torch.where(match.any(1), match.to(torch.int8).argmax(1), -1)  # [B]: the first match
        p = n[:, None] + torch.arange(L, device=dev)  # [B, L]: reference index of depth i + 1
        r = ref.clamp(min=0)[:, None]
        valid = (ref[:, None] >= 0) & (p < ref_lens[r])
        true = refs[r, p.clamp(max=refs.shape[1] - 1)]  # [B, L]
        draws = _hash_uniform(self.seed, ref[:, None, None], p[..., None], torch.arange(K + 2, device=dev))
        hit = draws[..., :K] < self.agreement  # [B, L, K]: rank k takes the true token if the first hit
        rank = torch.where(hit.any(-1), hit.to(torch.int8).argmax(-1), -1)  # [B, L], -1: not proposed
        # K distinct other tokens: an arithmetic progression modulo V - 1 (stride * (K-1) < V - 1),
        # shifted past the true token
        span = V - 1
        start = (draws[..., K] * span).long().clamp_(max=span - 1)
        stride = 1 + (draws[..., K + 1] * max(1, (span - 1) // max(1, K - 1))).long()
        others = (start[..., None] + stride[..., None] * torch.arange(K, device=dev)) % span  # [B, L, K]
        ranked = others + (others >= true[..., None]).long()
        ranked = torch.where(torch.arange(K, device=dev) == rank[..., None], true[..., None], ranked)
        logit = (-self.rank_gap * torch.arange(K, device=dev, dtype=torch.float32)).expand(ranked.shape)
        out = torch.full((history.shape[0], L, V), NEG, dtype=torch.float32, device=dev)
        out.scatter_(2, ranked, logit.contiguous())
        return out.masked_fill_(~valid[..., None], 0.0)

    @staticmethod
    def expected_chain_acceptance(agreement: float, depth: int) -> float:
        """Mean tokens per step of a pure chain (top-1 only) of ``depth`` drafts: sum_k a^k, k=0..depth."""
        return sum(agreement**k for k in range(depth + 1)) if agreement < 1 else float(depth + 1)


_MASK31 = (1 << 31) - 1


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of int64 values in ``[0, 2^31)`` into ``[0, 2^31)`` (xor-shift-multiply
    rounds; every product stays below 2^63)."""
    for _ in range(3):
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK31
        x = ((x ^ (x >> 12)) * 0x297A2D39) & _MASK31
    return x ^ (x >> 15)


def _hash_uniform(seed: int, *keys: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in ``[0, 1)`` per element of the broadcast ``keys`` (int64 tensors), a
    pure function of (``seed``, keys): the same draws on every device."""
    x = seed & _MASK31  # a Python int until the first key (no host-to-device copy: capturable)
    for k in keys:
        x = _mix31((x * 31 + (k & _MASK31)) & _MASK31)
    return (x >> 7).to(torch.float32) / float(1 << 24)
