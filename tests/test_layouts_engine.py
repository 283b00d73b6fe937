"""Every tensor argument of the engine's public functions (masks, DDTree build / compile /
acceptance / SGLang interop, the KV pool, bundles) in every layout a caller can produce: the same
values as a contiguous tensor, but transposed (column-major), sliced with a step, a column slice of
a wider buffer with poison around it, or broadcast (zero stride). Each call must give exactly the
contiguous call's result or raise a ``ValueError`` naming the argument; nothing the caller owns
(the poisoned buffers around the views, the pool's cache) may change.

(``verify_attention``'s own arguments are in ``tests/test_layouts.py``.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEVICE
from kdtree_engine import masks
from kdtree_engine.ddtree import (
    DraftTree,
    accept_greedy,
    accept_sampling,
    accept_tokens,
    ancestor_words,
    build_ddtree,
    commit_positions,
    compile_tree,
    draft_topk,
    expand_topk,
    target_tokens_greedy,
    tree_from_parents,
    tree_links,
)
from kdtree_engine.ddtree import interop
from kdtree_engine.kvpool import KVPool
from kdtree_engine.testing import random_tree

B, L, V, BUDGET = 3, 4, 23, 9
D = 576


# ----------------------------------------------------------------------------------------------
# layouts


def _poison(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return float("nan")
    return -(2**31) + 7 if dtype in (torch.int32, torch.int64) else 0


def layouts(x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``name -> (view, base)``: views with x's values and other strides; ``base`` is the buffer
    the view lives in (poison around it), checked unchanged after the call."""
    out = {}
    p = _poison(x.dtype)
    if x.dim() >= 2:
        t = x.transpose(-1, -2).contiguous()
        out["transposed"] = (t.transpose(-1, -2), t)
    if x.dim() >= 1 and x.shape[0] > 0:
        buf = torch.full((2 * x.shape[0], *x.shape[1:]), p, dtype=x.dtype, device=x.device)
        buf[::2] = x
        out["step"] = (buf[::2], buf)
        buf = torch.full((*x.shape[:-1], x.shape[-1] + 5), p, dtype=x.dtype, device=x.device)
        buf[..., 2 : 2 + x.shape[-1]] = x
        out["wide"] = (buf[..., 2 : 2 + x.shape[-1]], buf)
        if x.shape[0] > 1 and torch.equal(x, x[:1].expand_as(x)):
            row = x[:1].clone()
            out["broadcast"] = (row.expand_as(x), row)
    if x.dim() == 0 or x.numel() == 1:
        one = x.reshape(1).clone()
        out["broadcast"] = (one.reshape(()).expand(x.shape) if x.dim() else one[0], one)
    return out


