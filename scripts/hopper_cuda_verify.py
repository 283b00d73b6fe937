"""Checks of the Hopper CUDA kernel (``kdtree_engine.verify.hopper_cuda``; ``hopper_cuda.cu``) built
with nvcc ``--flags`` (its ``KD_*`` variants), on a plan's segments through the module's ``prepare``,
against the float64 reference (docs/perf_log.md, session 30).

    PYTHONPATH=src python3 scripts/hopper_cuda_verify.py [--cases 40] [--small] [--flags=-DKD_TMA=0]
    PYTHONPATH=src python3 scripts/ab_hopper.py cuda [cuda:FLAGS ...] --shapes ...

The first form checks it on a pipeline case (two segments of several pairs on one program; with
``--small`` too), eleven named cases, simplest first, then on random ragged batches (the
GPU suite's kinds of awkward cases: bf16 and fp16, page sizes 1 to 128, 1 to 128 heads, trees of 1
to 300 nodes, prefixes of 0 to 5,000 positions, NaN in every pool row no sequence uses, repeated
calls bitwise equal) and prints a PASS / FAIL line per case, half of them on grids of 1-5 programs
(several segments a program) and half with the library's combine kernel instead of the kernel's own
merge; built with ``KD_WATCHDOG`` (a thread that polls an mbarrier phase 2^26 times says which
barrier and traps, so a protocol error fails at once instead of hanging). The second times it beside
the Gluon kernel (``ab_hopper.py``: same plans, the reference check, NaN partials before the first
call, graph replay); ``ab_hopper.py`` loads a ``cuda[:FLAGS]`` variant as :class:`CudaKernel`.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import sys

import torch

from ab_hopper import planned_call  # (scripts/: this script's directory, first on sys.path when it runs)
from kdtree_engine import reference
from kdtree_engine.testing import TOLERANCES, CaseSpec, build_case, chain_tree, compare, random_tree
from kdtree_engine.verify import combine, hopper_cuda
from kdtree_engine.verify.plan import plan_verify


class CudaKernel:
    """The kernel built with nvcc ``flags``, as a module with :func:`kdtree_engine.verify.hopper.prepare`'s
    signature, and its watchdog (``KD_WATCHDOG`` builds)."""

    def __init__(self, flags: str = ""):
        self.flags = flags
        self._so = hopper_cuda.library(flags)
        self._watchdog = None

    def prepare(self, q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan):
        return hopper_cuda.prepare(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan,
                                   flags=self.flags)

    def arm_watchdog(self) -> None:
        """Give a ``KD_WATCHDOG`` build words to say which wait got stuck (pinned host memory: still
        readable after the trap, which ends the process's CUDA context)."""
        self._watchdog = torch.zeros(5, dtype=torch.int32, pin_memory=True)
        self._so.kd_verify_watchdog.argtypes = [ctypes.c_void_p]
        if self._so.kd_verify_watchdog(self._watchdog.data_ptr()):
            raise RuntimeError("kd_verify_watchdog failed")

    def watchdog_report(self) -> str:
        """What a fired watchdog wrote: the CTA, thread, barrier and parity of the wait ('' if none fired)."""
        if self._watchdog is None or not int(self._watchdog[0]):
            return ""
        _, cta, thread, offset, parity = (int(x) for x in self._watchdog)
        offsets = (ctypes.c_int * 4)()
        self._so.kd_verify_barrier_offsets(offsets)
        k_full, k_empty, q_full, q_empty = offsets
        if offset >= q_empty:
            name = "q_empty"
        elif offset >= q_full:
            name = "q_full"
        else:
            base, kind = (k_empty, "k_empty") if offset >= k_empty else (k_full, "k_full")
            name = f"{kind}[stage {(offset - base) // 8 // 9}][chunk {(offset - base) // 8 % 9}]"
        role = "producer" if thread >= 256 else f"math warpgroup {thread // 128}"
        return f"watchdog: CTA {cta} thread {thread} ({role}) stuck on {name}, parity {parity}"


def targeted_cases() -> list[CaseSpec]:
    """Named cases, simplest first, that each add one thing to the one before (a first failure says
    which): a tile alone, a pair, the clean steps, page sizes 1 and 16, ragged batches, one key, no
    prefix, a 1,024-node tree, 128 heads at a long prefix, a wide mask, fp16."""
    gen = torch.Generator().manual_seed(7)
    cases = [
        ("one-tile", 16, [40], [chain_tree(9)], 64),  # 49 keys: one tile, the pair's second missing
        ("one-pair", 16, [100], [chain_tree(9)], 64),
        ("clean-steps", 16, [1000], [chain_tree(9)], 64),
        ("page1", 16, [1000], [random_tree(9, gen)], 1),
        ("page16-ragged", 6, [1000, 5, 63, 2000], [random_tree(17, gen), random_tree(3, gen), [-1],
                                                   random_tree(40, gen)], 16),
        ("one-key", 1, [0], [[-1]], 64),
        ("no-prefix", 3, [0], [random_tree(33, gen)], 7),
        ("1024-nodes", 4, [3000], [random_tree(1024, gen)], 16),
        ("h128-long", 128, [20000], [random_tree(33, gen)], 1),
        ("wide-mask", 2, [11], [random_tree(5, gen)], 64),
        ("fp16", 8, [1000], [random_tree(17, gen)], 16),
    ]
    return [CaseSpec(name=name, num_heads=H, prefix_lens=prefixes, trees=trees, page_size=page, seed=i,
                     extra_mask_words=2 if name == "wide-mask" else 0, dtype="fp16" if name == "fp16" else "bf16")
            for i, (name, H, prefixes, trees, page) in enumerate(cases)]


def pipeline_case() -> CaseSpec:
    """Two sequences of 8 and 5 KV tiles at pages of 64 on one program: two segments of several pairs in one
    CTA, whose pairs after the first are TMA pairs but the second's last (a partial tile, gathered), so the
    K stages' barriers go through every hand-over (producer and, with KD_CONSUMER_TMA, the math warpgroups'
    own refills) and their phases carry across segments; small enough for the sanitizers."""
    gen = torch.Generator().manual_seed(11)
    return CaseSpec(name="pipeline", num_heads=3, prefix_lens=[503, 300], trees=[chain_tree(9), random_tree(5, gen)],
                    page_size=64, seed=11)


def random_case(rng: random.Random, seed: int, small: bool = False) -> CaseSpec:
    """One awkward batch: ragged prefixes and trees, a random page size and head count (``small``: at
    most 3 sequences of 33 nodes, 200 prefix positions and 16 heads, for the sanitizers)."""
    B = rng.choice([1, 2, 3] if small else [1, 1, 2, 3, 5])
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(rng.choice([1, 2, 7, 9, 16, 33] + ([] if small else [64, 100, 300])), gen) for _ in range(B)]
    prefixes = [rng.choice([0, 1, 63, 64, 65, 127, 200] + ([] if small else [1000, 4097])) for _ in range(B)]
    return CaseSpec(name=f"case{seed}", num_heads=rng.choice([1, 3, 16] + ([] if small else [64, 128])),
                    prefix_lens=prefixes, trees=trees, page_size=rng.choice([1, 7, 16, 64, 128]), seed=seed,
                    extra_mask_words=rng.choice([0, 1]), dtype=rng.choice(["bf16", "bf16", "fp16"]))


