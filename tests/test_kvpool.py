"""Tests of the paged KV pool (src/kdtree_engine/kvpool/).

The pool must never lose KV: every live sequence's logical KV (its rows in position order, all
layers) is compared bitwise with a plain model after every operation, and with ``debug=True``
every cache row that is not a live position must be NaN (freed pages and the unused tail of a
last page are poisoned, so a stale table read shows up as NaN). The fused Triton kernels (commit,
page copies) are run under the interpreter on the CPU and compared bitwise with the torch path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils._python_dispatch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import DEVICE, HAS_CUDA
from kdtree_engine import reference
from kdtree_engine.kvpool import (
    KVPool,
    MoveSchedule,
    PoolFullError,
    ScheduleError,
    SequenceTooLongError,
    StalePlanError,
    ThresholdPolicy,
    check_schedule,
    schedule_moves,
)
from kdtree_engine.masks import concat_tree_masks, tree_mask_from_parents
from kdtree_engine.testing import random_tree

D = 576
# the Triton kernels run on CUDA, or on the CPU under the interpreter (conftest.py selects it)
BF16 = torch.bfloat16


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view (NaN == NaN) for exact comparisons."""
    return t.contiguous().view(torch.int16).cpu()


def rand_rows(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, D, generator=gen).to(BF16).to(DEVICE)


def snapshot(pool: KVPool) -> dict:
    """Everything the pool is made of, host and device."""
    return {
        "store": bits(pool._store),
        # the last table column and stack entry are trash targets of the torch paths' masked writes
        "table": pool._table[:, :-1].cpu().clone(),
        "lens": pool._lens_d.cpu().clone(),
        "tree": pool._tree_d.cpu().clone(),
        "stack": pool._stack[:-1].cpu().clone(),
        "top": pool._top.cpu().clone(),
        "len": pool._len.copy(),
        "treeh": pool._tree.copy(),
        "live": pool._live.copy(),
        "free": pool._num_free,
        "rows": sorted(pool._free_rows),
        "version": pool._version,
    }


