"""DDTree construction and compilation: against a brute-force spec, the heap reference and the mask helpers."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kdtree_engine.ddtree import (
    LOGPROB_FLOOR,
    LOGPROB_SCALE,
    DraftTopK,
    DraftTree,
    build_ddtree,
    build_ddtree_reference,
    check_tree,
    compile_tree,
    draft_topk,
    expand_topk,
    expand_topk_reference,
    tree_from_parents,
    tree_links,
)
from kdtree_engine.ddtree.tree import _draft_topk_torch, _expand_topk_torch
from kdtree_engine.masks import ancestor_matrix, pack_tree_mask, tree_mask_from_parents
from kdtree_engine.verify.contract import check_content, check_inputs, D_QK

FIELDS = ("tokens", "parents", "depths", "ranks", "scores")

# the expansion's two implementations: the Triton kernel (CUDA, or the CPU under the interpreter,
# as in these tests) and the tensor-op fallback for the CPU without the interpreter
EXPANSIONS = {
    "kernel": expand_topk,
    "torch": lambda top, budget, roots: _expand_topk_torch(
        top.logprobs, top.token_ids, roots, budget, min(top.logprobs.shape[1], budget)
    ),
}


def assert_same_tree(a: DraftTree, b: DraftTree, fields=FIELDS):
    assert a.num_nodes_host == b.num_nodes_host
    assert a.max_depth == b.max_depth
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        assert x.shape == y.shape, f"{f}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        if not torch.equal(x.cpu(), y.cpu()):
            bad = (x.cpu() != y.cpu()).nonzero()[0].tolist()
            raise AssertionError(f"{f} differs first at {bad}: {x[tuple(bad)]} vs {y[tuple(bad)]}")


def brute_force(top: DraftTopK, budget: int, roots: list[int]):
    """The spec, by enumeration of every node up to depth L (paths of ranks).

    Order: score descending; ties: shallower first, then the node whose parent comes first, then
    the lower rank. Same-depth parents compare by their order within their depth, so the order is
    built depth by depth, then merged.
    """
    lp = top.logprobs.cpu().tolist()
    ids = top.token_ids.cpu().tolist()
    B, L, K = top.logprobs.shape
    out = []
    for b in range(B):
        within = {(): 0}  # path -> rank within its depth
        score = {(): 0}
        nodes = []
        for d in range(1, L + 1):
            level = [p + (r,) for p in score if len(p) == d - 1 for r in range(K)]
            for p in level:
                score[p] = score[p[:-1]] + lp[b][d - 1][p[-1]]
            level.sort(key=lambda p: (-score[p], within[p[:-1]], p[-1]))
            for i, p in enumerate(level):
                within[p] = i
                nodes.append((-score[p], d, i, p))
        nodes.sort()
        chosen = [p for *_, p in nodes[:budget]]
        index = {p: i + 1 for i, p in enumerate(chosen)}
        index[()] = 0
        tokens = [roots[b]] + [ids[b][len(p) - 1][p[-1]] for p in chosen]
        parents = [-1] + [index[p[:-1]] for p in chosen]
        scores = [0] + [score[p] for p in chosen]
        out.append((tokens, parents, scores))
    return out


def logits_case(kind: str, B: int, L: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(B, L, V, generator=g) * 2
    if kind == "ties":  # few distinct values: many equal logits and equal path scores
        return torch.randint(0, 3, (B, L, V), generator=g).float()
    if kind == "peaked":
        x = torch.randn(B, L, V, generator=g)
        x[..., 0] += 30.0  # log-probs of everything else far below; floor not reached
        return x
    if kind == "equal":  # every logit equal: every path of a depth ties
        return torch.zeros(B, L, V)
    if kind == "floor":  # gaps beyond the -1000 floor: equal clamped scores
        x = torch.randn(B, L, V, generator=g)
        x[..., :2] += 5000.0
        return x
    raise ValueError(kind)


# ----------------------------------------------------------------------------------------------
# top-K


# the top-K's two implementations: the split top-K kernels (CUDA, or the CPU under the
# interpreter, as in these tests) and tensor ops for the CPU without the interpreter
TOPKS = {"kernel": draft_topk, "torch": _draft_topk_torch}


def topk_reference(x: torch.Tensor, k: int) -> DraftTopK:
    """The spec of :func:`draft_topk`, literally: a stable sort of the float32 logits (descending;
    equal logits, -0.0 and +0.0 included, keep id order), its first k, float64 log-softmax."""
    xf = x.float().cpu()
    ids = torch.sort(xf, dim=-1, descending=True, stable=True).indices[..., :k]
    lsm = xf.double().gather(-1, ids) - torch.logsumexp(xf.double(), dim=-1, keepdim=True)
    return DraftTopK(token_ids=ids, logprobs=(lsm.clamp(min=LOGPROB_FLOOR) * LOGPROB_SCALE).round().long())


def assert_topk_equal(top: DraftTopK, x: torch.Tensor, k: int):
    """Ids equal to :func:`topk_reference` (order and ties); log-probs within float32 log-softmax
    rounding: ~eps32 * |logit| absolute, in units of 2^-20 nats."""
    ref = topk_reference(x, k)
    assert top.token_ids.shape == top.logprobs.shape == ref.token_ids.shape
    if not torch.equal(top.token_ids.cpu(), ref.token_ids):
        bad = (top.token_ids.cpu() != ref.token_ids).nonzero()[0].tolist()
        raise AssertionError(f"ids differ first at {bad}: {top.token_ids[tuple(bad)]} vs {ref.token_ids[tuple(bad)]}")
    finite = x.float().cpu().masked_fill(~x.float().cpu().isfinite(), 0)
    tol = 64 + 4 * LOGPROB_SCALE * torch.finfo(torch.float32).eps * finite.abs().amax(-1, keepdim=True)
    assert bool(((top.logprobs.cpu() - ref.logprobs).abs() <= tol).all())
    assert bool((top.logprobs[..., 1:] <= top.logprobs[..., :-1]).all())


@pytest.mark.parametrize("kind", ["randn", "ties", "floor"])
@pytest.mark.parametrize("impl", sorted(TOPKS))
def test_draft_topk_order_and_values(kind, impl):
    x = logits_case(kind, 2, 3, 11, seed=3)
    top = TOPKS[impl](x, 5)
    for b, d in itertools.product(range(2), range(3)):
        row = x[b, d].tolist()
        # the 5 first by logit desc, then id asc (ties at the 5th logit: the lowest ids)
        assert top.token_ids[b, d].tolist() == sorted(range(11), key=lambda t: (-row[t], t))[:5]
    assert_topk_equal(top, x, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_draft_topk_kernel_equals_tensor_ops(dtype, device):
    """The kernel and the tensor ops: the same ids in the same order, ties at the k-th logit
    included; fixed-point log-probs within float32 log-sum-exp rounding (the kernel sums per slice,
    torch.logsumexp in its own order). Strided and -inf logits included."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, 3000, generator=g) * 3).to(dtype)
    x[0, 1, ::7] = float("-inf")
    x[1, 2] = x[1, 2].round()  # many ties
    x = x.to(device)[:, :, ::2]  # strided rows
    for k in (1, 17, 300):
        a, b = draft_topk(x, k), _draft_topk_torch(x, k)
        assert torch.equal(a.token_ids, b.token_ids)
        lse_ulp = LOGPROB_SCALE * torch.finfo(torch.float32).eps * 16  # |lse| < 16 here
        assert (a.logprobs - b.logprobs).abs().max() <= 2 * lse_ulp
        assert_topk_equal(a, x, k)


