"""The speculative step as phases, run eagerly (CPU) or as captured CUDA graphs (GPU only).

CPU: the phase clock and the eager step graph, the mode checks, the pool's capturable half of
``reserve_step`` and the host half of a replayed commit, the per-step time split of a result.
GPU: decoding with one graph per step shape, and with a graph per phase, gives the tokens of
eager decoding, across step shapes that change as sequences finish, with each shape captured once.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import DEVICE, requires_cuda
from kdtree_engine.ddtree import accept_greedy, build_ddtree, tree_from_parents
from kdtree_engine.kvpool import KVPool
from kdtree_engine.model import MLARunner, Phase, build_random_model, tiny_config
from kdtree_engine.model.drafters import NGramDrafter, SyntheticDrafter
from kdtree_engine.model.graphs import PhaseClock, StepGraph
from kdtree_engine.model.speculative import GenerateResult, SpeculativeEngine, check_lossless
from kdtree_engine.model.step_kernels import _record_step_torch, record_step


def test_eager_step_graph_runs_phases_in_order_and_times_each_kind():
    seen = []

    def phase(kind, name, sleep=0.0):
        return Phase(kind, name, lambda: (seen.append(name), time.sleep(sleep)))

    g = StepGraph([phase("tree", "t", 0.01), phase("attention", "a0", 0.02), phase("rest", "r"),
                   phase("attention", "a1", 0.02)], "eager", "cpu")
    clock = PhaseClock("cpu")
    assert g.run(clock) is True and g.run(clock) is True  # eager: the Python runs every time
    assert seen == ["t", "a0", "r", "a1"] * 2
    assert set(clock.seconds) == {"tree", "attention", "rest"}
    assert clock.seconds["attention"] >= 0.08 and clock.seconds["tree"] >= 0.02
    assert clock.total_s == pytest.approx(sum(clock.seconds.values()))
    assert not g.captured and g.capture_s == 0.0


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU's refusal of graph modes")
def test_graph_modes_need_cuda():
    with pytest.raises(ValueError, match="mode must be one of"):
        StepGraph([], "graph", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StepGraph([], "step", "cpu")
    runner = MLARunner(build_random_model(tiny_config(), seed=0), kernel="reference", cache_dtype=torch.float16)
    assert SpeculativeEngine(runner).graphs == "eager"
    with pytest.raises(ValueError, match="graphs='phases' captures CUDA graphs"):
        SpeculativeEngine(runner, graphs="phases")
    with pytest.raises(ValueError, match="graphs must be one of"):
        SpeculativeEngine(runner, graphs="on")


def test_moe_model_is_not_capturable():
    dense = tiny_config(num_hidden_layers=2, first_k_dense_replace=2)
    assert MLARunner(build_random_model(dense, seed=0), kernel="reference").capturable
    assert not MLARunner(build_random_model(tiny_config(), seed=0), kernel="reference").capturable


def _pool_and_tree(page_size=4, use_triton=None):
    pool = KVPool(64, page_size, device=DEVICE, max_seqs=3, max_seq_len=96, use_triton=use_triton)
    ids = [pool.add_sequence() for _ in range(3)]
    pool.extend(ids, [5, 0, 13])
    g = torch.Generator().manual_seed(1)
    tree = build_ddtree(torch.randn(3, 3, 20, generator=g).to(DEVICE), 7, torch.tensor([1, 2, 3], device=DEVICE))
    return pool, ids, tree


@pytest.mark.parametrize("page_size", [1, 4])
def test_step_inputs_is_the_device_half_of_reserve_step(page_size):
    pool, ids, tree = _pool_and_tree(page_size)
    whole = pool.reserve_step(ids, tree)
    pool, ids, tree = _pool_and_tree(page_size)  # the same pool again
    pool.reserve_tree(ids, tree.num_nodes_host)
    half = pool.step_inputs(ids, tree)
    for name in ("tokens", "rope_pos", "slots", "page_table", "kv_lens", "qo_indptr", "tree_mask"):
        assert torch.equal(getattr(whole, name), getattr(half, name)), name
    assert half.page_table.shape == (3, pool.max_pages_per_seq)  # every column: a fixed shape
    assert half.kv_lens_host == whole.kv_lens_host == tuple(p + tree.width for p in (5, 0, 13))
    # slot of node j = the page table's place of position P_b + j
    pt = half.page_table.cpu().long()
    for b, P in enumerate((5, 0, 13)):
        for j in range(tree.width):
            row = half.qo_indptr_host[b] + j
            assert int(half.slots[row]) == int(pt[b, (P + j) // page_size]) * page_size + (P + j) % page_size


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_book_and_place_tree_are_reserve_tree(page_size):
    """The host half, then the device half, leave the pool as ``reserve_tree`` does, step after
    step, with the page pops as tensor ops or as the Triton kernel (the interpreter on the CPU)."""
    pools = []
    for split, use_triton, own_rows in ((False, False, False), (True, False, False), (True, True, False),
                                        (False, True, False), (True, False, True), (True, True, True)):
        pool, ids, tree = _pool_and_tree(page_size, use_triton)
        # the caller's rows buffer, as a step graph keeps it: here a strided column of a bigger tensor
        rows = torch.tensor([[i, 99] for i in ids], device=DEVICE)[:, 0] if own_rows else None
        for step in range(3):
            if split:
                pool.book_tree(ids, tree.width)
                pool.place_tree(ids, tree.width, rows=rows)
            else:
                pool.reserve_tree(ids, tree.num_nodes_host)
            pool.check()
            s = pool.step_inputs(ids, tree, rows=rows)
            acc = torch.tensor([[0, 1 + step], [0, -1], [0, 2]], device=DEVICE)
            pool.commit(ids, acc, torch.tensor([2, 1, 2], device=DEVICE), num_accepted_host=[2, 1, 2], rows=rows)
            pool.check()
        pools.append((s.slots, s.page_table, s.kv_lens, pool.num_free_pages, pool._top.clone(),
                      pool._stack[: pool.num_pages].clone(), [pool.seq_len(i) for i in ids]))  # not the trash slot
    for other in pools[1:]:
        for a, b in zip(pools[0], other):
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)


def test_rows_buffer_is_checked():
    """A caller's rows buffer: int64, one per sequence, on the pool's device; with ``debug`` its
    values must be the sequences' (a wrong one is refused before any device work)."""
    pool, ids, tree = _pool_and_tree(4)
    pool.debug = True
    pool.book_tree(ids, tree.width)
    for bad, err, match in ((torch.tensor(ids, dtype=torch.int32, device=DEVICE), TypeError, "int64"),
                            (torch.tensor(ids[:2], device=DEVICE), ValueError, "one row per sequence"),
                            (torch.tensor(ids), ValueError, "device") if DEVICE == "cuda" else
                            (list(ids), TypeError, "int64"),
                            (torch.tensor(ids[::-1], device=DEVICE), ValueError, "not the sequences")):
        with pytest.raises(err, match=match):
            pool.place_tree(ids, tree.width, rows=bad)
    assert pool._tree_d.tolist() == [0, 0, 0]  # nothing placed
    pool.place_tree(ids, tree.width, rows=torch.tensor(ids, device=DEVICE))
    assert pool._tree_d.tolist() == [tree.width] * 3


