"""``kdtree demo``: the project's main job, end to end on a real MLA model definition.

Stages (each prints its own lines; the exit status is non-zero if any check fails):

1. golden bundles: generate the standard verify bundles and check every kernel on them
   (:func:`check_standard_bundles`; on by default on CUDA, ``--bundles`` on the CPU where the
   Triton interpreter makes it slow).
2. numerics: one verify step of the demo model through the engine (absorbed MLA, KV pool,
   ``verify_attention``) against Hugging Face's own DeepseekV3 forward with the equivalent 4-D
   tree mask (eager attention), short prefix.
3. speculative decoding: ragged batch of long prompts, prefilled once; per kernel (naive, flash)
   plain greedy decoding, then speculative decoding with each drafter (n-gram prompt lookup: real;
   synthetic: agreement set by ``--agreement``, for benchmarking). Prints tokens/s, mean accepted
   length, time per step split into attention (the verify kernel, CUDA events) and the rest, the
   speedup over plain decoding with the same kernel, and losslessness: token-for-token against
   plain decoding and against ``model.generate(do_sample=False)`` of the HF model.

``--sweep 4096,32768,131072,204800`` instead measures, per prefix and kernel, plain and synthetic
speculative decoding (tokens/s, attention share, speedup) at fixed agreement.

On CUDA the default model is a DeepseekV3ForCausalLM whose attention matches Kimi K2 per GPU
(64 heads, q_lora 1536, nope 128 + rope 64, v 128, latent 512, hidden 7168, yarn) with 2 dense
layers and random weights (``--model-dir`` loads a local ``save_pretrained`` checkpoint instead).
On the CPU: a tiny config, fp32 weights, fp16 KV cache, kernels under the Triton interpreter.
Prefill is dense causal attention per sequence (HF-equivalent expanded form, torch SDPA), which
writes the latent KV into the pool; decode steps run the absorbed form over the pool.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from .backend import select_device
from .cliargs import (
    ArgumentParser,
    UsageError,
    existing_dir,
    float_above,
    guarded,
    int_in,
    int_list,
    prepare_output_dir,
    prepare_output_file,
)
from .masks import MAX_TREE_NODES
from .verify import KERNELS, available_kernels

# ddtree.MAX_BUDGET; not imported from there: ddtree loads Triton, which must wait for select_device
MAX_BUDGET = MAX_TREE_NODES - 1


def check_standard_bundles(device: str, out_dir: Path | None = None) -> int:
    """Generate the standard bundles (into ``out_dir`` or a temp dir) and check every kernel this
    device runs.

    Prints one PASS/FAIL line per (bundle, kernel); returns the number of failures.
    """
    from .bundles import check_bundle, make_bundle, save_bundle, standard_specs

    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = out_dir or Path(tmp)
        for spec in standard_specs():
            bundle = make_bundle(spec, device)
            save_bundle(bundle, root / bundle.filename)
            for kernel in available_kernels(device):
                result = check_bundle(bundle, kernel, device)
                print(result.line, flush=True)
                failures += not result.ok
    return failures


# ----------------------------------------------------------------------------------------------
# set-up

_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _defaults(args, cuda: bool) -> None:
    if args.quick:
        d = dict(prefix=4096, steps=16, batch=2) if cuda else dict(prefix=24, steps=6, batch=2)
    else:
        d = dict(prefix=131072, steps=48, batch=4) if cuda else dict(prefix=48, steps=12, batch=3)
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dtype is None:
        args.dtype = "bf16" if cuda else "fp32"
    if args.cache_dtype is None:  # fp32 weights (CPU): fp16 keeps 3 more mantissa bits than bf16
        args.cache_dtype = "bf16" if args.dtype == "bf16" else "fp16"
    if args.bundles is None:
        args.bundles = cuda and not args.quick and not args.sweep


def _build_model(args, device: str):
    from .model import build_random_model, kimi_k2_attention_config, load_model, tiny_config

    dtype = _DT[args.dtype]
    attn = "sdpa" if device == "cuda" else "eager"
    if args.model_dir:
        try:
            return load_model(args.model_dir, dtype=dtype, device=device, attn_implementation=attn), "checkpoint"
        except (OSError, ValueError) as e:  # no checkpoint there, or not a DeepseekV3 MLA one
            raise UsageError(f"argument --model-dir: {args.model_dir}: {str(e).splitlines()[0]}") from None
    if device == "cuda":
        cfg = kimi_k2_attention_config(num_layers=args.layers)
        name = f"Kimi-K2 attention (64 heads, latent 512 + rope 64), {args.layers} dense layers, random weights"
    else:
        cfg = tiny_config(num_hidden_layers=args.layers, first_k_dense_replace=1)
        name = f"tiny DeepseekV3 ({args.layers} layers, 4 heads, MoE), random weights"
    return build_random_model(cfg, seed=args.seed, dtype=dtype, device=device, attn_implementation=attn), name


def _prompt_lens(longest: int, batch: int, ragged: bool = True) -> list[int]:
    if not ragged:
        return [longest] * batch
    return [max(1, longest * (batch - i) // batch) for i in range(batch)]


def _prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


class _Bars:
    """Rich progress bars on stderr (or nothing with --no-progress)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(stderr=True), transient=False)

    def __enter__(self):
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()

    def task(self, description: str, total: int):
        if not self.progress:
            return None
        tid = self.progress.add_task(description, total=total)
        return lambda k: self.progress.advance(tid, k)


