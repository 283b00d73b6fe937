"""The float64 reference against an independent formulation (dense per-head SDPA with a bool mask)."""

import math

import pytest
import torch

from kdtree_engine import reference, unpack_tree_mask
from kdtree_engine.testing import CaseSpec, build_case, chain_tree, random_tree, star_tree


def dense_sdpa(c, sm_scale):
    """Materialise each sequence's K/V contiguously and run float64 SDPA over all heads."""
    outs, lses = [], []
    kv_cache = c["kv_cache"].to(torch.float64)
    ps = kv_cache.shape[1]
    qo = c["qo_indptr"].tolist()
    for b, L in enumerate(c["kv_lens"].tolist()):
        n = qo[b + 1] - qo[b]
        flat = kv_cache[c["page_table"][b].long()].reshape(-1, 576)[:L]  # pages in table order
        assert flat.shape[0] == L and ps * c["page_table"].shape[1] >= L
        q = c["q"][qo[b] : qo[b + 1]].to(torch.float64).transpose(0, 1)  # [H, n, 576]
        mask = torch.cat([torch.ones(n, L - n, dtype=torch.bool), unpack_tree_mask(c["tree_mask"][qo[b] : qo[b + 1]], n)], 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, flat[None], flat[None, :, :512], attn_mask=mask, scale=sm_scale)
        s = (q @ flat.T) * sm_scale
        lse = torch.logsumexp(s.masked_fill(~mask, -math.inf), -1)
        outs.append(o.transpose(0, 1))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_reference_matches_dense_sdpa(page_size):
    gen = torch.Generator().manual_seed(3)
    spec = CaseSpec("r", 5, [0, 17, 40], [random_tree(7, gen), chain_tree(4), star_tree(9)], page_size=page_size)
    c = build_case(spec)
    out, lse = reference(**c, sm_scale=0.07)
    d_out, d_lse = dense_sdpa(c, 0.07)
    torch.testing.assert_close(out, d_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, d_lse, rtol=1e-10, atol=1e-12)


def test_reference_single_visible_key_is_that_row():
    """A root with no prefix sees only itself: out = its own V row, lse = its own score."""
    spec = CaseSpec("one", 3, [0], [[-1, 0]], page_size=1)
    c = build_case(spec)
    out, lse = reference(**c)
    k = c["kv_cache"][c["page_table"][0, 0].long(), 0].to(torch.float64)
    torch.testing.assert_close(out[0], k[:512].expand(3, 512))
    torch.testing.assert_close(lse[0], (c["q"][0].to(torch.float64) @ k) / math.sqrt(576))


def test_reference_row_without_visible_key():
    spec = CaseSpec("empty", 2, [0], [[-1, 0]], page_size=1)
    c = build_case(spec)
    c["tree_mask"][1] = 0b01  # node 1 sees only the root, not itself
    c["tree_mask"][0] = 0  # node 0 sees nothing
    out, lse = reference(**c)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(torch.isneginf(lse[0]).all())
    assert bool(torch.isfinite(lse[1]).all())
