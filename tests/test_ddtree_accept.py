"""Acceptance: the batched walk against the reference walk, filtering against a per-row float64
reference, and a chi-square test that sampling acceptance reproduces the target distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kdtree_engine.ddtree import (
    accept_greedy,
    accept_reference,
    accept_sampling,
    accept_tokens,
    build_ddtree,
    commit_positions,
    compile_tree,
    filter_logits,
    filter_probs,
    greedy_workspace,
    sample_from_logits,
    sample_from_probs,
    target_tokens_greedy,
    target_tokens_sampled,
    tree_from_parents,
    tree_links,
)

from kdtree_engine.ddtree.accept import _accept_tokens_torch, _padded_targets

# the walk's two implementations: the Triton kernel (CUDA, or the CPU under the interpreter, as in
# these tests) and the tensor-op fallback for the CPU without the interpreter
WALKS = {
    "kernel": accept_tokens,
    "torch": lambda tree, tgt: _accept_tokens_torch(tree, _padded_targets(tree, tgt)),
}

RESULT_FIELDS = ("accepted", "lengths", "bonus", "accepted_tokens", "new_tokens")


def assert_same_result(a, b):
    for f in RESULT_FIELDS:
        x, y = getattr(a, f).cpu(), getattr(b, f).cpu()
        assert x.shape == y.shape, f"{f}: {tuple(x.shape)} != {tuple(y.shape)}"
        assert torch.equal(x, y), f"{f} differs:\n{x}\n{y}"


def chi2_bound(dof: int, z: float = 4.75) -> float:
    """Upper quantile of chi-square(dof) at about p = 1e-6 (Wilson-Hilferty)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells expected < 5 are pooled into one."""
    counts = counts.double().flatten().cpu()
    exp = probs.double().flatten().cpu() * counts.sum()
    assert bool((counts[exp == 0] == 0).all()), "a zero-probability outcome occurred"
    small = exp < 5
    c = torch.cat([counts[~small & (exp > 0)], counts[small].sum().reshape(1)])
    e = torch.cat([exp[~small & (exp > 0)], exp[small].sum().reshape(1)])
    keep = e > 0
    c, e = c[keep], e[keep]
    return float(((c - e) ** 2 / e).sum()), int(c.numel()) - 1


def matching_targets(tree, p_match: float, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Target tokens [B, n]: with probability p_match a random child's token, else a random token."""
    B, n = tree.batch_size, tree.width
    par, tok = tree.parents.cpu(), tree.tokens.cpu()
    out = torch.randint(0, vocab, (B, n), generator=gen)
    for b in range(B):
        for i in range(n):
            kids = (par[b] == i).nonzero().flatten()
            if len(kids) and float(torch.rand(1, generator=gen)) < p_match:
                out[b, i] = tok[b, kids[int(torch.randint(0, len(kids), (1,), generator=gen))]]
    return out.to(tree.device)


# ----------------------------------------------------------------------------------------------
# the walk


CASES = [
    # B, L, V, budget
    (1, 1, 5, 1),
    (4, 5, 7, 20),
    (3, 16, 50, 33),
    (2, 9, 11, 129),
    (5, 3, 3, 4),
]


@pytest.mark.parametrize("B,L,V,budget", CASES, ids=[f"B{c[0]}-L{c[1]}-V{c[2]}-N{c[3]}" for c in CASES])
@pytest.mark.parametrize("p_match", [0.0, 0.8, 1.0])
@pytest.mark.parametrize("walk", sorted(WALKS))
def test_walk_matches_reference_on_ddtrees(B, L, V, budget, p_match, walk, device):
    g = torch.Generator().manual_seed(B * 100 + budget)
    x = torch.randn(B, L, V, generator=g).to(device)
    tree = build_ddtree(x, budget, torch.randint(0, V, (B,), generator=g).to(device))
    tgt = matching_targets(tree, p_match, V, g)
    got = WALKS[walk](tree, tgt.reshape(-1))  # flat [T] rows
    assert_same_result(got, accept_reference(tree, tgt))
    assert got.accepted.shape == (B, tree.max_depth + 1)
    if p_match == 1.0:  # every node has a matching child until a leaf: the path ends at a leaf
        for b in range(B):
            last = int(got.accepted[b, got.lengths[b] - 1])
            assert not bool((tree.parents[b] == last).any())


def ragged_tree(device, g, V: int, sizes=(1, 9, 30, 17, 2)):
    """Ragged trees of ``sizes`` nodes with shuffled node order (children before parents too) and
    distinct tokens below ``V`` (so siblings are distinct)."""
    parents, tokens = [], []
    for n in sizes:
        par = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        perm = [0] + (torch.randperm(n - 1, generator=g) + 1).tolist()
        new = [0] * n
        for old, p in enumerate(par):
            new[perm[old]] = -1 if p < 0 else perm[p]
        parents.append(new)
        tokens.append(torch.randperm(V, generator=g)[:n].tolist())
    tree = tree_from_parents(parents, tokens)
    return tree_from_parents(tree.parents.to(device), tree.tokens.to(device), list(sizes))