def _awkward_trees(B: int, budget: int, g: torch.Generator):
    """Trees of one step: a DDTree of ``budget`` nodes from tie-heavy draft logits (values in
    {0, 1, 2}: many equal logits), one-node trees, and ragged trees from parent lists."""
    roots = torch.randint(0, 9, (B,), generator=g).to(DEVICE)
    yield build_ddtree(torch.randint(0, 3, (B, 5, 11), generator=g).float().to(DEVICE), budget, roots)
    yield build_ddtree(torch.zeros(B, 0, 11, device=DEVICE), 0, roots)
    shapes = [[-1, 0, 0, 1, 3, 1, 5], [-1], [-1, 0, 1, 2, 3], [-1, 0, 0, 0]]
    par = [shapes[b % 4] for b in range(B)]
    tree = tree_from_parents(par, [[int(x) for x in torch.randint(0, 50, (len(p),), generator=g)] for p in par])
    yield tree_from_parents(tree.parents.to(DEVICE), tree.tokens.to(DEVICE), [len(p) for p in par])


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("B,budget", [(1, 1), (1, 16), (4, 16), (5, 63)])
def test_step_inputs_kernel_equals_torch_ops(page_size, B, budget):
    """The fused step-inputs kernel writes compile_tree's and the pool's op-by-op tensors bit for
    bit: ragged batches over sequences of ragged lengths in shuffled pages, B = 1, one-node trees
    and trees of the budget (up to 64 nodes: two mask words)."""
    g = torch.Generator().manual_seed(B * 100 + budget + page_size)
    lens = torch.randint(0, 40, (B,), generator=g).tolist()
    out = []
    for use_triton in (False, True):
        g.manual_seed(7)
        pool = KVPool(8 + B * 120 // page_size, page_size, device=DEVICE, max_seqs=B + 1, max_seq_len=120,
                      use_triton=use_triton)
        pool.shuffle_free_pages(3)
        pool.add_sequence()  # row 0 unused: the sequences' rows are not 0..B-1
        ids = [pool.add_sequence() for _ in range(B)][::-1]
        pool.extend(ids, lens)
        for tree in _awkward_trees(B, budget, g):
            step = pool.reserve_step(ids, tree)
            out.append(step)
            pool.commit(ids, torch.zeros(B, 1, dtype=torch.int64, device=DEVICE),
                        torch.ones(B, dtype=torch.int64, device=DEVICE), num_accepted_host=[1] * B)
    half = len(out) // 2
    for a, b in zip(out[:half], out[half:]):
        for name in ("tokens", "rope_pos", "slots", "page_table", "kv_lens", "qo_indptr", "tree_mask"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
        assert (a.kv_lens_host, a.qo_indptr_host) == (b.kv_lens_host, b.qo_indptr_host)


@pytest.mark.parametrize("B,width,vocab", [(1, 1, 2), (1, 7, 50), (4, 1, 300), (3, 5, 1500), (2, 3, 20000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_record_step_kernel_equals_torch_ops(B, width, vocab, dtype):
    """The fused record of a step (top-2 logits of each emitted token, the result rows, the
    histories' append) equals the op-by-op one: ragged lengths, B = 1, one-column paths, vocabularies
    past one block and one program's slice, tie-heavy rows (small integers: the top value held twice or more)."""
    g = torch.Generator().manual_seed(B * 10 + width + vocab)
    n = torch.randint(1, 6, (B,), generator=g)
    T = int(n.sum())
    logits = torch.randint(-3, 4, (T, vocab), generator=g).to(dtype)
    logits[0, -1] = 9  # a row's largest in the last block
    qo = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(torch.int32)
    lengths = torch.randint(1, width + 1, (B,), generator=g)
    j = torch.arange(width)
    accepted = torch.where(j < lengths[:, None], torch.minimum(j, n[:, None] - 1).expand(B, width), -1)
    new_tokens = torch.where(j < lengths[:, None], torch.randint(0, 99, (B, width), generator=g), -1)
    rows = torch.randperm(B + 2, generator=g)[:B]
    C = 40
    history = torch.randint(0, 99, (B + 2, C + 1), generator=g)
    hist_len = torch.randint(1, C - width, (B + 2,), generator=g)
    outs = []
    for fn in (_record_step_torch, record_step):
        h, hl = history.clone().to(DEVICE), hist_len.clone().to(DEVICE)
        res, top2 = fn(*(t.to(DEVICE) for t in (logits, qo, accepted, lengths, new_tokens, rows)), h, hl)
        outs.append((res, top2, h[:, :C], hl))  # column C: the torch path's trash column
    for x, y in zip(*outs):
        assert x.dtype == y.dtype and torch.equal(x, y)
    with pytest.raises(ValueError, match="logits must be a float tensor"):
        record_step(logits[:, :1].to(DEVICE), *(t.to(DEVICE) for t in (qo, accepted, lengths, new_tokens, rows)),
                    history.to(DEVICE), hist_len.to(DEVICE))
    with pytest.raises(TypeError, match="accepted must be an integer tensor"):
        record_step(logits.to(DEVICE), qo.to(DEVICE), accepted.float().to(DEVICE),
                    *(t.to(DEVICE) for t in (lengths, new_tokens, rows, history, hist_len)))


@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA runs the pool's kernels in every engine test")
def test_engine_with_the_pool_kernels_decodes_the_same_tokens():
    """Plain and n-gram decoding with the pool's kernels (the fused step inputs, page pops and
    commit, as on CUDA; the interpreter here) emit the tokens and top-2 logits of its tensor ops."""
    cfg = tiny_config(num_hidden_layers=2, first_k_dense_replace=2)
    runner = MLARunner(build_random_model(cfg, seed=0), kernel="reference", cache_dtype=torch.float16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 8, (P,), generator=g).tolist() for P in (37, 9, 22)]  # repetitive: n-grams hit
    outs = []
    for use_triton in (False, True):
        eng = SpeculativeEngine(runner, None, budget=8, depth=3, page_size=4)
        eng.prefill(prompts, 10)
        eng.pool.use_triton = use_triton
        for drafter in (None, NGramDrafter(cfg.vocab_size)):
            eng.reset()
            eng.drafter = drafter
            res = eng.decode()
            outs.append((res.tokens, [t.tolist() for t in res.top2]))
    assert outs[:2] == outs[2:]


def test_step_inputs_and_replayed_commit_refuse_a_missing_reservation():
    pool, ids, tree = _pool_and_tree()
    with pytest.raises(ValueError, match="not the reserved ones"):
        pool.step_inputs(ids, tree)
    with pytest.raises(ValueError, match="seq_ids must be sequences with a tree reserved"):
        pool.replayed_commit(ids, torch.ones(3, dtype=torch.int64, device=DEVICE), 4)
    step = pool.reserve_step(ids, tree)
    with pytest.raises(ValueError, match="accepted_width must be a positive int"):
        pool.replayed_commit(ids, torch.ones(3, dtype=torch.int64, device=DEVICE), 0)
    res = accept_greedy(tree, torch.randn(step.num_rows, 20, device=DEVICE))
    pool.commit(ids, res.accepted, res.lengths)
    with pytest.raises(RuntimeError, match="a commit is pending"):
        pool.replayed_commit(ids, res.lengths, res.accepted.shape[1])
    pool.finalize_commit(res.lengths.cpu())


def test_replayed_commit_books_what_commit_books():
    """The host half alone (its kernel ran elsewhere) leaves the host counts commit leaves."""
    states = []
    for replayed in (False, True):
        pool, ids, tree = _pool_and_tree()
        step = pool.reserve_step(ids, tree)
        res = accept_greedy(tree, torch.randn(step.num_rows, 20, generator=torch.Generator().manual_seed(3)).to(DEVICE))
        lengths = res.lengths.cpu()
        if replayed:
            pool.replayed_commit(ids, res.lengths, res.accepted.shape[1], num_accepted_host=lengths)
        else:
            pool.commit(ids, res.accepted, res.lengths, num_accepted_host=lengths)
        states.append(([pool.seq_len(i) for i in ids], [pool.tree_size(i) for i in ids], pool.num_free_pages))
    assert states[0] == states[1]


def test_result_splits_the_step():
    res = GenerateResult(tokens=[[1]], steps=4, decode_s=0.040, kept=8,
                         phase_s={"attention": 0.010, "tree": 0.002, "accept": 0.002, "rest": 0.018})
    assert res.step_ms == pytest.approx(10.0) and res.device_ms == pytest.approx(8.0)
    assert res.host_ms == pytest.approx(2.0) and res.attn_ms == pytest.approx(2.5)
    assert res.kind_ms("tree") == pytest.approx(0.5) and res.kind_ms("step") == 0.0
    assert res.attn_share == pytest.approx(0.25) and res.tokens_per_s == pytest.approx(200.0)


# ----------------------------------------------------------------------------------------------
# GPU only: decoding through captured graphs


@requires_cuda
@pytest.mark.parametrize("mode", ["step", "phases"])
@pytest.mark.parametrize("kernel", ["flash", "auto", "naive"])
def test_graph_decoding_equals_eager(mode, kernel):
    """Plain and speculative decoding (a host drafter, and the n-gram drafter inside the graph)
    replayed from graphs emit eager decoding's tokens; sequences finish at different steps (new
    step shapes, captured then); each shape is captured once."""
    cfg = tiny_config(num_hidden_layers=2, first_k_dense_replace=2)  # dense: capturable
    model = build_random_model(cfg, seed=0, dtype=torch.float32, device="cuda")
    runner = MLARunner(model, kernel=kernel, cache_dtype=torch.float16)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (P,), generator=g).tolist() for P in (300, 41, 170)]
    new = 24
    eager = SpeculativeEngine(runner, None, budget=12, depth=4, page_size=16, graphs="eager")
    eager.prefill(prompts, new)
    plain = eager.decode()
    refs = [p + t for p, t in zip(prompts, plain.tokens)]
    drafter = SyntheticDrafter(refs, cfg.vocab_size, agreement=0.6, seed=1)
    eager.drafter = drafter
    eager.reset()
    spec = eager.decode()
    assert spec.steps < new - 1
    ngram = NGramDrafter(cfg.vocab_size)  # drafts on the device, inside the step's graph
    eager.drafter = ngram
    eager.reset()
    lookup = eager.decode()

    eng = SpeculativeEngine(runner, None, budget=12, depth=4, page_size=16, graphs=mode)
    eng.prefill(prompts, new)
    for d, want in ((None, plain), (drafter, spec), (ngram, lookup)):
        eng.drafter = d
        for _ in range(2):  # the second decode replays the shapes the first captured
            eng.reset()
            res = eng.decode()
            assert res.graphs == mode
            report = check_lossless(res.tokens, want.tokens, want.top2, tie_tol=0.0)
            assert report.exact, f"{mode} {kernel} {getattr(d, 'name', 'plain')}: {report.line()}"
            assert res.accepted == want.accepted
    assert all(b.graph.captured for b in eng._buckets.values() if b.graph.runs > 1)
    assert all(b.graph.runs >= 1 for b in eng._buckets.values())
    assert eng.capture_s > 0
    kinds = set(res.phase_s)
    assert kinds == ({"step"} if mode == "step" else {"tree", "attention", "accept", "rest"})


def _finishing_at_different_steps(device):
    """A dense 2-layer model, three prompts and a SYNTHETIC drafter whose acceptance differs per
    sequence, so the batch shrinks 3 -> 2 -> 1 with other sequences than the first ones left."""
    cfg = tiny_config(num_hidden_layers=2, first_k_dense_replace=2)
    model = build_random_model(cfg, seed=0, dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (P,), generator=g).tolist() for P in (40, 9, 23)]
    runner = MLARunner(model, kernel="reference" if device == "cpu" else "flash", cache_dtype=torch.float16)
    plain = SpeculativeEngine(runner, None, page_size=4, graphs="eager").generate(prompts, 20)
    refs = [p + t for p, t in zip(prompts, plain.tokens)]
    return runner, prompts, plain, SyntheticDrafter(refs, cfg.vocab_size, agreement=0.6, seed=2)


