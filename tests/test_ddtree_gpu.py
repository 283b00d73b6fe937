"""CUDA-only guarantees of the DDTree step: no host sync, and CUDA-graph capture replays correctly.

These run on the GPU machine (``pytest -m gpu``); without CUDA they are skipped, and the CPU runs
of the other ddtree tests cover the same code paths for correctness.
"""

from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda
from kdtree_engine.ddtree import (
    accept_greedy,
    accept_sampling,
    build_ddtree,
    build_ddtree_reference,
    compile_tree,
)

pytestmark = [pytest.mark.gpu, requires_cuda]


def make_inputs(B, L, V, budget, seed):
    g = torch.Generator().manual_seed(seed)
    draft = (torch.randn(B, L, V, generator=g) * 3).cuda().to(torch.bfloat16)
    roots = torch.randint(0, V, (B,), generator=g).cuda()
    prefix = torch.randint(0, 3000, (B,), generator=g).cuda()
    target = (torch.randn(B * (budget + 1), V, generator=g) * 3).cuda().to(torch.bfloat16)
    return draft, roots, prefix, target


def step(draft, roots, prefix, target, budget):
    tree = build_ddtree(draft, budget, roots)
    vb = compile_tree(tree, prefix)
    res = accept_greedy(tree, target)
    return tree, vb, res


@pytest.mark.parametrize("budget", [32, 129, 512])
def test_step_has_no_host_sync(budget):
    B, L, V = 3, 16, 32000
    draft, roots, prefix, target = make_inputs(B, L, V, budget, seed=budget)
    step(draft, roots, prefix, target, budget)  # warm caches (plans, pairs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = target.shape[0]
    temps = torch.rand(T, device="cuda") * 1.2 - 0.2  # per-row, some greedy
    sampling = [  # the fused kernel (top-k, temperature only) and the tensor-op filter (top-p alone)
        dict(temperature=0.8, top_k=40, top_p=0.9),
        dict(temperature=temps, top_k=7, top_p=torch.full((T,), 0.8, device="cuda")),
        dict(temperature=0.8),
        dict(temperature=0.8, top_p=0.9),
    ]
    for kw in sampling:
        accept_sampling(build_ddtree(draft, budget, roots), target, generator=gen, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tree, vb, res = step(draft, roots, prefix, target, budget)
        for kw in sampling:
            accept_sampling(tree, target, generator=gen, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = build_ddtree_reference(draft, budget, roots)
    assert torch.equal(tree.parents, ref.parents) and torch.equal(tree.tokens, ref.tokens)


def test_step_replays_from_cuda_graph():
    B, L, V, budget = 4, 16, 50000, 64
    draft, roots, prefix, target = make_inputs(B, L, V, budget, seed=1)
    static = [draft.clone(), roots.clone(), prefix.clone(), target.clone()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static, budget)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static, budget)
    for seed in (2, 3):
        new = make_inputs(B, L, V, budget, seed)
        for s, x in zip(static, new):
            s.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        want = step(*new, budget)
        for a, b in zip(out, want):
            for f in a.__dataclass_fields__:
                x, y = getattr(a, f), getattr(b, f)
                if isinstance(x, torch.Tensor):
                    assert torch.equal(x, y), f"{type(a).__name__}.{f} differs after replay"


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_k=40, top_p=0.9), dict(temperature=0.9)],
                         ids=["top-k-top-p", "temperature"])
def test_sampling_replays_from_cuda_graph(kw):
    """The fused sampling acceptance in a CUDA graph (default generator): a replay after
    ``torch.cuda.manual_seed(s)`` equals the eager call after the same seeding, for new logits."""
    B, L, V, budget = 4, 16, 50000, 64
    draft, roots, prefix, target = make_inputs(B, L, V, budget, seed=4)
    tree = build_ddtree(draft, budget, roots)
    static = target.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            accept_sampling(tree, static, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = accept_sampling(tree, static, **kw)
    for seed in (5, 6):
        new = make_inputs(B, L, V, budget, seed)[3]
        static.copy_(new)
        torch.cuda.manual_seed(seed)
        graph.replay()
        torch.cuda.synchronize()
        torch.cuda.manual_seed(seed)
        want = accept_sampling(tree, new, **kw)
        for f in out.__dataclass_fields__:
            assert torch.equal(getattr(out, f), getattr(want, f)), f"{f} differs after replay"
