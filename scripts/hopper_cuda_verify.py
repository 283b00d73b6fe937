"""Spike, second step: the Hopper verify kernel's whole contract in CUDA C++
(``scripts/hopper_cuda_verify.cu``: tree masks, page tables of any page size, ragged segments and
split partials on the step of ``scripts/hopper_cuda_step.cu``), built with nvcc and launched through
ctypes on a plan's segments, the splits merged in the kernel after a grid barrier where the library's
kernels do so (``combine.fuses``), else by the library's combine kernel (docs/perf_log.md).

    PYTHONPATH=src python3 scripts/hopper_cuda_verify.py [--cases 40] [--small] [--flags=-DKD_TMA=1]
    PYTHONPATH=src python3 scripts/ab_hopper.py cuda [cuda:FLAGS ...] --shapes ...

The first form checks it against the float64 reference on eleven named cases, simplest first, then on
random ragged batches (the GPU suite's kinds of awkward cases: bf16 and fp16, page sizes 1 to 128, 1
to 128 heads, trees of 1 to 300 nodes, prefixes of 0 to 5,000 positions, NaN in every pool row no
sequence uses, repeated calls bitwise equal) and prints a PASS / FAIL line per case, half of them on
grids of 1-5 programs (several segments a program) and half with the library's combine kernel
instead of the kernel's own merge; built with ``KD_WATCHDOG`` (a thread that polls an mbarrier phase
2^26 times says which barrier and traps, so a protocol error fails at once instead of hanging).
The second times it beside the Gluon kernel (``ab_hopper.py``: same plans, the reference check, NaN
partials before the first call, graph replay).

This module is also what ``ab_hopper.py`` loads for a ``cuda`` variant: :class:`CudaKernel` has the
Hopper module's ``prepare``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kdtree_engine import reference
from kdtree_engine.testing import TOLERANCES, CaseSpec, build_case, chain_tree, compare, random_tree
from kdtree_engine.verify import combine, hopper
from kdtree_engine.verify.plan import plan_verify

SOURCE = Path(__file__).with_suffix(".cu")
HEADER = SOURCE.with_name("hopper_cuda_ptx.cuh")
LOG2E = 1.4426950408889634


class Params(ctypes.Structure):
    """The kernel's ``Params`` (hopper_cuda_verify.cu), field for field."""

    _fields_ = ([(name, ctypes.c_void_p) for name in (
        "q", "kv", "page_table", "kv_lens", "qo_indptr", "tree_mask", "out", "lse", "prog_first_seg", "seg_seq",
        "seg_row0", "seg_kv_start", "seg_kv_end", "seg_partial", "partial_out", "partial_lse")]
        + [(name, ctypes.c_longlong) for name in (
            "q_st", "q_sh", "kv_sp", "kv_ss", "pt_s0", "pt_s1", "kl_s", "qo_s", "mt_s", "mw_s", "o_st", "o_sh", "l_st",
            "l_sh")]
        + [(name, ctypes.c_void_p) for name in (
            "group_seq", "group_row0", "group_first", "group_splits", "group_count", "grid_barrier")]
        + [("kv_rows", ctypes.c_longlong), ("heads", ctypes.c_int), ("page_size", ctypes.c_int),
           ("mask_words", ctypes.c_int), ("scale_log2", ctypes.c_float), ("tma", ctypes.c_int), ("fuse", ctypes.c_int),
           ("f16", ctypes.c_int)])


