"""Timings of the DDTree stages of one speculative step (no model forwards): ``python -m kdtree_engine.ddtree.bench``.

Per budget (draft nodes per tree, root excluded) and batch, on random logits (never zeros):

=================  ============================================================================
topk               :func:`draft_topk` on the draft logits ``[B, L, V]`` (device; log-softmax,
                   top-K, tie order)
expand             :func:`expand_topk`, the best-first expansion (device kernel, eager)
expand_graph       the same, replayed from a CUDA graph (CUDA only)
construct          topk + expand: the draft tree from the draft logits, eager
construct_graph    the same, replayed from a CUDA graph (CUDA only)
expand_host        :func:`expand_topk_reference`: one device->host copy of the top-K, a Python
                   heap per sequence, the tree copied back (what a host-side DDTree costs)
compile            :func:`compile_tree` (masks, positions, links)
accept_greedy      :func:`accept_greedy` on random target logits ``[T, V]`` (argmax + walk;
                   the walk stops at the root or one node below), with a workspace
                   (:func:`greedy_workspace`, as the engine's step: no counter zeroed per call)
accept_greedy_graph  the same, replayed from a CUDA graph (CUDA only)
accept_sample      :func:`accept_sampling`, temperature 0.7, top-k 50, top-p 0.9, random target
                   logits (the fused kernel samples one or two rows per sequence)
accept_sample_graph  the same, replayed from a CUDA graph (CUDA only; the default generator)
accept_*_deep      the same two on "deep" target logits: at every node with children the first
                   child's token gets logit +100, so the walk goes to the tree's deepest level
                   (``max_depth + 1`` rows sampled per sequence: the worst case); ``deep_length``
                   is the mean accepted length seen
walk               :func:`accept_tokens` alone (target tokens given)
step               topk + expand + compile + accept_greedy, eager
step_graph         the same four captured in one CUDA graph (CUDA only)
=================  ============================================================================

Method: eager stages are timed as wall-clock latency of one call between two device syncs
(``torch.cuda.synchronize``), median of ``reps`` after ``warmup`` calls: the expansion is
launch-bound, so host time is part of its cost. Graph stages: CUDA events around one replay,
median. Draft logits rotate through 4 buffers (> 60 MB L2 at Kimi's vocabulary); target logits
are ``B*(budget+1) x V`` (bf16), larger than L2. Before timing, the vectorised tree is checked
against the host heap (a mismatch is reported in the row and on stderr, never hidden).

Prints a machine line, then a table per batch, then the issue-13 targets (:data:`TARGETS`: the
stage, batch and budget each is measured at, eager and graph); ``--json PATH`` writes the rows
(and the targets); ``--plot PATH`` a PNG. ``--targets`` runs only the batches and budget of the
targets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from ..bench.report import machine_info, machine_line
from ..bench.timing import capture_graph, event_times_ms, wall_times_ms
from .accept import accept_greedy, accept_sampling, accept_tokens, greedy_workspace
from .tree import DraftTree, compile_tree, draft_topk, expand_topk, expand_topk_reference, tree_links

__all__ = ["run_benchmark", "main"]

KIMI_VOCAB = 163840
STAGES = (
    "topk",
    "expand",
    "expand_graph",
    "construct",
    "construct_graph",
    "expand_host",
    "compile",
    "accept_greedy",
    "accept_greedy_graph",
    "accept_sample",
    "accept_sample_graph",
    "accept_greedy_deep",
    "accept_greedy_deep_graph",
    "accept_sample_deep",
    "accept_sample_deep_graph",
    "walk",
    "step",
    "step_graph",
)

# issue 13: (name, stage, batch, budget, target us) at V = 163840, L = 16; acceptance on the deep
# targets (the walk reaches max_depth: the most rows the sampler reads)
TARGETS = (
    ("top-k + expansion", "construct", 1, 512, 100.0),
    ("greedy acceptance", "accept_greedy_deep", 1, 512, 50.0),
    ("sampling acceptance", "accept_sample_deep", 16, 512, 1000.0),
)


def _time_wall(fn: Callable[[int], object], dev: torch.device, reps: int, warmup: int) -> float:
    """Median wall-clock microseconds of ``fn(i)`` between device syncs."""
    for i in range(warmup):
        fn(i)
    return statistics.median(wall_times_ms(fn, reps, device=dev)) * 1e3


def _time_graph(fn: Callable[[], object], dev: torch.device, reps: int, warmup: int) -> float:
    """Median GPU microseconds of one replay of a CUDA graph of ``fn`` (CUDA events)."""
    graph = capture_graph(lambda _i: fn(), [0])  # one call, warmed on a side stream first
    for _ in range(max(warmup, 2)):
        graph.replay()
    ms = event_times_ms(lambda _j: graph.replay(), reps)
    del graph
    return statistics.median(ms) * 1e3


def deep_targets(tree: DraftTree, target: torch.Tensor) -> torch.Tensor:
    """``target [T, V]`` (rows ``b * n + j`` of a uniform tree) with logit +100 at the first
    child's token of every node that has children: greedy and sampled walks go to the leaves."""
    B, n = tree.batch_size, tree.width
    first = tree_links(tree)[0]
    b, j = (first >= 0).nonzero(as_tuple=True)
    deep = target.clone()
    deep.view(B, n, -1)[b, j, tree.tokens[b, first[b, j]]] = 100.0
    return deep


