"""The speculative decoding loop end to end on the CPU: lossless against HF ``generate``.

Tiny DeepseekV3 (fp32 weights, fp16 KV pool). Most loop tests run attention through the float64
``reference`` on the 16-bit cache (the Triton interpreter is slow); one runs the real ``naive``
kernel. Sequences of different lengths decode in one batch; the output must equal
``model.generate(do_sample=False)`` of the same HF model token for token.
"""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch

from kdtree_engine.model import MLARunner, build_random_model, tiny_config
from kdtree_engine.model.drafters import NGramDrafter, SyntheticDrafter
from kdtree_engine.model.speculative import RequestTooLarge, SpeculativeEngine, check_lossless
from kdtree_engine.verify import available_kernels
from kdtree_engine.verify.op import KERNELS

V = 128
NEW = 40


@pytest.fixture(scope="module")
def model():
    return build_random_model(tiny_config(), seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)  # a seed whose greedy outputs are not one repeated token
    return [torch.randint(0, V, (P,), generator=g).tolist() for P in (5, 23, 12)]


@pytest.fixture(scope="module")
def hf_greedy(model, prompts):
    """HF generate per prompt (batch 1, no padding): new tokens and the logits behind them."""
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
        out.append((g.sequences[0, len(p):].tolist(), torch.cat(g.logits, 0)))
    return out


def _drafter(kind, prompts, refs):
    if kind == "ngram":
        return NGramDrafter(V)
    if kind.startswith("synthetic"):
        agreement = float(kind.split("-")[1])
        return SyntheticDrafter([p + r for p, r in zip(prompts, refs)], V, agreement=agreement, seed=7)
    return None


@pytest.mark.parametrize("kind,budget,depth", [
    ("plain", 0, 0),
    ("ngram", 8, 4),
    ("synthetic-0.8", 8, 4),
    ("synthetic-0.4", 16, 6),
    ("synthetic-1.0", 5, 5),
])
def test_lossless_vs_hf_generate(model, prompts, hf_greedy, kind, budget, depth):
    refs = [r for r, _ in hf_greedy]
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    eng = SpeculativeEngine(runner, _drafter(kind, prompts, refs), budget=budget, depth=depth, page_size=4)
    res = eng.generate(prompts, NEW)
    report = check_lossless(res.tokens, refs, [lg for _, lg in hf_greedy])
    assert report.exact, report.line()
    assert [len(t) for t in res.tokens] == [NEW] * len(prompts)
    assert res.decoded_tokens == len(prompts) * (NEW - 1) <= sum(res.accepted)  # first token: prefill
    if kind == "plain":
        assert res.mean_accepted == 1.0
    if kind == "synthetic-1.0":  # every top-1 right; DDTree spends budget 5 on a depth-4 chain +
        assert res.mean_accepted > 4.5  # one sibling (rank-2 at depth 1 outscores depth 5)
    if kind == "synthetic-0.8":
        assert res.mean_accepted > 2.5


def test_lossless_page_size_one(model, prompts, hf_greedy):
    """Page size 1: the pool commits by remapping table entries instead of moving rows."""
    refs = [r for r, _ in hf_greedy]
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    drafter = SyntheticDrafter([p + r for p, r in zip(prompts, refs)], V, agreement=0.6, seed=11)
    res = SpeculativeEngine(runner, drafter, budget=12, depth=5, page_size=1).generate(prompts, NEW)
    assert check_lossless(res.tokens, refs).exact
    assert res.mean_accepted > 1.5


def test_runner_takes_every_verify_kernel_by_name(model):
    """Every kernel verify_attention runs by name is a runner kernel (the demo's --kernel hopper
    crashed on the H200 when the runner knew only naive/flash/auto)."""
    for kernel in (*KERNELS, "auto", "reference"):
        assert MLARunner(model, kernel=kernel).kernel == kernel
    with pytest.raises(ValueError, match="kernel must be one of"):
        MLARunner(model, kernel="fast")