@pytest.mark.parametrize("graphs", ["eager", pytest.param("step", marks=requires_cuda)])
def test_warm_up_makes_every_batch_size_and_changes_nothing(graphs):
    """warm_up() leaves one bucket per batch size 1..N and the prefilled state; decoding afterwards
    makes no new bucket (captures nothing), although its shrinking batches hold other sequences
    than the warm-up's first ones, and emits what it emits without the warm-up."""
    runner, prompts, plain, drafter = _finishing_at_different_steps(DEVICE if graphs == "step" else "cpu")
    cold = SpeculativeEngine(runner, drafter, budget=6, depth=3, page_size=4, graphs=graphs)
    cold.prefill(prompts, 20)
    want = cold.decode()
    eng = SpeculativeEngine(runner, drafter, budget=6, depth=3, page_size=4, graphs=graphs)
    eng.prefill(prompts, 20)
    eng.warm_up()
    assert sorted(k[2] for k in eng._buckets) == [1, 2, 3]
    assert [s.length for s in eng.seqs] == [len(p) + 1 for p in prompts]
    res = eng.decode()
    assert sorted(k[2] for k in eng._buckets) == [1, 2, 3] and res.captures == 0 and res.capture_s == 0
    assert res.tokens == want.tokens and res.accepted == want.accepted
    assert check_lossless(res.tokens, plain.tokens, plain.top2, tie_tol=0.0).exact
    assert {b.ids for b in eng._buckets.values()} - {(0, 1, 2), (0, 1), (0,)}, "no bucket was re-bound"