def awkward_logits(B: int, L: int, V: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[B, L, V]`` rows of every awkward kind, cycling: random, few distinct values (ties
    everywhere, across slices), all equal with -0.0 and +0.0 mixed, -inf (whole stretches, and
    rows with a single finite logit), the largest finite values of the dtype, a peak."""
    g = torch.Generator().manual_seed(seed)
    big = torch.finfo(dtype).max
    x = torch.randn(B * L, V, generator=g) * 3
    for r in range(B * L):
        kind = r % 6
        if kind == 1:
            x[r] = torch.randint(0, 3, (V,), generator=g).float()
        elif kind == 2:
            x[r] = torch.where(torch.rand(V, generator=g) < 0.5, -0.0, 0.0)
        elif kind == 3:
            x[r, V // 3 : 2 * V // 3] = float("-inf")
            x[r, torch.rand(V, generator=g) < 0.3] = float("-inf")
            if r % 12 == 3:
                x[r, :] = float("-inf")
                x[r, V - 1] = 0.5
        elif kind == 4:
            x[r, torch.rand(V, generator=g) < 0.4] = big
            x[r, torch.rand(V, generator=g) < 0.3] = -big
        elif kind == 5:
            x[r, V // 2] += 40.0
    return x.to(dtype).view(B, L, V)


# (B, L, V, k, slice): V not a multiple of the slice, k above the slice, k = V, k of the
# largest budget (1023), a single row, more rows than one program holds
SPLIT = [
    (1, 1, 37, 5, 16),
    (2, 3, 101, 40, 16),
    (3, 4, 64, 64, 16),
    (5, 7, 300, 17, 64),
    (2, 2, 3000, 1023, 1024),
    (1, 6, 2500, 512, 4096),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B,L,V,k,vslice", SPLIT, ids=[f"B{c[0]}-L{c[1]}-V{c[2]}-k{c[3]}-slice{c[4]}" for c in SPLIT])
def test_split_topk_awkward(B, L, V, k, vslice, dtype, device, monkeypatch):
    """The split top-K with the slices forced small (rows cut in several slices, the last one
    short), on every awkward kind of row, against the spec and the tensor ops: ids exactly (the
    order, and which of the tokens tied at the k-th logit enter: the lowest ids)."""
    from kdtree_engine.ddtree import kernels

    monkeypatch.setattr(kernels, "TOPK_SLICE", vslice)
    monkeypatch.setattr(kernels, "TOPK_SLICE_INTERPRETED", vslice)
    x = awkward_logits(B, L, V, dtype, seed=V + k).to(device)
    top = draft_topk(x, k)
    assert torch.equal(top.token_ids, _draft_topk_torch(x, k).token_ids)
    assert_topk_equal(top, x, k)


def test_draft_topk_bad_inputs():
    with pytest.raises(TypeError, match="draft_logits"):
        draft_topk(torch.zeros(2, 3, 4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="draft_logits"):
        draft_topk(torch.zeros(2, 3, 4, 5), 2)
    with pytest.raises(ValueError, match="k must be"):
        draft_topk(torch.zeros(2, 3, 4), 5)
    with pytest.raises(TypeError, match="k must be an int"):
        draft_topk(torch.zeros(2, 3, 4), 2.0)


# ----------------------------------------------------------------------------------------------
# construction


BRUTE = [
    # kind, B, L, V, budget, topk
    ("randn", 1, 1, 5, 3, None),
    ("randn", 3, 3, 4, 10, None),
    ("randn", 2, 4, 3, 40, None),  # budget > all 3+9+27+81? no: 120 nodes, 40 chosen
    ("ties", 3, 4, 3, 17, None),
    ("ties", 2, 3, 5, 50, None),
    ("floor", 2, 3, 4, 9, None),
    ("randn", 2, 3, 2, 100, None),  # fewer possible nodes (14) than the budget
    ("ties", 2, 4, 6, 13, 2),  # topk cap
]


@pytest.mark.parametrize("kind,B,L,V,budget,topk", BRUTE, ids=[f"{c[0]}-B{c[1]}-L{c[2]}-V{c[3]}-N{c[4]}-k{c[5]}" for c in BRUTE])
def test_build_matches_brute_force(kind, B, L, V, budget, topk, device):
    x = logits_case(kind, B, L, V, seed=budget).to(device)
    roots = torch.arange(B, device=device) + 100
    tree = build_ddtree(x, budget, roots, topk=topk)
    k = min(topk or budget, budget, V)
    top = draft_topk(x, k)
    spec = brute_force(top, budget, roots.tolist())
    n = len(spec[0][0])
    assert tree.num_nodes_host == (n,) * B and tree.width == n
    for b, (tokens, parents, scores) in enumerate(spec):
        assert tree.tokens[b].tolist() == tokens
        assert tree.parents[b].tolist() == parents
        assert tree.scores[b].tolist() == scores
    check_tree(tree)
    assert_same_tree(tree, build_ddtree_reference(x, budget, roots, topk=topk))


HEAP = [
    ("randn", 4, 16, 1000, 64),
    ("randn", 3, 7, 300, 129),
    ("randn", 2, 16, 5000, 512),
    ("ties", 3, 9, 7, 200),
    ("ties", 2, 5, 2, 61),  # the full binary tree of depth 5 is 62 nodes
    ("peaked", 3, 16, 50, 33),
    ("floor", 2, 6, 9, 70),
    ("randn", 1, 3, 40, 1023),  # maximum budget
]


@pytest.mark.parametrize("kind,B,L,V,budget", HEAP, ids=[f"{c[0]}-B{c[1]}-L{c[2]}-V{c[3]}-N{c[4]}" for c in HEAP])
@pytest.mark.parametrize("expansion", sorted(EXPANSIONS))
def test_vectorised_matches_heap(kind, B, L, V, budget, expansion, device):
    x = logits_case(kind, B, L, V, seed=L * V).to(device)
    roots = torch.arange(B, device=device)
    top = draft_topk(x, min(budget, V))
    fast = EXPANSIONS[expansion](top, budget, roots)
    ref = expand_topk_reference(top, budget, roots)
    assert_same_tree(fast, ref)
    assert fast.tokens.device == x.device
    check_tree(fast)
    # emission order = sorted by the documented key
    for b in range(B):
        s, d = fast.scores[b, 1:].tolist(), fast.depths[b, 1:].tolist()
        keys = [(-si, di) for si, di in zip(s, d)]
        assert keys == sorted(keys)


AWKWARD = [
    # kind, B, L, V, budget, topk
    ("randn", 2, 5, 30, 1, None),  # budget 1: the first position's best token
    ("randn", 3, 9, 50, 37, None),  # budget not a power of 2
    ("ties", 2, 6, 4, 300, None),  # ties everywhere, more survivors than the small blocks
    ("equal", 2, 4, 20, 45, None),  # every path of a depth ties
    ("peaked", 2, 16, 64, 100, 3),  # a deep tree: the running tree prunes every depth
    ("randn", 1, 12, 700, 511, 4),  # many parents of few ranks before the running tree fills
    ("floor", 2, 7, 9, 70, 5),  # clamped scores tie across depths
]


@pytest.mark.parametrize("tiers", [(256, 1024), (2, 8)], ids=["tiers-default", "tiers-tiny"])
@pytest.mark.parametrize("kind,B,L,V,budget,topk", AWKWARD, ids=[f"{c[0]}-B{c[1]}-L{c[2]}-V{c[3]}-N{c[4]}-k{c[5]}" for c in AWKWARD])
def test_expansion_awkward_sizes(kind, B, L, V, budget, topk, tiers, device, monkeypatch):
    """The kernel (its three sort blocks forced by tiny tiers too) against the heap."""
    from kdtree_engine.ddtree import kernels

    monkeypatch.setattr(kernels, "EXPAND_TIERS", tiers)
    x = logits_case(kind, B, L, V, seed=budget + L).to(device)
    roots = torch.arange(B, device=device) + 7
    top = draft_topk(x, min(topk or budget, budget, V))
    fast = expand_topk(top, budget, roots)
    assert_same_tree(fast, expand_topk_reference(top, budget, roots))
    check_tree(fast)


@pytest.mark.parametrize("slots", [2**16, 128], ids=["one-program", "4-seqs-per-program"])
def test_expansion_mixed_batch(slots, device, monkeypatch):
    """Sequences of very different survivor counts side by side (under the interpreter, rows of
    one program; a batch not a multiple of the block leaves padding rows): each tree as the heap's."""
    from kdtree_engine.ddtree import kernels

    monkeypatch.setattr(kernels, "EXPAND_TIERS", (2, 8))
    monkeypatch.setattr(kernels, "EXPAND_INTERPRETED_SLOTS", slots)  # BLOCK_C = 32 below (18 pairs)
    L, V, budget = 6, 5, 9
    x = torch.cat([logits_case(kind, 4, L, V, seed=i) for i, kind in enumerate(["randn", "peaked", "equal", "ties", "floor"])])
    x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))][:19].to(device)
    roots = torch.arange(19, device=device)
    top = draft_topk(x, 4)
    fast = expand_topk(top, budget, roots)
    assert_same_tree(fast, expand_topk_reference(top, budget, roots))
    check_tree(fast)


