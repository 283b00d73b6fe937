"""SGLang EAGLE tree formats: layouts spelled out by hand, round trips, and the contract's mask."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.ddtree import accept_tokens, build_ddtree, compile_tree, tree_from_parents
from kdtree_engine.ddtree.interop import (
    TreeMaskMode,
    accept_to_sglang,
    contract_to_sglang_mask,
    from_sglang_tree_mask,
    pack_visible,
    parents_from_sglang_eagle,
    parents_from_sglang_retrieve,
    parents_from_visible,
    sglang_mask_to_contract,
    sglang_retrieve_arrays,
    to_sglang_tree_mask,
    to_sglang_verify_input,
    tree_from_sglang,
    tree_visible,
    unpack_visible,
)
from kdtree_engine.masks import ancestor_matrix, tree_mask_from_parents

# root 0; 1, 2 children of 0; 3 child of 1; 4 child of 3; 5 child of 2
PARENTS = [-1, 0, 0, 1, 3, 2]
TOKENS = [10, 11, 12, 13, 14, 15]


def small_tree(device, batch: int = 2):
    t = tree_from_parents([PARENTS] * batch, [TOKENS] * batch)
    return tree_from_parents(t.parents.to(device), t.tokens.to(device))


def hand_full_mask(parents_per_seq, prefix):
    """FULL_MASK built the long way: per sequence rows of [prefix True..., tree columns]."""
    out = []
    for par, P in zip(parents_per_seq, prefix):
        vis = ancestor_matrix(par)
        n = len(par)
        for i in range(n):
            out += [True] * P + vis[i].tolist()
    return torch.tensor(out)


def test_mask_layouts_by_hand(device):
    tree = small_tree(device)
    vis = tree_visible(tree)
    want = ancestor_matrix(PARENTS)
    assert torch.equal(vis[0].cpu(), want) and torch.equal(vis[1].cpu(), want)
    prefix = [3, 0]
    full = to_sglang_tree_mask(vis, TreeMaskMode.FULL_MASK, prefix)
    assert full.dtype == torch.bool and full.shape == (6 * (3 + 6) + 6 * 6,)
    assert torch.equal(full.cpu(), hand_full_mask([PARENTS, PARENTS], prefix))
    qlen = to_sglang_tree_mask(vis, TreeMaskMode.QLEN_ONLY)
    assert qlen.shape == (2 * 36,) and torch.equal(qlen.view(2, 6, 6).cpu(), torch.stack([want, want]))
    packed = to_sglang_tree_mask(vis, TreeMaskMode.QLEN_ONLY_BITPACKING)
    assert packed.dtype == torch.uint8 and packed.shape == (12,)
    # row 4 sees 0, 1, 3, 4: bits 0b11011
    assert packed.view(2, 6)[0].to(torch.int64).tolist() == [0b1, 0b11, 0b101, 0b1011, 0b11011, 0b100101]


@pytest.mark.parametrize("n,dtype", [(1, torch.uint8), (8, torch.uint8), (9, torch.uint16), (16, torch.uint16), (17, torch.uint32), (32, torch.uint32)])
def test_bitpacking_widths(n, dtype, device):
    g = torch.Generator().manual_seed(n)
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)] for _ in range(3)]
    tree = tree_from_parents(parents, [list(range(n))] * 3)
    vis = tree_visible(tree).to(device)
    packed = to_sglang_tree_mask(vis, TreeMaskMode.QLEN_ONLY_BITPACKING)
    assert packed.dtype == dtype and packed.shape == (3 * n,)
    assert torch.equal(from_sglang_tree_mask(packed, 2, n), vis)
    # bit 31 (n = 32): the value is read back unsigned
    if n == 32:
        assert int(packed.to(torch.int64).max()) >= 0


def test_bitpacking_rejects_large_and_wrong_dtype(device):
    vis = torch.eye(33, dtype=torch.bool, device=device)[None]
    with pytest.raises(ValueError, match="at most 32"):
        to_sglang_tree_mask(vis, TreeMaskMode.QLEN_ONLY_BITPACKING)
    with pytest.raises(TypeError, match="uint8"):
        from_sglang_tree_mask(torch.zeros(4, dtype=torch.int32, device=device), 2, 4)
    with pytest.raises(ValueError, match="mode"):
        to_sglang_tree_mask(vis, 7)
    with pytest.raises(ValueError, match="prefix_lens"):
        to_sglang_tree_mask(vis, TreeMaskMode.FULL_MASK)
    with pytest.raises(ValueError, match="FULL_MASK with these prefix_lens"):
        from_sglang_tree_mask(torch.ones(10, dtype=torch.bool, device=device), 0, 2, [1])


@pytest.mark.parametrize("budget", [8, 31, 70])
def test_round_trips_and_contract(budget, device):
    g = torch.Generator().manual_seed(budget)
    B = 3
    tree = build_ddtree(torch.randn(B, 6, 40, generator=g).to(device), budget, torch.tensor([1, 2, 3], device=device))
    n = tree.width
    prefix = [0, 17, 5]
    vb = compile_tree(tree, torch.tensor(prefix, device=device))
    vis = tree_visible(tree)
    modes = [TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY] + ([TreeMaskMode.QLEN_ONLY_BITPACKING] if n <= 32 else [])
    for mode in modes:
        m = contract_to_sglang_mask(vb.tree_mask, n, mode, prefix)
        assert torch.equal(from_sglang_tree_mask(m, mode, n, prefix, check_prefix=True), vis)
        # SGLang mask -> the contract's tree_mask, ready for verify_attention
        assert torch.equal(sglang_mask_to_contract(m, mode, n, prefix), vb.tree_mask)
        back = tree_from_sglang(vb.input_ids, m, mode, n, prefix, max_depth=tree.max_depth)
        assert torch.equal(back.parents, tree.parents) and torch.equal(back.depths, tree.depths)
    assert torch.equal(unpack_visible(vb.tree_mask, n), vis)
    assert torch.equal(pack_visible(vis, words=4), compile_tree(tree, prefix, words=4).tree_mask)
    assert torch.equal(parents_from_visible(vis), tree.parents)


def test_full_mask_prefix_check(device):
    vis = tree_visible(small_tree(device, 1))
    m = to_sglang_tree_mask(vis, TreeMaskMode.FULL_MASK, [4])
    m[2] = False  # a prefix column of row 0
    with pytest.raises(ValueError, match="prefix column"):
        from_sglang_tree_mask(m, TreeMaskMode.FULL_MASK, 6, [4], check_prefix=True)


def test_parents_from_visible_any_order(device):
    g = torch.Generator().manual_seed(0)
    n = 40
    par = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    perm = torch.randperm(n, generator=g).tolist()  # even the root moves
    new = [0] * n
    for old, p in enumerate(par):
        new[perm[old]] = -1 if p < 0 else perm[p]
    vis = ancestor_matrix(new)[None].to(device)
    assert parents_from_visible(vis)[0].tolist() == new
    assert torch.equal(unpack_visible(tree_mask_from_parents(new).to(device), n), vis)


def test_retrieve_arrays(device):
    tree = small_tree(device)
    index, nxt, sib = sglang_retrieve_arrays(tree)
    assert index.tolist() == [list(range(6)), list(range(6, 12))]
    assert nxt[0].tolist() == [1, 3, 5, 4, -1, -1]
    assert sib[0].tolist() == [-1, 2, -1, -1, -1, -1]
    assert torch.equal(parents_from_sglang_retrieve(nxt, sib), tree.parents)
    g = torch.Generator().manual_seed(1)
    big = build_ddtree(torch.randn(2, 9, 30, generator=g).to(device), 200, torch.tensor([0, 1], device=device))
    _, nxt, sib = sglang_retrieve_arrays(big)
    assert torch.equal(parents_from_sglang_retrieve(nxt, sib), big.parents)


def test_verify_input_dict(device):
    tree = small_tree(device)
    d = to_sglang_verify_input(tree, [7, 2], TreeMaskMode.QLEN_ONLY)
    assert d["draft_token"].tolist() == TOKENS * 2
    depth = [0, 1, 1, 2, 3, 2]
    assert d["positions"].tolist() == [7 + x for x in depth] + [2 + x for x in depth]
    assert d["tree_mask"].shape == (72,)
    assert d["retrive_next_token"][1].tolist() == [1, 3, 5, 4, -1, -1]
    ragged = tree_from_parents([[-1, 0], [-1]], [[1, 2], [3]])
    with pytest.raises(ValueError, match="same number of nodes"):
        to_sglang_verify_input(ragged, [0, 0])
    # host prefix lengths are checked (negative ones gave negative positions, floats were truncated)
    with pytest.raises(ValueError, match="must be >= 0"):
        to_sglang_verify_input(tree, [7, -2], TreeMaskMode.QLEN_ONLY)
    with pytest.raises(TypeError, match="must hold integers"):
        to_sglang_verify_input(tree, [7, 2.5], TreeMaskMode.QLEN_ONLY)
    with pytest.raises(ValueError, match="mode must be a TreeMaskMode"):
        to_sglang_verify_input(tree, [7, 2], True)


def simulate_eagle(bs: int, topk: int, steps: int, num_draft: int, gen: torch.Generator):
    """EAGLE's draft bookkeeping as SGLang lays it out, and the true parent of each selected node.

    Score list: step 0 has topk entries (children of the root); step i >= 1 has topk*topk entries,
    index topk + (i-1)*topk^2 + beam*topk + c for child c of beam `beam` (the beam-th node chosen at
    step i-1). parents_list[0] = [-1, 0..topk-1]; parents_list[i] = score indices of the nodes chosen
    at step i. parent_list = cat(parents_list[:-1]); selected = sorted top (num_draft-1) scores.
    """
    parent_lists, selected, truth = [], [], []
    for _ in range(bs):
        scores, parent_of = [], []  # per score-list index: cumulative log-prob, parent score index
        p0 = torch.log_softmax(torch.randn(topk, generator=gen), 0)
        scores += p0.tolist()
        parent_of += [-1] * topk
        beams = list(range(topk))  # score indices of the current beams
        plist = [-1] + list(range(topk))
        for i in range(1, steps):
            base = topk + (i - 1) * topk * topk
            exp = []
            for bi, beam in enumerate(beams):
                lp = torch.log_softmax(torch.randn(topk, generator=gen), 0) - 0.01 * (bi + 1)
                for c in range(topk):
                    scores.append(scores[beam] + float(lp[c]))
                    parent_of.append(beam)
                    exp.append(base + bi * topk + c)
            chosen = sorted(exp, key=lambda s: -scores[s])[:topk]
            if i < steps - 1:
                plist += chosen
            beams = chosen
        sel = sorted(sorted(range(len(scores)), key=lambda s: -scores[s])[: num_draft - 1])
        node_of = {s: j + 1 for j, s in enumerate(sel)}
        truth.append([-1] + [0 if parent_of[s] < 0 else node_of[parent_of[s]] for s in sel])
        parent_lists.append(plist)
        selected.append(sel)
    return torch.tensor(parent_lists), torch.tensor(selected), torch.tensor(truth)


@pytest.mark.parametrize("topk,steps,num_draft", [(1, 3, 4), (2, 3, 6), (4, 4, 16), (8, 2, 9)])
def test_parents_from_eagle_selection(topk, steps, num_draft, device):
    g = torch.Generator().manual_seed(topk * 10 + steps)
    plist, sel, truth = simulate_eagle(3, topk, steps, num_draft, g)
    assert plist.shape[1] == topk * (steps - 1) + 1
    got = parents_from_sglang_eagle(plist.to(device), sel.to(device), topk)
    assert got.tolist() == truth.tolist()
    root_only = parents_from_sglang_eagle(plist.to(device), sel[:, :0].to(device), topk)  # (argmax of nothing raised)
    assert root_only.tolist() == [[-1]] * 3


def test_accept_to_sglang(device):
    tree = small_tree(device)
    tgt = torch.tensor([[11, 13, 0, 14, 9, 0], [12, 0, 7, 0, 0, 0]], device=device)
    res = accept_tokens(tree, tgt)
    out = accept_to_sglang(res, 6)
    assert out["accept_index"].dtype == torch.int32
    assert out["accept_index"].tolist() == [[0, 1, 3, 4], [6, 8, -1, -1]]
    assert out["accept_length"].tolist() == [3, 1]
    pred = out["predicts"].view(2, 6).tolist()
    assert pred[0] == [11, 13, 0, 14, 9, 0]  # rows 0, 1, 3, 4 accepted: next tokens, bonus 9
    assert pred[1] == [12, 0, 7, 0, 0, 0]
    assert out["bonus"].tolist() == [9, 7]
    with pytest.raises(TypeError, match="result must be an AcceptResult"):
        accept_to_sglang(out, 6)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        accept_to_sglang(res, "6")


def accepted_small_tree():
    """small_tree's batch on the CPU with node 4 (of 6) accepted in tree 0."""
    return accept_tokens(small_tree("cpu"), torch.tensor([[11, 13, 0, 14, 9, 0], [12, 0, 7, 0, 0, 0]]))