def build(flags: str = "") -> ctypes.CDLL:
    """The kernel built with ``flags`` (cached by source and flags in the temporary directory)."""
    digest = hashlib.sha256((SOURCE.read_text() + HEADER.read_text() + flags).encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"kdtree_cuda_verify_{digest}.so"
    if not lib.exists():
        cmd = ["nvcc", "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler",
               "-fPIC", "-Xptxas", "-v", *flags.split(), "-o", str(lib), str(SOURCE)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        report = [line.strip() for line in r.stderr.splitlines()
                  if any(word in line for word in ("registers", "spill", "error"))]
        print(f"cuda ({flags or 'no flags'}): " + "; ".join(report), flush=True)
        r.check_returncode()
    so = ctypes.CDLL(str(lib))
    so.kd_verify_launch.restype = ctypes.c_int
    so.kd_verify_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    so.kd_verify_params_bytes.restype = ctypes.c_int
    if so.kd_verify_params_bytes() != ctypes.sizeof(Params):
        raise RuntimeError(f"Params: {so.kd_verify_params_bytes()} bytes in the kernel, {ctypes.sizeof(Params)} here")
    return so


class _Launch:
    """One call signature's launches: the kernel on the plan's programs, then the combine kernel unless
    the kernel merges the splits itself (``merge`` None)."""

    def __init__(self, so, params: Params, num_programs: int, merge):
        self._so, self._params, self._programs, self._merge = so, params, num_programs, merge

    def __call__(self, tensors, ptrs, num_groups) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        rc = self._so.kd_verify_launch(ctypes.byref(self._params), self._programs, stream)
        if rc:
            raise RuntimeError(f"kd_verify_launch failed ({rc}: 1 shared memory size, 2 launch, 3 tensor map)")
        if self._merge is not None and (num_groups != 0 or torch.cuda.is_current_stream_capturing()):
            self._merge(tensors, ptrs)


class CudaKernel:
    """The kernel as a module with :func:`kdtree_engine.verify.hopper.prepare`'s signature."""

    def __init__(self, flags: str = ""):
        self.flags = flags
        self._so = build(flags)
        self._watchdog = None

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

    def prepare(self, q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan) -> _Launch:
        if plan.in_kernel:
            raise ValueError("plan: the CUDA spike runs host-scheduled plans only (not the one-sequence schedule)")
        if not hopper.supports_plan(plan.config) or not hopper.supports(q, kv_cache):
            raise ValueError("plan / q / kv_cache: not a layout the Hopper kernels take")
        if (q.stride(2) != 1 or kv_cache.stride(2) != 1 or out.stride(2) != 1 or out.stride(1) % 8 or out.stride(0) % 8
                or out.data_ptr() % 16):
            raise ValueError("q, kv_cache, out: rows must be contiguous (out's 16-byte aligned)")
        # the kernel merges the splits itself where the library's kernels do (combine.fuses: a GPU, at most one
        # program an SM)
        fused = combine.fuses(plan, q.device)
        ptr = lambda t: t.data_ptr()  # noqa: E731
        seg = plan.segment_rows
        params = Params(
            ptr(q), ptr(kv_cache), ptr(page_table), ptr(kv_lens), ptr(qo_indptr), ptr(tree_mask), ptr(out), ptr(lse),
            ptr(plan.prog_first_seg), *(ptr(t) for t in seg), ptr(plan.partial_out), ptr(plan.partial_lse),
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), *page_table.stride(), kv_lens.stride(0),
            qo_indptr.stride(0), *tree_mask.stride(), out.stride(0), out.stride(1), *lse.stride(),
            *(ptr(t) for t in plan.group_rows), ptr(plan.group_count), ptr(plan.grid_barrier),
            kv_cache.shape[0] * kv_cache.shape[1], q.shape[1], kv_cache.shape[1], tree_mask.shape[1], sm_scale * LOG2E,
            0, int(fused), int(q.dtype == torch.float16))
        return _Launch(self._so, params, plan.num_programs,
                       None if fused else combine.combine_launch(q, out, lse, qo_indptr, plan))


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
    tensors = (c["q"], c["kv_cache"], c["page_table"], c["kv_lens"], c["qo_indptr"], c["tree_mask"], out, lse)
    combine.FUSED_COMBINE = fused
    try:
        launch = kernel.prepare(*tensors[:6], spec.sm_scale, out, lse, plan.tables)
    finally:
        combine.FUSED_COMBINE = True
    launch(tensors, tuple(t.data_ptr() for t in tensors), plan.num_groups)
    first = (out.clone(), lse.clone())
    launch(tensors, tuple(t.data_ptr() for t in tensors), plan.num_groups)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(*tensors[:6], spec.sm_scale)
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
    # the named cases (not with --small), then the random ones: on the default grid and on a small one
    # (several segments a program: the barriers' phases across segments), merged by the kernel and by the
    # combine kernel
    runs = [] if a.small else [(spec, None, True) for spec in targeted_cases()]
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