def test_children_in_rank_order_and_parents_first(device):
    x = logits_case("randn", 2, 6, 30, seed=5).to(device)
    tree = build_ddtree(x, 90, torch.zeros(2, dtype=torch.long, device=device))
    par, rk = tree.parents.cpu(), tree.ranks.cpu()
    for b in range(2):
        for i in range(1, tree.width):
            assert par[b, i] < i
        for p in range(tree.width):
            kids = (par[b] == p).nonzero().flatten().tolist()
            assert [int(rk[b, c]) for c in kids] == list(range(len(kids)))  # ranks 0,1,2.. in index order


@pytest.mark.parametrize("L", [1, 4, 16])
def test_chain_is_special_case(L, device):
    x = logits_case("randn", 3, L, 50, seed=L).to(device)
    roots = torch.tensor([7, 8, 9], device=device)
    tree = build_ddtree(x, L, roots, topk=1)
    assert tree.width == L + 1
    assert tree.parents.tolist() == [list(range(-1, L))] * 3
    assert tree.depths.tolist() == [list(range(L + 1))] * 3
    assert torch.equal(tree.tokens[:, 0], roots)
    assert torch.equal(tree.tokens[:, 1:], x.argmax(-1))
    # a budget beyond L with topk=1 still gives the chain
    assert torch.equal(build_ddtree(x, L + 5, roots, topk=1).tokens, tree.tokens)