def same(a, b) -> bool:
    """Exact equality of results: tensors (values, shape, dtype; NaN == NaN), dataclasses,
    sequences and dicts of them."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(torch.nan_to_num(a.cpu(), nan=1.5e300) if a.is_floating_point() else a.cpu(),
                                torch.nan_to_num(b.cpu(), nan=1.5e300) if b.is_floating_point() else b.cpu()))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_every_layout(fn, args: dict, names: list[str]):
    """Call ``fn(**args)`` contiguous, then with each named tensor argument (or tensor field of a
    dataclass argument) in each layout. Returns ``{(arg, layout): "same" | "refused"}``."""
    want = fn(**args)
    seen = {}
    for name in names:
        arg, _, field = name.partition(".")
        value = getattr(args[arg], field) if field else args[arg]
        if value is None:
            continue
        for lay, (view, base) in layouts(value).items():
            before = base.clone()
            call = dict(args)
            call[arg] = dataclasses.replace(args[arg], **{field: view}) if field else view
            try:
                got = fn(**call)
            except ValueError as e:
                assert arg in str(e) or (field and field in str(e)), f"{name} {lay}: unclear error {e}"
                seen[name, lay] = "refused"
            else:
                assert same(got, want), f"{fn.__name__}: {name} {lay} gives another result"
                seen[name, lay] = "same"
            assert same(base, before), f"{fn.__name__}: {name} {lay}: the caller's buffer changed"
    return seen


# ----------------------------------------------------------------------------------------------
# inputs


def draft_logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, V, generator=g) * 3).to(DEVICE)


def a_tree(seed: int = 0) -> DraftTree:
    return build_ddtree(draft_logits(seed), BUDGET, torch.tensor([1, 2, 3], device=DEVICE))


def target_logits(tree: DraftTree, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(tree.num_nodes_host), V, generator=g)
    x[:, 5] += 4  # agreement somewhere
    return x.to(DEVICE)


TREE_FIELDS = ["tree.tokens", "tree.parents", "tree.depths", "tree.num_nodes", "tree.ranks", "tree.scores"]


# ----------------------------------------------------------------------------------------------
# masks


def test_mask_helpers_every_layout():
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor(random_tree(40, g))
    vis = masks.ancestor_matrix(parents)
    packed = masks.pack_tree_mask(vis)
    check_every_layout(masks.ancestor_matrix, {"parents": parents}, ["parents"])
    check_every_layout(masks.tree_mask_from_parents, {"parents": parents}, ["parents"])
    check_every_layout(masks.pack_tree_mask, {"visible": vis}, ["visible"])
    check_every_layout(masks.unpack_tree_mask, {"mask": packed, "n": 40}, ["mask"])
    other = masks.tree_mask_from_parents(random_tree(7, g))

    def concat(first, second):
        return masks.concat_tree_masks([first, second], words=3)

    check_every_layout(concat, {"first": packed, "second": other}, ["first", "second"])


# ----------------------------------------------------------------------------------------------
# DDTree: build, compile


def test_build_every_layout():
    x = draft_logits()
    roots = torch.tensor([4, 4, 4], device=DEVICE)  # equal: a broadcast root vector is a layout too
    check_every_layout(build_ddtree, {"draft_logits": x, "budget": BUDGET, "root_tokens": roots},
                       ["draft_logits", "root_tokens"])
    check_every_layout(draft_topk, {"draft_logits": x, "k": 5}, ["draft_logits"])
    top = draft_topk(x, 5)
    check_every_layout(expand_topk, {"top": top, "budget": BUDGET, "root_tokens": roots},
                       ["top.token_ids", "top.logprobs", "root_tokens"])


def test_tree_from_parents_every_layout():
    g = torch.Generator().manual_seed(3)
    sizes = [5, 9, 1]
    par = torch.full((3, 9), -1, dtype=torch.int64)
    tok = torch.full((3, 9), -1, dtype=torch.int64)
    for b, n in enumerate(sizes):
        par[b, :n] = torch.tensor(random_tree(n, g, shuffle=False))
        tok[b, :n] = torch.arange(n)
    check_every_layout(tree_from_parents, {"parents": par.to(DEVICE), "tokens": tok.to(DEVICE), "num_nodes": sizes},
                       ["parents", "tokens"])


def test_compile_and_tree_views_every_layout():
    tree = a_tree()
    prefix = torch.tensor([7, 7, 7], device=DEVICE)
    check_every_layout(compile_tree, {"tree": tree, "prefix_lens": prefix}, ["prefix_lens", *TREE_FIELDS])
    check_every_layout(ancestor_words, {"tree": tree}, TREE_FIELDS)
    check_every_layout(tree_links, {"tree": tree}, TREE_FIELDS)


# ----------------------------------------------------------------------------------------------
# DDTree: acceptance


def test_acceptance_every_layout():
    tree = a_tree()
    logits = target_logits(tree)
    tokens = target_tokens_greedy(logits)
    check_every_layout(target_tokens_greedy, {"target_logits": logits}, ["target_logits"])
    check_every_layout(accept_greedy, {"tree": tree, "target_logits": logits}, ["target_logits", *TREE_FIELDS])
    check_every_layout(accept_tokens, {"tree": tree, "target_tokens": tokens}, ["target_tokens", *TREE_FIELDS])

    def sampled(tree, target_logits):
        gen = torch.Generator(device=DEVICE).manual_seed(11)
        return accept_sampling(tree, target_logits, temperature=0.8, top_k=10, top_p=0.9, generator=gen)

    check_every_layout(sampled, {"tree": tree, "target_logits": logits}, ["target_logits"])
    # ragged trees: a kernel that read num_nodes as if contiguous would take other trees' sizes
    ragged = tree_from_parents([[-1, 0, 0, 1, 3], [-1], [-1, 0, 1]], [[1, 5, 7, 5, 2], [3], [4, 5, 5]])
    ragged = tree_from_parents(ragged.parents.to(DEVICE), ragged.tokens.to(DEVICE), [5, 1, 3])
    rag_logits = target_logits(ragged)
    check_every_layout(accept_tokens, {"tree": ragged, "target_tokens": target_tokens_greedy(rag_logits)},
                       ["tree.num_nodes"])
    check_every_layout(sampled, {"tree": ragged, "target_logits": rag_logits}, ["tree.num_nodes"])
    res = accept_greedy(tree, logits)
    prefix = torch.tensor([3, 3, 3], device=DEVICE)
    check_every_layout(commit_positions, {"result": res, "prefix_lens": prefix},
                       ["prefix_lens", "result.accepted", "result.lengths", "result.new_tokens"])


def test_sglang_interop_every_layout():
    tree = a_tree()
    vis = interop.tree_visible(tree)
    n = tree.width
    check_every_layout(interop.tree_visible, {"tree": tree}, TREE_FIELDS)
    check_every_layout(interop.pack_visible, {"visible": vis}, ["visible"])
    check_every_layout(interop.parents_from_visible, {"visible": vis}, ["visible"])
    prefix = torch.tensor([6, 6, 6], device=DEVICE)
    for mode in interop.TreeMaskMode:
        flat = interop.to_sglang_tree_mask(vis, mode, prefix)
        check_every_layout(interop.to_sglang_tree_mask, {"visible": vis, "mode": mode, "prefix_lens": prefix},
                           ["visible", "prefix_lens"])
        check_every_layout(interop.sglang_mask_to_contract,
                           {"tree_mask": flat, "mode": mode, "num_draft_tokens": n, "prefix_lens": prefix},
                           ["tree_mask", "prefix_lens"])
    contract = compile_tree(tree, prefix).tree_mask
    check_every_layout(interop.unpack_visible, {"tree_mask": contract, "num_draft_tokens": n}, ["tree_mask"])
    nxt_tok, nxt_sib = interop.sglang_retrieve_arrays(tree)[1:]
    check_every_layout(interop.parents_from_sglang_retrieve, {"next_token": nxt_tok, "next_sibling": nxt_sib},
                       ["next_token", "next_sibling"])


# ----------------------------------------------------------------------------------------------
# the KV pool


def pool_with_prefix(page_size: int, prefixes=(5, 9, 2)) -> tuple[KVPool, list[int]]:
    pool = KVPool(80 // page_size + 8, page_size, device=DEVICE, max_seqs=4, debug=True)
    pool.shuffle_free_pages(1)
    ids = [pool.add_sequence() for _ in prefixes]
    g = torch.Generator().manual_seed(2)
    slots = pool.extend(ids, list(prefixes))
    pool.write(slots, torch.randn(slots.numel(), D, generator=g).to(torch.bfloat16).to(DEVICE), layer=0)
    return pool, ids


def pool_state(pool: KVPool, ids) -> list:
    return [pool.gather_kv(s) for s in ids] + list(pool.verify_inputs(ids))


@pytest.mark.parametrize("page_size", [1, 4])
def test_pool_write_every_layout(page_size):
    """``write(slots, rows)``: strided, wide and broadcast rows and slots land where the contiguous
    ones do; the rest of the cache is untouched."""

    def run(slots, rows):
        pool, ids = pool_with_prefix(page_size)
        pool.write(slots, rows, layer=0)
        return pool.kv_cache().clone()

    pool, ids = pool_with_prefix(page_size)
    slots = pool.reserve_tree(ids, [1, 1, 1])
    rows = torch.full((3, D), 0.25, dtype=torch.bfloat16, device=DEVICE)  # equal rows: broadcast too
    seen = check_every_layout(run, {"slots": slots, "rows": rows}, ["slots", "rows"])
    assert seen["rows", "broadcast"] == "same"


def test_pool_write_refuses_rows_that_alias_the_cache():
    """A source that is a view of the pool's own cache would be read while it is written: refused,
    and the cache is unchanged."""
    pool, ids = pool_with_prefix(1)
    slots = pool.slots(ids[0])
    before = pool.kv_cache().clone()
    rows = pool.kv_cache().view(-1, D)[slots.flip(0)]  # a gather: a copy, allowed
    pool.write(slots, rows, layer=0)
    assert same(pool.kv_cache()[slots.flip(0)], before[slots])
    before = pool.kv_cache().clone()
    with pytest.raises(ValueError, match="rows"):
        pool.write(slots[:2], pool.kv_cache().view(-1, D)[0:2], layer=0)
    assert same(pool.kv_cache(), before)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_pool_commit_every_layout(page_size, use_triton):
    """``commit(accepted, num_accepted)`` in every layout commits what the contiguous call does."""
    tree = a_tree()
    res = accept_greedy(tree, target_logits(tree))

    def run(accepted, num_accepted):
        pool, ids = pool_with_prefix(page_size)
        pool.use_triton = use_triton
        step = pool.reserve_step(ids, tree)
        g = torch.Generator().manual_seed(5)
        pool.write(step.slots, torch.randn(step.num_rows, D, generator=g).to(torch.bfloat16).to(DEVICE), layer=0)
        pool.commit(ids, accepted, num_accepted, num_accepted_host=num_accepted.cpu())
        pool.check()
        return pool_state(pool, ids)

    check_every_layout(run, {"accepted": res.accepted, "num_accepted": res.lengths}, ["accepted", "num_accepted"])
    # a broadcast path: every sequence accepts the root only
    ones = torch.ones(B, dtype=torch.int64, device=DEVICE)
    roots = torch.zeros(B, 2, dtype=torch.int64, device=DEVICE)
    seen = check_every_layout(run, {"accepted": roots, "num_accepted": ones}, ["accepted", "num_accepted"])
    assert seen["num_accepted", "broadcast"] == "same" and seen["accepted", "broadcast"] == "same"


def test_pool_reserve_step_every_tree_layout():
    tree = a_tree()

    def run(tree):
        pool, ids = pool_with_prefix(4)
        return pool.reserve_step(ids, tree)

    check_every_layout(run, {"tree": tree}, TREE_FIELDS)


# ----------------------------------------------------------------------------------------------
# bundles


def test_save_bundle_every_layout(tmp_path):
    """A bundle whose tensors are strided views saves the values (and only them)."""
    from kdtree_engine.bundles import load_bundle, make_bundle, save_bundle, standard_specs

    spec = next(s for s in standard_specs() if s.name == "verify_attn_h1_p50_b4")
    bundle = make_bundle(spec, "cpu")
    count = [0]

    def saved(**inputs):
        count[0] += 1
        b = dataclasses.replace(bundle, inputs=inputs)
        back = load_bundle(save_bundle(b, tmp_path / f"b{count[0]}.kdtr"))
        return back.inputs

    seen = check_every_layout(saved, dict(bundle.inputs), list(bundle.inputs))
    assert set(seen.values()) == {"same"} and ("page_table", "transposed") in seen
