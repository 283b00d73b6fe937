"""The kernels behind one name: a launch preparer per kernel, and the ``kdtree::verify_attention`` op.

The layer above the kernels and below the API: imports the contract and the plan at import time,
the kernel modules (and so Triton) only when a preparer is first asked for.

The op lets ``torch.compile(fullgraph=True)`` trace a model step through verify without a graph
break: it takes the caller's tensors, the plan's tables and partial buffers (as tensors: a new
plan changes their content, never their shapes, so nothing recompiles) and the kernel config as
ints, and returns fresh ``out [T, H, 512]`` (q's dtype) and ``lse [T, H]`` (float32). Its fake
implementation gives those shapes without running anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .contract import D_V, check_content, check_inputs
from .plan import FlashConfig, FlashTables, plan_of

__all__ = ["KERNELS", "OPT_IN_KERNELS", "available_kernels", "preparer", "launch", "resolve", "verify_attention_op"]

KERNELS = ("naive", "flash", "hopper")
# kernels that run only where named (never "auto", nor a list of the kernels a device runs): the CUDA
# C++ Hopper kernel, slower than the Gluon one at one sequence and at pages of one row (perf log run 47)
OPT_IN_KERNELS = ("hopper_cuda",)
_PREPARERS: dict[str, Callable] = {}


def preparer(kernel: str) -> Callable:
    """The ``prepare(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse,
    plan)`` function of ``kernel`` (imports its module, and Triton, on first use): it returns
    ``run(tensors, ptrs, num_groups, site=None)``, the kernel's launches for every call with the
    signature of its tensors (dtypes, 16-byte alignment, shapes, strides; inputs checked), where
    ``tensors`` are that call's eight contract tensors, ``ptrs`` their data pointers,
    ``num_groups`` the plan's split groups when the host knows them (else None) and ``site`` where
    the launch before went (see :class:`~kdtree_engine.verify.launch.Launch`; None: read when needed)."""
    prepare = _PREPARERS.get(kernel)
    if prepare is not None:
        return prepare
    if kernel == "naive":
        from .triton_naive import prepare
    elif kernel == "flash":
        from .triton_flash import prepare
    elif kernel == "hopper":
        from .hopper import prepare
    elif kernel == "hopper_cuda":
        from .hopper_cuda import prepare
    else:
        raise ValueError(f"kernel must be one of {KERNELS + OPT_IN_KERNELS}, got {kernel!r}")
    _PREPARERS[kernel] = prepare
    return prepare


def launch(kernel: str, q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale: float, out, lse,
           plan: FlashTables | None) -> None:
    """One call of ``kernel`` (a name of :data:`KERNELS`) on checked inputs: writes ``out`` and ``lse``."""
    tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
    run = preparer(kernel)(*tensors[:6], sm_scale, out, lse, plan)
    run(tensors, tuple([t.data_ptr() for t in tensors]), None if plan is None else plan.num_groups)


@functools.lru_cache(maxsize=None)
def _hopper_runs_on(device: torch.device) -> bool:
    from .hopper import available

    return available(device)


@functools.lru_cache(maxsize=None)
def _hopper_cuda_runs_on(device: torch.device) -> bool:
    from .hopper_cuda import available

    return available(device)


def available_kernels(device: torch.device | str, *, opt_in: bool = False) -> tuple[str, ...]:
    """The kernels that run on ``device``: naive and flash everywhere (the CPU through Triton's
    interpreter), hopper on an sm_90 GPU with Triton's Gluon; with ``opt_in`` also those of
    :data:`OPT_IN_KERNELS` that run there (hopper_cuda: an sm_90 GPU and an nvcc to build it with;
    whether the build succeeds is known at its first call)."""
    device = torch.device(device)
    kernels = ("naive", "flash")
    if device.type == "cuda" and torch.cuda.is_available():
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        kernels += ("hopper",) * _hopper_runs_on(device)
        kernels += ("hopper_cuda",) * (opt_in and _hopper_cuda_runs_on(device))
    return kernels


def resolve(kernel: str, q: torch.Tensor, kv_cache: torch.Tensor, config: FlashConfig | None) -> str:
    """The kernel a call runs. ``"auto"``: ``"hopper"`` on an sm_90 GPU with Triton's Gluon when
    the plan's tiles (``config``) and the layouts of ``q`` / ``kv_cache`` suit it (it was faster
    than the Triton flash kernel on every shape measured on the H200: docs/perf_log.md, run 14),
    else ``"flash"`` (never ``"hopper_cuda"``, opt-in: :data:`OPT_IN_KERNELS`). A named
    kernel is returned as it is, ``"hopper"`` / ``"hopper_cuda"`` after checking that it runs on this
    device, suits the plan's tiles and the layouts (``ValueError`` otherwise)."""
    if kernel in ("hopper", "hopper_cuda"):
        cuda = kernel == "hopper_cuda"
        if not (q.is_cuda and (_hopper_cuda_runs_on if cuda else _hopper_runs_on)(q.device)):
            needs = "an nvcc to build it (see kdtree_engine.verify.hopper_cuda)" if cuda else "Triton's Gluon"
            raise ValueError(f"kernel={kernel!r} needs an sm_90 GPU and {needs}; q is on {q.device}"
                             + ("" if cuda else " (kernel='auto' picks it where it runs)"))
        from .hopper import BLOCK_M, BLOCK_N, supports, supports_plan

        if not supports_plan(config):
            # block_m: the partial buffers' rows; block_n: segments start on a BLOCK_N boundary, so a
            # tile never straddles a page when the page size is a multiple of BLOCK_N (one page id per tile)
            raise ValueError(f"kernel={kernel!r} needs a plan with block_m={BLOCK_M} and block_n a multiple of "
                             f"{BLOCK_N}, got {config.block_m}x{config.block_n}")
        if not supports(q, kv_cache):
            raise ValueError(f"kernel={kernel!r} needs q and kv_cache 16-byte aligned with outer strides that are "
                             "multiples of 16 elements (see kdtree_engine.verify.hopper.supports)")
        return kernel
    if kernel != "auto":
        return kernel
    if q.is_cuda and config is not None and _hopper_runs_on(q.device):
        from .hopper import supports, supports_plan

        if supports_plan(config) and supports(q, kv_cache):
            return "hopper"
    return "flash"