def test_degenerate_budgets(device):
    x = logits_case("randn", 2, 3, 4, seed=0).to(device)
    roots = torch.tensor([1, 2], device=device)
    for tree in (build_ddtree(x, 0, roots), build_ddtree(x[:, :0], 5, roots), build_ddtree_reference(x, 0, roots)):
        assert tree.width == 1 and tree.max_depth == 0
        assert tree.tokens.tolist() == [[1], [2]] and tree.parents.tolist() == [[-1], [-1]]
    one = build_ddtree(x, 1, roots)
    assert one.width == 2 and torch.equal(one.tokens[:, 1], x[:, 0].argmax(-1))
    v1 = build_ddtree(x[..., :1], 10, roots)  # V = 1: the chain of token 0
    assert v1.width == 4 and v1.tokens[:, 1:].tolist() == [[0, 0, 0]] * 2
    single = build_ddtree(x[0], 4, roots[:1])  # [L, V] input
    assert single.batch_size == 1


def test_build_bad_inputs(device):
    x = torch.zeros(2, 3, 5, device=device)
    r = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(x, -1, r)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(x, 1024, r)
    with pytest.raises(TypeError, match="budget"):
        build_ddtree(x, 3.0, r)
    with pytest.raises(ValueError, match="root_tokens"):
        build_ddtree(x, 3, r[:1])
    with pytest.raises(TypeError, match="root_tokens"):
        build_ddtree(x, 3, r.float())
    with pytest.raises(ValueError, match="topk"):
        build_ddtree(x, 3, r, topk=0)
    with pytest.raises(TypeError, match="draft_logits"):
        build_ddtree(x.long(), 3, r)
    with pytest.raises(TypeError, match="top"):
        expand_topk(x, 3, r)
    for bad in ([1.5, 2.7], [True, False]):  # host lists: integers only (were truncated / read as 0, 1)
        with pytest.raises(TypeError, match="root_tokens must hold integers"):
            build_ddtree(x, 3, bad)
    top = draft_topk(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)).to(device), 2)
    lp, ids = top.logprobs, top.token_ids  # distinct log-probs along K
    bad_tops = [
        (DraftTopK(ids[..., :1], lp), ValueError, "same shape"),  # (returned garbage)
        (DraftTopK(ids, lp.float()), TypeError, r"top.logprobs must be an integer \[B, L, K\]"),
        (DraftTopK(ids.tolist(), lp.tolist()), TypeError, "top.logprobs must be an integer"),
        (DraftTopK(ids[0], lp[0]), TypeError, "top.logprobs must be an integer"),
    ]
    if x.device.type == "cpu":  # host values: the log-probs' range and order too
        bad_tops += [(DraftTopK(ids, lp.flip(-1)), ValueError, "non-increasing along K"),
                     (DraftTopK(ids, lp + 2**30), ValueError, "fixed-point log-probabilities")]
    for top, exc, msg in bad_tops:
        for expansion in (expand_topk, expand_topk_reference):
            with pytest.raises(exc, match=msg):
                expansion(top, 3, r)


