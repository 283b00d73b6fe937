"""Public entry points of tree-verify MLA attention: the one-call function and the plan/run object.

The top layer of :mod:`kdtree_engine.verify` (contract <- plan <- kernels <- op <- api)::

    out, lse = verify_attention(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask,
                                sm_scale=None, *, kernel="auto", out=None, lse=None)

plans on every call (on a GPU with the device scheduler: one more launch, no sync; one sequence
whose KV parts fill the grid is scheduled by the kernel itself: one launch); the fast path plans
once per model step and runs per layer, FlashInfer's convention::

    attn = VerifyAttention(max_batch, max_tree_nodes, num_heads, device)
    attn.plan(kv_lens, qo_indptr)                               # once per step (host or device)
    out, lse = attn.run(q, kv_cache, page_table, tree_mask)     # per layer

See :func:`verify_attention` for shapes.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from ..backend import interpreting
from ..masks import MAX_TREE_NODES
from .contract import (D_QK, D_V, InputCheck, Signature, VerifyInputs, check_content, check_inputs, check_lengths,
                       host_lengths)
from .op import KERNELS, OPT_IN_KERNELS, launch, preparer, resolve, verify_attention_op
from .plan import HOPPER_COSTS, TRITON_COSTS, FlashConfig, VerifyPlan

__all__ = ["verify_attention", "VerifyAttention", "KERNELS"]


_KERNEL_NAMES = ("auto",) + KERNELS + OPT_IN_KERNELS
# the host schedule's cost model of a kernel named at construction ("auto" and "naive": the one
# of the kernel "auto" runs on the device, plan.default_costs)
_KERNEL_COSTS = {"flash": TRITON_COSTS, "hopper": HOPPER_COSTS, "hopper_cuda": HOPPER_COSTS}
_DEFAULT_SCALE = 1.0 / math.sqrt(D_QK)
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _kernel_name(kernel) -> str:
    if kernel not in _KERNEL_NAMES:
        raise ValueError(f"kernel must be one of {_KERNEL_NAMES}; got {kernel!r}")
    return kernel


def _scale(sm_scale) -> float:
    if sm_scale is None:
        return _DEFAULT_SCALE
    try:
        scale = float(sm_scale) if isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool) else math.nan
    except OverflowError:  # an int past float's range
        scale = math.inf
    if not 0 < scale * math.log2(math.e) < _FLOAT32_MAX:  # the kernels scale by it in float32 (log2 units)
        raise ValueError(f"sm_scale must be a positive number within float32's range, got {sm_scale!r}")
    return scale


def _check_backend(device: torch.device, name: str = "q is") -> None:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} on {device}: the kernels run on a CUDA GPU, or on the CPU under Triton's interpreter")
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{name} on the CPU: the Triton kernels run there only under the interpreter; "
            "set TRITON_INTERPRET=1 before importing triton (or use kdtree_engine.reference)"
        )


# The workspaces verify_attention plans into when it is given no plan, one per (device, heads,
# stream), grown to the largest batch and tree seen (on a GPU the tree bound is T, the host knowing
# no tree size): an unplanned call costs its plan, not a workspace's allocations. Calls on one
# stream run in order, so they may share one. A workspace outgrown is kept (its int32 tables; the
# partials pass to its successor), so that a CUDA graph captured around an earlier call never reads
# freed memory; growth at least doubles the batch or the tree bound, so few are kept.
_UNPLANNED: dict[tuple, VerifyPlan] = {}
_OUTGROWN: list[VerifyPlan] = []


def _unplanned_workspace(B: int, max_nodes: int, num_heads: int, device: torch.device, stream: int) -> VerifyPlan:
    """The workspace of ``(device, num_heads, stream)`` (``stream``: the device's current raw CUDA
    stream, 0 on the CPU) holding B sequences of max_nodes tree nodes."""
    key = (device, num_heads, stream)
    ws = _UNPLANNED.get(key)
    if ws is None:
        ws = _UNPLANNED[key] = VerifyPlan(B, max_nodes, num_heads, device)
    elif B > ws.max_batch or max_nodes > ws.max_tree_nodes:
        _OUTGROWN.append(ws)
        bounds = (_grown(B, ws.max_batch, 1 << 20), _grown(max_nodes, ws.max_tree_nodes, MAX_TREE_NODES))
        ws = _UNPLANNED[key] = VerifyPlan(*bounds, num_heads, device, partials_of=ws)
    return ws


def _grown(need: int, have: int, most: int) -> int:
    """A workspace bound: ``have`` where it suffices, else ``need`` but at least twice ``have``
    where ``most`` allows."""
    return have if need <= have else max(need, min(2 * have, most))


_CHECK = InputCheck()  # verify_attention's checks by signature


def _check_plan_lengths(plan: VerifyPlan, kv_lens, qo_indptr) -> None:
    """The call's lengths equal the plan's (reads both on the host: a sync for device tensors)."""
    kv, qo = host_lengths(kv_lens, qo_indptr)
    planned = ((plan.kv_lens_host, plan.qo_indptr_host) if plan.kv_lens_host is not None
               else host_lengths(plan.kv_lens, plan.qo_indptr))
    if not (np.array_equal(kv, planned[0]) and np.array_equal(qo, planned[1])):
        raise ValueError(f"kv_lens / qo_indptr {kv.tolist()} / {qo.tolist()} are not the lengths the plan was made "
                         f"for ({planned[0].tolist()} / {planned[1].tolist()})")


def _check_plan(plan: VerifyPlan, info: VerifyInputs, device: torch.device) -> None:
    """The call's sizes against the plan's (T only when the plan knows it: a device plan does not)."""
    H, T, B = info.num_heads, info.num_rows, info.num_seqs
    if ((plan.num_heads, plan.num_seqs) != (H, B) or (plan.num_rows is not None and plan.num_rows != T)
            or plan.device != device):  # (not `not in (None, T)`: Dynamo gets that wrong for a symbolic T)
        raise ValueError(
            f"plan was built for H={plan.num_heads}, T={plan.num_rows}, B={plan.num_seqs} on {plan.device}; "
            f"got H={H}, T={T}, B={B} on {device}"
        )


class _Prepared:
    """A call signature's launches on one plan (kept in ``plan.prepared``) and the plan state its
    checks against the plan last passed for (:attr:`VerifyPlan.state`)."""

    __slots__ = ("run", "state")

    def __init__(self, run):
        self.run, self.state = run, None


def _prepared(plan: VerifyPlan, sig: Signature, kernel: str, scale: float, tensors: tuple) -> _Prepared:
    """``plan.prepared[(sig, kernel, scale, in_kernel)]``, made on first use from ``tensors`` (the call's
    eight, outputs allocated): the kernel resolved (``"auto"``: see
    :func:`~kdtree_engine.verify.op.resolve`) and its launches laid out for the signature."""
    key = (sig, kernel, scale, plan.tables.in_kernel)
    call = plan.prepared.get(key)
    if call is None:
        q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse = tensors
        name = resolve(kernel, q, kv_cache, plan.tables.config)
        run = preparer(name)(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, scale, out, lse, plan.tables)
        call = plan.keep(plan.prepared, key, _Prepared(run))
    return call


def _outputs(info: VerifyInputs, q: torch.Tensor, out, lse, ptrs: tuple):
    """``(out, lse, ptrs)`` with a fresh ``[T, H, 512]`` (q's dtype) / ``[T, H]`` float32 tensor
    for an absent output, its data pointer in ``ptrs`` (the eight tensors' pointers)."""
    if out is None:
        out = torch.empty(info.num_rows, info.num_heads, D_V, dtype=q.dtype, device=q.device)
        ptrs = (*ptrs[:6], out.data_ptr(), ptrs[7])
    if lse is None:
        lse = torch.empty(info.num_rows, info.num_heads, dtype=torch.float32, device=q.device)
        ptrs = (*ptrs[:7], lse.data_ptr())
    return out, lse, ptrs


def verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float | None = None,
    *,
    kernel: str = "auto",
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    plan=None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-verify attention for MLA (absorbed form: one latent KV head shared by all heads).

    Args:
        q: ``[T, H, 576]`` bf16 or fp16; T = all tree nodes of the batch, H in 1..128. Any strides
            with the last dimension contiguous. Columns 0..511 multiply the latent ``c_kv``,
            512..575 the rope part ``k_pe``.
        kv_cache: ``[num_pages, page_size, 576]``, q's dtype. V is ``kv_cache[..., :512]`` (the same
            rows; it is read once, never copied).
        page_table: ``[B, max_pages]`` int32; ``page_table[b, i]`` holds positions
            ``i*page_size .. (i+1)*page_size-1`` of sequence b. Entries past the pages a sequence
            uses are never read.
        kv_lens: ``[B]`` int32; KV length of sequence b = prefix P_b + its n_b tree nodes. Tree node
            j of sequence b is at position ``P_b + j`` (its KV is already in the cache).
        qo_indptr: ``[B+1]`` int32; the tree nodes of sequence b are q rows
            ``qo_indptr[b]:qo_indptr[b+1]`` (n_b >= 1, n_b <= 1024).
        tree_mask: ``[T, W]`` int32, ``W >= ceil(max n_b / 32)``: bit ``j % 32`` of word ``j // 32``
            of row t is set iff node j of t's tree is visible to t (an ancestor or itself); bits at
            or past n_b are zero. Prefix positions are visible to every node. Node order is free.
            Build it with :mod:`kdtree_engine.masks`.
        sm_scale: softmax scale; default ``1/sqrt(576)``.
        kernel: ``"naive"`` (the oracle), ``"flash"`` (Triton, portable), ``"hopper"`` (Gluon,
            sm_90 only), ``"hopper_cuda"`` (CUDA C++ built with nvcc at first use, sm_90 only, opt-in:
            :mod:`~kdtree_engine.verify.hopper_cuda`) or ``"auto"``: hopper where it runs (an sm_90
            GPU with Triton's Gluon, 16-byte aligned q / kv_cache, the default tiles), else flash;
            see :func:`~kdtree_engine.verify.op.resolve`.
        out: optional ``[T, H, 512]`` output buffer in q's dtype (last dim contiguous), written
            through its strides; it must not overlap itself or an input.
        lse: optional ``[T, H]`` float32 buffer, any non-overlapping strides.

    Every stride of page_table, kv_lens, qo_indptr and tree_mask is honoured (slices, transposes,
    broadcasts); q and kv_cache need only their last dimension contiguous.
        plan: optional :class:`~kdtree_engine.verify.plan.VerifyPlan` from
            :func:`~kdtree_engine.verify.plan_verify`, built once per model step from host
            lengths and reused by every layer; with it the flash launch has no host sync and can
            be captured in a CUDA graph. Without it one is made here, into a workspace kept per
            (device, heads, stream): on a GPU by the device scheduler from the device lengths (one
            launch, no sync, no length checks: see ``validate``), on the CPU from the host
            lengths, checked; for one sequence whose KV parts fill the grid
            (:meth:`~kdtree_engine.verify.plan.VerifyPlan.schedules_in_kernel`) by the kernel
            itself from the call's device lengths, no launch of its own. The fast path is
            :class:`VerifyAttention`. The plan must be made from the call's lengths: where they
            are validated (CPU tensors, ``validate=True``) a mismatch is a ``ValueError``;
            unvalidated, the kernels would run the plan's schedule on the call's lengths.
        validate: content checks (page ids in range, kv_len >= n_b, self bit set, no stray bits).
            ``None`` (default): run the checks that cost no device sync, i.e. all of them for CPU
            tensors, the length checks (incl. mask width) when a given plan has host lengths.
            The naive kernel on a GPU without validation never reads past the mask's W words, but
            a too-narrow mask then hides nodes instead of raising. ``True``: all checks,
            syncing if needed. ``False``: none. Shape, dtype and device checks always run.

    Returns:
        ``(out, lse)``: out ``[T, H, 512]`` in q's dtype; lse ``[T, H]`` float32, the natural-log
        sum of exp of the scaled scores over the visible keys. A row with no visible key (only
        possible with a malformed mask) gets out = 0 and lse = -inf. NaN in q or in a key a row
        sees (a cache or an activation gone bad) makes that row's out and lse NaN, never a finite
        value that leaves it out.
    """
    compiling = torch.compiler.is_compiling()  # dynamo traces the plain checks, not their cache
    if compiling:
        info, sig, ptrs = check_inputs(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse), None, None
    else:
        sig, ptrs = _CHECK(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
        info = sig.info
    if kernel != "auto":
        _kernel_name(kernel)
    sm_scale = _DEFAULT_SCALE if sm_scale is None else _scale(sm_scale)
    cuda = q.is_cuda
    if not cuda:
        _check_backend(q.device)
    given = plan is not None
    if given and not isinstance(plan, VerifyPlan):
        hint = " (a VerifyAttention: call its run(), or pass its .workspace)" if isinstance(plan, VerifyAttention) else ""
        raise TypeError(f"plan must be a VerifyPlan from plan_verify, got {type(plan).__name__}{hint}")
    site = None  # where the launches go, when the scheduler's launch has read it
    if kernel != "naive" and not given:
        # one sequence whose KV parts fill the grid: the kernel schedules it (one launch); else on a
        # GPU the device scheduler from the device lengths (no sync; the launches go where it went),
        # on the CPU the host from the host lengths
        if cuda:
            device = q.device
            plan = _unplanned_workspace(info.num_seqs, min(info.num_rows, MAX_TREE_NODES), info.num_heads, device,
                                        torch._C._cuda_getCurrentRawStream(device.index))
        else:  # host lengths: checked first
            kv, qo = check_lengths(kv_lens, qo_indptr, info)
            plan = _unplanned_workspace(kv.shape[0], int((qo[1:] - qo[:-1]).max()), info.num_heads, q.device, 0)
        if info.num_seqs == 1 and plan.schedules_in_kernel(info.num_rows):
            plan._plan_in_kernel()
        elif cuda:
            site = plan.launch_on_device(kv_lens, qo_indptr, sig, None if compiling else ptrs[3:5], "auto")
        else:
            plan.plan(kv, qo)
    check_host_lengths = validate is None and cuda
    if validate is None:
        validate = not cuda
    plan_checked = False
    if validate:
        check_content(page_table, kv_lens, qo_indptr, tree_mask, info)
        if given:  # the sizes first (the clearer message), then the lengths themselves
            _check_plan(plan, info, q.device)
            _check_plan_lengths(plan, kv_lens, qo_indptr)
            plan_checked = True
    if compiling or plan is None:  # traced, or the naive kernel without a plan: one-off launches
        if plan is not None and not plan_checked:
            _check_plan(plan, info, q.device)
        out, lse, _ = _outputs(info, q, out, lse, (0,) * 8)
        tables = None if plan is None else plan.tables
        launch(resolve(kernel, q, kv_cache, None if tables is None else tables.config), q, kv_cache, page_table,
               kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, tables)
        return out, lse
    if out is None or lse is None:
        out, lse, ptrs = _outputs(info, q, out, lse, ptrs)
    tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
    call = _prepared(plan, sig, kernel, sm_scale, tensors)
    if call.state is not plan.state:
        if not plan_checked:
            _check_plan(plan, info, q.device)
        if given and check_host_lengths and plan.kv_lens_host is not None:
            check_lengths(plan.kv_lens_host, plan.qo_indptr_host, info)  # host data: no sync
        call.state = plan.state
    call.run(tensors, ptrs, plan.tables.num_groups, site)
    return out, lse


class VerifyAttention:
    """Tree-verify attention planned once per model step and run per layer (FlashInfer's
    plan/run convention), with a workspace allocated once, so a CUDA graph captured around
    :meth:`run` replays correctly after a new :meth:`plan` with different lengths.

    Args:
        max_batch: most sequences B of any step.
        max_tree_nodes: most tree nodes n_b of any ONE sequence (so T <= max_batch * max_tree_nodes).
        num_heads: H of every layer, 1..128.
        device: where the kernels run.
        kernel: ``"auto"`` (hopper where it runs, else flash, decided per call), ``"flash"``,
            ``"hopper"``, ``"hopper_cuda"`` (opt-in) or ``"naive"`` (the oracle: ignores the schedule).
            Host plans are scheduled with the named kernel's cost model (``"auto"``: that of the
            kernel it runs on the device).
        config: flash tile config (default: the best that fits the device).
        num_programs: the flash grid (tuning / tests); default: the programs the device runs at once.

    The workspace (:class:`~kdtree_engine.verify.plan.VerifyPlan`): device lengths
    ``kv_lens [max_batch]`` / ``qo_indptr [max_batch + 1]``, the schedule tables and the partial
    buffers, all at fixed addresses; the flash kernels' grids are fixed too (programs without work
    exit). No KV-length maximum is needed: the tables are bounded by the row blocks plus twice the
    grid, whatever the KV length. The naive kernel's grid is ``[T, H]``: a graph captured around
    it replays only plans of the same T.
    """

    def __init__(self, max_batch: int, max_tree_nodes: int, num_heads: int, device: str | torch.device = "cuda",
                 *, kernel: str = "auto", config: FlashConfig | None = None, num_programs: int | None = None):
        self.kernel = _kernel_name(kernel)
        _check_backend(torch.device(device), "device is")
        self.workspace = VerifyPlan(max_batch, max_tree_nodes, num_heads, device, config=config,
                                    num_programs=num_programs, costs=_KERNEL_COSTS.get(self.kernel))
        self.device = self.workspace.device
        self.num_heads = num_heads
        self._check = InputCheck((self.workspace.kv_lens_buf, self.workspace.qo_indptr_buf))

    def plan(self, kv_lens, qo_indptr, *, device_schedule: str = "line") -> None:
        """Plan a step: ``kv_lens`` ``[B]`` (prefix + tree nodes per sequence) and ``qo_indptr``
        ``[B+1]``. Both int32 CUDA tensors: the device scheduler writes ``device_schedule`` from
        them (``"line"``; ``"parts"`` / ``"rounds"`` where they apply; ``"auto"``: the unplanned call's
        rules; pick with :meth:`device_schedule_for`;
        one launch on the current stream, no sync, capturable in a CUDA graph with the layers; only
        shapes checked, see :meth:`~kdtree_engine.verify.plan.VerifyPlan.plan_on_device`).
        Otherwise host data (lists, numpy arrays or CPU tensors): checked (``ValueError`` naming
        the argument, also past the maxima), scheduled on the host and written with one
        non-blocking copy on the current stream. Allocates nothing on the device."""
        self.workspace.plan(kv_lens, qo_indptr, device_schedule=device_schedule)

    def device_schedule_for(self, kv_lens, qo_indptr) -> str:
        """The device schedule (``"auto"`` for small steps, else ``"line"``, ``"parts"`` or ``"rounds"``)
        for steps of these host lengths (:meth:`~kdtree_engine.verify.plan.VerifyPlan.device_schedule_for`)."""
        return self.workspace.device_schedule_for(kv_lens, qo_indptr)

    @property
    def kv_lens(self) -> torch.Tensor:
        """``[B]`` int32 on the device: the planned lengths (a view of a fixed buffer)."""
        return self.workspace.kv_lens

    @property
    def qo_indptr(self) -> torch.Tensor:
        """``[B+1]`` int32 on the device: the planned row offsets (a view of a fixed buffer)."""
        return self.workspace.qo_indptr

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, tree_mask: torch.Tensor,
            *, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of the planned step; the contract of :func:`verify_attention` with the lengths
        taken from the plan (:attr:`kv_lens`, :attr:`qo_indptr`).

        Args:
            q: ``[T, H, 576]`` bf16 / fp16, T = the planned rows, any strides with the last
                dimension contiguous.
            kv_cache: ``[num_pages, page_size, 576]``, q's dtype, last dimension contiguous.
            page_table: ``[B, max_pages]`` int32, any strides; ``max_pages * page_size`` covers
                the longest planned sequence.
            tree_mask: ``[T, W]`` int32, any strides; ``32 * W`` covers the largest planned tree.
            out, lse: optional ``[T, H, 512]`` (q's dtype) / ``[T, H]`` float32 outputs.
            sm_scale: default ``1/sqrt(576)``.

        Checks shapes, dtypes and devices; on a GPU no content (no sync; see
        :func:`~kdtree_engine.verify.contract.check_content` to validate a step once), on the CPU
        the content too, as :func:`verify_attention` does there (host data: no sync). For a CUDA
        graph replayed across plans, pass views of buffers allocated for the maxima (the graph
        keeps their addresses and strides); rows past the current T are not written.

        Returns ``(out, lse)``.
        """
        ws = self.workspace
        scale = _DEFAULT_SCALE if sm_scale is None else _scale(sm_scale)
        if torch.compiler.is_compiling():  # dynamo traces the plain checks and the op, not the caches
            # the inputs' shapes here; the plan's host state (T, lengths) changes at every step, and
            # reading it here would make guards on it, a recompile per plan (fullgraph: an error): the
            # op checks the call against it when it runs (plan_serial)
            check_inputs(q, kv_cache, page_table, ws.kv_lens, ws.qo_indptr, tree_mask, out, lse)
            if q.shape[1] != self.num_heads:
                raise ValueError(f"q has {q.shape[1]} heads; this VerifyAttention was made for {self.num_heads}")
            t, cfg = ws.tables, ws.tables.config  # the op resolves "auto" when it runs (it reads data pointers)
            o, s = verify_attention_op(q, kv_cache, page_table, ws.kv_lens, ws.qo_indptr, tree_mask,
                                       t.prog_first_seg, t.segments, t.groups, t.group_count, t.grid_barrier,
                                       t.partial_out, t.partial_lse, scale, self.kernel, cfg.block_m, cfg.block_n,
                                       cfg.num_warps, cfg.num_stages, ws.serial)
            if out is None and lse is None:
                return o, s
            out = o if out is None else out.copy_(o)
            lse = s if lse is None else lse.copy_(s)
            return out, lse
        if ws.num_seqs == 0:
            raise RuntimeError("VerifyAttention.run() before plan(): plan the step's lengths first")
        kv_lens, qo_indptr = ws.kv_lens, ws.qo_indptr
        sig, ptrs = self._check(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
        if out is None or lse is None:
            out, lse, ptrs = _outputs(sig.info, q, out, lse, ptrs)
        tensors = (q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse)
        call = _prepared(ws, sig, self.kernel, scale, tensors)
        if call.state is not ws.state:
            self._check_plan(sig.info, q.device)
            call.state = ws.state
        if not q.is_cuda:  # (Triton's interpreter would read a page id past the cache from host memory)
            check_content(page_table, kv_lens, qo_indptr, tree_mask, sig.info)
        call.run(tensors, ptrs, ws.tables.num_groups)
        return out, lse

    def _check_plan(self, info: VerifyInputs, device: torch.device) -> None:
        """A call's sizes against the current plan: heads, rows, sequences, device, and with host
        lengths the mask's width and the page table's capacity (``ValueError``)."""
        ws = self.workspace
        _check_plan(ws, info, device)
        ws.check_fits(info.num_rows, info.mask_words, info.max_pages * info.page_size)