@pytest.mark.parametrize("kernel", ["naive", "flash", "hopper"])
def test_lossless_real_kernels(kernel, device):
    """The loop with the real kernels against HF generate: on the CPU (Triton interpreter) a ragged
    pair, 12 tokens, exact; on CUDA three prompts up to 300 tokens, 40 tokens and three drafters,
    exact or diverging only where HF's two best logits are within 1e-2 (fp16 cache rounding)."""
    if kernel not in available_kernels(device):
        pytest.skip(f"{kernel} does not run on {device}")
    model = build_random_model(tiny_config(), seed=0, dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(2)
    cuda = device == "cuda"
    prompts = [torch.randint(0, V, (P,), generator=g).tolist() for P in ((300, 23, 97) if cuda else (5, 23))]
    new = NEW if cuda else 12
    hf = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        hf.append((out.sequences[0, len(p):].tolist(), torch.cat(out.logits, 0).float().cpu()))
    refs = [r for r, _ in hf]
    runner = MLARunner(model, kernel=kernel, cache_dtype=torch.float16)
    synthetic = SyntheticDrafter([p + r for p, r in zip(prompts, refs)], V, agreement=0.7, seed=3)
    for drafter in ((None, NGramDrafter(V), synthetic) if cuda else (synthetic,)):
        eng = SpeculativeEngine(runner, drafter, budget=16 if cuda else 6, depth=6 if cuda else 3, page_size=16)
        res = eng.generate(prompts, new)
        report = check_lossless(res.tokens, refs, [lg for _, lg in hf], tie_tol=1e-2 if cuda else 0.0)
        assert report.ok, f"{kernel} {getattr(drafter, 'name', 'plain')}: {report.line()}"
        if drafter is synthetic:
            assert res.steps < new - 1  # fewer target forwards than tokens


def test_reset_and_eos(model, prompts, hf_greedy):
    """Decoding again after reset() reuses the prompt KV and gives the same tokens; an EOS token
    ends a sequence there, as in HF generate."""
    refs = [r for r, _ in hf_greedy]
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    eng = SpeculativeEngine(runner, NGramDrafter(V), budget=6, depth=3, page_size=8)
    eng.prefill(prompts, NEW)
    first = eng.decode().tokens
    eng.reset()
    assert eng.decode().tokens == first == refs
    eos = refs[1][7]  # sequence 1's 8th token
    eng.reset()
    out = eng.decode(eos_token_id=eos).tokens
    for p, o, r in zip(prompts, out, refs):
        expect = r[: r.index(eos) + 1] if eos in r else r
        assert o == expect
        hf = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
        assert o == hf[0, len(p):].tolist()[: len(o)] and (o[-1] == eos or len(o) == NEW)


class HostNGram:
    """NGramDrafter's drafts from the host contexts (no ``draft_tensor``): the loop's host-drafter path."""

    name, synthetic, vocab_size = "host-ngram", False, V

    def __init__(self):
        self.inner = NGramDrafter(V)

    def draft(self, contexts, num_positions):
        return self.inner.draft(contexts, num_positions)


def test_host_drafter_stops_a_sequence_at_eos(model, prompts, hf_greedy):
    """A host drafter sees a step's tokens before the next step: a sequence that emitted the EOS
    takes no further step (it decoded to max_new_tokens before, its EOS overwritten), and its
    output ends at the EOS like the device drafter's."""
    refs = [r for r, _ in hf_greedy]
    eos = refs[1][7]
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    eng = SpeculativeEngine(runner, HostNGram(), budget=6, depth=3, page_size=8)
    eng.prefill(prompts, NEW)
    res = eng.decode(eos_token_id=eos)
    for s, o, r in zip(eng.seqs, res.tokens, refs):
        expect = r[: r.index(eos) + 1] if eos in r else r
        assert o == expect
        # the step that emitted the EOS may overshoot it by the rest of its accepted path, no more
        assert s.length - s.prompt_len <= len(expect) + 3 + 1
    assert res.kept < len(prompts) * NEW


def test_close_frees_the_pool_without_the_collector(model, prompts):
    """close() (also the next prefill's first act) frees the request's pool at once: the step
    graphs' phases hold their bucket and the pool in a cycle, which the collector freed only late
    (a request's buckets live long enough to reach its oldest generation), while the next
    request's pool was being sized and allocated."""
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    eng = SpeculativeEngine(runner, NGramDrafter(V), budget=4, depth=2, page_size=8)
    eng.prefill(prompts, 6)
    eng.decode()
    pool = weakref.ref(eng.pool)
    gc.collect()
    gc.disable()
    try:
        eng.prefill(prompts, 6)
        assert pool() is None
        pool = weakref.ref(eng.pool)
        eng.close()
        assert pool() is None
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="prefill"):
        eng.reset()