@torch.library.custom_op("kdtree::verify_attention", mutates_args=("grid_barrier", "partial_out", "partial_lse"))
def verify_attention_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor,
    prog_first_seg: torch.Tensor,
    segments: torch.Tensor,
    groups: torch.Tensor,
    group_count: torch.Tensor,
    grid_barrier: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    sm_scale: float,
    kernel: str,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    plan_serial: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-verify attention on checked inputs with a plan's tables (see :class:`FlashTables`;
    the naive kernel ignores them); ``kernel`` may be ``"auto"`` (see :func:`resolve`). Returns
    ``(out [T, H, 512] q.dtype, lse [T, H] float32)``.
    ``plan_serial``: the :attr:`~kdtree_engine.verify.plan.VerifyPlan.serial` of the plan the
    tables belong to; the call is checked against its host lengths here, when it runs
    (:meth:`~kdtree_engine.verify.plan.VerifyPlan.check_fits`: the rows, the mask and the page
    table wide enough), not where it is traced. On the CPU it checks the contents too
    (:func:`~.contract.check_content`; the host's data: no sync).
    The plan's host count of split groups, read here too, picks the form of the merge (a fused
    kernel, or the combine kernel after it: see :mod:`.combine`; without the plan, the combine
    kernel always runs where the kernel does not merge its splits itself); ``grid_barrier`` is the
    word of a fused kernel's grid barrier (see :mod:`.combine`)."""
    T, H, _ = q.shape
    plan = plan_of(plan_serial)
    if plan is not None:
        plan.check_fits(T, tree_mask.shape[1], page_table.shape[1] * kv_cache.shape[1])
    if not q.is_cuda:  # as VerifyAttention.run on the CPU (the host's data: no sync)
        check_content(page_table, kv_lens, qo_indptr, tree_mask,
                      check_inputs(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask))
    out = q.new_empty(T, H, D_V)
    lse = q.new_empty(T, H, dtype=torch.float32)
    tables = FlashTables(FlashConfig(block_m, block_n, num_warps, num_stages), prog_first_seg, segments, groups,
                         group_count, grid_barrier, partial_out, partial_lse,
                         num_groups=None if plan is None else plan.num_groups,
                         segment_rows=segments.unbind(0), group_rows=groups.unbind(0))
    launch(resolve(kernel, q, kv_cache, tables.config), q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask,
           sm_scale, out, lse, tables)
    return out, lse


@verify_attention_op.register_fake
def _(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, prog_first_seg, segments, groups, group_count,
      grid_barrier, partial_out, partial_lse, sm_scale, kernel, block_m, block_n, num_warps, num_stages, plan_serial=-1):
    T, H, _ = q.shape
    return q.new_empty(T, H, D_V), q.new_empty(T, H, dtype=torch.float32)