@pytest.mark.parametrize("walk", sorted(WALKS))
def test_walk_on_ragged_shuffled_trees(walk, device):
    g = torch.Generator().manual_seed(7)
    sizes = [1, 9, 70, 33, 2]
    tree = ragged_tree(device, g, 1000, sizes)
    for p_match in (0.5, 1.0):
        tgt = matching_targets(tree, p_match, 1000, g)
        flat = torch.cat([tgt[b, :n] for b, n in enumerate(sizes)])  # verify rows, qo_indptr order
        assert_same_result(WALKS[walk](tree, flat), accept_reference(tree, tgt))
        assert_same_result(WALKS[walk](tree, tgt), accept_reference(tree, tgt))
        assert_same_result(WALKS[walk](tree, tgt.t().contiguous().t()), accept_reference(tree, tgt))


def test_greedy_uses_first_argmax_and_flat_rows(device):
    # chain root(5) -> 1 -> 2 -> 3 and a sibling 4 under the root
    tree = tree_from_parents([[-1, 0, 1, 2, 0]], [[5, 1, 2, 3, 4]])
    tree = tree_from_parents(tree.parents.to(device), tree.tokens.to(device))
    logits = torch.full((5, 8), -1.0, device=device)
    logits[0, 1] = 2.0  # root -> 1
    logits[1, 2] = 2.0
    logits[1, 6] = 2.0  # tie: argmax is the first index, 2
    logits[2, 7] = 1.0  # 2 -> 7 is not a child of node 2: stop, bonus 7
    res = accept_greedy(tree, logits)
    assert res.accepted.tolist() == [[0, 1, 2, -1]]
    assert res.lengths.tolist() == [3] and res.bonus.tolist() == [7]
    assert res.accepted_tokens.tolist() == [[5, 1, 2, -1]]
    assert res.new_tokens.tolist() == [[1, 2, 7, -1]]


