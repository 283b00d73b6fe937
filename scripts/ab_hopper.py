"""A/B of variants of the Hopper kernel against this tree's, in one process on the same plans.

    PYTHONPATH=src python scripts/ab_hopper.py VARIANT [VARIANT ...] [--shapes 64x33x4x131072x64,...]
        [--rounds 3] [--flashmla DIR] [--clock-seconds 2] [--json ab.json]

``VARIANT``: a whole ``verify/hopper.py`` (e.g. ``git show hopper-pbuf:src/kdtree_engine/verify/hopper.py
> ab/hopper_pbuf.py``, a path that travels to the GPU machine with the working tree), named by its
file stem; or ``FILE.diff:NAME``, the section ``### variant NAME`` (or ``### ablation NAME``) of a
file of unified diffs against ``verify/hopper.py`` (``docs/results/hopper_variants_run29.diff``)
applied to this tree's kernel (stops if a hunk does not fit: the kernel changed); or ``fused`` /
``unfused``, this tree's kernel merging the splits of every group count itself / none (the combine
kernel after it; ``hopper.FUSED_MERGE_MAX_GROUPS`` decides between the two for the base); or ``kept``,
this tree's kernel with its fused merge keeping the partials in L2 (``hopper.DISCARD_PARTIALS`` off); or ``cuda`` /
``cuda:FLAGS``, the CUDA C++ kernel (``kdtree_engine.verify.hopper_cuda``) built with nvcc ``FLAGS``
(e.g. ``cuda:-DKD_TMA=0``); or ``schedule:NAME``, this tree's kernel on a plan of the same lengths
with the schedule ``NAME`` forced (``parts``, ``whole:140``, ...: ``tune_flash.plan_with_schedule``;
skipped, with a line saying so, at a shape whose work has no such candidate; its outputs differ
from the base's in rounding where the splits differ); or ``nomerge``, this tree's kernel leaving its
KV splits unmerged (the split form without the combine kernel after it: FAIL wherever the plan
splits, by design), so that ``unfused`` less ``nomerge`` is what the merge costs in place, the most
any other merge could save there. Per shape, this
tree's kernel and every variant are prepared on the same plan (a ``schedule:`` variant on its own)
and inputs (own outputs) through
their own ``prepare`` (kernel + combine), each checked against the float64 reference on the first
sequence (bf16 tolerances) after its first call, made on NaN partials (the kernels share the plan's
partial buffers: a kernel whose merge read partials before its own writes were visible would
otherwise read the last kernel's equal values and pass, as run 44's ``tmapart`` did here while the
GPU suite failed it), and again after its last replay (``REPLAYS DIFFER``
where those two outputs are not bitwise equal: a race), each variant's last outputs compared with
the base's (bitwise equal or not, largest difference), then all timed in turn: ``--rounds`` rounds of a
CUDA-graph replay median each (``--calls`` calls a graph, back to back), after an untimed round (the
GPU's clock settles under its power limit) and each round starting at another kernel, the fastest
round per kernel reported, so drift between calls of the machine hits all of them. Each kernel
compiles once per (heads, page size) of the shapes.
``--flashmla DIR``: FlashMLA is timed in the same rounds on each shape's work as chain trees (pages of
64 whatever the shape's page size, its own random inputs, unchecked), and every time is also printed
as a ratio to its (issue 11's measure, here on random trees, which run 43 found within 5% of chain
trees at all 48 of its shapes).
``--clock-seconds S``: after the rounds, each kernel's call (FlashMLA's too) replayed for S seconds while
``nvidia-smi`` samples the SM clock and the power draw (``clock_probe.replay_sampled``): the median
MHz and W printed beside its time, and its time in thousands of cycles at that clock. Under the power
limit a kernel that draws more power per cycle runs at a lower clock, so two kernels' time ratio
can differ from their cycle ratio (perf log run 71 read 7-8% at 1 x 128 heads x 33 nodes from 64k keys,
not yet checked against cycles at locked clocks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).parent))
from clock_probe import replay_sampled, seconds  # noqa: E402
from hopper_timeline import module_from_source, variant_source  # noqa: E402
from tune_flash import empty_outputs, equal_step, plan_with_schedule, time_graph  # noqa: E402

from kdtree_engine import reference  # noqa: E402
from kdtree_engine.bench.flashmla import chain_call, load_flashmla_module  # noqa: E402
from kdtree_engine.testing import TOLERANCES, compare  # noqa: E402
from kdtree_engine.verify import hopper  # noqa: E402

# max_fused_groups for this tree's kernel in one merge form at every group count: fused / split + combine
MERGE_FORMS = {"fused": 1 << 30, "unfused": -1}
NO_MERGE = "nomerge"  # this tree's kernel in the split form with no combine after it (outputs unmerged)
KEPT = "kept"  # this tree's kernel, its fused merge keeping the partials it read in L2
SCHEDULE = "schedule:"  # this tree's kernel on a plan with the schedule named after it forced


class Kernel(NamedTuple):
    """One kernel of the A/B and how it is called (:func:`planned_call`'s settings)."""

    module: object  # verify/hopper.py or a variant of it, or the CUDA C++ kernel: has ``prepare``
    max_fused_groups: int | None = None  # None: the module's FUSED_MERGE_MAX_GROUPS
    discard: bool = True  # the fused merge drops the partials it read from L2
    schedule: str | None = None  # a schedule forced on a plan of its own (None: the shape's plan)
    merge: bool = True  # False: the split form alone, its partials left unmerged


SHAPES = ("64x33x4x131072x64,128x33x1x16384x64,64x9x1x131072x64,16x9x4x16384x64,128x9x4x131072x64,"
          "16x33x1x131072x64,64x33x4x16384x1")


@contextlib.contextmanager
def _settings(module, **values):
    """``module``'s attributes set to ``values`` for the block (those it has; a value None leaves its own)."""
    kept = {k: getattr(module, k) for k, v in values.items() if v is not None and hasattr(module, k)}
    for k in kept:
        setattr(module, k, values[k])
    try:
        yield
    finally:
        for k, v in kept.items():
            setattr(module, k, v)


def planned_call(module, c, plan, out, lse, max_fused_groups: int | None = None, discard: bool = True,
                 sm_scale: float = 1.0 / math.sqrt(576), merge: bool = True):
    """One planned call of ``module``'s kernel (+ combine) on the inputs ``c`` (``max_fused_groups``:
    in place of the module's ``FUSED_MERGE_MAX_GROUPS``, where it has one: the most split groups the
    kernel merges itself, see :mod:`kdtree_engine.verify.combine`; ``discard``: in place of the
    module's ``DISCARD_PARTIALS``, where it has one; ``merge`` False: the kernel's split form alone,
    its partials left unmerged, for timing only)."""
    tensors = (c["q"], c["kv_cache"], c["page_table"], c["kv_lens"], c["qo_indptr"], c["tree_mask"], out, lse)
    with _settings(module, FUSED_MERGE_MAX_GROUPS=max_fused_groups, DISCARD_PARTIALS=discard):
        launch = module.prepare(*tensors[:6], sm_scale, out, lse, plan.tables)
    ptrs = tuple(t.data_ptr() for t in tensors)
    if not merge:  # PlannedLaunch's split form (a combine follows it there, also in a graph's capture)
        return lambda: launch._split(tensors, ptrs, None)
    return lambda: launch(tensors, ptrs, plan.num_groups)


def matches(out, lse, ref_out, ref_lse) -> bool:
    """``out`` and ``lse`` within the bf16 tolerances of the float64 reference's."""
    return compare(out, ref_out, *TOLERANCES["bf16"]["out"]).ok and compare(lse, ref_lse, *TOLERANCES["bf16"]["lse"]).ok


def _spread(us: list[float]) -> str:
    """A kernel's rounds as ``+x.x%``: how far its slowest round is from its fastest (a difference
    between kernels smaller than that is within the noise of the call)."""
    return f"+{(max(us) / min(us) - 1) * 100:.1f}%"


def _clock(clock) -> str:
    """A kernel's :func:`replay_sampled` as `` [MHz, W, kcycles a call]`` ('' where not sampled)."""
    if not clock:
        return ""
    us, mhz, watts, _ = clock
    return f"  [{mhz:.0f} MHz {watts:.0f} W {us * mhz / 1e3:.1f} kcycles]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help="whole verify/hopper.py files (named by their file stem), "
                   "FILE.diff:NAME sections of a variants file, fused, unfused, nomerge, kept, cuda[:FLAGS], "
                   "schedule:NAME")
    p.add_argument("--shapes", default=SHAPES, help="H x nodes x B x prefix x page size, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=1, help="calls in each timed graph, back to back (per call: the "
                   "replay's time divided by them); more than one times a launch beside the call before it, as "
                   "the bench's graphs do (programmatic dependent launch, FlashMLA's two kernels)")
    p.add_argument("--flashmla", metavar="DIR", help="also time FlashMLA (flashmla_peer.py in DIR) in the rounds: "
                   "the shape's work as chain trees (its causal mask), pages of 64, its own inputs; every kernel's "
                   "time then also as a ratio to it")
    p.add_argument("--clock-seconds", type=seconds, default=0.0, help="also sample each kernel's SM clock and "
                   "power over this many seconds of replays after the rounds (0: not)")
    p.add_argument("--json")
    a = p.parse_args()
    fm = load_flashmla_module(a.flashmla) if a.flashmla else None
    kernels = {"base": Kernel(hopper)}
    for spec in a.variants:
        if spec in MERGE_FORMS:  # this tree's kernel merging any group count itself, or none
            kernels[spec] = Kernel(hopper, MERGE_FORMS[spec])
            continue
        if spec == NO_MERGE:
            kernels[spec] = Kernel(hopper, MERGE_FORMS["unfused"], merge=False)
            continue
        if spec == KEPT:
            kernels[spec] = Kernel(hopper, discard=False)
            continue
        if spec.startswith(SCHEDULE):
            kernels[spec] = Kernel(hopper, schedule=spec[len(SCHEDULE):])
            continue
        if spec == "cuda" or spec.startswith("cuda:"):  # the CUDA C++ kernel, a build of its -D variants
            from hopper_cuda_verify import CudaKernel

            kernels[spec] = Kernel(CudaKernel(spec[5:]))
            continue
        name, source = variant_source(spec)
        kernels[name] = Kernel(module_from_source(source, f"variant_{name}"))
    rows = []
    for text in a.shapes.split(","):
        H, n, B, prefix, ps = (int(x) for x in text.split("x"))
        c, base_plan = equal_step(H, n, B, prefix, ps)
        ref_out, ref_lse = reference(c["q"][:n], c["kv_cache"], c["page_table"][:1], c["kv_lens"][:1],
                                     c["qo_indptr"][:2], c["tree_mask"][:n])
        res, plans = {}, []
        for name, (module, max_fused_groups, discard, schedule, merge) in kernels.items():
            plan = base_plan
            if schedule is not None:
                try:
                    plan = plan_with_schedule(c["kv_lens"].tolist(), n, H, schedule)
                except ValueError as e:  # no such candidate for this shape's work
                    print(f"{text}: {name} skipped: {e}", flush=True)
                    continue
            plans.append(plan)
            out, lse = empty_outputs(c["q"])
            call = planned_call(module, c, plan, out, lse, max_fused_groups, discard, merge=merge)
            plan.tables.partial_out.fill_(float("nan"))
            plan.tables.partial_lse.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            res[name] = dict(call=call, out=out, lse=lse, ok=matches(out[:n], lse[:n], ref_out, ref_lse),
                             first=(out.clone(), lse.clone()), us=[])
        for plan in plans:  # as the plans made them (a merge reads rows never written)
            plan.tables.partial_out.zero_()
            plan.tables.partial_lse.zero_()
        if fm is not None:  # timed in the rounds as the kernels are; no check (its own inputs)
            res["flashmla"] = dict(call=chain_call(fm, H, n, B, prefix, 1.0 / math.sqrt(576), "cuda"), us=[])
        # a first round untimed, then each round in another order: after the checks' idle time the
        # GPU runs its first long kernels at a higher clock than under its power limit later (run
        # 35: the base's first round 3-11% faster than its others at 5 of 7 shapes), which a fixed
        # order gave to the first kernel alone
        names = list(res)
        for i in range(a.rounds + 1):
            for name in names[i % len(names):] + names[: i % len(names)]:
                us = time_graph(res[name]["call"], calls=a.calls) * 1e6
                if i:
                    res[name]["us"].append(us)
        for r in res.values():  # us, MHz, W, samples
            r["clock"] = replay_sampled(r["call"], a.clock_seconds) if a.clock_seconds else None
        flashmla = res.pop("flashmla") if fm is not None else None
        flashmla_us = min(flashmla["us"]) if flashmla else None
        for r in res.values():  # the last replay's outputs too, and whether they are the first call's
            r["ok"] = r["ok"] and matches(r["out"][:n], r["lse"][:n], ref_out, ref_lse)
            r["repeats"] = torch.equal(r["first"][0], r["out"]) and torch.equal(r["first"][1], r["lse"])
        base = res["base"]
        base_us = min(base["us"])
        to_flashmla = (lambda us: f"  / FlashMLA {us / flashmla_us:6.3f}") if flashmla_us else (lambda us: "")
        print(f"{text}: base {base_us:.1f} us (rounds {_spread(base['us'])}) {'PASS' if base['ok'] else 'FAIL'}"
              f"{'' if base['repeats'] else '  REPLAYS DIFFER'}{_clock(base['clock'])}"
              + (f"; FlashMLA {flashmla_us:.1f} us{_clock(flashmla['clock'])}, base{to_flashmla(base_us)}"
                 if flashmla_us else ""), flush=True)
        for name, r in res.items():
            if name == "base":
                continue
            equal = torch.equal(base["out"], r["out"]) and torch.equal(base["lse"], r["lse"])
            diff = (base["out"].float() - r["out"].float()).abs().max().item()
            row = dict(shape=text, variant=name, base_us=base_us, variant_us=min(r["us"]), base_rounds=base["us"],
                       variant_rounds=r["us"], base_ok=base["ok"], variant_ok=r["ok"], bitwise_equal=equal,
                       max_out_diff=diff, base_repeats=base["repeats"], variant_repeats=r["repeats"])
            row["ratio"] = row["variant_us"] / base_us
            row["flashmla_us"] = flashmla_us
            clocks = {"base": base["clock"], "variant": r["clock"], "flashmla": flashmla and flashmla["clock"]}
            for who, clock in clocks.items():
                if clock:
                    row[f"{who}_mhz"], row[f"{who}_watts"] = clock[1], clock[2]
            rows.append(row)
            print(f"  {name:>24} {row['variant_us']:9.1f} us  ratio {row['ratio']:6.3f}  (rounds {_spread(r['us'])})  "
                  f"{'PASS' if r['ok'] else 'FAIL'}  {'bitwise equal' if equal else f'max |diff| {diff:.3g}'}"
                  f"{'' if r['repeats'] else '  REPLAYS DIFFER'}{to_flashmla(row['variant_us'])}{_clock(r['clock'])}",
                  flush=True)
        del c, res
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
