import numpy as np
import pytest
import torch

from kdtree_engine.masks import (
    ancestor_matrix,
    concat_tree_masks,
    mask_words,
    pack_tree_mask,
    tree_mask_from_parents,
    unpack_tree_mask,
)
from kdtree_engine.testing import chain_tree, random_tree, star_tree


def brute_force_ancestors(parents):
    n = len(parents)
    vis = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j != -1:
            vis[i][j] = True
            j = parents[j]
    return torch.tensor(vis)


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 64, 65, 130, 1024])
def test_pack_unpack_round_trip(n):
    gen = torch.Generator().manual_seed(n)
    visible = torch.rand(n, n, generator=gen) < 0.3
    packed = pack_tree_mask(visible)
    assert packed.dtype == torch.int32 and packed.shape == (n, mask_words(n))
    assert torch.equal(unpack_tree_mask(packed, n), visible)


def test_bit_layout_is_the_contract():
    # node 31 -> bit 31 of word 0 (negative int32), node 32 -> bit 0 of word 1
    visible = torch.zeros(33, 33, dtype=torch.bool)
    visible[0, 31] = True
    visible[1, 32] = True
    visible[2, 0] = True
    packed = pack_tree_mask(visible, words=3)
    assert packed[0].tolist() == [-(2**31), 0, 0]
    assert packed[1].tolist() == [0, 1, 0]
    assert packed[2].tolist() == [1, 0, 0]


@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("n", [1, 5, 33, 100])
def test_ancestor_matrix_matches_brute_force(shape, n):
    gen = torch.Generator().manual_seed(7)
    parents = {"random": random_tree(n, gen), "chain": chain_tree(n), "star": star_tree(n)}[shape]
    assert torch.equal(ancestor_matrix(parents), brute_force_ancestors(parents))
    assert torch.equal(unpack_tree_mask(tree_mask_from_parents(parents), n), brute_force_ancestors(parents))


def test_parents_in_any_order():
    # root is the last node; children come before their parents
    parents = [2, 2, 4, 4, -1]
    expected = brute_force_ancestors(parents)
    assert torch.equal(ancestor_matrix(parents), expected)
    assert bool(expected[0, 4]) and not bool(expected[0, 1])


@pytest.mark.parametrize(
    "parents, msg",
    [
        ([0, 0], "exactly one root"),
        ([-1, -1], "exactly one root"),
        ([-1, 2, 1], "cycle"),
        ([-1, 5], "outside"),
        ([], "non-empty"),
        ([-1, 2**64], "outside int64"),  # (a RuntimeError)
    ],
)
def test_bad_parents(parents, msg):
    with pytest.raises(ValueError, match=msg):
        ancestor_matrix(parents)


def test_pack_errors():
    with pytest.raises(ValueError, match="square"):
        pack_tree_mask(torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="torch.bool"):
        pack_tree_mask(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="too narrow"):
        pack_tree_mask(torch.zeros(40, 40, dtype=torch.bool), words=1)
    with pytest.raises(TypeError, match="words must be an int"):
        pack_tree_mask(torch.zeros(3, 3, dtype=torch.bool), words=2.0)
    with pytest.raises(TypeError, match="words must be an int"):
        pack_tree_mask(torch.zeros(3, 3, dtype=torch.bool), words=True)
    with pytest.raises(ValueError, match="words=1099511627776 is wider than the 32 words"):
        pack_tree_mask(torch.eye(3, dtype=torch.bool), 2**40)  # (reached the allocator)
    with pytest.raises(ValueError, match="words=33 is wider"):
        concat_tree_masks([tree_mask_from_parents([-1, 0])], words=33)


def test_integer_arguments_of_other_integer_types():
    """numpy integers and 0-d integer tensors are integers (as for the draft-tree functions)."""
    visible = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    packed = pack_tree_mask(visible, words=2)
    assert torch.equal(pack_tree_mask(visible, words=np.int64(2)), packed)
    assert torch.equal(pack_tree_mask(visible, words=torch.tensor(2)), packed)
    assert torch.equal(unpack_tree_mask(packed, np.int32(5)), visible)
    assert torch.equal(unpack_tree_mask(packed, torch.tensor(5)), visible)


@pytest.mark.parametrize("parents", [[-1, 0.5, 1.9], [-1.5, 0], torch.tensor([-1.0, 0.0]), [-1, float("nan")],
                                     [None, 0], [-1, True]])
def test_parents_must_be_integers(parents):
    """Float parents were truncated into a valid-looking tree ([-1, 0.5, 1.9] masked as [-1, 0, 1]);
    None raised a RuntimeError, a bool was read as 1."""
    with pytest.raises(TypeError, match="parents must hold integers"):
        tree_mask_from_parents(parents)


def test_mask_arguments_are_checked():
    m = tree_mask_from_parents([-1, 0])
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        unpack_tree_mask(m, -1)
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        unpack_tree_mask([[1]], 1)
    with pytest.raises(TypeError, match=r"masks\[0\] must be a torch.Tensor"):
        concat_tree_masks([[1]])
    with pytest.raises(ValueError, match=r"masks\[1\] must be int32"):
        concat_tree_masks([m, m.long()])  # (an int64 batch mask was returned)
    with pytest.raises(ValueError, match=r"masks\[0\] must be int32 \[R, W\]"):
        concat_tree_masks([m[0]])


def test_concat_pads_to_widest():
    a = tree_mask_from_parents(chain_tree(40))  # 2 words
    b = tree_mask_from_parents(star_tree(3))  # 1 word
    m = concat_tree_masks([a, b])
    assert m.shape == (43, 2)
    assert torch.equal(m[40:, 1], torch.zeros(3, dtype=torch.int32))
    assert torch.equal(unpack_tree_mask(m[40:], 3), brute_force_ancestors(star_tree(3)))
    with pytest.raises(ValueError, match="does not fit"):
        concat_tree_masks([a], words=1)