@pytest.mark.parametrize("V", [1, 7, 2048 + 3], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_greedy_kernel_equals_argmax_then_walk(V, ragged, device, monkeypatch):
    """The one-launch greedy acceptance against torch's argmax then the reference walk: ragged
    and uniform batches, V of 1, below and not a multiple of the argmax block (also forced tiny),
    ties everywhere, -inf rows, NaN, -0.0, bf16, rows chosen so the walk goes deep."""
    from kdtree_engine.ddtree import kernels

    g = torch.Generator().manual_seed(V)
    if ragged:
        tree = ragged_tree(device, g, max(V, 40), (1, 9, 40, 2))
    else:
        x = torch.randn(3, 6, max(V, 2), generator=g)
        tree = build_ddtree(x[..., :V].to(device), 20, torch.randint(0, V, (3,), generator=g).to(device))
    T = sum(tree.num_nodes_host)
    starts = [sum(tree.num_nodes_host[:b]) for b in range(tree.batch_size)]
    Vt = max(V, 40) if ragged else V
    ws = greedy_workspace(tree.batch_size + 3, device)  # shared by every call below, wider than B
    for case in ("deep", "ties", "special"):
        logits = torch.randint(0, 3, (T, Vt), generator=g).float() if case == "ties" else torch.randn(T, Vt, generator=g)
        if case == "deep":  # follow a child at most nodes
            tgt = matching_targets(tree, 0.9, Vt, g).cpu()
            for b, s0 in enumerate(starts):
                for j in range(tree.num_nodes_host[b]):
                    logits[s0 + j, tgt[b, j]] = 50.0
        if case == "special":
            logits[0] = float("-inf")
            logits[1 % T, : Vt // 2] = -0.0
            logits[1 % T, Vt // 2 :] = 0.0
            logits[2 % T, (3 * Vt) // 4] = float("nan")
        logits = logits.to(device)
        for block in (kernels.GREEDY_BLOCK_V, 4) if Vt < 100 else (kernels.GREEDY_BLOCK_V,):
            monkeypatch.setattr(kernels, "GREEDY_BLOCK_V", block)
            for lg in (logits, logits.to(torch.bfloat16), logits.t().contiguous().t()):  # column stride != 1
                want = accept_reference(tree, lg.float().cpu().argmax(1).to(device))
                assert_same_result(accept_greedy(tree, lg), want)
                assert_same_result(accept_greedy(tree, lg, workspace=ws), want)
    assert not ws.any()  # left zero by every call


def test_greedy_workspace_checked(device):
    tree = tree_from_parents([[-1, 0], [-1, 0]], [[1, 2], [3, 4]])
    tree = tree_from_parents(tree.parents.to(device), tree.tokens.to(device))
    logits = torch.zeros(4, 8, device=device)
    with pytest.raises(TypeError, match="workspace"):
        accept_greedy(tree, logits, workspace=torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="workspace"):
        accept_greedy(tree, logits, workspace=[0, 0])
    with pytest.raises(TypeError, match="workspace"):
        accept_greedy(tree, logits, workspace=torch.zeros(4, dtype=torch.int32, device=device)[::2])
    with pytest.raises(ValueError, match="workspace"):
        accept_greedy(tree, logits, workspace=greedy_workspace(1, device))
    if device != "cpu":
        with pytest.raises(ValueError, match="workspace"):
            accept_greedy(tree, logits, workspace=greedy_workspace(2, "cpu"))


@pytest.mark.parametrize("block, V", [(4, 45), (None, 2 * 8192 + 2 * 2048 + 7)], ids=["block4", "block2048"])
def test_greedy_argmax_nan_inf_ties(block, V, device, monkeypatch):
    """The greedy kernel's argmax on awkward rows, one root-only sequence per row (its bonus is
    the row's argmax): NaN above every number (either sign; the first NaN wins, across lanes,
    steps and the chunks of one step), NaN with +inf, all -inf, ties of +inf and of numbers
    across lanes, steps and chunks, -0.0 == +0.0, a float32 subnormal, the maximum in the partial
    last chunk; float32 (against fixed columns), bfloat16, float16, float64 (against torch's
    argmax of the float32 logits); float8 e4m3 (no -inf: columns past V lose to -448). Steps of 4
    chunks of ``block`` lanes: two whole steps, then chunks past them, the last partial."""
    from kdtree_engine.ddtree import kernels

    if block is not None:
        monkeypatch.setattr(kernels, "GREEDY_BLOCK_V", block)
    lanes = min(1 << (V - 1).bit_length(), kernels.GREEDY_BLOCK_V)
    step = lanes * kernels.STREAM_UNROLL
    assert V // step == 2 and V % lanes > 0

    def col(s, u, lane):  # the column at chunk u of step s, lane ``lane``
        return s * step + u * lanes + lane

    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(V)
    rows = []  # (row [V] float32, its argmax, columns of negative NaNs)

    def row(want, *sets, base=None, neg_nan=()):
        x = torch.randn(V, generator=g) if base is None else torch.full((V,), base)
        for c, v in sets:
            x[c] = v
        rows.append((x, int(x.argmax()) if want is None else want, neg_nan))

    row(None)
    row(col(0, 1, 3), (col(0, 0, 0), inf), (col(0, 1, 3), nan), (col(1, 0, 1), nan))
    row(col(1, 2, 2), (col(0, 0, 1), inf), (col(1, 2, 2), nan), neg_nan=[col(1, 2, 2)])
    row(col(1, 1, 2), (col(1, 3, 2), nan), (col(1, 1, 2), nan), (col(2, 0, 2), nan), (col(0, 0, 2), 50.0))
    row(V - 1, (0, inf), (V - 1, nan))
    row(col(0, 0, 2), (col(0, 0, 2), nan), (col(0, 2, 0), nan), base=-inf, neg_nan=[col(0, 0, 2)])
    row(0, base=-inf)
    row(V - 1, (V - 1, -1e30), base=-inf)
    row(col(0, 3, 1), (col(1, 0, 3), inf), (col(0, 3, 1), inf), (col(2, 0, 0), inf))
    row(col(0, 2, 3), (col(1, 0, 0), 10.0), (col(0, 2, 3), 10.0), (col(2, 1, 0), 10.0))
    row(col(0, 0, 3), (col(0, 1, 0), 10.0), (col(0, 0, 3), 10.0))
    row(col(0, 3, 2), (col(0, 3, 2), 10.0), (col(1, 0, 2), 10.0), (col(2, 0, 2), 10.0))
    row(col(1, 1, 1), (col(1, 1, 1), 10.0), (col(1, 2, 1), 10.0), (col(1, 3, 0), 10.0))
    row(col(0, 2, 1), (col(0, 2, 1), -0.0), (col(1, 0, 0), 0.0), base=-1.0)
    row(col(0, 0, 2), (col(0, 2, 1), 0.0), (col(0, 0, 2), -0.0), base=-1.0)
    row(col(1, 1, 1), (col(0, 0, 0), 0.0), (col(1, 1, 1), 2.0**-140), base=-1.0)  # 0 in bf16, fp16
    row(V - 1, (V - 1, 10.0), (V - 2, 9.0))
    row(0, base=1.0)
    row(col(2, 0, 1), (col(2, 0, 1), 10.0), (col(2, 1, 0), 10.0), (V - 1, 10.0))

    B = len(rows)
    tree = tree_from_parents([[-1]] * B, [[0]] * B)
    tree = tree_from_parents(tree.parents.to(device), tree.tokens.to(device))
    x32 = torch.stack([x for x, _, _ in rows])
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}
    for dtype, bits in ints.items():
        lg = x32.to(dtype)
        for r, (_, _, cols) in enumerate(rows):
            for c in cols:  # set the sign bit of a NaN (conversions may drop it)
                lg.view(bits)[r, c] |= torch.iinfo(bits).min
                assert torch.isnan(lg[r, c].float()) and lg.view(bits)[r, c] < 0
        got = accept_greedy(tree, lg.to(device)).bonus.cpu()
        assert torch.equal(got, lg.float().argmax(1)), f"{dtype}: {got.tolist()}"
        if dtype == torch.float32:
            assert got.tolist() == [w for _, w, _ in rows]
    lg = torch.full((B, V), -448.0)
    lg[torch.arange(1, B), torch.arange(1, B)] = -416.0
    assert accept_greedy(tree, lg.to(torch.float8_e4m3fn).to(device)).bonus.tolist() == list(range(B))


def test_commit_positions(device):
    tree = tree_from_parents([[-1, 0, 0, 2, 3], [-1, 0, 1, 1, 0]], [[9, 1, 2, 3, 4], [9, 1, 2, 3, 4]])
    tree = tree_from_parents(tree.parents.to(device), tree.tokens.to(device))
    tgt = torch.tensor([[2, 0, 3, 4, 0], [1, 3, 0, 0, 0]], device=device)
    res = accept_tokens(tree, tgt)
    assert res.accepted.tolist() == [[0, 2, 3, 4], [0, 1, 3, -1]]
    src, dst, new_len = commit_positions(res, torch.tensor([10, 0], device=device))
    assert src.tolist() == [[10, 12, 13, 14], [0, 1, 3, -1]]
    assert dst.tolist() == [[10, 11, 12, 13], [0, 1, 2, -1]]
    assert new_len.tolist() == [14, 3]


def test_accept_bad_inputs(device):
    tree = build_ddtree(torch.zeros(2, 3, 4, device=device), 5, torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="target_tokens"):
        accept_tokens(tree, torch.zeros(7, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="target_tokens"):
        accept_tokens(tree, torch.zeros(12, device=device))
    with pytest.raises(TypeError, match="target_tokens must be a torch.Tensor"):
        accept_tokens(tree, [0] * 12)  # (an AttributeError on the kernel path)
    with pytest.raises(TypeError, match="top_k must be an int or an integer"):
        accept_sampling(tree, torch.zeros(12, 4, device=device), top_k=2.0)
    with pytest.raises(TypeError, match="tree"):
        accept_tokens(None, torch.zeros(12, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="prefix_lens"):
        commit_positions(accept_tokens(tree, torch.zeros(12, dtype=torch.long, device=device)), [0, 0])
    with pytest.raises(ValueError, match="target_logits"):
        accept_sampling(tree, torch.zeros(7, 4, device=device), top_k=2)
    with pytest.raises(TypeError, match="target_logits"):
        accept_sampling(tree, torch.zeros(12, 4, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="top_p"):
        accept_sampling(tree, torch.zeros(12, 4, device=device), top_k=2, top_p=1.5)
    tgt = torch.zeros(12, dtype=torch.long, device=device)
    for dtype in (torch.bool, torch.complex64):  # (were accepted: read as 0 / 1, imaginary part dropped)
        for accept in (accept_tokens, accept_reference):
            with pytest.raises(TypeError, match="target_tokens must be an integer tensor"):
                accept(tree, tgt.to(dtype))
    with pytest.raises(TypeError, match="tree must be a DraftTree"):
        accept_reference(None, tgt)
    res = accept_tokens(tree, tgt)
    with pytest.raises(TypeError, match="result must be an AcceptResult"):
        commit_positions(None, torch.zeros(2, dtype=torch.long, device=device))  # (an AttributeError)
    for dtype in (torch.float32, torch.bool):  # (floats were truncated, bools read as 0 / 1)
        with pytest.raises(TypeError, match="prefix_lens must be an integer tensor"):
            commit_positions(res, torch.ones(2, device=device).to(dtype))
    if device == "cpu":  # host values: >= 0 (gave negative positions)
        with pytest.raises(ValueError, match="prefix_lens must be >= 0"):
            commit_positions(res, torch.tensor([-3, 4]))


# ----------------------------------------------------------------------------------------------
# filtering


def filter_reference(row: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """One row, float64, the documented rules spelled out."""
    x = row.double()
    V = x.numel()
    if temperature <= 0:
        out = torch.zeros(V, dtype=torch.float64)
        out[int(x.argmax())] = 1.0
        return out
    x = x / temperature
    keep = torch.ones(V, dtype=torch.bool)
    if top_k and top_k < V:
        keep &= x >= x.sort(descending=True).values[top_k - 1]
    if top_p is not None and top_p < 1:
        p = torch.softmax(x.masked_fill(~keep, -math.inf), 0)
        order = sorted(range(V), key=lambda t: -float(p[t]))
        mass, kept = 0.0, []
        for t in order:
            if mass >= top_p:
                break
            kept.append(t)
            mass += float(p[t])
        keep &= p >= min(float(p[t]) for t in kept)
    return torch.softmax(x.masked_fill(~keep, -math.inf), 0)


FILTERS = [
    (1.0, None, None),
    (0.6, None, None),
    (1.3, 5, None),
    (1.0, None, 0.7),
    (0.8, 7, 0.5),
    (1.0, 1, None),
    (0.0, None, None),
    (2.0, 0, 1.0),  # both off
    (1.0, 40, 0.999),
]


@pytest.mark.parametrize("temperature,top_k,top_p", FILTERS, ids=[f"t{f[0]}-k{f[1]}-p{f[2]}" for f in FILTERS])
def test_filter_probs_against_reference(temperature, top_k, top_p, device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 37, generator=g) * 2
    logits[0, :4] = 3.0  # ties at the top
    logits[1] = torch.randint(0, 3, (37,), generator=g).float()  # ties everywhere
    got = filter_probs(logits.to(device), temperature, top_k, top_p).cpu()
    for r in range(6):
        want = filter_reference(logits[r], temperature, top_k, top_p)
        assert torch.equal(got[r] > 0, want > 0), f"row {r}: kept sets differ"
        torch.testing.assert_close(got[r].double(), want, atol=1e-6, rtol=1e-5)


def test_filter_probs_per_row_parameters(device):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 23, generator=g)
    temps = torch.tensor([1.0, 0.0, 0.5, 1.5], device=device)
    ks = torch.tensor([0, 3, 23, 5], device=device)
    ps = torch.tensor([1.0, 0.5, 0.9, 0.3], device=device)
    got = filter_probs(logits.to(device), temps, ks, ps).cpu()
    for r in range(4):
        want = filter_reference(logits[r], float(temps[r]), int(ks[r]), float(ps[r]))
        torch.testing.assert_close(got[r].double(), want, atol=1e-6, rtol=1e-5)


def test_filter_probs_bad_inputs(device):
    x = torch.zeros(3, 5, device=device)
    with pytest.raises(ValueError, match="top_p"):
        filter_probs(x, 1.0, None, 0.0)
    with pytest.raises(ValueError, match="top_k"):
        filter_probs(x, 1.0, -1)
    with pytest.raises(ValueError, match="temperature"):
        filter_probs(x, torch.ones(2, device=device))
    with pytest.raises(TypeError, match="logits"):
        filter_probs(x.long())
    with pytest.raises(TypeError, match="temperature"):
        filter_probs(x, "hot")
    for t in (math.nan, math.inf):  # a host scalar: checked (the paths disagreed, or sampled token 0)
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            filter_probs(x, t)
    # per-row tensors: real dtypes (a complex temperature raised NotImplementedError, bools were read as 0 / 1)
    rows = torch.ones(3, device=device)
    for kw, msg in ((dict(temperature=rows.to(torch.complex64)), "temperature must be a real-valued tensor"),
                    (dict(top_p=rows.bool()), "top_p must be a real-valued tensor"),
                    (dict(top_k=rows.bool()), "top_k must be an int or an integer")):
        with pytest.raises(TypeError, match=msg):
            filter_logits(x, **kw)
    if device == "cpu":  # host values: a negative top_k row was read as off (an int one raises)
        with pytest.raises(ValueError, match="top_k must be >= 0"):
            filter_logits(x, top_k=torch.tensor([2, -1, 2]))
    # the row functions: [R, V >= 1] floating point (were IndexError / RuntimeError / AttributeError)
    for fn in (sample_from_logits, sample_from_probs, target_tokens_greedy):
        with pytest.raises(ValueError, match=r"must be \[R, V\]"):
            fn(torch.zeros(2, 0, device=device))
        with pytest.raises(ValueError, match=r"must be \[R, V\]"):
            fn(torch.zeros(3, device=device))
        with pytest.raises(TypeError, match="must be a floating-point torch.Tensor"):
            fn(torch.zeros(2, 3, dtype=torch.long, device=device))
        with pytest.raises(TypeError, match="must be a floating-point torch.Tensor"):
            fn([[0.0, 1.0]])


def test_per_row_parameters_out_of_range_are_greedy_or_argmax(device):
    """Per-row tensors are not read on the host: a temperature not above 0 (NaN too) is greedy,
    a top-p not above 0 (NaN too) keeps the most probable token, on both sampling paths. The
    fused path sampled token 0, whose logit is -inf, for a top-p of 0 or below."""
    row = torch.tensor([-math.inf, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 2.0], device=device)
    tree = tree_from_parents([[-1]] * 32, [[3]] * 32)
    tree = type(tree)(*(getattr(tree, f).to(device) if isinstance(getattr(tree, f), torch.Tensor) else getattr(tree, f)
                        for f in ("tokens", "parents", "depths", "num_nodes", "num_nodes_host", "max_depth")))
    logits = row.expand(32, 8)
    bad = torch.tensor([0.0, -0.5, math.nan, 0.0] * 8, device=device)
    for kw in (dict(top_p=bad), dict(top_p=bad, top_k=5), dict(temperature=bad), dict(temperature=bad, top_k=5),
               dict(temperature=bad, top_p=0.9)):
        probs = filter_probs(logits, **{"temperature": 1.0, **kw})
        assert torch.equal(probs[:, 7].cpu(), torch.ones(32)), kw
        g = torch.Generator(device=device).manual_seed(3)
        bonus = accept_sampling(tree, logits, generator=g, **kw).bonus.cpu()
        assert (bonus == 7).all(), (kw, bonus.tolist())


@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_p=0.8), dict(top_p=0.8), dict(top_k="rows")])
def test_sampling_does_not_depend_on_the_logits_layout(kw, device):
    """The same values in another layout (row-strided, transposed) give bit for bit the same
    samples: the filtered copy kept the input's strides, so the random draws landed on other cells."""
    g = torch.Generator().manual_seed(8)
    base = torch.randn(12, 13, generator=g).to(device)
    if kw.get("top_k") == "rows":
        kw = dict(top_k=torch.tensor([3, 0, 5, 13] * 3, device=device))
    wide = torch.zeros(12, 26, device=device)
    wide[:, ::2] = base
    results = []
    for logits in (base, wide[:, ::2], base.t().contiguous().t()):
        gen = torch.Generator(device=device).manual_seed(5)
        results.append(target_tokens_sampled(logits, generator=gen, **kw).cpu())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# ----------------------------------------------------------------------------------------------
# sampling is lossless


def test_sample_from_probs_distribution(device):
    g = torch.Generator(device=device).manual_seed(3)
    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05], device=device)
    s = sample_from_probs(p.expand(40000, 5), generator=g)
    counts = torch.bincount(s.cpu(), minlength=5)
    stat, dof = chi2_stat(counts, p)
    assert stat < chi2_bound(dof)
    assert counts[1] == 0


SAMPLING = [
    # temperature, top_k, top_p
    (1.0, None, None),
    (0.7, 3, None),
    (1.2, None, 0.8),
    (1.0, 4, 0.9),
]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING, ids=[f"t{s[0]}-k{s[1]}-p{s[2]}" for s in SAMPLING])
def test_sampling_acceptance_is_lossless(temperature, top_k, top_p, device):
    """Many copies of one tree: the first emitted token follows the filtered target at the root,
    and, given it was a drafted child, so does the second (the target at that child)."""
    V, L, budget, B = 6, 3, 9, 30000
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V, V, generator=g) * 1.5  # target logits after token t: table[t]
    draft = table[torch.tensor([2, 0, 4])] + 0.5 * torch.randn(L, V, generator=g)  # a decent draft
    tree = build_ddtree(draft[None].expand(B, L, V).to(device), budget, torch.full((B,), 2, device=device))
    vb = compile_tree(tree, torch.zeros(B, dtype=torch.long, device=device))
    logits = table.to(device)[vb.input_ids]  # [T, V]: the target after each node's token
    gen = torch.Generator(device=device).manual_seed(11)
    res = accept_sampling(tree, logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    probs = filter_probs(table.to(device), temperature, top_k, top_p).cpu().double()  # [V, V]

    first = res.new_tokens[:, 0].cpu()
    stat, dof = chi2_stat(torch.bincount(first, minlength=V), probs[2])
    assert stat < chi2_bound(dof), f"first token: chi2={stat:.1f} dof={dof}"
    # negative control: the same samples are far from the unfiltered / untempered target
    if (temperature, top_k, top_p) != (1.0, None, None):
        wrong = torch.softmax(table[2].double(), 0)
        assert chi2_stat(torch.bincount(first, minlength=V), wrong)[0] > chi2_bound(dof)
    # second token, conditioned on the first (whatever the path length)
    second = res.new_tokens[:, 1].cpu()
    for a in range(V):
        sel = (first == a) & (second >= 0)
        if int(sel.sum()) < 2000:
            continue
        stat, dof = chi2_stat(torch.bincount(second[sel], minlength=V), probs[a])
        assert stat < chi2_bound(dof), f"second token after {a}: chi2={stat:.1f} dof={dof}"
    # acceptance happened at all (the test exercises the walk, not only the bonus)
    assert float((res.lengths > 1).double().mean()) > 0.3


def test_sampling_temperature_zero_equals_greedy(device):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 6, 20, generator=g).to(device)
    tree = build_ddtree(x, 40, torch.tensor([1, 2, 3], device=device))
    logits = torch.randn(sum(tree.num_nodes_host), 20, generator=g).to(device)
    assert_same_result(accept_sampling(tree, logits, temperature=0.0), accept_greedy(tree, logits))