# ----------------------------------------------------------------------------------------------
# trees from parents, structure helpers


def shuffled_tree(n: int, gen: torch.Generator) -> list[int]:
    """A random tree with the root at 0 and the other nodes in random order (children may precede parents)."""
    par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    perm = [0] + (torch.randperm(n - 1, generator=gen) + 1).tolist()
    new = [0] * n
    for old, p in enumerate(par):
        new[perm[old]] = -1 if p < 0 else perm[p]
    return new


def test_tree_from_parents_checks_host_input():
    """Host lists are checked at no cost: integers only (floats were truncated), num_nodes too,
    and a max_depth at least the trees' depth (one below it gave wrong depths, and greedy
    acceptance stopped short); a max_depth must be an int >= 0 for tensors too."""
    with pytest.raises(TypeError, match="must hold integers"):
        tree_from_parents([[-1, 0.5]], [[1, 2]])
    with pytest.raises(TypeError, match="must hold integers"):
        tree_from_parents([[-1, 0]], [[1, 2.5]])
    with pytest.raises(TypeError, match="num_nodes must hold integers"):
        tree_from_parents([[-1, 0]], [[1, 2]], num_nodes=[1.5])
    with pytest.raises(ValueError, match=r"deeper \(3\) than max_depth=1"):
        tree_from_parents([[-1, 0, 1, 2]], [[1, 2, 3, 4]], max_depth=1)
    for bad in (-1, 2.5, "a"):
        with pytest.raises(ValueError, match="max_depth must be an int >= 0"):
            tree_from_parents(torch.tensor([[-1, 0]]), torch.tensor([[1, 2]]), max_depth=bad)
    assert tree_from_parents([[-1, 0, 1, 2]], [[1, 2, 3, 4]], max_depth=5).max_depth == 5  # a looser bound is fine


