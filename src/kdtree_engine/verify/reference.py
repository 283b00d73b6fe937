"""Float64 reference of tree-verify attention: a plain loop per sequence with an explicit mask.

Deliberately simple; every kernel is checked against it. Runs on any device.
"""

from __future__ import annotations

import math

import torch

from ..masks import unpack_tree_mask
from .contract import D_QK, D_V

__all__ = ["reference", "gather_sequence_kv"]


def gather_sequence_kv(kv_cache: torch.Tensor, page_table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` cache rows of one sequence, in position order: ``[kv_len, 576]``."""
    page_size = kv_cache.shape[1]
    pos = torch.arange(kv_len, device=kv_cache.device)
    pages = page_table_row.to(torch.int64)[pos // page_size]
    return kv_cache[pages, pos % page_size]


def reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 tree-verify attention with the contract of :func:`kdtree_engine.verify_attention`.

    Returns ``(out [T, H, 512] float64, lse [T, H] float64)`` on q's device. Rows with no visible
    key get out = 0 and lse = -inf; a row with a NaN score among its visible keys (NaN in q or in
    a key it sees) gets out and lse NaN.
    """
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D_QK)
    T, H, _ = q.shape
    out = torch.zeros(T, H, D_V, dtype=torch.float64, device=q.device)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64, device=q.device)
    kv_lens = kv_lens.tolist()
    qo_indptr = qo_indptr.tolist()
    for b, kv_len in enumerate(kv_lens):
        q0, q1 = qo_indptr[b], qo_indptr[b + 1]
        n = q1 - q0
        prefix = kv_len - n
        k = gather_sequence_kv(kv_cache, page_table[b], kv_len).to(torch.float64)  # [L, 576]
        v = k[:, :D_V]  # [L, 512]
        visible = torch.ones(n, kv_len, dtype=torch.bool, device=q.device)
        visible[:, prefix:] = unpack_tree_mask(tree_mask[q0:q1], n)
        scores = torch.einsum("nhd,ld->nhl", q[q0:q1].to(torch.float64), k) * sm_scale  # [n, H, L]
        scores = scores.masked_fill(~visible[:, None, :], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [n, H]
        has_key = visible.any(-1)[:, None].expand(n, H)
        # a row with no visible key has probs 0 (its exp(-inf - -inf) is NaN); a NaN score of a
        # visible key (NaN in q or in the KV it sees) makes its row NaN, out and lse
        probs = torch.where(has_key[..., None], torch.exp(scores - row_lse[..., None]), 0.0)
        out[q0:q1] = torch.einsum("nhl,ld->nhd", probs, v)
        lse[q0:q1] = torch.where(has_key, row_lse, -math.inf)
    return out, lse