def test_request_too_large_fails_before_any_work(model, prompts, monkeypatch):
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    eng = SpeculativeEngine(runner, NGramDrafter(V), budget=8, depth=4, page_size=16, max_pool_bytes=64 << 10)
    plan = eng.plan([len(p) for p in prompts], NEW)
    # pages: ceil((P + NEW - 1 + 9) / 16) per sequence; bytes: (pages + trash) * 16 * 576 * 2 * layers
    assert plan.pages_per_seq == [4, 5, 4]
    assert plan.kv_bytes == (13 + 1) * 16 * 576 * 2 * 2
    called = []
    monkeypatch.setattr(runner, "prefill", lambda *a, **k: called.append(1))
    with pytest.raises(RequestTooLarge, match="KV pool needs"):
        eng.prefill(prompts, NEW)
    assert not called and eng.pool is None


def test_ngram_drafter_proposes_continuations():
    d = NGramDrafter(10, max_ngram=3)
    ctx = torch.tensor([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])
    logits = d.draft([ctx], 4)
    assert logits.shape == (1, 4, 10)
    # "1 2 3" was followed by "4 1 2 3" and "5 1 2 3": both candidates at position 0, then 1 2 3
    p0 = logits[0, 0].softmax(-1)
    assert p0[4] > 0.4 and p0[5] > 0.4
    assert logits[0, 1:].argmax(-1).tolist() == [1, 2, 3]
    flat = d.draft([torch.tensor([7])], 2)  # nothing to look up: uniform
    assert torch.allclose(flat, flat[..., :1].expand_as(flat))


def _ngram_reference(d: NGramDrafter, contexts, L: int) -> torch.Tensor:
    """The n-gram drafter as first written (numpy, one sequence and one position at a time)."""
    V = d.vocab_size
    out = torch.zeros(len(contexts), L, V)
    floor = math.log(d.smoothing / V)
    for b, c in enumerate(contexts):
        ctx = torch.as_tensor(c, dtype=torch.int64).numpy()
        N = ctx.shape[0]
        starts = np.zeros(0, dtype=np.int64)
        ends = np.flatnonzero(ctx[: N - 1] == ctx[N - 1]) if N >= 2 else starts
        if ends.size:
            length = np.ones(ends.size, dtype=np.int64)
            alive = np.ones(ends.size, dtype=bool)
            for k in range(1, min(d.max_ngram, N - 1)):
                idx = ends - k
                alive &= idx >= 0
                alive[alive] = ctx[idx[alive]] == ctx[N - 1 - k]
                length += alive
            best = int(length.max())
            if best >= d.min_ngram:
                starts = ends[length == best][::-1][: d.max_matches] + 1
        for i in range(L):
            follow = ctx[starts[starts + i < N] + i]
            if follow.size == 0:
                break
            tok, cnt = np.unique(follow, return_counts=True)
            p = (1.0 - d.smoothing) * cnt / follow.size + d.smoothing / V
            out[b, i] = floor
            out[b, i, torch.from_numpy(tok)] = torch.from_numpy(np.log(p)).float()
    return out