def test_lossy_rule_is_detected(device):
    """Negative control for the harness above: a typical lossy shortcut (accept the draft's best
    child whenever the target gives it >= 15%) must fail the same chi-square bound."""
    V, L, budget, B = 6, 3, 9, 30000
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V, V, generator=g) * 1.5
    draft = table[torch.tensor([2, 0, 4])] + 0.5 * torch.randn(L, V, generator=g)
    tree = build_ddtree(draft[None].expand(B, L, V).to(device), budget, torch.full((B,), 2, device=device))
    logits = table.to(device)[compile_tree(tree, torch.zeros(B, dtype=torch.long, device=device)).input_ids]
    gen = torch.Generator(device=device).manual_seed(11)
    tokens = sample_from_probs(filter_probs(logits), gen).view(B, -1)
    best_child = tree.tokens[:, 1]
    p_child = torch.softmax(logits.view(B, -1, V)[:, 0], -1).gather(1, best_child[:, None])[:, 0]
    tokens[:, 0] = torch.where(p_child >= 0.15, best_child, tokens[:, 0])
    first = accept_tokens(tree, tokens).new_tokens[:, 0].cpu()
    stat, dof = chi2_stat(torch.bincount(first, minlength=V), torch.softmax(table[2].double(), 0))
    assert stat > chi2_bound(dof)