@requires_cuda
def test_capture_survives_another_thread_destroying_a_graph():
    """Another thread destroys a captured graph while this one captures (as Python's collector
    did in the demo's progress-bar thread, freeing a dead request's step graphs): the capture
    stands (CUDA's thread_local capture mode), and release() destroys a graph on demand."""
    x = torch.zeros(4, device="cuda")
    doomed = [StepGraph([Phase("rest", "add", lambda: x.add_(1))], "step", "cuda")]
    for _ in range(2):
        doomed[0].run(PhaseClock("cuda"))
    assert doomed[0].captured
    go, done = threading.Event(), threading.Event()

    def destroy():
        go.wait()
        doomed.pop().release()  # the last reference: the graph is destroyed in this thread
        done.set()

    def phase():
        if torch.cuda.is_current_stream_capturing():
            go.set()
            assert done.wait(10)  # releases the GIL: the other thread runs inside this capture
        x.mul_(2)

    t = threading.Thread(target=destroy)
    t.start()
    g = StepGraph([Phase("rest", "wait", phase)], "step", "cuda")
    g.run(PhaseClock("cuda"))
    g.run(PhaseClock("cuda"))  # the capture (the other thread destroys its graph now), then a replay
    t.join()
    assert g.captured and not doomed
    torch.cuda.synchronize()
    assert x.tolist() == [8.0] * 4  # 1, 2 (replay); then 4 (eager), 8 (replay)