def test_tree_from_parents_depths_and_links(device):
    g = torch.Generator().manual_seed(11)
    sizes = [1, 2, 33, 70, 5]
    parents = [shuffled_tree(n, g) for n in sizes]
    tokens = [torch.randperm(200, generator=g)[:n].tolist() for n in sizes]
    pad = torch.nn.utils.rnn.pad_sequence
    par_t = pad([torch.tensor(p) for p in parents], batch_first=True, padding_value=-1).to(device)
    tok_t = pad([torch.tensor(t) for t in tokens], batch_first=True, padding_value=-1).to(device)
    tree = tree_from_parents(par_t, tok_t, sizes)
    check_tree(tree)
    assert tree.num_nodes_host == tuple(sizes) and tree.width == 70
    fc, ns = tree_links(tree)
    for b, p in enumerate(parents):
        n = len(p)
        depth = [0] * n
        for i in range(n):
            j = i
            while p[j] >= 0:
                j, depth[i] = p[j], depth[i] + 1
        assert tree.depths[b, :n].tolist() == depth
        assert tree.depths[b, n:].tolist() == [-1] * (70 - n)
        kids = {i: [c for c in range(n) if p[c] == i] for i in range(n)}
        assert fc[b, :n].tolist() == [k[0] if k else -1 for k in kids.values()]
        want_ns = [-1] * n
        for k in kids.values():
            for a, c in zip(k, k[1:]):
                want_ns[a] = c
        assert ns[b, :n].tolist() == want_ns
    assert tree.max_depth == max(max(d for d in tree.depths[b].tolist()) for b in range(len(sizes)))


