"""End to end: speculative decoding with DDTree trees is lossless on toy deterministic targets.

* A table target (next-token logits from the token, the previous token and the position) decoded
  for hundreds of tokens: greedy speculative output == plain greedy output, token for token.
* A toy attention model run through the float64 verify reference with compiled masks, positions,
  a paged KV cache (permuted pages, NaN-poisoned stale slots) and the commit moves.
* Sampling over several steps: the joint law of the first three emitted tokens is the target's.
"""

from __future__ import annotations

import math

import pytest
import torch

from kdtree_engine.ddtree import (
    accept_greedy,
    accept_sampling,
    build_ddtree,
    commit_positions,
    compile_tree,
    filter_probs,
)
from kdtree_engine.verify.contract import D_QK, D_V
from kdtree_engine.verify.reference import reference

# ----------------------------------------------------------------------------------------------
# a table target


class TableTarget:
    """logits(next | token, prev, pos) = A[token] + B[prev] + C[pos % 7]."""

    def __init__(self, vocab: int, seed: int, device):
        g = torch.Generator().manual_seed(seed)
        self.V = vocab
        self.A = (torch.randn(vocab, vocab, generator=g) * 2).to(device)
        self.B = (torch.randn(vocab, vocab, generator=g)).to(device)
        self.C = (torch.randn(7, vocab, generator=g)).to(device)

    def logits(self, tok, prev, pos):
        return self.A[tok] + self.B[prev] + self.C[pos % 7]


def tree_logits(target: TableTarget, tree, vb, prev_root: torch.Tensor) -> torch.Tensor:
    """Target logits ``[T, V]`` for the verify rows: prev token of a node = its parent's token."""
    par_tok = tree.tokens.gather(1, tree.parents.clamp(min=0))
    prev = torch.where(tree.parents >= 0, par_tok, prev_root[:, None])  # [B, n]
    flat_prev = prev.reshape(-1)[vb.row_index.reshape(-1)[vb.row_index.reshape(-1) >= 0]]
    return target.logits(vb.input_ids, flat_prev, vb.positions)