# ----------------------------------------------------------------------------------------------
# the fused sampler (kernels.sample_walk): the walk samples only the nodes it reaches


def root_only(rows: int, device):
    """``rows`` one-node trees: sequence b's root is verify row b, so the walk samples every row."""
    tree = tree_from_parents([[-1]] * rows, [[0]] * rows)
    return tree_from_parents(tree.parents.to(device), tree.tokens.to(device))


def sample_rows(logits, seed, **filt):
    """The fused sampler's draw at every row of ``logits [R, V]`` (generator seeded ``seed``)."""
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    return accept_sampling(root_only(logits.shape[0], logits.device), logits, generator=gen, **filt).bonus


FUSED = [
    dict(temperature=0.8, top_k=5, top_p=0.7),
    dict(temperature=1.3, top_k=12),
    dict(temperature=0.9),
    dict(temperature="rows", top_k=6, top_p="rows"),
]


def filter_kwargs(f, rows: int, device, g):
    """``f`` with "rows" replaced by per-row tensors (some temperatures <= 0: greedy rows)."""
    out = dict(f)
    if out.get("temperature") == "rows":
        out["temperature"] = (torch.rand(rows, generator=g) * 1.5 - 0.3).to(device)
    if out.get("top_p") == "rows":
        out["top_p"] = (torch.rand(rows, generator=g) * 0.9 + 0.1).to(device)
    return out