def test_check_tree_rejects():
    good = tree_from_parents([[-1, 0, 0]], [[1, 2, 3]])
    with pytest.raises(ValueError, match="tree 0: node 0 has two children with token 5"):
        check_tree(dataclasses.replace(good, tokens=torch.tensor([[1, 5, 5]])))
    with pytest.raises(ValueError, match="only root"):
        check_tree(dataclasses.replace(good, parents=torch.tensor([[-1, -1, 0]])))
    # lists and CPU tensors are refused when built (with a max_depth, tensors were not checked)
    for make in (lambda x: x, torch.tensor):
        with pytest.raises(ValueError, match="cycle"):
            tree_from_parents(make([[-1, 2, 1]]), make([[1, 2, 3]]), max_depth=2)
        with pytest.raises(ValueError, match=r"deeper \(3\) than max_depth=2"):
            tree_from_parents(make([[-1, 0, 1, 2]]), make([[1, 2, 3, 4]]), max_depth=2)
        with pytest.raises(ValueError, match="tree 1: node 1 has two children with token 7"):  # (check_tree did)
            tree_from_parents(make([[-1, 0, 1, 1], [-1, 0, 1, 1]]), make([[1, 2, 7, 8], [1, 2, 7, 7]]), max_depth=2)
        tree_from_parents(make([[-1, 0, 1, 2]]), make([[1, 7, 7, 7]]), max_depth=3)  # a token again, not as siblings
        for parents in ([[-1, -1, 1]], [[-1, 0, -1]], [[1, 0, 0]]):  # (check_tree refused them)
            with pytest.raises(ValueError, match=r"parents\[0\]: node 0 must be the only root"):
                tree_from_parents(make(parents), make([[1, 2, 3]]), max_depth=2)
    with pytest.raises(ValueError, match="num_nodes"):
        tree_from_parents([[-1, 0]], [[1, 2]], [3])
    with pytest.raises(ValueError, match="outside"):
        tree_from_parents([[-1, 0], [-1, 5]], [[1, 2], [1, 2]])
    for bad in (-5, 4, 2**31 - 1):  # CPU tensors too (a gather past the row raised IndexError, -5 passed)
        with pytest.raises(ValueError, match=r"parents\[1\] holds an index outside \[-1, 4\)"):
            tree_from_parents(torch.tensor([[-1, 0, 0, 0], [-1, 0, bad, 1]]), torch.ones(2, 4, dtype=torch.int64),
                              max_depth=3)
    tree_from_parents(torch.tensor([[-1, 0, 1, 99]]), torch.ones(1, 4, dtype=torch.int64), [3])  # past num_nodes
    with pytest.raises(TypeError, match="both"):
        tree_from_parents(torch.tensor([[-1, 0]]), [[1, 2]])


# ----------------------------------------------------------------------------------------------
# compile


def test_compile_ddtree_batch(device):
    x = logits_case("randn", 3, 5, 40, seed=1).to(device)
    tree = build_ddtree(x, 70, torch.tensor([3, 4, 5], device=device))  # 71 nodes: 3 mask words
    prefix = torch.tensor([0, 9, 1000], device=device)
    vb = compile_tree(tree, prefix)
    n = tree.width
    assert vb.num_rows == 3 * n and vb.tree_mask.shape == (3 * n, 3) and vb.tree_mask.dtype == torch.int32
    assert vb.qo_indptr.tolist() == [0, n, 2 * n, 3 * n] and vb.qo_indptr.dtype == torch.int32
    for b in range(3):
        rows = slice(b * n, (b + 1) * n)
        want = tree_mask_from_parents(tree.parents[b].cpu())
        assert torch.equal(vb.tree_mask[rows].cpu(), want)
        assert torch.equal(vb.positions[rows], prefix[b] + tree.depths[b])
        assert torch.equal(vb.kv_positions[rows], prefix[b] + torch.arange(n, device=device))
        assert torch.equal(vb.input_ids[rows], tree.tokens[b])