def plain_greedy(target: TableTarget, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    dev = target.A.device
    for _ in range(steps):
        t = torch.tensor([seq[-1]], device=dev)
        p = torch.tensor([seq[-2]], device=dev)
        pos = torch.tensor([len(seq) - 1], device=dev)
        seq.append(int(target.logits(t, p, pos).argmax()))
    return seq


def noisy_draft(expected: list[list[int]], starts: list[int], L: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """Draft logits [B, L, V]: noise plus a bump on the true next tokens, of random strength (0 = miss)."""
    B = len(expected)
    x = torch.randn(B, L, V, generator=gen)
    strength = torch.tensor([0.0, 2.0, 4.0, 9.0])[torch.randint(0, 4, (B, L), generator=gen)]
    for b in range(B):
        for d in range(min(L, len(expected[b]) - starts[b])):
            x[b, d, expected[b][starts[b] + d]] += strength[b, d]
    return x


GREEDY = [
    # budget, L, topk, batch
    (1, 1, None, 3),
    (4, 4, 1, 2),  # chain
    (8, 4, None, 4),
    (33, 16, None, 3),
    (128, 6, None, 2),
]


@pytest.mark.parametrize("budget,L,topk,B", GREEDY, ids=[f"N{c[0]}-L{c[1]}-k{c[2]}-B{c[3]}" for c in GREEDY])
def test_greedy_speculative_equals_plain_greedy(budget, L, topk, B, device):
    V, new_tokens = 23, 150
    target = TableTarget(V, seed=budget, device=device)
    gen = torch.Generator().manual_seed(L)
    prompts = [[int(x) for x in torch.randint(0, V, (2 + b,), generator=gen)] for b in range(B)]
    expected = [plain_greedy(target, p, new_tokens + L + 1) for p in prompts]
    seqs = [list(p) for p in prompts]
    steps = 0
    accepted_drafts = 0
    while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < new_tokens:
        roots = torch.tensor([s[-1] for s in seqs], device=device)
        prev_root = torch.tensor([s[-2] for s in seqs], device=device)
        prefix = torch.tensor([len(s) - 1 for s in seqs], device=device)
        draft = noisy_draft(expected, [len(s) for s in seqs], L, V, gen).to(device)
        tree = build_ddtree(draft, budget, roots, topk=topk)
        vb = compile_tree(tree, prefix)
        res = accept_greedy(tree, tree_logits(target, tree, vb, prev_root))
        lengths = res.lengths.tolist()
        new = res.new_tokens.tolist()
        for b in range(B):
            seqs[b].extend(new[b][: lengths[b]])
            k = min(len(seqs[b]), len(expected[b]))  # fast sequences may run past the expectation
            assert seqs[b][:k] == expected[b][:k], f"diverged at step {steps}, sequence {b}"
        accepted_drafts += sum(lengths) - B
        steps += 1
    assert steps < new_tokens  # the draft helped: more than one token per step on average
    assert accepted_drafts > 0


# ----------------------------------------------------------------------------------------------
# a toy attention model through the verify reference


class ToyAttentionLM:
    """One absorbed-MLA-shaped attention layer: KV row = E[token] + Pe[position], q = row @ Wq[h],
    logits = out (all heads) @ U. Float64 so the verify reference is exact enough for argmax."""

    def __init__(self, vocab: int, heads: int, max_pos: int, seed: int, device):
        g = torch.Generator().manual_seed(seed)
        self.V, self.H = vocab, heads
        self.E = (torch.randn(vocab, D_QK, generator=g) * 0.5).double().to(device)
        self.Pe = (torch.randn(max_pos, D_QK, generator=g) * 0.5).double().to(device)
        self.Wq = (torch.randn(heads, D_QK, D_QK, generator=g) * 3 / math.sqrt(D_QK)).double().to(device)
        self.U = (torch.randn(heads * D_V, vocab, generator=g) * 4 / math.sqrt(heads * D_V)).double().to(device)

    def rows(self, tok, pos):
        return self.E[tok] + self.Pe[pos]  # [T, 576]

    def q(self, tok, pos):
        return torch.einsum("td,hde->the", self.rows(tok, pos), self.Wq)  # [T, H, 576]

    def head(self, out):
        return out.reshape(out.shape[0], -1) @ self.U  # [T, V]

    def next_token(self, seq: list[int]) -> int:
        """Plain decoding: the whole sequence in a contiguous cache, the last token as a 1-node tree."""
        dev = self.E.device
        L = len(seq)
        tok = torch.tensor(seq, device=dev)
        pos = torch.arange(L, device=dev)
        kv = self.rows(tok, pos)[:, None, :]  # page size 1, page i = position i
        out, _ = reference(
            self.q(tok[-1:], pos[-1:]),
            kv,
            torch.arange(L, dtype=torch.int32, device=dev)[None, :],
            torch.tensor([L], dtype=torch.int32, device=dev),
            torch.tensor([0, 1], dtype=torch.int32, device=dev),
            torch.ones(1, 1, dtype=torch.int32, device=dev),
        )
        return int(self.head(out).argmax())


def test_attention_model_lossless_with_paged_cache(device):
    V, H, L, budget, B, new_tokens = 17, 3, 5, 12, 3, 24
    page_size, max_len = 4, 96
    lm = ToyAttentionLM(V, H, max_len, seed=0, device=device)
    gen = torch.Generator().manual_seed(1)
    prompts = [[int(x) for x in torch.randint(0, V, (n,), generator=gen)] for n in (1, 4, 7)]
    expected = []
    for p in prompts:
        s = list(p)
        while len(s) < len(p) + new_tokens + L + 1:
            s.append(lm.next_token(s))
        expected.append(s)

    # paged cache: permuted pages, everything NaN until written
    pages_per_seq = max_len // page_size
    num_pages = B * pages_per_seq + 2
    table = torch.randperm(num_pages, generator=gen)[: B * pages_per_seq].view(B, pages_per_seq)
    table = table.to(torch.int32).to(device)
    cache = torch.full((num_pages, page_size, D_QK), float("nan"), dtype=torch.float64, device=device)
    flat = cache.view(-1, D_QK)

    def slots(b: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return table.long()[b, pos // page_size] * page_size + pos % page_size

    seqs = [list(p) for p in prompts]
    for b, s in enumerate(seqs):  # committed prefix = all but the last token (the first root)
        pos = torch.arange(len(s) - 1, device=device)
        flat[slots(torch.full_like(pos, b), pos)] = lm.rows(torch.tensor(s[:-1], dtype=torch.long, device=device), pos)
    prefix = torch.tensor([len(s) - 1 for s in seqs], device=device)
    steps = 0
    while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < new_tokens:
        roots = torch.tensor([s[-1] for s in seqs], device=device)
        draft = noisy_draft(expected, [len(s) for s in seqs], L, V, gen).to(device)
        tree = build_ddtree(draft, budget, roots)
        vb = compile_tree(tree, prefix)
        seq = torch.arange(B, device=device).repeat_interleave(tree.num_nodes, output_size=vb.num_rows)
        flat[slots(seq, vb.kv_positions)] = lm.rows(vb.input_ids, vb.positions)  # node j at P + j, RoPE P + depth
        kv_lens = (prefix + tree.num_nodes).to(torch.int32)
        out, _ = reference(lm.q(vb.input_ids, vb.positions), cache, table, kv_lens, vb.qo_indptr, vb.tree_mask)
        res = accept_greedy(tree, lm.head(out))
        src, dst, prefix = commit_positions(res, prefix)
        on = src >= 0
        bidx = torch.arange(B, device=device)[:, None].expand_as(src)
        moved = flat[slots(bidx[on], src[on])].clone()
        flat[slots(bidx[on], dst[on])] = moved
        # poison every slot past the committed prefix: stale tree KV must never be read
        for b in range(B):
            pos = torch.arange(int(prefix[b]), max_len, device=device)
            flat[slots(torch.full_like(pos, b), pos)] = float("nan")
        lengths, new = res.lengths.tolist(), res.new_tokens.tolist()
        for b in range(B):
            seqs[b].extend(new[b][: lengths[b]])
            k = min(len(seqs[b]), len(expected[b]))  # fast sequences may run past the expectation
            assert seqs[b][:k] == expected[b][:k], f"diverged at step {steps}, sequence {b}"
            assert int(prefix[b]) == len(seqs[b]) - 1
        steps += 1
    assert steps < new_tokens


# ----------------------------------------------------------------------------------------------
# sampling over several steps


def test_sampling_over_steps_matches_target_joint(device):
    """Joint law of the first three emitted tokens (across steps) = the target's chain rule."""
    V, L, budget, B = 4, 3, 6, 40000
    target = TableTarget(V, seed=3, device=device)
    temperature, top_k, top_p = 0.9, None, 0.95
    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.Generator().manual_seed(2)
    prev_root = torch.full((B,), 1, device=device)
    roots = torch.full((B,), 2, device=device)
    prefix = torch.full((B,), 5, device=device)
    out = torch.full((B, 3), -1, dtype=torch.long, device=device)
    have = torch.zeros(B, dtype=torch.long, device=device)
    draft_base = target.A[torch.tensor([2, 0, 3])].cpu()
    for _ in range(3):
        draft = (draft_base + torch.randn(B, L, V, generator=g)).to(device)
        tree = build_ddtree(draft, budget, roots)
        vb = compile_tree(tree, prefix)
        res = accept_sampling(
            tree, tree_logits(target, tree, vb, prev_root), temperature=temperature, top_k=top_k, top_p=top_p, generator=gen
        )
        # append the emitted tokens into out (first 3 per sequence), vectorised
        col = have[:, None] + torch.arange(res.new_tokens.shape[1], device=device)[None, :]
        ok = (res.new_tokens >= 0) & (col < 3)
        out.view(-1).scatter_(0, (torch.arange(B, device=device)[:, None] * 3 + col.clamp(max=2))[ok], res.new_tokens[ok])
        have = (have + res.lengths).clamp(max=3)
        # next step: the last two committed tokens and the new position
        L_new = res.lengths
        last_acc = res.accepted_tokens.gather(1, (L_new - 1)[:, None])[:, 0]
        prev_root = torch.where(L_new > 0, last_acc, prev_root)
        roots = res.bonus
        prefix = prefix + L_new
    assert bool((have == 3).all())
    # expected joint: p(a | 2, prev 1, pos 5) p(b | a, 2, pos 6) p(c | b, a, pos 7)
    def cond(tok, prev, pos):
        return filter_probs(target.logits(tok, prev, pos)[None], temperature, top_k, top_p)[0].cpu().double()

    t = lambda v: torch.tensor(v, device=device)  # noqa: E731
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    p1 = cond(t(2), t(1), t(5))
    for a in range(V):
        p2 = cond(t(a), t(2), t(6))
        for b_ in range(V):
            joint[a, b_] = p1[a] * p2[b_] * cond(t(b_), t(a), t(7))
    counts = torch.bincount((out[:, 0] * V * V + out[:, 1] * V + out[:, 2]).cpu(), minlength=V**3)
    exp = joint.flatten() * B
    small = exp < 5
    c = torch.cat([counts[~small].double(), counts[small].sum().double().reshape(1)])
    e = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    stat = float(((c - e) ** 2 / e.clamp(min=1e-12)).sum())
    dof = int(c.numel()) - 1
    h = 2.0 / (9.0 * dof)
    bound = dof * (1.0 - h + 4.75 * math.sqrt(h)) ** 3
    assert stat < bound, f"chi2={stat:.1f} dof={dof} bound={bound:.1f}"


# ----------------------------------------------------------------------------------------------
# the KV pool of kdtree_engine.kvpool takes the trees and the accepted paths as they are


@pytest.mark.parametrize("page_size", [1, 4])
def test_kvpool_interop(page_size, device):
    from kdtree_engine.kvpool import KVPool

    g = torch.Generator().manual_seed(page_size)
    B, V = 3, 30
    pool = KVPool(num_pages=200 // page_size + 8, page_size=page_size, device=device, max_seqs=4)
    ids = [pool.add_sequence() for _ in range(B)]
    prefix = [5, 0, 13]
    pool.extend(ids, prefix)
    tree = build_ddtree(torch.randn(B, 4, V, generator=g).to(device), 20, torch.tensor([1, 2, 3], device=device))
    step = pool.reserve_step(ids, tree)
    vb = compile_tree(tree, torch.tensor(prefix, device=device))
    sizes = list(tree.num_nodes_host)
    assert step.kv_lens.tolist() == list(step.kv_lens_host) == [p + n for p, n in zip(prefix, sizes)]
    assert step.qo_indptr.tolist() == list(step.qo_indptr_host) == vb.qo_indptr.tolist()
    assert torch.equal(step.tree_mask, vb.tree_mask) and torch.equal(step.tokens, vb.input_ids)
    assert torch.equal(step.rope_pos, vb.positions)
    # the slots are where the page table puts positions P_b + j
    pos = vb.kv_positions.cpu()
    seq = torch.arange(B).repeat_interleave(torch.tensor(sizes))
    want = step.page_table.cpu().long()[seq, pos // page_size] * page_size + pos % page_size
    assert step.slots.tolist() == want.tolist()
    # tag each node's KV row with its flat verify row, accept, commit, read back by position
    cache = pool.kv_cache().view(-1, D_QK)
    cache[step.slots] = torch.arange(step.num_rows, device=device, dtype=cache.dtype)[:, None].expand(-1, D_QK)
    tgt = torch.randint(0, V, (step.num_rows,), generator=g).to(device)
    tgt.view(B, -1)[:, 0] = tree.tokens[:, 1]  # the best first child is accepted at least
    res = accept_greedy(tree, torch.nn.functional.one_hot(tgt, V).float())
    pool.commit(ids, res.accepted, res.lengths, num_accepted_host=res.lengths.cpu())
    src, dst, new_len = commit_positions(res, torch.tensor(prefix, device=device))
    page_table, kv_lens = pool.verify_inputs(ids)
    assert torch.equal(kv_lens.long(), new_len)
    n = tree.width
    for b in range(B):
        for i in range(int(res.lengths[b])):
            pos = int(dst[b, i])
            slot = int(page_table[b, pos // page_size]) * page_size + pos % page_size
            assert int(cache[slot, 0]) == b * n + int(res.accepted[b, i])  # node's row, now at P + i
