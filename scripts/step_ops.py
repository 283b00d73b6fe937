"""Device ops per phase of the engine's decode step, counted on the CPU (no GPU needed).

    PYTHONPATH=src python scripts/step_ops.py [--batch 4] [--budget 16] [--depth 6] [--steps 3]

Runs a tiny dense model's eager steps (plain decoding, then the n-gram drafter) with the KV pool's
Triton kernels on (as on CUDA; Triton's interpreter here) and counts, per phase and per part of
the draft-tree phase, what each would launch on the GPU: ATen ops that run a kernel (views,
``empty`` and other metadata-only ops left out) and Triton kernel launches. Every small op in a
captured graph still costs a few microseconds of GPU time, so the count is the phase's floor.
The device scheduler of a planned attention (one launch on CUDA) is not in these counts: the
reference kernel used here plans nothing. Prints one line per (mode, phase or part): the mean per
step, ATen kernels + Triton launches, and the most frequent ATen ops.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kdtree_engine.backend import select_device  # noqa: E402

select_device("cpu")

import triton.runtime.interpreter as interp  # noqa: E402

from kdtree_engine import ddtree  # noqa: E402
from kdtree_engine.kvpool import KVPool  # noqa: E402
from kdtree_engine.model import MLARunner, build_random_model, tiny_config  # noqa: E402
from kdtree_engine.model import graphs, speculative  # noqa: E402
from kdtree_engine.model.drafters import NGramDrafter  # noqa: E402

# ops that allocate or reinterpret without running a kernel
_FREE = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias", "_unsafe_view",
         "resolve_conj", "resolve_neg", "set_", "_local_scalar_dense"}


class Counter(TorchDispatchMode):
    """Counts the ATen ops that run a kernel, and Triton launches, under the current label."""

    def __init__(self):
        super().__init__()
        self.label: list[str] = []
        self.aten: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.triton: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and self.label and not func.is_view and name not in _FREE:
            self.aten[self.label[-1]][name] += 1
        return func(*args, **(kwargs or {}))


def _labelled(counter: Counter, label: str, fn):
    @functools.wraps(fn)
    def run(*a, **k):
        if not counter.label:  # outside the step's phases (e.g. a bucket's set-up)
            return fn(*a, **k)
        counter.label.append(label)
        try:
            return fn(*a, **k)
        finally:
            counter.label.pop()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ngram-torch", action="store_true", help="the n-gram drafter's tensor ops, not its kernels")
    a = p.parse_args()

    counter = Counter()
    launch = interp.GridExecutor.__call__

    def counted_launch(self, *args, **kwargs):
        if counter.label and not counter.paused:
            counter.triton[counter.label[-1]][self.fn.__name__] += 1
        counter.paused += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            counter.paused -= 1

    interp.GridExecutor.__call__ = counted_launch
    # the parts of the draft-tree phase (names as the step calls them)
    spec = speculative
    spec.build_ddtree = _labelled(counter, "tree: build_ddtree", spec.build_ddtree)
    KVPool.place_tree = _labelled(counter, "tree: place_tree", KVPool.place_tree)
    KVPool.step_inputs = _labelled(counter, "tree: step_inputs", KVPool.step_inputs)
    NGramDrafter.draft_tensor = _labelled(counter, "tree: drafter", NGramDrafter.draft_tensor)
    spec.accept_greedy = _labelled(counter, "accept: accept_greedy", spec.accept_greedy)
    KVPool.commit = _labelled(counter, "accept: commit", KVPool.commit)
    eager = graphs.StepGraph._eager

    def counted_eager(self, clock):
        for ph in self.phases:
            counter.label.append(ph.kind)
            try:
                ph.run()
            finally:
                counter.label.pop()

    graphs.StepGraph._eager = counted_eager

    cfg = tiny_config(num_hidden_layers=2, first_k_dense_replace=2)
    runner = MLARunner(build_random_model(cfg, seed=0), kernel="reference", cache_dtype=torch.float16)
    V = cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 29, 17, 33)[: a.batch]]
    prompts += [torch.randint(0, V, (20,), generator=g).tolist() for _ in range(a.batch - len(prompts))]
    eng = speculative.SpeculativeEngine(runner, None, budget=a.budget, depth=a.depth, page_size=16, graphs="eager")
    eng.prefill(prompts, 4 * a.steps * (a.depth + 1))
    eng.pool.use_triton = True  # the pool's kernels, as on CUDA
    for mode, drafter in (("plain", None), ("n-gram", NGramDrafter(V, use_triton=not a.ngram_torch))):
        eng.reset()
        eng.drafter = drafter
        counter.aten.clear()
        counter.triton.clear()
        with counter:
            eng.decode(max_steps=a.steps)
        for label in sorted(set(counter.aten) | set(counter.triton)):
            n_aten = sum(counter.aten[label].values()) / a.steps
            n_tri = sum(counter.triton[label].values()) / a.steps
            top = ", ".join(f"{k} {v / a.steps:g}" for k, v in counter.aten[label].most_common(8))
            tri = ", ".join(f"{k} {v / a.steps:g}" for k, v in counter.triton[label].items())
            print(f"{mode:7s} {label:24s} {n_aten + n_tri:6.1f} = aten {n_aten:5.1f} + triton {n_tri:4.1f}"
                  f"   [{top}] [{tri}]")
    graphs.StepGraph._eager = eager
    interp.GridExecutor.__call__ = launch


if __name__ == "__main__":
    main()