def test_compile_ragged_paged_and_wide(device):
    g = torch.Generator().manual_seed(4)
    sizes = [1, 40, 7, 65]
    parents = [shuffled_tree(n, g) for n in sizes]
    tokens = [list(range(n)) for n in sizes]
    tree = tree_from_parents(parents, tokens)
    tree = tree_from_parents(tree.parents.to(device), tree.tokens.to(device), sizes)
    prefix = [5, 0, 33, 2]
    page_size = 4
    kv_lens = [p + n for p, n in zip(prefix, sizes)]
    pages = [(L + page_size - 1) // page_size for L in kv_lens]
    perm = torch.randperm(sum(pages) + 3, generator=g)
    table = torch.full((4, max(pages)), 10**6, dtype=torch.int32)
    c = 0
    for b, k in enumerate(pages):
        table[b, :k] = perm[c : c + k].to(torch.int32)
        c += k
    vb = compile_tree(tree, prefix, words=5)
    T = sum(sizes)
    assert vb.num_rows == T and vb.tree_mask.shape == (T, 5)
    assert vb.qo_indptr.tolist() == [0, 1, 41, 48, 113]
    for b in range(4):
        q0, q1 = vb.qo_indptr[b].item(), vb.qo_indptr[b + 1].item()
        want = pack_tree_mask(ancestor_matrix(parents[b]), words=5)
        assert torch.equal(vb.tree_mask[q0:q1].cpu(), want)
        assert vb.input_ids[q0:q1].tolist() == tokens[b]
        assert torch.equal(vb.positions[q0:q1], prefix[b] + tree.depths[b, : sizes[b]])
        pos = torch.arange(sizes[b]) + prefix[b]
        assert vb.kv_positions[q0:q1].tolist() == pos.tolist()
        assert vb.row_index[b, : sizes[b]].tolist() == list(range(q0, q1))
        assert vb.row_index[b, sizes[b] :].tolist() == [-1] * (65 - sizes[b])
    # the contract's own content checks accept the compiled batch
    q = torch.zeros(T, 3, D_QK, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(int(perm.numel()), page_size, D_QK, dtype=torch.bfloat16, device=device)
    kv_lens_d = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    info = check_inputs(q, kv, table.to(device), kv_lens_d, vb.qo_indptr, vb.tree_mask)
    check_content(table.to(device), kv_lens_d, vb.qo_indptr, vb.tree_mask, info)


def test_compile_bad_inputs(device):
    tree = build_ddtree(torch.zeros(2, 2, 3, device=device), 3, torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="prefix_lens"):
        compile_tree(tree, [1])
    with pytest.raises(TypeError, match="prefix_lens"):
        compile_tree(tree, torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="words"):
        compile_tree(tree, [0, 0], words=0)
    with pytest.raises(ValueError, match="words=1099511627776 is wider than the 32 words"):
        compile_tree(tree, [0, 0], words=2**40)  # (reached the allocator)
    with pytest.raises(TypeError, match="words must be an int"):
        compile_tree(tree, [0, 0], words=True)
    for bad in ([1.5, 2.5], [True, False]):  # host lists: integers only (were truncated)
        with pytest.raises(TypeError, match="prefix_lens must hold integers"):
            compile_tree(tree, bad)
    bad_lens = [[-5, -7]] + ([torch.tensor([3, -1])] if tree.device.type == "cpu" else [])  # host values >= 0
    for bad in bad_lens:
        with pytest.raises(ValueError, match="prefix_lens must be >= 0"):
            compile_tree(tree, bad)
    with pytest.raises(TypeError, match="tree"):
        compile_tree("tree", [0, 0])