@requires_cuda
def test_replayed_graph_steps_do_not_sync_inside():
    """Once captured, a step is host work + one replay + one read: the replay itself launches no
    synchronising op (sync debug mode raises on any), and the step time is mostly device time."""
    cfg = tiny_config(num_hidden_layers=2, first_k_dense_replace=2)
    model = build_random_model(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    runner = MLARunner(model, kernel="flash")
    eng = SpeculativeEngine(runner, None, budget=8, depth=3, page_size=16, graphs="step")
    eng.prefill([[1, 2, 3] * 50, [4, 5] * 30], 12)
    eng.decode(max_steps=2)  # warm-up, capture
    bucket = next(iter(eng._buckets.values()))
    assert bucket.graph.captured
    clock = PhaseClock("cuda")
    eng.reset()
    with torch.inference_mode():  # as decode() runs a step: the bucket's buffers are inference tensors
        ids = bucket.ids
        eng.pool.book_tree(ids, bucket.n)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert bucket.graph.run(clock) is False  # a replay (the attention plan is inside it)
            eng.pool.replayed_commit(ids, bucket.lengths, bucket.accepted_width)
            slot = bucket.read()  # pinned non-blocking copies and an event
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ints, _ = bucket.host(slot)
        eng.pool.finalize_commit(ints[:, 0])
    assert ints[:, 0].tolist() == [1, 1]