def assert_same_state(a: dict, b: dict) -> None:
    for k in a:
        x, y = a[k], b[k]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else (
            np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
        assert same, f"pool state '{k}' changed"


def live_slot_mask(pool: KVPool) -> torch.Tensor:
    mask = torch.zeros((pool.num_pages + 1) * pool.page_size, dtype=torch.bool)
    for s in pool.live_sequences():
        mask[pool.slots(s).cpu()] = True
    return mask


def assert_consistent(pool: KVPool, model: dict) -> None:
    """Invariants + every live sequence's KV bitwise equal to the model + NaN elsewhere (debug)."""
    pool.check()
    assert sorted(model) == pool.live_sequences()
    for s, kv in model.items():
        assert pool.seq_len(s) == kv.shape[1]
        got = pool.gather_kv(s, layer=None)
        assert torch.equal(bits(got), bits(kv)), f"sequence {s}: KV changed"
    if pool.debug:
        nan_rows = torch.isnan(pool._store.view(pool.num_layers, -1, D)).all(-1).all(0).cpu()
        dead = ~live_slot_mask(pool)
        dead[pool.num_pages * pool.page_size:] = False  # the trash page
        assert bool(nan_rows[dead].all()), "a row that holds no live position is not NaN"


def new_pool(num_pages, page_size, *, layers=1, debug=True, use_triton=False, seed=0, shuffle=True, **kw):
    pool = KVPool(num_pages, page_size, num_layers=layers, device=DEVICE, debug=debug,
                  use_triton=use_triton, **kw)
    if shuffle:
        pool.shuffle_free_pages(seed)
    return pool


def fill(pool: KVPool, gen, lens: list[int]) -> dict:
    """Sequences of these lengths with random KV; returns the model {sid: [L, len, 576]}."""
    ids = [pool.add_sequence() for _ in lens]
    slots = pool.extend(ids, lens)
    rows = rand_rows(gen, pool.num_layers, sum(lens))
    pool.write(slots, rows, layer=None)
    model, o = {}, 0
    for s, n in zip(ids, lens):
        model[s] = rows[:, o: o + n].cpu()
        o += n
    return model


def step(pool: KVPool, model: dict, gen, ids, trees, paths, *, pad=0, host=True, acc_dtype=torch.int64):
    """One speculative step: reserve, write tree KV, commit ``paths`` (node lists, root first)."""
    slots = pool.reserve_tree(ids, trees)
    rows = rand_rows(gen, pool.num_layers, sum(trees))
    pool.write(slots, rows, layer=None)
    A = max(len(p) for p in paths) + pad
    acc = torch.full((len(ids), A), -1, dtype=acc_dtype)
    for b, p in enumerate(paths):
        acc[b, : len(p)] = torch.tensor(p)
    na = torch.tensor([len(p) for p in paths], dtype=torch.int32)
    pool.commit(ids, acc.to(DEVICE), na.to(DEVICE), num_accepted_host=na.numpy() if host else None)
    if not host:
        pool.finalize_commit()
    o = 0
    for s, n, p in zip(ids, trees, paths):
        model[s] = torch.cat([model[s], rows[:, o + torch.tensor(p, dtype=torch.long)].cpu()], 1)
        o += n


# ----------------------------------------------------------------------------------------------
# Layout: the pool's tensors are exactly the verify contract's


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_verify_inputs_follow_the_contract(page_size):
    """reference() on the pool's (kv_cache, page_table, kv_lens) equals reference() on a dense
    contiguous cache of the same logical rows, bitwise; tree nodes are the last n_b positions."""
    gen = torch.Generator().manual_seed(1)
    pool = new_pool(200 // page_size + 8, page_size, debug=True, seed=3)
    prefixes, trees = [0, 37, 70], [[-1], random_tree(9, gen), random_tree(5, gen)]
    model = fill(pool, gen, prefixes)
    ids = sorted(model)
    slots = pool.reserve_tree(ids, [len(t) for t in trees])
    rows = rand_rows(gen, 1, slots.numel())
    pool.write(slots, rows[0], layer=0)
    o = 0
    for s, t in zip(ids, trees):
        model[s] = torch.cat([model[s], rows[:, o: o + len(t)].cpu()], 1)
        o += len(t)
    page_table, kv_lens = pool.verify_inputs(ids)
    assert page_table.dtype == torch.int32 and kv_lens.dtype == torch.int32
    assert page_table.shape == (3, -(-max(p + len(t) for p, t in zip(prefixes, trees)) // page_size))
    assert kv_lens.tolist() == [p + len(t) for p, t in zip(prefixes, trees)]
    qo = torch.tensor([0, 1, 10, 15], dtype=torch.int32, device=DEVICE)
    mask = concat_tree_masks([tree_mask_from_parents(t) for t in trees]).to(DEVICE)
    q = (torch.randn(15, 4, D, generator=gen) * 2).to(BF16).to(DEVICE)
    out, lse = reference(q, pool.kv_cache(0), page_table, kv_lens, qo, mask)
    dense = torch.cat([model[s][0] for s in ids]).to(DEVICE)[:, None, :]  # page size 1, in order
    lens = torch.tensor([model[s].shape[1] for s in ids])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
    dense_pt = torch.zeros(3, int(lens.max()), dtype=torch.int32)
    for b in range(3):
        dense_pt[b, : lens[b]] = torch.arange(starts[b], starts[b] + lens[b])
    out2, lse2 = reference(q, dense, dense_pt.to(DEVICE), kv_lens, qo, mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert_consistent(pool, model)


def test_slots_and_extend_order():
    pool = new_pool(16, 4, shuffle=False, debug=False)
    a, b = pool.add_sequence(), pool.add_sequence()
    s = pool.extend([a, b], [5, 3])
    # fresh pool: pages handed out ascending, sequence by sequence
    assert s.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert pool.slots(a).tolist() == [0, 1, 2, 3, 4] and pool.slots(b).tolist() == [8, 9, 10]
    assert pool.num_free_pages == 13  # 2 + 1 pages used


# ----------------------------------------------------------------------------------------------
# Commit


def test_commit_page_size_1_is_a_remap():
    gen = torch.Generator().manual_seed(2)
    pool = new_pool(64, 1, debug=False, seed=5)
    model = fill(pool, gen, [10, 4])
    a, b = sorted(model)
    slots = pool.reserve_tree([a, b], [6, 3])
    pool.write(slots, rand_rows(gen, 9), layer=0)
    node = slots.cpu().tolist()
    before = bits(pool._store)
    free_before = pool.num_free_pages
    acc = torch.tensor([[4, 0, 5], [1, -1, -1]], device=DEVICE)
    pool.commit([a, b], acc, torch.tensor([3, 1], device=DEVICE), num_accepted_host=[3, 1])
    assert torch.equal(bits(pool._store), before), "page size 1 commit must not copy KV"
    assert pool.slots(a, 10).tolist() == [node[4], node[0], node[5]]
    assert pool.slots(b, 4).tolist() == [node[6 + 1]]
    assert pool.num_free_pages == free_before + (6 - 3) + (3 - 1)
    nf = pool.num_free_pages
    top = pool._stack[nf - 5: nf].tolist()  # rejected slots pushed in batch order, node order
    assert top == [node[1], node[2], node[3], node[6], node[8]]
    pool.check()


@pytest.mark.parametrize("page_size", [2, 3, 16, 64])
@pytest.mark.parametrize(
    "n,path",
    [
        (1, [0]),  # one-node tree
        (5, [0, 2, 1]),  # swap: row 2 -> 1 and row 1 -> 2
        (6, [3, 0, 5]),  # root not node 0, path not ascending
        (40, list(range(40))),  # chain, everything accepted, > 32 nodes
        (70, [0, 69, 35, 1]),  # > 64 nodes
        (9, [8, 7, 6, 5, 4, 3, 2, 1, 0]),  # reversed
    ],
    ids=["one-node", "swap", "root-not-0", "chain40", "n70", "reversed"],
)
def test_commit_moves_rows_any_order(page_size, n, path):
    gen = torch.Generator().manual_seed(n)
    pool = new_pool(400 // page_size + 8, page_size, layers=2, seed=n)
    model = fill(pool, gen, [13, 1])
    ids = sorted(model)
    step(pool, model, gen, ids, [n, 2], [path, [1]])
    assert_consistent(pool, model)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_commit_ragged_batch(use_triton, page_size):
    """Trees of 1, 9, 33 and 70 nodes, A wider than any path, int32 paths as a strided view."""
    gen = torch.Generator().manual_seed(7)
    pool = new_pool(600 // page_size + 8, page_size, layers=2, use_triton=use_triton, seed=1)
    model = fill(pool, gen, [0, 5, 64, 100])
    ids = sorted(model)
    trees = [1, 9, 33, 70]
    slots = pool.reserve_tree(ids, trees)
    rows = rand_rows(gen, 2, sum(trees))
    pool.write(slots, rows, layer=None)
    paths = [[0], [0, 4, 8], [0, 1, 2, 31, 32], [69, 3, 50, 0, 7, 8, 9]]
    big = torch.full((4, 20), -1, dtype=torch.int32)
    for b, p in enumerate(paths):
        big[b, : len(p)] = torch.tensor(p)
    acc = big.to(DEVICE)[:, :12]  # non-contiguous rows
    na = torch.tensor([len(p) for p in paths], device=DEVICE)
    pool.commit(ids, acc, na)
    with pytest.raises(RuntimeError, match="pending"):
        pool.extend(ids[:1], [1])
    pool.finalize_commit()  # reads the lengths from the device
    o = 0
    for s, n, p in zip(ids, trees, paths):
        model[s] = torch.cat([model[s], rows[:, o + torch.tensor(p)].cpu()], 1)
        o += n
    assert_consistent(pool, model)


def scripted(pool: KVPool, gen) -> dict:
    """A fixed sequence of every operation, for comparing the Triton and torch paths."""
    model = fill(pool, gen, [7, 30, 3])
    ids = sorted(model)
    step(pool, model, gen, ids, [5, 9, 3], [[0, 2], [4, 1, 0, 8], [2]])
    step(pool, model, gen, ids[:2], [11, 1], [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0]], pad=3)
    pool.truncate(ids[1], 20)
    model[ids[1]] = model[ids[1]][:, :20]
    s = pool.extend([ids[2]], [6])
    rows = rand_rows(gen, pool.num_layers, 6)
    pool.write(s, rows, layer=None)
    model[ids[2]] = torch.cat([model[ids[2]], rows.cpu()], 1)
    pool.defragment()
    step(pool, model, gen, ids, [4, 4, 4], [[3, 2, 1, 0], [1], [0, 3]])
    pool.remove_sequence(ids[0])
    del model[ids[0]]
    pool.defragment(pack=True)
    return model


@pytest.mark.parametrize("page_size,layers", [(1, 1), (4, 2), (64, 1)])
def test_triton_matches_torch(page_size, layers):
    states, models = [], []
    for use_triton in (False, True):
        gen = torch.Generator().manual_seed(11)
        pool = new_pool(200 // page_size + 12, page_size, layers=layers, use_triton=use_triton, seed=4)
        pool.defrag_scratch_bytes = 2 * pool.page_bytes  # force a scratch stage and levels
        models.append(scripted(pool, gen))
        assert_consistent(pool, models[-1])
        states.append(snapshot(pool))
    assert_same_state(states[0], states[1])


# ----------------------------------------------------------------------------------------------
# Capacity errors leave the pool exactly as it was


@pytest.mark.parametrize("page_size", [1, 5])
def test_pool_full_changes_nothing(page_size):
    gen = torch.Generator().manual_seed(3)
    pool = new_pool(10, page_size, max_seqs=3, max_seq_len=8 * page_size, seed=2)
    model = fill(pool, gen, [3 * page_size, 2 * page_size + 1])
    ids = sorted(model)
    snap = snapshot(pool)
    free = pool.num_free_pages
    with pytest.raises(PoolFullError, match="pool full") as e:
        pool.extend(ids, [page_size, (free) * page_size])  # first fits, second not: nothing done
    assert e.value.requested > e.value.available == free
    assert_same_state(snap, snapshot(pool))
    with pytest.raises(PoolFullError):
        pool.reserve_tree(ids, [1, free * page_size + 1])
    assert_same_state(snap, snapshot(pool))
    with pytest.raises(SequenceTooLongError):
        pool.extend([ids[0]], [5 * page_size + 1])
    assert_same_state(snap, snapshot(pool))
    with pytest.raises(ValueError):
        pool.extend([ids[0], ids[0]], [1, 1])
    with pytest.raises(ValueError):
        pool.extend([7], [1])
    assert_same_state(snap, snapshot(pool))
    pool.add_sequence()
    with pytest.raises(PoolFullError, match="sequence rows"):
        pool.add_sequence()
    assert issubclass(PoolFullError, RuntimeError)
    # exactly full is fine
    pool.extend([ids[0]], [pool.num_free_pages * page_size])
    assert pool.num_free_pages == 0
    with pytest.raises(PoolFullError):
        pool.reserve_tree([ids[1]], [page_size + 1])


def test_misuse_is_rejected():
    gen = torch.Generator().manual_seed(4)
    pool = new_pool(32, 1)
    model = fill(pool, gen, [4, 4])
    a, b = sorted(model)
    acc = torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    one = torch.ones(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="no tree"):
        pool.commit([a], acc, one)
    pool.reserve_tree([a], [3])
    with pytest.raises(ValueError, match="tree reserved"):
        pool.reserve_tree([a], [3])
    with pytest.raises(ValueError, match="tree reserved"):
        pool.extend([a], [1])
    with pytest.raises(TypeError):
        pool.commit([a], acc.float(), one)
    with pytest.raises(ValueError, match="rows"):
        pool.commit([a], torch.zeros(2, 1, dtype=torch.int64, device=DEVICE), one)
    with pytest.raises(RuntimeError, match="no commit"):
        pool.finalize_commit()
    snap = snapshot(pool)
    for bad_acc, bad_n in (([[0, 0]], 2), ([[0, 3]], 2), ([[0, 1]], 3), ([[0]], 0)):
        with pytest.raises(ValueError):  # debug mode checks the path on the host
            pool.commit([a], torch.tensor(bad_acc, device=DEVICE), torch.tensor([bad_n], device=DEVICE))
    assert_same_state(snap, snapshot(pool))
    with pytest.raises(ValueError, match="prefix"):
        pool.truncate(a, 6)
    pool.truncate(a, 2)  # drops the tree too
    model[a] = model[a][:, :2]
    assert pool.tree_size(a) == 0
    assert_consistent(pool, model)


@pytest.mark.parametrize("use_triton", [False, True])
def test_refused_calls_change_nothing(use_triton):
    """Calls refused after their first checks leave the pool exactly as it was: a commit whose
    num_accepted_host has the wrong length (it ran the commit first: a pending commit stuck), a
    reserve_step whose tree is narrower than its node counts (it reserved first, and the kernel
    read past the tree), a defragmentation plan of another pool (applied: the KV moved), counts
    that overflow int64 (wrapped to a negative length), and host values that are not integers
    (floats were truncated)."""
    from kdtree_engine.ddtree import tree_from_parents

    gen = torch.Generator().manual_seed(14)
    pool = new_pool(32, 4, use_triton=use_triton)
    model = fill(pool, gen, [6, 9])
    a, b = sorted(model)
    pool.reserve_tree([a], [3])
    snap = snapshot(pool)
    acc, one = torch.tensor([[0, 2]], device=DEVICE), torch.tensor([2], device=DEVICE)
    with pytest.raises(ValueError, match="num_accepted_host has 2 entries for 1"):
        pool.commit([a], acc, one, num_accepted_host=[2, 2])
    assert_same_state(snap, snapshot(pool))
    assert not pool.pending_commit
    pool.truncate(a, 6)  # drops the tree: usable, nothing pending
    snap = snapshot(pool)
    tree = tree_from_parents(torch.tensor([[-1, 0, 1, 2]], device=DEVICE), torch.tensor([[5, 6, 7, 8]], device=DEVICE))
    narrow = type(tree)(tree.tokens[:, :2], tree.parents[:, :2], tree.depths[:, :2], tree.num_nodes, (4,), 3)
    with pytest.raises(ValueError, match="at most the tree's width 2"):
        pool.reserve_step([a], narrow)
    assert_same_state(snap, snapshot(pool))
    twin = new_pool(32, 4, use_triton=use_triton)
    fill(twin, torch.Generator().manual_seed(14), [6, 9])
    with pytest.raises(ValueError, match="another pool"):
        pool.apply_defragment(twin.plan_defragment(pack=True))
    assert_same_state(snap, snapshot(pool))
    for call in (lambda: pool.book_tree([a], 2**63 - 1), lambda: pool.extend([a], [2**63 - 1])):
        with pytest.raises(SequenceTooLongError):
            call()
    for call in (lambda: pool.extend([b], [1.9]), lambda: pool.truncate("1", 1), lambda: pool.extend([0.6], [1])):
        with pytest.raises(TypeError, match="must hold integers"):
            call()
    for call, name in ((lambda: pool.truncate(a, 2.7), "new_len"), (lambda: pool.truncate(a, [2, 4]), "new_len"),
                       (lambda: pool.slots(a, 1.5), "start"), (lambda: pool.slots(a, 0, True), "end"),
                       (lambda: pool.shuffle_free_pages(1.5), "seed"), (lambda: pool.apply_defragment(None), "plan"),
                       (lambda: pool.maybe_defragment(5), "policy"), (lambda: pool.write([0], rand_rows(gen, 1)), "slots")):
        with pytest.raises(TypeError, match=f"^{name} must be"):
            call()
    with pytest.raises(ValueError, match="layer must be"):
        pool.gather_kv(a, layer=1)
    with pytest.raises(TypeError, match="slots must be torch.int64"):
        pool.write(torch.zeros(1, dtype=torch.int32, device=DEVICE), rand_rows(gen, 1), layer=0)
    with pytest.raises(ValueError, match="layer must be"):
        pool.write(torch.zeros(1, dtype=torch.int64, device=DEVICE), rand_rows(gen, 1), layer=1)
    assert_same_state(snap, snapshot(pool))
    assert_consistent(pool, model)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(num_pages=2.5), TypeError, "num_pages must be an int"),  # (was truncated)
    (dict(num_pages=True), TypeError, "num_pages must be an int"),
    (dict(num_pages="3"), TypeError, "num_pages must be an int"),
    (dict(page_size=1.5), TypeError, "page_size must be an int"),
    (dict(max_seqs=2.5), TypeError, "max_seqs must be an int"),
    (dict(max_seq_len=3.5), TypeError, "max_seq_len must be an int"),
    (dict(num_pages=0), ValueError, "must be positive"),
    (dict(device=[0]), TypeError, "device must be"),
    (dict(device="meta"), ValueError, "CPU or CUDA device"),
    (dict(device=f"cuda:{torch.cuda.device_count()}"), ValueError, "no such CUDA device"),
])
def test_constructor_refuses_bad_arguments(kwargs, err, match):
    args = dict(num_pages=8, page_size=1, device="cpu", use_triton=False) | kwargs
    with pytest.raises(err, match=match):
        KVPool(**args)


@pytest.mark.parametrize("page_size", [1, 4])
def test_cpu_commit_and_write_check_their_indices(page_size):
    """On the CPU a commit checks its accepted paths and its rows without debug (the read costs no
    sync): a repeated node (page size 1: a page in two table entries), a negative one (clamped to
    the root, a repeat), one past the tree, or rows naming another sequence is refused and the pool
    is unchanged; num_accepted past the path is still clamped, as on a GPU. write() checks its
    slots there too."""
    pool = KVPool(32, page_size, device="cpu", debug=False, use_triton=False)
    pool.shuffle_free_pages(3)
    a = pool.add_sequence()
    pool.extend([a], [6])
    pool.reserve_tree([a], [5])
    snap = snapshot(pool)
    for path in ([0, 2, 2], [0, -3, 1], [0, 5, 1], [0, 2**31 - 1, 1]):
        with pytest.raises(ValueError, match="must be distinct nodes in \\[0, 5\\)"):
            pool.commit([a], torch.tensor([path]), torch.tensor([3]), num_accepted_host=[3])
        assert_same_state(snap, snapshot(pool))
        assert not pool.pending_commit
    with pytest.raises(ValueError, match="rows holds"):  # another sequence's row: its table rewritten
        pool.commit([a], torch.tensor([[0, 1]]), torch.tensor([2]), rows=torch.tensor([a + 1]))
    assert_same_state(snap, snapshot(pool))
    pool.commit([a], torch.tensor([[0, 3, 99]]), torch.tensor([0]), num_accepted_host=[1])  # 1: 99 unread
    assert pool.seq_len(a) == 7
    pool.check()
    snap = snapshot(pool)
    for bad in (-1, 32 * page_size, 2**40):  # (index_copy_ raised IndexError; 32 * page_size: the trash page)
        with pytest.raises(ValueError, match=f"slots must be in \\[0, {32 * page_size}\\)"):
            pool.write(torch.tensor([0, bad]), torch.zeros(2, 576, dtype=torch.bfloat16), layer=0)
    assert_same_state(snap, snapshot(pool))


@pytest.mark.parametrize("path", [[0, 2, 2], [0, 0, 0], [0, -3, 1], [0, 3, 99]], ids=str)
def test_repeated_nodes_keep_a_gpu_commit_consistent(path, monkeypatch):
    """A GPU commit does not read the accepted path (a sync): a repeated node (also a negative one,
    clamped to the root; one past the tree is clamped to its last node) put one slot in two table
    entries at page size 1 and
    pushed more freed slots than the host counts, over the next sequence's. Now the later
    positions of a repeated node take rejected slots: the pool stays consistent, the positions of
    each first occurrence hold their node's KV, and the kernel and the torch path agree. Here on
    the CPU with its host checks off, as on a GPU."""
    monkeypatch.setattr(KVPool, "_reads_inputs", property(lambda self: False))
    gen = torch.Generator().manual_seed(16)
    states = []
    for use_triton in (False, True):
        pool = new_pool(32, 1, debug=False, use_triton=use_triton, seed=16)
        a, b = pool.add_sequence(), pool.add_sequence()
        prefix = rand_rows(torch.Generator().manual_seed(1), 6)
        pool.write(pool.extend([a, b], [6, 0]), torch.cat([prefix, prefix[:0]]), layer=0)
        nodes = rand_rows(torch.Generator().manual_seed(2), 8)
        pool.write(pool.reserve_tree([a, b], [5, 3]), nodes, layer=0)
        acc = torch.tensor([path, [0, 2, -1]], device=DEVICE)
        pool.commit([a, b], acc, torch.tensor([3, 2], device=DEVICE), num_accepted_host=[3, 2])
        pool.check()  # (failed: a slot in two table entries, the freed slots over b's)
        assert (pool.seq_len(a), pool.seq_len(b)) == (9, 2)
        kv = pool.gather_kv(a).cpu()
        first = [i for i, x in enumerate(path) if min(max(x, 0), 4) not in [min(max(y, 0), 4) for y in path[:i]]]
        for i in first:
            assert torch.equal(kv[6 + i], nodes[min(max(path[i], 0), 4)].cpu()), i
        assert torch.equal(kv[:6], prefix.cpu()) and torch.equal(pool.gather_kv(b).cpu(), nodes[[5, 7]].cpu())
        states.append({k: v for k, v in snapshot(pool).items() if k != "store"})  # (unwritten slots: garbage)
    assert_same_state(*states)


@pytest.mark.parametrize("use_triton", [False, True])
def test_place_tree_must_place_the_booking(use_triton):
    """place_tree pops the pages book_tree counted: without a booking, for other sequences or
    another size, or twice, it would pop pages the host never counted (the free count and the
    stack apart). Until the booking is placed every other mutation raises, as while a commit is
    pending. replayed_commit's num_accepted is checked before the commit is marked pending."""
    pool = new_pool(16, 1, use_triton=use_triton)
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.extend([a, b], [3, 2])
    with pytest.raises(RuntimeError, match="no book_tree to place"):
        pool.place_tree([a], 2)
    with pytest.raises(TypeError, match="tree_size must be an int"):
        pool.book_tree([a], 1.5)
    snap = snapshot(pool)
    pool.book_tree([a], 2)
    for ids, size in (([a], 5), ([a], 2.0), ([b], 2), ([a, b], 2)):
        with pytest.raises(ValueError, match="must place the booking"):
            pool.place_tree(ids, size)
    for call in (lambda: pool.extend([b], [1]), lambda: pool.commit([a], torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)),
                 lambda: pool.book_tree([b], 1), pool.check):
        with pytest.raises(RuntimeError, match="not placed"):
            call()
    now = snapshot(pool)  # the refused places left the device as the booking found it
    assert_same_state({k: snap[k] for k in ("store", "table", "lens", "tree", "stack", "top")}, now)
    pool.place_tree([a], 2)
    pool.check()
    with pytest.raises(RuntimeError, match="no book_tree to place"):
        pool.place_tree([a], 2)
    snap = snapshot(pool)
    with pytest.raises(TypeError, match="num_accepted must be a 1-D int32/int64 tensor"):
        pool.replayed_commit([a], [2], 2)
    assert_same_state(snap, snapshot(pool))
    assert not pool.pending_commit


@pytest.mark.parametrize("debug", [False, True])
def test_wrong_host_lengths_are_refused(debug):
    """A num_accepted_host other than num_accepted (after both are clamped) would leave the host's
    lengths and free count apart from the device's: on the CPU (a free read) and with debug, commit
    refuses it before the kernel runs (the pool unchanged) and finalize_commit before any change
    (the commit still pending, so a right call can follow). Values that clamp alike pass."""
    if not debug and DEVICE != "cpu":
        pytest.skip("without debug a GPU pool does not read the device's counts (a sync)")
    gen = torch.Generator().manual_seed(5)
    pool = new_pool(32, 1, debug=debug)
    model = fill(pool, gen, [4])
    (a,) = model
    pool.reserve_tree([a], [4])
    snap = snapshot(pool)
    acc, three = torch.tensor([[0, 1, 2]], device=DEVICE), torch.tensor([3], device=DEVICE)
    with pytest.raises(ValueError, match=r"num_accepted_host \[2\] differs from num_accepted \[3\]"):
        pool.commit([a], acc, three, num_accepted_host=[2])
    assert_same_state(snap, snapshot(pool))
    assert not pool.pending_commit
    pool.commit([a], acc, three)
    with pytest.raises(ValueError, match="differs"):
        pool.finalize_commit([2])
    assert pool.pending_commit
    pool.finalize_commit([3])
    assert pool.seq_len(a) == 7
    pool.check()
    if debug:
        return  # debug refuses a num_accepted outside [1, min(n, A)] instead of clamping it
    pool.reserve_tree([a], [2])  # clamped alike: 9 and 2 (the tree), 0 and 1 (the root)
    pool.commit([a], acc[:, :2], torch.tensor([9], device=DEVICE), num_accepted_host=[2])
    pool.reserve_tree([a], [2])
    pool.commit([a], acc[:, :2], torch.tensor([0], device=DEVICE), num_accepted_host=[1])
    assert pool.seq_len(a) == 10
    pool.check()


# ----------------------------------------------------------------------------------------------
# Poison: a use-after-free reads NaN


def test_stale_page_table_reads_nan_after_commit():
    gen = torch.Generator().manual_seed(6)
    pool = new_pool(64, 1, seed=9)
    model = fill(pool, gen, [20])
    (a,) = model
    tree = random_tree(6, gen)
    slots = pool.reserve_tree([a], [6])
    pool.write(slots, rand_rows(gen, 6), layer=0)
    pt_old, lens_old = pool.verify_inputs([a])
    pt_old, lens_old = pt_old.clone(), lens_old.clone()
    qo = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    mask = tree_mask_from_parents(tree).to(DEVICE)
    q = torch.randn(6, 2, D, generator=gen).to(BF16).to(DEVICE)
    out, _ = reference(q, pool.kv_cache(), pt_old, lens_old, qo, mask)
    assert torch.isfinite(out).all()
    pool.commit([a], torch.tensor([[0, 2]], device=DEVICE), torch.tensor([2], device=DEVICE), num_accepted_host=[2])
    # the verify inputs from before the commit now point at freed (poisoned) slots
    out, _ = reference(q, pool.kv_cache(), pt_old, lens_old, qo, mask)
    assert torch.isnan(out).any()
    assert torch.isnan(pool.kv_cache()[slots[[1, 3, 4, 5]].cpu()].float()).all()
    assert not torch.isnan(pool.kv_cache()[slots[[0, 2]].cpu()].float()).any()


# ----------------------------------------------------------------------------------------------
# Defragmentation


def interleaved(pool: KVPool, gen, n_seqs: int, rounds: int, chunk: int) -> dict:
    """Sequences grown in turns (pages interleave) and partly truncated (holes)."""
    ids = [pool.add_sequence() for _ in range(n_seqs)]
    model = {s: torch.zeros(pool.num_layers, 0, D, dtype=BF16) for s in ids}
    for r in range(rounds):
        for s in ids:
            k = chunk + (r + s) % 3
            sl = pool.extend([s], [k])
            rows = rand_rows(gen, pool.num_layers, k)
            pool.write(sl, rows, layer=None)
            model[s] = torch.cat([model[s], rows.cpu()], 1)
        if r % 2:
            s = ids[r % n_seqs]
            new = model[s].shape[1] - chunk // 2
            pool.truncate(s, new)
            model[s] = model[s][:, :new]
    return model


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("pack", [False, True])
def test_defragment_makes_sequences_contiguous(page_size, pack):
    gen = torch.Generator().manual_seed(page_size)
    pool = new_pool(24 * (2 * page_size + 4) // page_size + 16, page_size, layers=2, seed=page_size)
    model = interleaved(pool, gen, 4, 6, 2 * page_size + 1)
    before = pool.fragmentation()
    assert max(before.runs) > 1 and before.frag_ratio > 0
    report = pool.defragment(pack=pack)
    assert report.pages_moved > 0
    after = pool.fragmentation()
    assert after.runs == [1] * len(after.runs) and after.frag_ratio == 0
    for s in pool.live_sequences():
        sl = pool.slots(s).cpu()
        assert (torch.diff(sl) == 1).all(), "positions must be ascending contiguous slots"
    if pack:
        assert after.high_water == pool.num_used_pages
        assert after.largest_free_run == pool.num_free_pages
    assert_consistent(pool, model)
    # after a defrag, growth continues on the stack of ascending free pages
    s = pool.live_sequences()[0]
    step(pool, model, gen, [s], [3], [[0, 1]])
    assert_consistent(pool, model)


def test_defragment_subset_leaves_others_alone():
    gen = torch.Generator().manual_seed(8)
    pool = new_pool(200, 1, shuffle=False)  # interleaved runs below, one free run above
    model = interleaved(pool, gen, 3, 5, 4)
    ids = pool.live_sequences()
    assert min(pool.fragmentation().runs) > 1
    tables = {s: pool.slots(s).cpu() for s in ids}
    report = pool.defragment([ids[1]])
    assert report.seq_ids == [ids[1]] and report.skipped == []
    for s in (ids[0], ids[2]):
        assert torch.equal(pool.slots(s).cpu(), tables[s])
    assert pool.fragmentation([ids[1]]).runs == [1]
    assert_consistent(pool, model)


def test_defragment_subset_without_room_is_skipped():
    gen = torch.Generator().manual_seed(8)
    pool = new_pool(200, 1, seed=8)  # scattered: no free run holds a whole sequence
    model = interleaved(pool, gen, 3, 5, 4)
    ids = pool.live_sequences()
    assert pool.fragmentation().largest_free_run < min(m.shape[1] for m in model.values())
    snap = snapshot(pool)
    report = pool.defragment([ids[1]])
    assert report.seq_ids == [] and report.skipped == [ids[1]] and report.pages_moved == 0
    assert_same_state(snap, snapshot(pool))
    report = pool.defragment()  # the whole pool: packs when a sequence finds no room
    assert sorted(report.seq_ids) == ids
    assert pool.fragmentation().runs == [1, 1, 1]
    assert_consistent(pool, model)


def test_defragment_anchor_moves_only_the_stray_pages():
    """A sequence that is contiguous but for its last pages keeps its long run in place."""
    gen = torch.Generator().manual_seed(9)
    pool = new_pool(64, 4, shuffle=False)
    model = fill(pool, gen, [40, 8])  # a: pages 0..9, b: pages 10, 11
    a, b = sorted(model)
    sl = pool.extend([a], [8])  # a grows into pages 12, 13
    rows = rand_rows(gen, 1, 8)
    pool.write(sl, rows, layer=None)
    model[a] = torch.cat([model[a], rows.cpu()], 1)
    pool.remove_sequence(b)  # pages 10, 11 become free
    del model[b]
    assert pool.fragmentation().runs == [2]
    report = pool.defragment()
    assert report.pages_moved == 2 and pool.slots(a)[0].item() == 0
    assert pool.fragmentation().runs == [1]
    assert_consistent(pool, model)


def test_defragment_without_room_packs_the_pool():
    gen = torch.Generator().manual_seed(10)
    pool = new_pool(24, 1, seed=10)
    model = fill(pool, gen, [12, 11])  # full but one page, both scattered
    plan = pool.plan_defragment()
    # each fits only if the other moves out of the way: first fit places the larger one,
    # then the smaller one finds room among the pages vacated; otherwise it is skipped
    assert set(plan.seq_ids) | set(plan.skipped) == set(model)
    pool.defragment()  # falls back to packing when something was skipped
    assert pool.fragmentation().runs == [1, 1]
    assert_consistent(pool, model)


def test_stale_plan_raises():
    gen = torch.Generator().manual_seed(12)
    pool = new_pool(40, 1)
    model = fill(pool, gen, [10, 10])
    plan = pool.plan_defragment()
    pool.extend([sorted(model)[0]], [0])
    with pytest.raises(StalePlanError):
        pool.apply_defragment(plan)


def test_fragmentation_figures():
    pool = new_pool(16, 1, shuffle=False, debug=False)
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.extend([a], [3])  # 0 1 2
    pool.extend([b], [2])  # 3 4
    pool.extend([a], [2])  # 5 6
    st_ = pool.fragmentation()
    assert st_.runs == [2, 1] and st_.pages == [5, 2] and st_.tokens == [5, 2]
    assert st_.high_water == 7 and st_.free_runs == 1 and st_.largest_free_run == 9
    assert st_.frag_ratio == pytest.approx(1 / 5)
    pool.remove_sequence(b)
    st_ = pool.fragmentation()
    assert st_.free_runs == 2 and st_.largest_free_run == 9 and st_.free_pages == 11


def test_threshold_policy_hook():
    gen = torch.Generator().manual_seed(13)
    pool = new_pool(400, 1, shuffle=False)
    a, b, c = (pool.add_sequence() for _ in range(3))
    model = {s: torch.zeros(1, 0, D, dtype=BF16) for s in (a, b, c)}

    def grow(s, k):
        sl = pool.extend([s], [k])
        rows = rand_rows(gen, 1, k)
        pool.write(sl, rows, layer=None)
        model[s] = torch.cat([model[s], rows.cpu()], 1)

    for _ in range(20):  # a: 80 tokens in 20 runs; b: 20 tokens, too short to matter
        grow(a, 4)
        grow(b, 1)
    grow(c, 100)  # contiguous
    policy = ThresholdPolicy(max_runs_per_1k_tokens=64, min_tokens=50, check_every=2)
    assert pool.maybe_defragment(policy) is None  # no committed steps yet: no check, no sync
    step(pool, model, gen, [a, b, c], [3, 3, 3], [[0], [0], [0]])
    assert pool.maybe_defragment(policy) is None  # one step: still no check
    step(pool, model, gen, [a, b, c], [3, 3, 3], [[0], [0], [0]])
    report = pool.maybe_defragment(policy)
    assert report is not None and report.seq_ids == [a] and report.skipped == []
    assert pool.fragmentation([a]).runs == [1]
    assert pool.maybe_defragment(policy) is None  # checked this step already
    assert_consistent(pool, model)


def test_policy_packs_when_there_is_no_room():
    gen = torch.Generator().manual_seed(15)
    pool = new_pool(300, 1, seed=15)  # scattered slots: no contiguous room for any sequence
    model = fill(pool, gen, [100, 20, 100])
    for _ in range(2):
        step(pool, model, gen, sorted(model), [3, 3, 3], [[0, 1], [0], [2]])
    report = pool.maybe_defragment(ThresholdPolicy(min_tokens=50, check_every=2))
    assert report is not None and sorted(report.seq_ids) == sorted(model)  # packed
    assert pool.fragmentation().runs == [1, 1, 1]
    assert_consistent(pool, model)


# ----------------------------------------------------------------------------------------------
# The move schedule


def run_schedule(s: MoveSchedule, content: np.ndarray, reverse: bool) -> np.ndarray:
    """Execute a schedule with one-pass semantics, each launch's moves one by one in a given
    order: a launch with a hazard inside gives a wrong result in one of the two orders."""
    mem = content.copy()
    scratch = mem[s.scratch_src].copy()
    for k in range(s.levels):
        lo, hi = s.level_bounds[k], s.level_bounds[k + 1]
        idx = range(hi - 1, lo - 1, -1) if reverse else range(lo, hi)
        for i in idx:
            mem[s.dst[i]] = mem[s.src[i]]
    mem[s.scratch_dst] = scratch
    return mem


def check_moves(src, dst, num_pages, budget_units):
    s = schedule_moves(src, dst, num_pages, unit_bytes=1, scratch_budget_bytes=budget_units)
    check_schedule(s, num_pages)
    content = np.arange(num_pages) + 1000
    want = content.copy()
    want[dst] = content[src]
    for reverse in (False, True):
        assert np.array_equal(run_schedule(s, content, reverse), want)
    keep = np.asarray(src) != np.asarray(dst)
    assert s.num_moves == int(keep.sum())
    return s


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_schedule_random_moves(data):
    n = data.draw(st.integers(1, 60))
    m = data.draw(st.integers(0, n))
    src = data.draw(st.permutations(range(n)))[:m]
    dst = data.draw(st.permutations(range(n)))[:m]
    budget = data.draw(st.sampled_from([0, 1, 3, 1000]))
    check_moves(np.array(src, np.int64), np.array(dst, np.int64), n, budget)


def test_schedule_long_chain_and_cycles():
    n = 1000
    # slide down by one page: one chain of 999 moves
    s = check_moves(np.arange(1, n), np.arange(0, n - 1), n, budget_units=0)
    assert s.levels == n - 1 and len(s.scratch_src) == 0  # no scratch allowed: one level per link
    s = check_moves(np.arange(1, n), np.arange(0, n - 1), n, budget_units=10**9)
    assert s.levels < 10 and s.launches < 12  # scratch allowed: few launches
    # swaps and a 3-cycle need one scratch page per cycle even with no budget
    s = check_moves(np.array([0, 1, 5, 6, 7]), np.array([1, 0, 6, 7, 5]), 10, budget_units=0)
    assert len(s.scratch_src) == 2
    # identity moves vanish
    s = check_moves(np.arange(5), np.arange(5), 5, budget_units=0)
    assert s.num_moves == 0 and s.launches == 0


def test_check_schedule_catches_a_hazard():
    bad = MoveSchedule(src=np.array([1, 2]), dst=np.array([0, 1]), level_bounds=np.array([0, 2]),
                       scratch_src=np.zeros(0, np.int64), scratch_dst=np.zeros(0, np.int64))
    with pytest.raises(ScheduleError, match="overwritten"):
        check_schedule(bad, 3)


# ----------------------------------------------------------------------------------------------
# Property test: random operation sequences never lose KV


class PoolMachine(RuleBasedStateMachine):
    use_triton = False

    @initialize(page_size=st.sampled_from([1, 2, 5, 16]), pages=st.integers(8, 48),
                layers=st.integers(1, 2), seed=st.integers(0, 2**16), short=st.booleans())
    def setup(self, page_size, pages, layers, seed, short):
        # short: a sequence may hold only half the pool (SequenceTooLongError becomes reachable)
        self.pool = KVPool(pages, page_size, num_layers=layers, device=DEVICE, debug=True,
                           use_triton=self.use_triton, max_seqs=4,
                           max_seq_len=(pages // 2 if short else pages) * page_size)
        self.pool.defrag_scratch_bytes = self.pool.page_bytes * (seed % 3)  # 0, 1 or 2 pages
        self.pool.shuffle_free_pages(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.model: dict = {self.pool.add_sequence(): torch.zeros(layers, 0, D, dtype=BF16)}

    def _expect_unchanged(self, fn) -> bool:
        snap = snapshot(self.pool)
        try:
            fn()
        except (PoolFullError, SequenceTooLongError) as e:
            event(f"refused: {type(e).__name__}")
            assert_same_state(snap, snapshot(self.pool))
            return False
        return True

    @rule()
    def add(self):
        if len(self.model) < self.pool.max_seqs:
            s = self.pool.add_sequence()
            self.model[s] = torch.zeros(self.pool.num_layers, 0, D, dtype=BF16)
        else:
            assert not self._expect_unchanged(self.pool.add_sequence)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def extend(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        counts = data.draw(st.lists(st.integers(0, 2 * self.pool.page_size + 1), min_size=len(ids), max_size=len(ids)))
        out = {}

        def go():
            out["slots"] = self.pool.extend(ids, counts)

        if self._expect_unchanged(go):
            rows = rand_rows(self.gen, self.pool.num_layers, sum(counts))
            self.pool.write(out["slots"], rows, layer=None)
            o = 0
            for s, k in zip(ids, counts):
                self.model[s] = torch.cat([self.model[s], rows[:, o: o + k].cpu()], 1)
                o += k

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def speculative_step(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        trees = data.draw(st.lists(st.integers(1, 9), min_size=len(ids), max_size=len(ids)))
        paths = []
        for n in trees:
            order = data.draw(st.permutations(range(n)))
            paths.append(list(order[: data.draw(st.integers(1, n))]))
        pad = data.draw(st.integers(0, 2))
        host = data.draw(st.booleans())
        snap = snapshot(self.pool)
        try:
            step(self.pool, self.model, self.gen, ids, trees, paths, pad=pad, host=host,
                 acc_dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
            event("committed")
        except (PoolFullError, SequenceTooLongError) as e:
            event(f"step refused: {type(e).__name__}")
            assert_same_state(snap, snapshot(self.pool))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def speculative_step_again(self, data):  # twice as likely as the other rules
        self.speculative_step(data)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        new = data.draw(st.integers(0, self.model[s].shape[1]))
        self.pool.truncate(s, new)
        self.model[s] = self.model[s][:, :new]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.pool.remove_sequence(s)
        del self.model[s]

    @rule(data=st.data())
    def defragment(self, data):
        how = data.draw(st.sampled_from(["all", "pack", "subset"]))
        if how == "subset" and self.model:
            ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
            event(f"defrag subset moved {min(self.pool.defragment(ids).pages_moved, 1)}")
        else:
            self.pool.defragment(pack=how == "pack")
            assert all(r <= 1 for r in self.pool.fragmentation().runs)  # 0: empty sequence

    @rule(seed=st.integers(0, 100))
    def shuffle(self, seed):
        self.pool.shuffle_free_pages(seed)

    @invariant()
    def nothing_lost(self):
        if hasattr(self, "pool"):
            assert_consistent(self.pool, self.model)


PoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
test_pool_state_machine = PoolMachine.TestCase


class TritonPoolMachine(PoolMachine):
    use_triton = True


TritonPoolMachine.TestCase.settings = settings(
    max_examples=10, stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
test_pool_state_machine_triton = TritonPoolMachine.TestCase


# ----------------------------------------------------------------------------------------------
# On the CPU: the no-sync paths use no op that synchronizes on CUDA (the GPU test below proves it
# on a device; this catches the usual culprits everywhere)


class _SyncingOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records ops that make a host sync on CUDA: ``.item()``, ``nonzero`` (boolean indexing),
    ``masked_select``, and ``index_put_`` of a 0-dim value -- ``x[idx] = 0`` on a CUDA tensor
    turns the Python scalar into a CPU tensor that index_put_ copies over with a blocking copy
    (a stream sync; under ``set_sync_debug_mode("error")`` it raises half-way through a pool
    mutation, and a CUDA-graph capture fails)."""

    def __init__(self):
        super().__init__()
        self.found = []
        self._made = set()  # storages of op outputs (a Python scalar's tensor is made by none)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "nonzero", "masked_select"):
            self.found.append(name)
        elif name in ("index_put_", "index_put", "_index_put_impl_"):
            v = args[2] if len(args) > 2 else kwargs.get("values")
            # a tensor value shows up as a view (setitem strips its leading 1s); a Python scalar
            # as a fresh 0-dim tensor that no op made (on CUDA: a CPU tensor, copied blocking)
            if (isinstance(v, torch.Tensor) and v.dim() == 0 and not v._is_view()
                    and v.untyped_storage().data_ptr() not in self._made):
                self.found.append(f"{name} of a Python scalar (x[idx] = scalar)")
        elif name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.found.append("boolean-mask index")
        out = func(*args, **kwargs)
        if name.startswith("lift_fresh"):  # a constant entering (the Python scalar too)
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._made.add(t.untyped_storage().data_ptr())
        return out


def test_sync_audit_flags_scalar_index_assignment():
    x, idx = torch.zeros(4, dtype=torch.int32), torch.tensor([1, 2])
    with _SyncingOps() as mode:
        x[idx] = 0
    assert mode.found and "Python scalar" in mode.found[0]
    with _SyncingOps() as mode:
        x.index_fill_(0, idx, 0)
        x[idx] = torch.ones(2, dtype=torch.int32)
        x[idx[:1]] = torch.ones(1, dtype=torch.int32)
        x[idx] = x.sum(dtype=torch.int32)  # a 0-dim value some op made: no copy
    assert mode.found == []


@pytest.mark.parametrize("page_size", [1, 64])
def test_torch_commit_path_has_no_syncing_op(page_size):
    gen = torch.Generator().manual_seed(15)
    pool = new_pool(1024 // page_size + 32, page_size, debug=False, use_triton=False, seed=15)
    model = fill(pool, gen, [100, 300])
    ids = sorted(model)
    step(pool, model, gen, ids, [9, 9], [[0, 2, 5], [0, 1]])  # warm the row cache
    acc = torch.tensor([[0, 2, 5], [0, 1, -1]], device=DEVICE)
    na = torch.tensor([3, 2], device=DEVICE)
    rows = rand_rows(gen, 1, 18)
    with _SyncingOps() as mode:
        slots = pool.reserve_tree(ids, [9, 9])
        pool.write(slots, rows, layer=None)
        pool.verify_inputs(ids)
        pool.commit(ids, acc, na)
    assert mode.found == []
    pool.finalize_commit([3, 2])
    model[ids[0]] = torch.cat([model[ids[0]], rows[:, [0, 2, 5]].cpu()], 1)
    model[ids[1]] = torch.cat([model[ids[1]], rows[:, [9, 10]].cpu()], 1)
    with _SyncingOps() as mode:
        pool.truncate(ids[1], 200)  # frees pages and resets the tree size the same way
    assert mode.found == []
    model[ids[1]] = model[ids[1]][:, :200]
    assert_consistent(pool, model)


# ----------------------------------------------------------------------------------------------
# GPU only: commit and extend do not synchronize, commit can be captured in a CUDA graph


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_commit_has_no_host_sync_and_captures(page_size, use_triton):
    gen = torch.Generator().manual_seed(14)
    pool = new_pool(4096 // page_size + 64, page_size, debug=False, use_triton=use_triton, seed=14)
    model = fill(pool, gen, [100, 300])
    ids = sorted(model)
    step(pool, model, gen, ids, [9, 9], [[0, 2, 5], [0, 1]])  # compile, warm the row cache
    acc = torch.tensor([[0, 2, 5], [0, 1, -1]], device="cuda")
    na = torch.tensor([3, 2], device="cuda")
    rows = rand_rows(gen, 1, 18)
    # eager: reserve, verify_inputs and commit raise if anything synchronizes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        slots = pool.reserve_tree(ids, [9, 9])
        pool.write(slots, rows, layer=None)
        pool.verify_inputs(ids)
        pool.commit(ids, acc, na)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    pool.finalize_commit([3, 2])
    model[ids[0]] = torch.cat([model[ids[0]], rows[:, [0, 2, 5]].cpu()], 1)
    model[ids[1]] = torch.cat([model[ids[1]], rows[:, [9, 10]].cpu()], 1)
    # captured in a CUDA graph (nothing runs), then replayed
    slots = pool.reserve_tree(ids, [9, 9])
    pool.write(slots, rows, layer=None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.commit(ids, acc, na)
    graph.replay()
    pool.finalize_commit([3, 2])
    model[ids[0]] = torch.cat([model[ids[0]], rows[:, [0, 2, 5]].cpu()], 1)
    model[ids[1]] = torch.cat([model[ids[1]], rows[:, [9, 10]].cpu()], 1)
    assert_consistent(pool, model)


# ----------------------------------------------------------------------------------------------
# The benchmark's code path, at toy sizes on the CPU (its GPU numbers come from the H200 run)


@pytest.mark.skipif(HAS_CUDA, reason="the CPU smoke run; on CUDA run python -m kdtree_engine.kvpool_bench")
def test_benchmark_runs_on_cpu():
    from kdtree_engine.kvpool_bench import format_results, run_benchmark

    rows = run_benchmark("cpu", quick=True, prefixes=(70,), shapes=((2, 3),), kernels=("naive",),
                         commit_batch=3, commit_nodes=5, commit_steps=2)
    assert not [r for r in rows if "error" in r]
    (d,) = [r for r in rows if r["section"] == "defrag"]
    assert d["kv_intact"] and d["pages_moved"] > 0
    ver = [r for r in rows if r["section"] == "verify"]
    assert {r["layout"] for r in ver} == {"ps1-scattered", "ps1-defragmented", "ps64-scattered"}
    # the naive kernel reads the same logical KV through three page layouts: bitwise the same
    assert all(r["max_diff_vs_scattered"] == 0.0 for r in ver if r["layout"] != "ps1-scattered")
    assert len([r for r in rows if r["section"] == "commit"]) == 4
    assert len([r for r in rows if r["section"] == "payback"]) == 1
    assert "commit per step" in format_results(rows)