@pytest.mark.parametrize("f", FUSED, ids=[str(i) for i in range(len(FUSED))])
@pytest.mark.parametrize("trees", ["ddtree", "ragged"])
def test_fused_sampling_is_sampling_every_node_then_walking(f, trees, device):
    """The walk samples only the nodes it reaches; each draw depends on (seed, row) only, so the
    result equals drawing at every row (one-node trees over the same rows) and walking those."""
    g = torch.Generator().manual_seed(4)
    V, L, budget, B = 30, 4, 20, 6
    if trees == "ddtree":
        draft = torch.randn(B, L, V, generator=g)
        tree = build_ddtree(draft.to(device), budget, torch.randint(0, V, (B,), generator=g).to(device))
    else:
        tree = ragged_tree(device, g, V)
        B = tree.batch_size
    vb = compile_tree(tree, torch.zeros(B, dtype=torch.long, device=device))
    # targets that often follow the tree: the walk goes deep
    logits = torch.randn(B, tree.width, V, generator=g)
    first = tree_links(tree)[0].cpu()  # [B, n]
    child_tok = tree.tokens.cpu().gather(1, first.clamp(min=0))
    logits.scatter_add_(2, child_tok[..., None], torch.where(first >= 0, 8.0, 0.0)[..., None])
    logits = logits[tree.node_mask().cpu()]  # [T, V] verify rows
    kw = filter_kwargs(f, vb.num_rows, device, g)
    gen = torch.Generator(device=device).manual_seed(21)
    got = accept_sampling(tree, logits.to(device), generator=gen, **kw)
    everywhere = sample_rows(logits.to(device), 21, **kw)
    assert_same_result(got, accept_reference(tree, everywhere))
    assert float((got.lengths > 2).double().mean()) > 0.3
    again = accept_sampling(tree, logits.to(device), generator=torch.Generator(device=device).manual_seed(21), **kw)
    assert_same_result(got, again)  # deterministic for a generator state