@pytest.mark.parametrize("V,max_ngram,min_ngram,max_matches", [(7, 4, 1, 8), (5, 3, 2, 3), (30, 4, 1, 8), (3, 1, 1, 2)])
def test_ngram_drafter_equals_its_first_implementation(V, max_ngram, min_ngram, max_matches):
    """The vectorised drafter (one padded history, fixed shapes) gives the first (numpy) version's
    logits bit for bit on random histories: small vocabularies repeat n-grams, and lengths from 1
    token to longer than the matches cover the no-match, short-context and many-match cases."""
    g = torch.Generator().manual_seed(V * 100 + max_ngram)
    d = NGramDrafter(V, max_ngram=max_ngram, min_ngram=min_ngram, max_matches=max_matches)
    for trial in range(6):
        lens = torch.randint(1, 60, (4,), generator=g).tolist() + [1, 2]
        contexts = [torch.randint(0, V, (n,), generator=g) for n in lens]
        for L in (1, 5):
            assert torch.equal(d.draft(contexts, L), _ngram_reference(d, contexts, L)), (trial, L)
    # the device form on histories padded with junk past each length
    hist = torch.randint(0, V, (3, 50), generator=g)
    lens = torch.tensor([50, 17, 1])
    got = d.draft_tensor(hist, lens, 4)
    assert torch.equal(got, _ngram_reference(d, [hist[b, :n] for b, n in enumerate(lens.tolist())], 4))


def test_synthetic_drafter_agreement():
    ref = torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    for agreement in (0.0, 0.5, 1.0):
        d = SyntheticDrafter([ref], 50, agreement=agreement, max_rank=4, seed=1)
        logits = d.draft([torch.tensor(ref[:100])], 200)[0]  # positions 100..299
        top1 = logits.argmax(-1)
        hit = (top1 == torch.tensor(ref[100:300])).float().mean().item()
        assert abs(hit - agreement) < 0.08, (agreement, hit)
    # beyond the reference: uniform
    tail = d.draft([torch.tensor(ref[:399])], 3)[0]
    assert torch.all(tail[1:] == 0)


def test_synthetic_drafter_proposes_distinct_ranked_tokens():
    """Every drafted position proposes ``max_rank`` distinct tokens at logits 0, -1, ...; the true
    token, when proposed, is the reference's; the draws do not depend on the history's padding or
    on which batch row asks; no match and past the end are uniform."""
    V, K = 7, 4
    g = torch.Generator().manual_seed(3)
    refs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (30, 45)]
    d = SyntheticDrafter(refs, V, agreement=0.5, max_rank=K, seed=5)
    contexts = [refs[1][:20], refs[0][:28], [refs[0][0] ^ 1] + refs[0][1:10]]  # ref 1, ref 0 near its end, none
    out = d.draft(contexts, 5)
    for b, (ctx, ref) in enumerate(zip(contexts, (refs[1], refs[0], None))):
        for i in range(5):
            row, p = out[b, i], len(ctx) + i
            if ref is None or p >= len(ref):
                assert torch.equal(row, torch.zeros(V)), (b, i)
                continue
            proposed = (row > -1e3).nonzero().flatten()
            assert len(proposed) == K
            assert sorted(row[proposed].tolist()) == [-3.0, -2.0, -1.0, 0.0]
            if ref[p] not in proposed.tolist():
                continue
            assert row[ref[p]] in (0.0, -1.0, -2.0, -3.0)
    history = torch.full((3, 64), 5, dtype=torch.int64)  # other padding, another width, rows swapped
    for b, c in zip((1, 0, 2), contexts):
        history[b, : len(c)] = torch.tensor(c)
    again = d.draft_tensor(history, torch.tensor([28, 20, 10]), 5)
    assert torch.equal(again[[1, 0, 2]], out)
    assert d.references() == refs
    d.set_references([refs[1], refs[0]])  # in place, the copy the drafts above made included
    swapped = SyntheticDrafter([refs[1], refs[0]], V, agreement=0.5, max_rank=K, seed=5)
    assert torch.equal(d.draft(contexts, 5), swapped.draft(contexts, 5))
    assert not torch.equal(d.draft(contexts, 5), out)  # context 0 matches reference 0 now: other draws
    fresh = SyntheticDrafter(refs, V, agreement=0.5, max_rank=K, seed=5)
    with torch.inference_mode():  # first drafted as the engine drafts: its copy stays writable outside
        fresh.draft(contexts, 5)
    fresh.set_references([refs[1], refs[0]])
    assert torch.equal(fresh.draft(contexts, 5), swapped.draft(contexts, 5))
    with pytest.raises(ValueError, match="holds 2"):
        d.set_references([refs[0]])
    with pytest.raises(ValueError, match="capacity"):
        d.set_references([refs[0], refs[1] + [0]])
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticDrafter(refs, 1)
    with pytest.raises(ValueError, match="capacity"):
        SyntheticDrafter(refs, V, capacity=10)