def _same_tree(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "depths", "scores"))


def run_benchmark(
    device: str | None = None,
    budgets=(32, 128, 512),
    vocab: int = KIMI_VOCAB,
    depth: int = 16,
    batch: int = 4,
    *,
    reps: int | None = None,
    warmup: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    graphs: bool = True,
    seed: int = 0,
    verbose: bool = True,
) -> list[dict]:
    """Time the DDTree stages for each budget; returns one dict per budget (times in microseconds).

    Args:
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``; default CUDA when available.
        budgets: draft nodes per tree (root excluded); trees have budget+1 nodes.
        vocab: V (Kimi K2: 163840). depth: L, draft positions per step. batch: B sequences.
        reps / warmup: default 30 / 3 on CUDA, 5 / 1 on the CPU.
        dtype: of the draft and target logits.
        graphs: also time CUDA-graph replays (CUDA only).

    A stage that fails records ``None`` and its error in ``row["errors"]`` instead of raising.
    """
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cuda = dev.type == "cuda"
    reps = reps if reps is not None else (30 if cuda else 5)
    warmup = warmup if warmup is not None else (3 if cuda else 1)
    if verbose:
        print(machine_line(machine_info(str(dev))))
        print(f"V={vocab} L={depth} B={batch} dtype={str(dtype).replace('torch.', '')} reps={reps}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n_rot = 4 if cuda else 1
    drafts = [
        (torch.randn(batch, depth, vocab, generator=gen) * 3).to(device=dev, dtype=dtype) for _ in range(n_rot)
    ]
    roots = torch.randint(0, vocab, (batch,), generator=gen).to(dev)
    rows = []
    for budget in budgets:
        row: dict = {
            "device": str(dev),
            "budget": budget,
            "nodes": budget + 1,
            "batch": batch,
            "vocab": vocab,
            "depth": depth,
            "errors": {},
        }
        k = min(budget, vocab)
        T = batch * (budget + 1)
        prefix = torch.randint(100, 5000, (batch,), generator=gen).to(dev)
        target = deep = None
        try:
            target = (torch.randn(T, vocab, generator=gen) * 3).to(device=dev, dtype=dtype)
        except Exception as exc:  # e.g. out of memory at a huge batch: the other stages still run
            row["errors"]["target_logits"] = repr(exc)
        top = draft_topk(drafts[0], k)
        tree = expand_topk(top, budget, roots)
        ok = _same_tree(tree, expand_topk_reference(top, budget, roots))
        row["matches_reference"] = ok
        if not ok:
            print(f"ERROR: vectorised tree != host heap at budget {budget}", file=sys.stderr)
        tgt_tokens = target.argmax(-1) if target is not None else None

        def stage(name: str, fn):
            try:
                row[name] = fn()
            except Exception as exc:
                row[name] = None
                row["errors"][name] = repr(exc)
                if verbose:
                    print(f"  {name} failed at budget {budget}: {exc!r}", file=sys.stderr)

        gws = greedy_workspace(batch, dev)

        def step(i: int = 0):
            t = expand_topk(draft_topk(drafts[i % n_rot], k), budget, roots)
            compile_tree(t, prefix)
            return accept_greedy(t, target, workspace=gws)

        def greedy(logits):
            return accept_greedy(tree, logits, workspace=gws)

        def construct(i: int = 0):
            return expand_topk(draft_topk(drafts[i % n_rot], k), budget, roots)

        def sample(generator=None, logits=target):
            return accept_sampling(tree, logits, temperature=0.7, top_k=50, top_p=0.9, generator=generator)

        stage("topk", lambda: _time_wall(lambda i: draft_topk(drafts[i % n_rot], k), dev, reps, warmup))
        stage("expand", lambda: _time_wall(lambda i: expand_topk(top, budget, roots), dev, reps, warmup))
        stage("construct", lambda: _time_wall(construct, dev, reps, warmup))
        stage("expand_host", lambda: _time_wall(lambda i: expand_topk_reference(top, budget, roots), dev, reps, warmup))
        stage(
            "compile",
            lambda: _time_wall(lambda i: compile_tree(tree, prefix), dev, reps, warmup),
        )
        if target is not None:
            stage("accept_greedy", lambda: _time_wall(lambda i: greedy(target), dev, reps, warmup))
            sgen = torch.Generator(device=dev).manual_seed(seed)
            stage(
                "accept_sample",
                lambda: _time_wall(lambda i: sample(sgen), dev, reps, warmup),
            )
            deep = deep_targets(tree, target)
            row["deep_length"] = float(greedy(deep).lengths.double().mean())
            stage("accept_greedy_deep", lambda: _time_wall(lambda i: greedy(deep), dev, reps, warmup))
            stage("accept_sample_deep", lambda: _time_wall(lambda i: sample(sgen, deep), dev, reps, warmup))
            stage("walk", lambda: _time_wall(lambda i: accept_tokens(tree, tgt_tokens), dev, reps, warmup))
            stage("step", lambda: _time_wall(step, dev, reps, warmup))
        if cuda and graphs:
            stage("expand_graph", lambda: _time_graph(lambda: expand_topk(top, budget, roots), dev, reps, warmup))
            stage("construct_graph", lambda: _time_graph(construct, dev, reps, warmup))
            if target is not None:
                stage("accept_greedy_graph", lambda: _time_graph(lambda: greedy(target), dev, reps, warmup))
                stage("accept_sample_graph", lambda: _time_graph(sample, dev, reps, warmup))
                stage("accept_greedy_deep_graph", lambda: _time_graph(lambda: greedy(deep), dev, reps, warmup))
                stage("accept_sample_deep_graph", lambda: _time_graph(lambda: sample(None, deep), dev, reps, warmup))
                stage("step_graph", lambda: _time_graph(step, dev, reps, warmup))
        del target, deep
        rows.append(row)
        if verbose:
            _print_row(row, header=len(rows) == 1)
    return rows


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _print_row(row: dict, header: bool) -> None:
    cols = ("budget", "nodes") + STAGES
    if header:
        print("times in us (eager: wall-clock between syncs; *_graph: CUDA-graph replay, GPU time)")
        print(" ".join(f"{c:>13}" for c in cols) + "  ok  deep_length")
    vals = [str(row["budget"]), str(row["nodes"])] + [_fmt(row.get(s)) for s in STAGES]
    deep = row.get("deep_length")
    print(" ".join(f"{v:>13}" for v in vals) + f"  {'yes' if row.get('matches_reference') else 'NO'}"
          f"  {'-' if deep is None else f'{deep:.1f}'}")


def target_table(rows: list[dict]) -> list[dict]:
    """One entry per :data:`TARGETS` item found among ``rows``: eager and graph us, and whether
    the better of the two meets the target (graph replay is how a decode step runs it)."""
    out = []
    for name, stage, batch, budget, target in TARGETS:
        for r in rows:
            if r["batch"] == batch and r["budget"] == budget:
                eager, graph = r.get(stage), r.get(stage + "_graph")
                best = min((t for t in (eager, graph) if t is not None), default=None)
                out.append({
                    "target": name, "stage": stage, "batch": batch, "budget": budget, "vocab": r["vocab"],
                    "eager_us": eager, "graph_us": graph, "target_us": target,
                    "met": best is not None and best <= target,
                })
    return out


def _print_targets(entries: list[dict]) -> None:
    print("issue-13 targets (us)")
    print(f"{'target':>20} {'B':>3} {'budget':>6} {'V':>7} {'eager':>9} {'graph':>9} {'target':>8}  met")
    for e in entries:
        print(
            f"{e['target']:>20} {e['batch']:>3} {e['budget']:>6} {e['vocab']:>7} {_fmt(e['eager_us']):>9}"
            f" {_fmt(e['graph_us']):>9} {_fmt(e['target_us']):>8}  {'yes' if e['met'] else 'NO'}"
        )


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s for s in STAGES if any(r.get(s) is not None for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(rows), 1)
    for j, r in enumerate(rows):
        xs = [i + j * width for i in range(len(stages))]
        ax.bar(xs, [r.get(s) or 0 for s in stages], width, label=f"budget {r['budget']} (B={r['batch']})")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(stages))], stages, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("us per call")
    ax.set_title(f"DDTree stages, {rows[0]['device']}, V={rows[0]['vocab']}, L={rows[0]['depth']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree_engine.ddtree.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda / cuda:N / cpu (default: cuda if available)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="one table per batch size")
    ap.add_argument("--vocab", type=int, default=KIMI_VOCAB)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--targets", action="store_true", help="only the batches and budget of the issue-13 targets")
    ap.add_argument("--json", default=None, help="write all rows to this JSON file")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart (needs matplotlib)")
    args = ap.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    batches, budgets = args.batch, args.budgets
    if args.targets:
        batches = sorted({t[2] for t in TARGETS})
        budgets = sorted({t[3] for t in TARGETS})
    rows = []
    for b in batches:
        rows += run_benchmark(
            args.device,
            tuple(budgets),
            args.vocab,
            args.depth,
            b,
            reps=args.reps,
            warmup=args.warmup,
            dtype=dtype,
            graphs=not args.no_graphs,
        )
        print()
    targets = target_table(rows)
    if targets:
        _print_targets(targets)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(rows[0]["device"]), "rows": rows, "targets": targets}, f, indent=1)
    if args.plot:
        try:
            _plot(rows, args.plot)
        except Exception as exc:
            print(f"plot failed: {exc!r}", file=sys.stderr)
    return 0 if all(r.get("matches_reference") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