def tied_logits(rows: int, V: int, g) -> torch.Tensor:
    """Logits on a coarse grid (many ties, as bf16 has at a large vocabulary)."""
    return torch.randint(-6, 4, (rows, V), generator=g).float() * 0.5


@pytest.mark.parametrize("f", FUSED, ids=[str(i) for i in range(len(FUSED))])
@pytest.mark.parametrize("small", [False, True], ids=["sizes", "tiny-buffer"])
def test_fused_samples_lie_in_the_filtered_support(f, small, device, monkeypatch):
    """Every draw is a token that :func:`filter_probs` keeps; greedy rows draw the first argmax.
    ``tiny-buffer`` shrinks the candidate buffer and the lanes so that the overflow paths (ties
    past the buffer, the bisection of the lower bound) run."""
    from kdtree_engine.ddtree import kernels

    if small:
        monkeypatch.setattr(kernels, "SAMPLE_CAP_MIN_INTERPRETED", 1)
        monkeypatch.setattr(kernels, "SAMPLE_CAP_MIN", 1)
        monkeypatch.setattr(kernels, "SAMPLE_BLOCK_V", 4)
    g = torch.Generator().manual_seed(8)
    R, V = 400, 70
    logits = tied_logits(R, V, g).to(device)
    kw = filter_kwargs(f, R, device, g)
    for seed in range(3):
        s = sample_rows(logits, seed, **kw).cpu()
        probs = filter_probs(logits, kw.get("temperature", 1.0), kw.get("top_k"), kw.get("top_p")).cpu()
        assert bool((probs.gather(1, s[:, None]) > 0).all())
        t = kw.get("temperature", 1.0)
        if isinstance(t, torch.Tensor):
            greedy = (t <= 0).cpu()
            assert torch.equal(s[greedy], logits.argmax(1).cpu()[greedy])


