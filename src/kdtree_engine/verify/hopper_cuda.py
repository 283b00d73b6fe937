"""Hopper (sm_90a) tree-verify kernel in CUDA C++ (``hopper_cuda.cu``), built with nvcc at first use:
a drop-in for the Gluon kernel (:mod:`.hopper`) on the same plans. Opt-in (``kernel="hopper_cuda"``):
``"auto"`` does not pick it (perf log run 47, H200, the issue-11 grid: 0.98-1.06 of the Gluon kernel's
time at batch 4 with pages of 64 from 16k, but up to 1.28 at one sequence and 1.21-1.92 at pages of one
row).

The kernel (see the head of ``hopper_cuda.cu``): one persistent CTA per program of a plan, two math
warpgroups running the two-tile step of FlashMLA's design in our own code (each warpgroup its own
KV tile and 256 of the 512 output columns, P exchanged through shared memory, the pairs of clean
prefix tiles with no mask code and no branch around a wgmma) and a producer warpgroup loading Q
and KV rows through the page table (pairs of whole tiles by TMA where pages hold them, otherwise
gathered by cp.async: any page size; rows past a segment's end zero-filled); the tree mask on the
tiles that reach the tree nodes or the segment's end only; the split row blocks merged by the
kernel itself after a grid barrier where the library's kernels fuse the merge
(:func:`~.combine.fuses`), else by the combine kernel; a one-sequence step scheduled by the kernel
itself from the device lengths where the plan says so (``plan.in_kernel``), as the other planned
kernels do. bf16 and fp16.

Why CUDA C++ next to the Gluon kernel: the step in Gluon stays ~7% slower than FlashMLA's at long
context after runs 23-44 measured every structural change Gluon can express; a CUDA C++ step with
FlashMLA's loop layout came within 2-3% of FlashMLA (run 45), and TMA multicast across a cluster
cannot be expressed in Gluon 3.6 at all.

The build: ``nvcc`` with :data:`NVCC_TARGET` (``-O3``, sm_90a) and ``-shared`` of ``hopper_cuda.cu`` into
a shared library loaded through ctypes (no torch headers: a ~10 s build, independent of the Python and
torch ABI), cached by the hash of the source, the nvcc flags and nvcc's version in ``$KDTREE_CACHE_DIR`` (default
``~/.cache/kdtree_engine``); it says on stderr when it builds. nvcc is ``$KDTREE_NVCC``, else the one
on ``PATH``, else ``$CUDA_HOME/bin/nvcc``. Without one, ``kernel="hopper_cuda"`` raises a
``ValueError`` saying so (and a list of the kernels a device runs leaves it out); a failed build
raises :class:`BuildError` with nvcc's message.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .combine import LOG2E, combine_launch, fuses
from .launch import current_device, current_stream

__all__ = ["BuildError", "Params", "available", "compiler", "library", "prepare", "supports_out"]

SOURCE = Path(__file__).with_suffix(".cu")
HEADER = SOURCE.with_name("hopper_cuda_ptx.cuh")
NVCC_TARGET = ("-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a")  # every build's (and scripts')


class BuildError(RuntimeError):
    """The kernel could not be built (no nvcc, or nvcc failed): the message says which and how to fix it."""


class Params(ctypes.Structure):
    """The kernel's ``Params`` (``hopper_cuda.cu``), field for field: the contract's tensors and the
    plan's tables (data pointers), strides in elements, sizes, and the launch's choices."""

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
           ("f16", ctypes.c_int), ("in_kernel", ctypes.c_int), ("zero", ctypes.c_uint)])


def compiler() -> str | None:
    """The nvcc that builds the kernel: ``$KDTREE_NVCC``, else ``nvcc`` on ``PATH``, else
    ``$CUDA_HOME/bin/nvcc`` or ``/usr/local/cuda/bin/nvcc``; None when there is none."""
    given = os.environ.get("KDTREE_NVCC")
    if given:
        return given if Path(given).is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def cache_dir() -> Path:
    """Where built kernels are kept (made if missing): ``$KDTREE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kdtree_engine``, else ``~/.cache/kdtree_engine``; the temporary directory's
    ``kdtree_engine`` where that cannot be made (a read-only home)."""
    given = os.environ.get("KDTREE_CACHE_DIR")
    path = Path(given) if given else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kdtree_engine"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        path = Path(tempfile.gettempdir()) / "kdtree_engine"
        path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=None)
def library(flags: str = "") -> ctypes.CDLL:
    """The kernel built with nvcc ``flags`` (``-D`` variants of its ``KD_*`` macros), from the cache or
    built now (once; a note on stderr). Raises :class:`BuildError`."""
    nvcc = compiler()
    if nvcc is None:
        raise BuildError("the Hopper CUDA kernel is built with nvcc at first use, and no nvcc was found "
                         "(set KDTREE_NVCC or CUDA_HOME, or put nvcc on PATH)")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join((SOURCE.read_text(), HEADER.read_text(), " ".join(NVCC_TARGET), flags,
                                      version)).encode())
    path = cache_dir() / f"hopper_cuda_{digest.hexdigest()[:20]}.so"
    if not path.is_file():
        print(f"kdtree_engine: building the Hopper CUDA kernel with {nvcc} (once, ~10 s; kept in {path.parent})",
              file=sys.stderr, flush=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # then renamed: concurrent builds never mix
        cmd = [nvcc, *NVCC_TARGET, "-shared", "-Xcompiler", "-fPIC", *flags.split(), "-o", str(partial), str(SOURCE)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            partial.unlink(missing_ok=True)
            raise BuildError(f"nvcc could not build {SOURCE.name} ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
        os.replace(partial, path)
    so = ctypes.CDLL(str(path))
    so.kd_verify_launch.restype = ctypes.c_int
    so.kd_verify_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    so.kd_verify_params_bytes.restype = ctypes.c_int
    if so.kd_verify_params_bytes() != ctypes.sizeof(Params):
        raise BuildError(f"{path.name}: its Params is {so.kd_verify_params_bytes()} bytes, this module's "
                         f"{ctypes.sizeof(Params)} (a stale build: remove it)")
    return so


def available(device: torch.device | str | None = None) -> bool:
    """True when this kernel can run on ``device``: an sm_90 (Hopper) GPU and an nvcc to build it with
    (whether the build succeeds is known at the first call)."""
    if not torch.cuda.is_available() or compiler() is None:
        return False
    device = torch.device(device if device is not None else "cuda")
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def supports_out(out: torch.Tensor) -> bool:
    """True when ``out`` takes the kernel's 4-byte stores of two output columns: 4-byte aligned, its
    two outer strides even (the contract allows any; other layouts need another kernel)."""
    return out.data_ptr() % 4 == 0 and out.stride(0) % 2 == 0 and out.stride(1) % 2 == 0


class _Launch:
    """One call signature's launches on one plan: the kernel on the plan's programs (a ctypes call,
    its ``Params`` laid out once and its eight tensor pointers set per call), then the combine kernel
    unless the kernel merges the splits itself (``merge`` None)."""

    __slots__ = ("_so", "_params", "_programs", "_merge")

    def __init__(self, so, params: Params, num_programs: int, merge):
        self._so, self._params, self._programs, self._merge = so, params, num_programs, merge

    def __call__(self, tensors: tuple, ptrs: tuple, num_groups: int | None,
                 site: tuple[int, int] | None = None) -> tuple[int, int]:
        p = self._params
        p.q, p.kv, p.page_table, p.kv_lens, p.qo_indptr, p.tree_mask, p.out, p.lse = ptrs
        if site is None:
            device = current_device()
            site = (device, current_stream(device))
        rc = self._so.kd_verify_launch(ctypes.byref(p), self._programs, site[0], site[1])
        if rc:
            raise RuntimeError(f"the Hopper CUDA kernel's launch failed ({rc}: 1 shared memory size, 2 launch, "
                               "3 tensor map)")
        if self._merge is not None and (num_groups != 0 or torch.cuda.is_current_stream_capturing()):
            self._merge(tensors, ptrs, site)
        return site


def prepare(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan,
            flags: str = "") -> _Launch:
    """The kernel (built with nvcc ``flags``) on the plan's segments, then the merge, laid out for every
    call with the signature of these tensors: :func:`kdtree_engine.verify.hopper.prepare`'s contract
    (inputs checked against the contract and the plan; ``plan`` a
    :class:`~kdtree_engine.verify.plan.FlashTables` with 64-row blocks and tiles a multiple of 64,
    host- or device-scheduled or ``in_kernel``; q / kv_cache as
    :func:`kdtree_engine.verify.hopper.supports` (16-byte copies: checked by
    :func:`kdtree_engine.verify.op.resolve`), out :func:`supports_out` (checked here)). Raises
    :class:`BuildError` when the kernel cannot be built."""
    if not supports_out(out):
        raise ValueError("kernel='hopper_cuda' needs out 4-byte aligned with even outer strides "
                         "(see kdtree_engine.verify.hopper_cuda.supports_out)")
    so = library(flags)
    fused = fuses(plan, q.device)  # where the library's kernels merge their splits themselves, so does this one
    ptr = lambda t: t.data_ptr()  # noqa: E731
    params = Params(
        ptr(q), ptr(kv_cache), ptr(page_table), ptr(kv_lens), ptr(qo_indptr), ptr(tree_mask), ptr(out), ptr(lse),
        ptr(plan.prog_first_seg), *(ptr(t) for t in plan.segment_rows), ptr(plan.partial_out), ptr(plan.partial_lse),
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), *page_table.stride(), kv_lens.stride(0),
        qo_indptr.stride(0), *tree_mask.stride(), out.stride(0), out.stride(1), *lse.stride(),
        *(ptr(t) for t in plan.group_rows), ptr(plan.group_count), ptr(plan.grid_barrier),
        kv_cache.shape[0] * kv_cache.shape[1], q.shape[1], kv_cache.shape[1], tree_mask.shape[1], sm_scale * LOG2E,
        0, int(fused), int(q.dtype == torch.float16), int(plan.in_kernel), 0)
    return _Launch(so, params, plan.num_programs, None if fused else combine_launch(q, out, lse, qo_indptr, plan))