# ----------------------------------------------------------------------------------------------
# stage 2: numerics


# The engine must be as accurate as HF's own forward in the model's dtype: its max |logit error|
# against a float32 truth (HF's forward on a float32 copy of the same weights, same inputs and 4-D
# mask) at most NUMERICS_FACTOR times HF's own error against that truth, plus a floor. The floor is
# one rounding unit at the largest logit, eps(d) * max |truth logit|, of the dtype d that only the
# engine rounds to: the KV cache's when it is coarser than the model dtype (fp32 weights with an
# fp16 cache: HF's forward IS the truth, error 0, and the floor alone is the tolerance), else fp32
# (a negligible floor: the bf16 engine is held to 2x bf16 HF).
NUMERICS_FACTOR = 2.0
# HF's own generate() is the lossless reference only up to this prompt length on CUDA: at 131072
# tokens (4 ragged prompts, Kimi-K2 attention, bf16) HF's forward hit an illegal memory access on
# the H200 (2026-11-30, reported at its o_proj call, right after its SDPA attention), which kills
# the CUDA context. Longer runs check losslessness against plain decoding through the same engine.
HF_REFERENCE_MAX_TOKENS_CUDA = 32768


def floor_dtype(model_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the floor: the KV cache's if it is coarser than the model's, else float32."""
    return cache_dtype if torch.finfo(cache_dtype).eps > torch.finfo(model_dtype).eps else torch.float32


def numerics_tolerance(hf_err: float, truth_absmax: float, model_dtype: torch.dtype, cache_dtype: torch.dtype,
                       factor: float = NUMERICS_FACTOR) -> tuple[float, float]:
    """``(tolerance, floor)`` on the engine's max |logit error| vs the float32 truth:
    ``factor * hf_err + eps(floor_dtype) * max |truth logit|``."""
    floor = torch.finfo(floor_dtype(model_dtype, cache_dtype)).eps * truth_absmax
    return factor * hf_err + floor, floor


def near_tie_tolerance(engine_err: float, hf_err: float) -> float:
    """Top-1/top-2 margin below which a greedy divergence counts as numerics in stage 3.

    Two outputs whose logits are each within ``e_a`` / ``e_b`` of the truth differ by at most
    ``e_a + e_b`` per logit, so their argmaxes can only differ where the reference's top-1 - top-2
    margin is below ``2 (e_a + e_b)`` (the two logits moving oppositely). Stage 3 compares the
    engine with HF (``e_b`` = HF's error) and with itself (plain decoding, ``e_b`` = the engine's
    error): ``e_b = max`` of both. A further factor 2 covers the longer contexts and the many more
    steps of stage 3 than of this one-step check.
    """
    return 2 * 2 * (engine_err + max(engine_err, hf_err))


def _fp32_tree_logits(model, prefixes, trees) -> torch.Tensor:
    """HF's forward (same config, same 4-D mask) on a float32 copy of ``model``'s weights, with
    full-precision fp32 matmuls (no TF32)."""
    from .model import hf_tree_logits

    m32 = copy.deepcopy(model).to(torch.float32)
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return torch.cat(hf_tree_logits(m32, prefixes, trees))
    finally:
        torch.set_float32_matmul_precision(prec)
        dev = next(m32.parameters()).device
        del m32
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def numerics_check(runner, seed: int, prefix_len: int = 200, factor: float = NUMERICS_FACTOR) -> dict:
    """One verify step of ``runner`` vs HF eager with the 4-D tree mask, both measured against the
    float32 truth (HF's forward on a float32 copy of the weights); ``ok`` per :data:`NUMERICS_FACTOR`.

    Errors are max |logit - truth| over all tree rows and the whole vocabulary.
    """
    from .model import hf_tree_logits
    from .model.speculative import verify_once

    model = runner.hf
    V = runner.vocab_size
    g = torch.Generator().manual_seed(seed + 101)
    prefixes = [torch.randint(0, V, (n,), generator=g).tolist() for n in (prefix_len, prefix_len // 3 + 1)]
    trees = []
    for n in (17, 6):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        trees.append((torch.randint(0, V, (n,), generator=g).tolist(), parents))
    logits, _, _ = verify_once(runner, prefixes, trees, shuffle_seed=seed)
    old = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        hf = torch.cat(hf_tree_logits(model, prefixes, trees))
        truth = hf if runner.dtype == torch.float32 else _fp32_tree_logits(model, prefixes, trees)
    finally:
        model.config._attn_implementation = old
    engine_err = float((logits - truth).abs().max())
    hf_err = float((hf - truth).abs().max())
    absmax = float(truth.abs().max())
    tol, floor = numerics_tolerance(hf_err, absmax, runner.dtype, runner.cache_dtype, factor)
    coarse = floor_dtype(runner.dtype, runner.cache_dtype)
    top = truth.argmax(-1)
    return dict(kernel=runner.kernel, rows=int(logits.shape[0]), model_dtype=str(runner.dtype).removeprefix("torch."),
                cache_dtype=str(runner.cache_dtype).removeprefix("torch."), floor_dtype=str(coarse).removeprefix("torch."),
                engine_err=engine_err, hf_err=hf_err, engine_vs_hf=float((logits - hf).abs().max()),
                engine_rms=float((logits - truth).pow(2).mean().sqrt()), hf_rms=float((hf - truth).pow(2).mean().sqrt()),
                truth_absmax=absmax, logit_std=float(truth.std()), factor=factor, floor=floor, tol=tol,
                argmax_agree=float((logits.argmax(-1) == top).float().mean()),
                hf_argmax_agree=float((hf.argmax(-1) == top).float().mean()),
                ok=engine_err <= tol)


def numerics_line(n: dict) -> str:
    """One PASS/FAIL line: both errors vs the fp32 truth, the limit and how it is made up."""
    md, coarse = _SHORT[n["model_dtype"]], _SHORT[n["floor_dtype"]]
    hf = "0 (HF fp32 is the truth)" if md == "fp32" else f"{n['hf_err']:.2e}"
    return (f"{'PASS' if n['ok'] else 'FAIL'} [{n['kernel']}] {n['rows']} tree rows, max |logit - fp32 truth|: "
            f"engine {n['engine_err']:.2e}, HF {md} {hf}; limit {n['factor']:g} x HF + {coarse} eps x max|logit| "
            f"({n['floor']:.2e}) = {n['tol']:.2e} | engine vs HF {n['engine_vs_hf']:.2e}, logit std "
            f"{n['logit_std']:.2f}, argmax = truth's: engine {100 * n['argmax_agree']:.0f}%, HF {100 * n['hf_argmax_agree']:.0f}%")


# ----------------------------------------------------------------------------------------------
# stage 3: speculative decoding


def hf_reference(model, prompts, steps: int, device: str, bars: _Bars):
    """``model.generate(do_sample=False)`` per prompt (batch 1, no padding): tokens, logits, seconds.

    On CUDA the SDPA math fallback is excluded (it would materialise a P x P score matrix)."""
    out, t0 = [], time.perf_counter()
    adv = bars.task("HF generate (reference)", len(prompts))
    ctx = _no_math_sdpa() if device == "cuda" else contextlib.nullcontext()
    with ctx, torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            # an explicit all-ones mask: HF must not guess padding from token ids
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                               output_logits=True, return_dict_in_generate=True, eos_token_id=None)
            out.append((g.sequences[0, len(p):].tolist(), torch.cat(g.logits, 0).float().cpu()))
            if adv:
                adv(1)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # HF's prefill activations: give them back before the engine's
    return out, time.perf_counter() - t0


def _no_math_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def _row(kernel, drafter, res, split=None, plain=None, capture_s=0.0, vs_plain=None, vs_hf=None, vs_split=None) -> dict:
    """A table row: throughput and wall / device / host time per step from ``res``, the split of
    the step by phase kind from ``split`` (the same run replayed as a graph per phase) or, without
    one, from ``res`` itself."""
    sp = split or res
    return dict(kernel=kernel, drafter=drafter, graphs=res.graphs, steps=res.steps, tokens=res.decoded_tokens,
                tokens_per_s=res.tokens_per_s, mean_accepted=res.mean_accepted, step_ms=res.step_ms,
                device_ms=res.device_ms, host_ms=res.host_ms, attn_ms=sp.kind_ms("attention"),
                tree_ms=sp.kind_ms("tree"), accept_ms=sp.kind_ms("accept"), rest_ms=sp.kind_ms("rest"),
                split_graphs=sp.graphs, split_device_ms=sp.device_ms, draft_ms=1e3 * res.draft_s / max(1, res.steps),
                attn_share=sp.kind_ms("attention") / sp.step_ms if sp.step_ms > 0 else float("nan"),
                speedup=(res.tokens_per_s / plain.tokens_per_s) if plain else 1.0, capture_s=capture_s,
                lossless_vs_plain=None if vs_plain is None else vs_plain.line(),
                lossless_vs_hf=None if vs_hf is None else vs_hf.line(),
                split_vs_run=None if vs_split is None else vs_split.line(),
                ok=all(c is None or c.ok for c in (vs_plain, vs_hf, vs_split)))


def _print_table(rows: list[dict], title: str) -> None:
    """step ms = wall time per step; dev ms = its phases' time (GPU on CUDA, host on the CPU); host
    ms = the difference; attn / tree / acc+com / rest = dev ms by phase kind (from the phase-split
    run with graphs); capture s = graph capture of the row's step shapes, warm-up included."""
    print(title)
    hdr = (f"{'kernel':<6} {'decoding':<24} {'tok/s':>8} {'accept':>6} {'step ms':>8} {'dev ms':>8} {'host ms':>7} "
           f"{'attn':>7} {'tree':>6} {'acc+com':>7} {'rest':>7} {'attn %':>6} {'speedup':>7} {'capture s':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['kernel']:<6} {r['drafter']:<24} {r['tokens_per_s']:>8.1f} {r['mean_accepted']:>6.2f} "
              f"{r['step_ms']:>8.2f} {r['device_ms']:>8.2f} {r['host_ms']:>7.2f} {r['attn_ms']:>7.2f} "
              f"{r['tree_ms']:>6.2f} {r['accept_ms']:>7.2f} {r['rest_ms']:>7.2f} {100 * r['attn_share']:>5.1f}% "
              f"{r['speedup']:>6.2f}x {'-' if r['graphs'] == 'eager' else format(r['capture_s'], '.2f'):>9}")


def _warm_up(eng, drafters, modes) -> None:
    """:meth:`~kdtree_engine.model.speculative.SpeculativeEngine.warm_up` per drafter (``None``:
    plain decoding) and graph mode: JIT compiles (Triton kernels of attention, tree, acceptance,
    KV commit), first-call set-up and, with graphs, the eager warm-up step and the capture of
    every batch size's step shape are not timed."""
    keep = eng.graphs
    for mode in modes:
        eng.graphs = mode
        for d in drafters:
            eng.drafter = d
            eng.warm_up()
    eng.graphs = keep


SYNC_PASSES = 4


def _sync_references(eng, drafter, prompts, plain_tokens, modes) -> int:
    """Point the SYNTHETIC ``drafter`` at the target's own tokens under this speculative
    configuration: it drafts first from plain decoding's tokens (every step shape warmed up
    meanwhile), then, for up to :data:`SYNC_PASSES` untimed speculative runs, from the previous
    run's tokens, until a run emits its references. Exact bf16 ties let a speculative run leave
    plain decoding's tokens (within the near-tie tolerance: the verify forward rounds differently
    from the one-token one); a drafter still drafting from those would propose nothing right for
    the rest of that sequence, which then decodes one token per step while the others wait.
    Returns the passes run; the timed run is in sync when the last one emitted its references
    (the steps are deterministic)."""
    refs = plain_tokens
    drafter.set_references([p + t for p, t in zip(prompts, refs)])
    _warm_up(eng, (drafter,), modes)
    for passes in range(1, SYNC_PASSES + 1):
        eng.reset()
        out = eng.decode().tokens
        if out == refs:
            break
        refs = out
        drafter.set_references([p + t for p, t in zip(prompts, refs)])
    return passes


def _split_mode(eng) -> str | None:
    """The mode of the run that splits a graph-replayed step by phase (None when eager: the
    eager run splits itself)."""
    return "phases" if eng.graphs == "step" else None


def _measure(eng, drafter, adv=None, split: bool = True):
    """One timed decode from the prefilled prompts with ``drafter``, and (with graphs and
    ``split``) the same decode replayed as a graph per phase for the time split. Returns
    ``(run, split run or None)``."""
    eng.drafter = drafter
    eng.reset()
    res = eng.decode(progress=adv)
    mode = _split_mode(eng)
    if mode is None or not split:
        return res, None
    keep, eng.graphs = eng.graphs, mode
    eng.reset()
    split = eng.decode()
    eng.graphs = keep
    return res, split


def run_decoding(runner, args, kernels: list[str], prompts, bars: _Bars, hf=None, tie_tol: float = 0.0,
                 drafters=("ngram", "synthetic")) -> list[dict]:
    """Prefill once, then per kernel: plain decoding and one speculative run per drafter (all on
    the same prefilled prompt KV); returns the table rows."""
    from .model.drafters import NGramDrafter, SyntheticDrafter
    from .model.speculative import SpeculativeEngine, check_lossless

    rows = []
    steps = args.steps
    # one pool, sized for the trees; every run below reuses the prompt KV (reset())
    eng = SpeculativeEngine(runner, None, budget=args.budget, depth=args.depth, page_size=args.page_size,
                            graphs=_graph_mode(runner, args))
    plan = eng.plan([len(p) for p in prompts], steps)
    print(f"KV pool: {plan.describe()}")
    print(f"steps: {_graphs_line(eng)}", flush=True)
    adv = bars.task(f"prefill {sum(len(p) for p in prompts)} tokens", sum(len(p) for p in prompts))
    _, prefill_s = eng.prefill(prompts, steps, progress=adv)
    print(f"prefill: {len(prompts)} sequences, {sum(len(p) for p in prompts)} tokens in {prefill_s:.2f} s "
          f"(dense causal SDPA per sequence)", flush=True)
    hf_tokens = [t for t, _ in hf] if hf else None
    hf_logits = [lg for _, lg in hf] if hf else None
    modes = [m for m in (eng.graphs, _split_mode(eng)) if m]
    for kernel in kernels:
        runner.kernel = kernel
        # plain greedy decoding: one-node trees, same engine, same kernel
        c0 = eng.capture_s
        _warm_up(eng, (None,), modes)
        plain, split = _measure(eng, None, bars.task(f"{kernel}: plain decoding", len(prompts) * (steps - 1)))
        vs_hf = check_lossless(plain.tokens, hf_tokens, hf_logits, tie_tol) if hf else None
        vs_split = check_lossless(split.tokens, plain.tokens, plain.top2, tie_tol) if split else None
        rows.append(_row(kernel, "plain (1 token/step)", plain, split, None, eng.capture_s - c0, None, vs_hf, vs_split))
        for name in drafters:
            c1 = eng.capture_s
            if name == "ngram":
                drafter = NGramDrafter(runner.vocab_size)
                label = "ngram (prompt lookup)"
                _warm_up(eng, (drafter,), modes)
            else:
                drafter = SyntheticDrafter([p + t for p, t in zip(prompts, plain.tokens)], runner.vocab_size,
                                           agreement=args.agreement, seed=args.seed)
                label = f"SYNTHETIC a={args.agreement:g}"
                _sync_references(eng, drafter, prompts, plain.tokens, modes)
            adv = bars.task(f"{kernel}: {name} speculative", len(prompts) * (steps - 1))
            res, split = _measure(eng, drafter, adv)
            vs_plain = check_lossless(res.tokens, plain.tokens, plain.top2, tie_tol)
            vs_hf = check_lossless(res.tokens, hf_tokens, hf_logits, tie_tol) if hf else None
            vs_split = check_lossless(split.tokens, res.tokens, res.top2, tie_tol) if split else None
            rows.append(_row(kernel, label, res, split, plain, eng.capture_s - c1, vs_plain, vs_hf, vs_split))
    eng.close()
    return rows


def _graph_mode(runner, args) -> str:
    """``"step"`` graphs on CUDA for a model without MoE layers unless ``--no-graphs``, else eager."""
    return "step" if runner.device.type == "cuda" and runner.capturable and not args.no_graphs else "eager"


def _graphs_line(eng) -> str:
    r = eng.runner
    if eng.graphs == "step":
        return ("one CUDA graph per step shape (captured at its second step, replayed after); the time split "
                "by phase from a second run replayed as a graph per phase")
    why = ("--no-graphs" if r.device.type == "cuda" and r.capturable else
           "the model has MoE layers (host syncs)" if r.device.type == "cuda" else "CPU: CUDA graphs need a GPU")
    return f"eager ({why}); phases timed {'with CUDA events' if r.device.type == 'cuda' else 'on the host clock'}"


SWEEP_BATCHES = (1, 4)
SWEEP_BUDGETS = (8, 16, 32, 64)


def _sweep(runner, args, kernels, bars, tie_tol: float, save=None) -> tuple[list[dict], bool]:
    """Per batch, context and kernel: plain decoding, then synthetic speculative decoding at each
    tree budget (one prefill per batch and context, the pool sized for the largest budget).
    ``save(rows)`` after each row (the rows so far survive a failure later in the sweep)."""
    from .model.drafters import SyntheticDrafter
    from .model.speculative import SpeculativeEngine, check_lossless

    rows, ok = [], True
    budgets = sorted(args.sweep_budgets)
    for batch in args.sweep_batches:
        for ctx in args.sweep:
            prompts = _prompts(_prompt_lens(ctx, batch, ragged=False), runner.vocab_size, args.seed + ctx)
            eng = SpeculativeEngine(runner, None, budget=budgets[-1], depth=args.depth, page_size=args.page_size,
                                    graphs=_graph_mode(runner, args))
            try:
                adv = bars.task(f"prefill {batch} x {ctx}", batch * ctx)
                _, prefill_s = eng.prefill(prompts, args.steps, progress=adv)
                for kernel in kernels:
                    runner.kernel = kernel
                    c0 = eng.capture_s
                    _warm_up(eng, (None,), (eng.graphs,))
                    plain, _ = _measure(eng, None, split=False)
                    base = dict(batch=batch, context=ctx, kernel=kernel, prefill_s=prefill_s, graphs=eng.graphs)
                    rows.append(base | _sweep_fields(plain, None, eng.capture_s - c0, 0, "plain"))
                    print(_sweep_line(rows[-1]), flush=True)
                    if save:
                        save(rows)
                    drafter = SyntheticDrafter([p + t for p, t in zip(prompts, plain.tokens)], runner.vocab_size,
                                               agreement=args.agreement, seed=args.seed)
                    for budget in budgets:
                        eng.budget = budget
                        c0 = eng.capture_s
                        passes = _sync_references(eng, drafter, prompts, plain.tokens, (eng.graphs,))
                        spec, _ = _measure(eng, drafter, split=False)
                        synced = [t[len(p):] for p, t in zip(prompts, drafter.references())] == spec.tokens
                        same = check_lossless(spec.tokens, plain.tokens, plain.top2, tie_tol)
                        ok &= same.ok
                        what = f"SYNTHETIC a={args.agreement:g}"
                        rows.append(base | _sweep_fields(spec, plain, eng.capture_s - c0, budget, what)
                                    | dict(lossless_vs_plain=same.line(), ok=same.ok, sync_passes=passes,
                                           in_sync=synced))
                        print(_sweep_line(rows[-1]), flush=True)
                        if save:
                            save(rows)
            finally:  # the request's graphs and pool freed, also when a row fails
                eng.close()
                if runner.device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows, ok


def _sweep_fields(res, plain, capture_s: float, budget: int, drafter: str) -> dict:
    return dict(budget=budget, drafter=drafter, tokens_per_s=res.tokens_per_s, mean_accepted=res.mean_accepted,
                step_ms=res.step_ms, device_ms=res.device_ms, host_ms=res.host_ms, capture_s=capture_s,
                timed_captures=res.captures, speedup=res.tokens_per_s / plain.tokens_per_s if plain else 1.0)


def _sweep_line(r: dict) -> str:
    what = "plain" if r["budget"] == 0 else f"budget {r['budget']:>3}"
    line = (f"batch {r['batch']} context {r['context']:>7} {r['kernel']:<6} {what:<10} {r['tokens_per_s']:9.1f} tok/s "
            f"accept {r['mean_accepted']:5.2f} step {r['step_ms']:7.2f} ms (dev {r['device_ms']:7.2f}, host "
            f"{r['host_ms']:6.2f}) speedup {r['speedup']:5.2f}x")
    if r["timed_captures"]:
        line += f" | {r['timed_captures']} step shape(s) captured inside the timed run"
    if r["budget"]:
        line += f" | drafter {'in sync' if r['in_sync'] else 'OUT OF SYNC'} ({r['sync_passes']} passes)"
        line += " | " + ("lossless" if r["lossless_vs_plain"].startswith("lossless") else r["lossless_vs_plain"])
    return line


def write_sweep_plot(path: Path, rows: list[dict], title: str) -> Path:
    """Tokens/s against context, one panel per batch size, one line per (kernel, budget): colour by
    budget (plain decoding black and thick), line style by kernel (matplotlib, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        sel = [r for r in rows if r["batch"] == batch]
        budgets = sorted({r["budget"] for r in sel})
        colors = {k: ("black" if k == 0 else plt.cm.viridis(i / max(1, len(budgets) - 1))) for i, k in enumerate(budgets)}
        for style, kernel in zip(("-", "--", ":", "-."), sorted({r["kernel"] for r in sel})):
            for budget in budgets:
                pts = sorted((r["context"], r["tokens_per_s"]) for r in sel if r["kernel"] == kernel and r["budget"] == budget)
                label = f"{kernel} plain" if budget == 0 else f"{kernel} budget {budget}"
                ax.plot(*zip(*pts), style, color=colors[budget], marker="o", label=label,
                        linewidth=2.4 if budget == 0 else 1.4)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens per sequence)")
        ax.set_ylabel("tokens/s (all sequences)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# main


def _kernel_list(text: str) -> list[str]:
    """``--kernel``: ``all`` or a comma list of distinct kernel names."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return names
    bad = [n for n in names if n not in KERNELS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (all, or a comma list of distinct "
                                         f"{', '.join(KERNELS)})")
    return names


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kdtree demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="small sizes (GPU: 4k prefix, 16 tokens, 2 sequences)")
    p.add_argument("--prefix", type=int_in(1), help="longest prompt (the batch is ragged: P, (B-1)P/B, ...); "
                   "default 131072 on CUDA, 48 on the CPU")
    p.add_argument("--batch", type=int_in(1), help="sequences decoded together (default 4 CUDA, 3 CPU)")
    p.add_argument("--steps", type=int_in(1), help="new tokens per sequence = steps of plain decoding "
                   "(speculative decoding generates the same tokens in fewer steps); default 48 CUDA, 12 CPU")
    p.add_argument("--kernel", type=_kernel_list, default=["all"],
                   help=f"a comma list of {', '.join(KERNELS)}, or all: every kernel this device runs (hopper only on "
                        f"sm_90)")
    p.add_argument("--drafter", choices=["ngram", "synthetic", "both"], default="both")
    p.add_argument("--agreement", type=float_above(0, inclusive=True, hi=1), default=0.7, help="synthetic drafter: P(top-1 = target token)")
    p.add_argument("--budget", type=int_in(0, MAX_BUDGET), default=16, help="DDTree draft nodes per tree (root excluded)")
    p.add_argument("--depth", type=int_in(0), default=6, help="draft positions (max tree depth)")
    p.add_argument("--page-size", type=int_in(1), default=16)
    p.add_argument("--layers", type=int_in(1), default=2, help="layers of the random-weight model")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="model weights (default bf16 CUDA, fp32 CPU)")
    p.add_argument("--cache-dtype", choices=["bf16", "fp16"], help="KV cache (default bf16 with bf16 weights, else fp16)")
    p.add_argument("--model-dir", type=existing_dir, help="local save_pretrained DeepseekV3 checkpoint (kv_lora_rank 512, rope 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", type=int_list(1),
                   help="comma-separated contexts (tokens per sequence): tokens/s of plain and synthetic speculative "
                        "decoding per batch size, context, kernel and tree budget (JSON with --json, plot with --plot)")
    p.add_argument("--sweep-batches", type=int_list(1), default=list(SWEEP_BATCHES),
                   help=f"sweep: batch sizes (default {','.join(map(str, SWEEP_BATCHES))})")
    p.add_argument("--sweep-budgets", type=int_list(1, MAX_BUDGET), default=list(SWEEP_BUDGETS),
                   help=f"sweep: DDTree budgets (default {','.join(map(str, SWEEP_BUDGETS))})")
    p.add_argument("--plot", type=Path, help="sweep: write the tokens/s plot here (PNG; default: --json's path "
                   "with .png)")
    p.add_argument("--no-graphs", action="store_true", help="run every step eagerly on CUDA too (no CUDA graphs)")
    p.add_argument("--no-hf-check", action="store_true", help="skip model.generate (the HF reference)")
    p.add_argument("--bundles", action=argparse.BooleanOptionalAction, default=None,
                   help="stage 1, golden bundles (default: on with CUDA unless --quick/--sweep)")
    p.add_argument("--refs-dir", type=Path, help="keep the generated bundles here")
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--no-progress", action="store_true")
    return p


@guarded
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.refs_dir is not None:
        prepare_output_dir(args.refs_dir, "--refs-dir")
    if args.json is not None:
        prepare_output_file(args.json, "--json")
    if args.plot is None and args.sweep and args.json is not None:
        args.plot = args.json.with_suffix(".png")
    if args.plot is not None:
        if not args.sweep:
            raise UsageError(f"argument --plot: plots the sweep; give --sweep too (got --plot {args.plot})")
        prepare_output_file(args.plot, "--plot")
    device = select_device(args.device)  # sets TRITON_INTERPRET=1 on the CPU before any kernel import
    from .bench.report import machine_info, machine_line

    cuda = device == "cuda"
    _defaults(args, cuda)
    runs = available_kernels(device)
    kernels = list(runs) if args.kernel == ["all"] else args.kernel
    for k in kernels:
        if k not in runs:
            raise UsageError(f"argument --kernel: {k} does not run on {device} (this device runs {', '.join(runs)})")
    print(f"kdtree demo on {device}{' (Triton interpreter, small sizes)' if not cuda else ''}")
    print(machine_line(machine_info(device)), flush=True)
    report: dict = {"device": device, "args": {k: str(v) for k, v in vars(args).items()}}
    failures = 0

    # stage 1
    if args.bundles:
        print("== stage 1: golden bundles ==", flush=True)
        nb = check_standard_bundles(device, args.refs_dir)
        print("golden bundles: " + ("all PASS" if nb == 0 else f"{nb} FAIL"), flush=True)
        failures += nb
        report["bundle_failures"] = nb
    else:
        print("== stage 1: golden bundles: skipped (--bundles to run; slow under the CPU interpreter) ==")

    from .model import MLARunner
    from .model.speculative import RequestTooLarge, memory_plan

    t0 = time.perf_counter()
    model, model_name = _build_model(args, device)
    c = model.config
    runner = MLARunner(model, kernel=kernels[0], cache_dtype=_DT[args.cache_dtype])
    print(f"model: {model_name}; hidden {c.hidden_size}, heads {c.num_attention_heads}, q_lora {c.q_lora_rank}, "
          f"nope {c.qk_nope_head_dim} + rope {c.qk_rope_head_dim}, v {c.v_head_dim}, vocab {c.vocab_size}, "
          f"{args.dtype} weights, {args.cache_dtype} KV cache; built in {time.perf_counter() - t0:.1f} s", flush=True)

    # every request of stage 3 is sized before any work: a request that does not fit stops here
    if args.sweep:
        requests = [_prompt_lens(p, b, ragged=False) for b in args.sweep_batches for p in args.sweep]
        tree, what = max(args.sweep_budgets) + 1, "--sweep/--sweep-batches/--sweep-budgets/--steps"
    else:
        requests, tree, what = [_prompt_lens(args.prefix, args.batch)], args.budget + 1, "--prefix/--batch/--steps"
    try:
        for lens in requests:
            memory_plan(runner, lens, args.steps, tree, args.page_size).check()
    except RequestTooLarge as e:
        raise UsageError(f"arguments {what}: {e}") from None

    # stage 2
    print("== stage 2: numerics, one verify step vs HF DeepseekV3 (eager, 4-D tree mask) ==", flush=True)
    tie_tol = 0.0
    for kernel in kernels:
        runner.kernel = kernel
        n = numerics_check(runner, args.seed, prefix_len=200 if cuda else 20)
        tie_tol = max(tie_tol, near_tie_tolerance(n["engine_err"], n["hf_err"]))
        print(numerics_line(n), flush=True)
        failures += not n["ok"]
        report.setdefault("numerics", []).append(n)
    report["tie_tol"] = tie_tol
    print(f"near-tie tolerance for the lossless checks: 2 x 2 x (engine err + max(engine err, HF err)) "
          f"= {tie_tol:.2e}")

    # stage 3
    with _Bars(not args.no_progress) as bars:
        if args.sweep:
            print(f"== stage 3: sweep, batches {args.sweep_batches} x contexts {args.sweep}, {args.steps} "
                  f"tokens/sequence, plain and SYNTHETIC drafter a={args.agreement:g} at budgets "
                  f"{sorted(args.sweep_budgets)}, depth {args.depth} ==", flush=True)
            def save(rows):  # the JSON so far, marked incomplete until the sweep ends
                args.json.write_text(json.dumps(report | {"sweep": rows, "sweep_complete": False}, indent=2,
                                                default=str))

            rows, ok = _sweep(runner, args, kernels, bars, tie_tol, save if args.json else None)
            failures += not ok
            report["sweep"] = rows
            report["sweep_complete"] = True
            if args.plot:
                title = (f"kdtree demo --sweep: {model_name}, {args.dtype}; {args.steps} tokens/sequence, SYNTHETIC "
                         f"drafter a={args.agreement:g}, depth {args.depth}; {machine_line(machine_info(device))}")
                print(f"wrote {write_sweep_plot(args.plot, rows, title)}")
        else:
            lens = requests[0]
            prompts = _prompts(lens, c.vocab_size, args.seed)
            print(f"== stage 3: speculative decoding, prompts {lens}, {args.steps} new tokens each, "
                  f"DDTree budget {args.budget}, depth {args.depth} ==", flush=True)
            hf = None
            if cuda and not args.no_hf_check and max(lens) > HF_REFERENCE_MAX_TOKENS_CUDA:
                print(f"HF reference skipped: prompts over {HF_REFERENCE_MAX_TOKENS_CUDA} tokens faulted inside HF's "
                      f"forward on CUDA; losslessness is checked against plain decoding", flush=True)
            elif not args.no_hf_check:
                try:
                    hf, hf_s = hf_reference(model, prompts, args.steps, device, bars)
                    print(f"HF reference: model.generate(do_sample=False) per sequence, {hf_s:.1f} s", flush=True)
                except (RuntimeError, torch.OutOfMemoryError) as e:
                    print(f"HF reference unavailable at this size ({type(e).__name__}: {str(e)[:200]}); "
                          f"losslessness is checked against plain decoding only", flush=True)
                    if cuda:
                        torch.cuda.empty_cache()
            drafters = ("ngram", "synthetic") if args.drafter == "both" else (args.drafter,)
            rows = run_decoding(runner, args, kernels, prompts, bars, hf, tie_tol, drafters)
            report["runs"] = rows
    if not args.sweep:
        _print_table(rows, f"decode: {len(prompts)} sequences {lens}, {args.steps} tokens each "
                           f"(speedup = tok/s over plain decoding with the same kernel)")
        print("losslessness:")
        for r in rows:
            print(f"  [{r['kernel']}] {r['drafter']}:")
            if r["lossless_vs_plain"]:
                print(f"      vs plain decoding: {r['lossless_vs_plain']}")
            if r["lossless_vs_hf"]:
                print(f"      vs HF generate:    {r['lossless_vs_hf']}")
            if r["split_vs_run"]:
                print(f"      phase-split run vs this run: {r['split_vs_run']}")
            failures += not r["ok"]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    print("demo: " + ("all checks PASS" if failures == 0 else f"{failures} check(s) FAIL"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