FUSED_CHI2 = [
    # name, temperature, top_k, top_p, logits builder
    ("ties-past-buffer", 1.0, 3, 0.5),
    ("lower-bound-bisection", 0.5, 3, None),
    ("ties-past-buffer-no-top-p", 0.7, 3, None),
]


def chi2_logits(name: str, V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    if name.startswith("ties"):  # two tokens above 50 tied ones: the 3rd largest ties 50 times
        x = torch.rand(V, generator=g) - 3.0
        x[:2] = 1.0
        x[torch.randperm(V - 2, generator=g)[:50] + 2] = 0.5
        return x
    x = torch.rand(V, generator=g)  # lane 0 of 4 holds the large values
    x[::4] = 4.0 + torch.rand(V // 4, generator=g)
    return x


@pytest.mark.parametrize("name,temperature,top_k,top_p", FUSED_CHI2, ids=[c[0] for c in FUSED_CHI2])
def test_fused_overflow_paths_are_lossless(name, temperature, top_k, top_p, device, monkeypatch):
    """Chi-square of the fused draws against :func:`filter_probs` where the candidate buffer (8
    entries here) overflows: ties at the top-k threshold past it, and a lower bound from 4 lanes
    that bisection must raise."""
    from kdtree_engine.ddtree import kernels

    monkeypatch.setattr(kernels, "SAMPLE_CAP_MIN_INTERPRETED", 1)
    monkeypatch.setattr(kernels, "SAMPLE_CAP_MIN", 1)
    monkeypatch.setattr(kernels, "SAMPLE_BLOCK_V", 4)
    V, R = 96, 6000
    row = chi2_logits(name, V)
    logits = row.expand(R, V).to(device)
    s = sample_rows(logits, 5, temperature=temperature, top_k=top_k, top_p=top_p).cpu()
    probs = filter_probs(row[None].to(device), temperature, top_k, top_p)[0].cpu().double()
    stat, dof = chi2_stat(torch.bincount(s, minlength=V), probs)
    assert dof >= 2 and stat < chi2_bound(dof), f"chi2={stat:.1f} dof={dof}"


# ----------------------------------------------------------------------------------------------
# fixed shapes: what a CUDA graph captures


@pytest.mark.parametrize("kind", ["random", "all-equal", "one-hot"])
def test_step_shapes_do_not_depend_on_values(kind, device):
    """Every output of the per-step functions has a shape fixed by (B, L, V, budget) and the
    counts on the device: the values of the logits (ties everywhere, a single token) change
    neither the tree's shape nor the acceptance's."""
    B, L, V, budget = 3, 5, 40, 24
    g = torch.Generator().manual_seed(6)
    draft = {"random": torch.randn(B, L, V, generator=g), "all-equal": torch.zeros(B, L, V),
             "one-hot": torch.full((B, L, V), -30.0).index_fill_(2, torch.tensor([7]), 5.0)}[kind].to(device)
    roots = torch.randint(0, V, (B,), generator=g).to(device)
    ref = build_ddtree(torch.randn(B, L, V, generator=g).to(device), budget, roots)
    tree = build_ddtree(draft, budget, roots)
    for f in ("tokens", "parents", "depths", "ranks", "scores", "num_nodes"):
        x, y = getattr(tree, f), getattr(ref, f)
        assert x.shape == y.shape and x.dtype == y.dtype and x.device.type == device.split(":")[0], f
    assert tree.num_nodes_host == ref.num_nodes_host and tree.max_depth == ref.max_depth
    T = sum(tree.num_nodes_host)
    for target in (torch.randn(T, V, generator=g), torch.zeros(T, V)):
        target = target.to(device)
        for res in (accept_greedy(tree, target),
                    accept_sampling(tree, target, temperature=0.7, top_k=5, top_p=0.9),
                    accept_sampling(tree, target, temperature=0.7)):
            for f in ("accepted", "accepted_tokens", "new_tokens"):
                assert getattr(res, f).shape == (B, tree.max_depth + 1), f
            assert res.lengths.shape == (B,) and res.bonus.shape == (B,)
            assert res.lengths.device == tree.device