def off_tree_mask():
    """small_tree's QLEN_ONLY mask with node 4's root bit cleared: not the relation of a tree."""
    vis = tree_visible(small_tree("cpu"))
    vis[0, 4, 0] = False
    return vis.reshape(-1)


NOT_SQUARE = torch.ones(2, 3, 4, dtype=torch.bool)
NEXT_NONE = torch.full((1, 6), -1)


@pytest.mark.parametrize("call, exc, msg", [
    # an n below the accepted nodes: rows overlapping the next tree's (n = 3), or a scatter past the end (n = 2)
    (lambda: accept_to_sglang(accepted_small_tree(), 3), ValueError, "num_draft_tokens=3 is below"),
    (lambda: accept_to_sglang(accepted_small_tree(), 2), ValueError, "num_draft_tokens=2 is below"),
    # masks that are no tree, a max_depth below the tree's depth (the acceptance was wrong)
    (lambda: tree_from_sglang(torch.tensor(TOKENS * 2), off_tree_mask(), 1, 6), ValueError, "not the ancestor"),
    (lambda: tree_from_sglang(torch.tensor(TOKENS * 2), torch.zeros(72, dtype=torch.bool), 1, 6), ValueError,
     "only root"),
    (lambda: tree_from_sglang(torch.tensor(TOKENS * 2), tree_visible(small_tree("cpu")).reshape(-1), 1, 6,
                              max_depth=1), ValueError, r"deeper \(3\) than max_depth=1"),
    (lambda: parents_from_visible(NOT_SQUARE), ValueError, r"visible must be \[B, n, n\]"),
    (lambda: to_sglang_tree_mask(NOT_SQUARE, 1), ValueError, r"visible must be \[B, n, n\]"),
    (lambda: to_sglang_tree_mask(NOT_SQUARE, 0, [1, 2]), ValueError, r"visible must be \[B, n, n\]"),
    (lambda: to_sglang_tree_mask(NOT_SQUARE[:, :3, :3], 1.7), ValueError, "mode must be a TreeMaskMode"),
    (lambda: to_sglang_tree_mask(NOT_SQUARE[:, :3, :3], "1"), ValueError, "mode must be a TreeMaskMode"),
    (lambda: pack_visible(NOT_SQUARE[:, :3, :3], True), TypeError, "words must be an int"),
    (lambda: pack_visible(NOT_SQUARE[:, :3, :3], 2**40), ValueError, "words=1099511627776 is wider"),
    # retrieve arrays: an index past n (a scatter's RuntimeError), below -1 (read as none), bools
    (lambda: parents_from_sglang_retrieve(torch.tensor([[11, -1, -1, -1, -1, -1]]), NEXT_NONE), ValueError,
     r"next_token holds an index outside \[-1, 6\)"),
    (lambda: parents_from_sglang_retrieve(torch.tensor([[6, -1, -1, -1, -1, -1]]), NEXT_NONE), ValueError,
     "next_token holds an index outside"),
    (lambda: parents_from_sglang_retrieve(torch.tensor([[-5, -1, -1, -1, -1, -1]]), NEXT_NONE), ValueError,
     "next_token holds an index outside"),
    (lambda: parents_from_sglang_retrieve(torch.tensor([[1, -1, -1, -1, -1, -1]]), torch.tensor([[-1, 12, -1, -1, -1, -1]])),
     ValueError, "next_sibling holds an index outside"),
    (lambda: parents_from_sglang_retrieve(NEXT_NONE.bool(), NEXT_NONE.bool()), TypeError, "next_token must be an integer"),
    # EAGLE selections: a negative score index (a gather's RuntimeError), one past parent_list (clamped)
    (lambda: parents_from_sglang_eagle(torch.tensor([[-1, 0, 1, 2]]), torch.tensor([[-3, 1, 3]]), 2), ValueError,
     r"selected_index holds a score index outside \[0, topk \* 4\)"),
    (lambda: parents_from_sglang_eagle(torch.tensor([[-1, 0, 1, 2]]), torch.tensor([[0, 1, 8]]), 2), ValueError,
     "selected_index holds a score index outside"),
    (lambda: parents_from_sglang_eagle(torch.tensor([[-1, 0, 1, 2]]).to(torch.complex64), torch.tensor([[0, 1, 3]]), 2),
     TypeError, "parent_list must be an integer"),
    # prefix lengths of a CPU tensor are host values: negative ones gave negative positions
    (lambda: to_sglang_verify_input(small_tree("cpu"), torch.tensor([-5, -5]), 1), ValueError,
     "prefix_lens must be >= 0"),
    (lambda: to_sglang_verify_input(small_tree("cpu"), torch.tensor([5.0, 5.0]), 1), TypeError,
     "prefix_lens must be an integer tensor"),
    # a FULL_MASK's size follows its prefix lengths: one past int32 reached the allocator
    (lambda: to_sglang_tree_mask(torch.eye(3, dtype=torch.bool)[None], TreeMaskMode.FULL_MASK, [2**40]), ValueError,
     r"prefix_lens must be < 2\*\*31"),
    (lambda: from_sglang_tree_mask(torch.ones(12, dtype=torch.bool), TreeMaskMode.FULL_MASK, 3, [2**31]),
     ValueError, r"prefix_lens must be < 2\*\*31"),
    # a CPU bit-packed row with a bit past the tree (a wrong n, or garbage) was read without it
    (lambda: from_sglang_tree_mask(torch.tensor([1, 3, 8], dtype=torch.uint8), TreeMaskMode.QLEN_ONLY_BITPACKING, 3),
     ValueError, "bit at or past num_draft_tokens=3"),
    (lambda: from_sglang_tree_mask(torch.tensor([1, 3, 7, 16], dtype=torch.uint8), 2, 4), ValueError,
     "bit at or past num_draft_tokens=4"),
])
def test_interop_rejects(call, exc, msg):
    """Bad arguments raise a TypeError / ValueError naming them (CPU tensors: their values too;
    on a GPU the content checks here are the caller's)."""
    with pytest.raises(exc, match=msg):
        call()