def check(kernel: CudaKernel, spec: CaseSpec, num_programs: int | None, fused: bool) -> bool:
    """``spec`` through the kernel on a fresh plan (partials NaN) against the float64 reference, its
    splits merged by itself (``fused``) or by the combine kernel; a second call must be bitwise equal."""
    c = build_case(spec, "cuda")
    T, H = c["q"].shape[:2]
    plan = plan_verify(spec.kv_lens, c["qo_indptr"].tolist(), H, "cuda", num_programs=num_programs)
    plan.tables.partial_out.fill_(float("nan"))
    plan.tables.partial_lse.fill_(float("nan"))
    out = torch.full((T, H, 512), float("nan"), device="cuda", dtype=c["q"].dtype)
    lse = torch.full((T, H), float("nan"), device="cuda", dtype=torch.float32)
    combine.FUSED_COMBINE = fused
    try:
        call = planned_call(kernel, c, plan, out, lse, sm_scale=spec.sm_scale)
    finally:
        combine.FUSED_COMBINE = True
    call()
    first = (out.clone(), lse.clone())
    call()
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(**c, sm_scale=spec.sm_scale)
    r_out = compare(out, ref_out, *TOLERANCES[spec.dtype]["out"])
    r_lse = compare(lse, ref_lse, *TOLERANCES[spec.dtype]["lse"])
    repeat = torch.equal(first[0], out) and torch.equal(first[1], lse)
    ok = r_out.ok and r_lse.ok and repeat
    worst = "" if r_out.ok and r_lse.ok else f" ({(r_lse if r_out.ok else r_out).detail})"
    print(f"{'PASS' if ok else 'FAIL'} {spec.name}: {spec.dtype} H={H} page={spec.page_size} "
          f"nodes={[len(t) for t in spec.trees]} prefix={spec.prefix_lens} programs={plan.num_programs} "
          f"{'fused' if fused else 'combine'} out {r_out} lse {r_lse}{'' if repeat else ' REPEAT DIFFERS'}{worst}",
          flush=True)
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="small batches only (for compute-sanitizer)")
    p.add_argument("--flags", default="", help="nvcc flags (-D variants of the KD_* macros)")
    a = p.parse_args()
    kernel = CudaKernel(f"{a.flags} -DKD_WATCHDOG=1".strip())  # a wait that hangs traps and says where
    kernel.arm_watchdog()
    rng = random.Random(a.seed)
    # the pipeline case, the named cases (not with --small), then the random ones: on the default grid and on a small one
    # (several segments a program: the barriers' phases across segments), merged by the kernel and by the
    # combine kernel
    runs = [(pipeline_case(), 1, True)] + ([] if a.small else [(spec, None, True) for spec in targeted_cases()])
    for i in range(a.cases):
        runs.append((random_case(rng, a.seed * 1000 + i, a.small), None if i % 2 else rng.choice([1, 2, 5]),
                     i % 4 < 2))
    failed = 0
    for spec, num_programs, fused in runs:
        try:
            failed += not check(kernel, spec, num_programs, fused)
        except RuntimeError as e:  # a trap ends the CUDA context: no further case can run
            print(f"FAIL {spec.name}: {type(e).__name__}: {e}\n{kernel.watchdog_report()}", flush=True)
            sys.exit(1)
    print(f"{len(runs) - failed} of {len(runs)} cases PASS")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