def test_check_lossless_report():
    logits = [torch.tensor([[0.0, 1.0, 0.999], [0.0, 5.0, 1.0]])]
    near = check_lossless([[2, 1]], [[1, 1]], logits, tie_tol=0.01)
    assert not near.exact and near.ok and near.divergences[0][:2] == (0, 0)
    far = check_lossless([[1, 0]], [[1, 1]], logits, tie_tol=0.01)
    assert not far.ok and "MISMATCH" in far.line()
    assert check_lossless([[1, 1]], [[1, 1]]).exact
    for args, match in ((([[1, 2], [3, 4]], [[1, 2]]), "outputs holds 2 sequences, references 1"),  # (zip dropped one)
                        (([[1], [3]], [[1], [3]], logits), "reference_logits holds 1"),
                        (([[1]], [[2]], [torch.zeros(1, 1)]), "V >= 2")):
        with pytest.raises(ValueError, match=match):
            check_lossless(*args)


def test_engine_refuses_bad_arguments(model, monkeypatch):
    """Sizes, prompts and decode's arguments are checked before any work: floats were truncated
    (a prompt [1.7, 2.2] ran as [1, 2]), page_size 0 divided by zero, a token past the
    vocabulary failed inside the embedding."""
    runner = MLARunner(model, kernel="reference")
    for kwargs, err, match in ((dict(budget=2.5), TypeError, "budget must be an int"),
                               (dict(depth=True), TypeError, "depth must be an int"),
                               (dict(page_size=0), ValueError, "page_size must be >= 1"),
                               (dict(max_pool_bytes=1.5), TypeError, "max_pool_bytes")):
        with pytest.raises(err, match=match):
            SpeculativeEngine(runner, NGramDrafter(V), **kwargs)
    eng = SpeculativeEngine(runner, NGramDrafter(V), budget=4, depth=2)
    called = []
    monkeypatch.setattr(runner, "prefill", lambda *a, **k: called.append(1))
    for prompts, err, match in (([[1.7, 2.2]], TypeError, "token ids must be integers"),
                                ([[True, False]], TypeError, "token ids must be integers"),
                                ([[[1, 2]]], ValueError, "must be 1-D"),
                                ([[1, V]], ValueError, "outside the vocabulary"),
                                ([[-1, 2]], ValueError, "outside the vocabulary")):
        with pytest.raises(err, match=match):
            eng.prefill(prompts, 4)
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        eng.prefill([[1, 2]], 4.0)
    assert not called and eng.pool is None
    monkeypatch.undo()
    eng.prefill([[1, 2]], 4)
    with pytest.raises(TypeError, match="eos_token_id must be an int or None"):
        eng.decode(eos_token_id=1.5)


def test_top2_margins_match_logits(model, prompts, hf_greedy):
    """The loop keeps the target's two largest logits behind every new token (for near-tie
    reporting); they agree with HF's own logits at those positions."""
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    eng = SpeculativeEngine(runner, NGramDrafter(V), budget=8, depth=4, page_size=4)
    res = eng.generate(prompts, NEW)
    for top2, (_, logits) in zip(res.top2, hf_greedy):
        assert top2.shape == (NEW, 2)
        expected = logits.topk(2, dim=-1).values
        assert torch.allclose(top2, expected, atol=5e-3), (top2 - expected).abs().max()


def test_memory_plan_against_free_device_memory():
    """With a device's free memory known, pool + prefill working memory must fit in 90% of it."""
    from kdtree_engine.model.speculative import MemoryPlan

    plan = MemoryPlan(pages_per_seq=[8, 4], page_size=16, kv_bytes=600, work_bytes=300, free_bytes=1000)
    plan.check()  # 900 <= 0.9 * 1000
    with pytest.raises(RequestTooLarge, match="free"):
        MemoryPlan([8, 4], 16, 600, 301, 1000).check()
    with pytest.raises(RequestTooLarge, match="limit"):
        plan.check(limit_bytes=599)

