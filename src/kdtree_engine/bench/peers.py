"""Implementations under test, behind one interface, and the peers they are compared with.

Every implementation turns a :class:`~kdtree_engine.bench.shapes.BenchCase` into a
:class:`Prepared` call ``run(i)`` (input set ``i``) that writes ``case.sets[i].out`` (and
``.lse`` when it has one) and never syncs with the host. Whatever can be done once per model step
(plans, index lists, masks) is done in ``prepare``, outside the timed region.

Peers:

- ``torch`` (always): plain PyTorch. Per sequence, gather its KV rows through the page table
  (``index_select`` of the slots), then ``scaled_dot_product_attention`` with the tree as a bool
  mask. The heads are folded into the query rows (MQA with one KV head: q ``[n*H, 576]`` against
  K ``[L, 576]``, V = K's first 512 columns), so K is never copied per head; the mask
  ``[n*H, L]`` is expanded from the per-node ``[n, L]`` mask inside the call.
- ``sglang`` (only when installed; never vendored): SGLang's Triton extend-attention kernel with a
  custom mask, the kernel SGLang runs for EAGLE tree verify with the Triton backend.
- ``flashinfer`` (only when installed; never vendored): ``BatchPrefillWithPagedKVCacheWrapper``
  with a custom mask, head_dim_qk 576 / head_dim_vo 512, one KV head. Best effort: FlashInfer may
  not build these head dims; the row then says why.

Peers without an lse are checked on ``out`` only.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..verify.contract import D_QK, D_V
from .shapes import BenchCase, Shape

__all__ = ["Impl", "Prepared", "Unavailable", "TorchSDPA", "SGLangExtend", "FlashInferPrefill", "detect_peers"]


class Unavailable(Exception):
    """This implementation cannot run this shape (the message says why); the row is skipped."""


def _written_in_place(i: int) -> None:
    """The default ``collect``: ``run`` already wrote ``case.sets[i].out`` / ``.lse``."""


@dataclass
class Prepared:
    run: Callable[[int], None]  # one call on input set i; no host sync
    graphable: bool = True  # may be captured in a CUDA graph
    note: str = ""
    keep: list = field(default_factory=list)  # tensors/objects that must outlive the calls
    # untimed, before a check: moves results of set i that ``run`` kept in its own layout into
    # ``case.sets[i].out`` / ``.lse`` (for peers that cannot write the caller's buffers)
    collect: Callable[[int], None] = _written_in_place


class Impl:
    """An implementation under test."""

    name: str = "?"
    has_lse: bool = False
    description: str = ""

    def extra_bytes(self, shape: Shape) -> int:
        """Device bytes this implementation needs beyond the inputs (estimate, for skipping)."""
        return 0

    def est_tflops(self) -> float:
        """Rough sustained TFLOP/s on an H200, only for ``--dry-run`` estimates and budgets."""
        return 100.0

    def prepare(self, case: BenchCase) -> Prepared:
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------
# torch: gather + SDPA


class TorchSDPA(Impl):
    name = "torch"
    has_lse = False
    description = "plain PyTorch: gather via page table + scaled_dot_product_attention, bool mask"

    def extra_bytes(self, shape: Shape) -> int:
        # per sequence (looped): gathered K, expanded mask, and the math backend's fp32 scores,
        # probabilities and a bf16 copy (~14 bytes per score); masks [n, L] of all sequences
        m, L = shape.q_len * shape.heads, shape.kv_len
        return L * D_QK * 2 * 2 + m * L * 14 + shape.batch * shape.q_len * L

    def est_tflops(self) -> float:
        return 9.0  # docs/benchmark.md "The problem in numbers": 8.0 ms at H64 n33 P16k, 129 ms at H128 n33 P128k

    def prepare(self, case: BenchCase) -> Prepared:
        sh = case.shape
        B, n, H, L = sh.batch, sh.q_len, sh.heads, sh.kv_len
        slots = [case.slots(b) for b in range(B)]
        masks = [case.visible(b) for b in range(B)]  # [n, L] bool
        qo = case.qo_indptr_host.tolist()
        scale = case.sm_scale

        def run(i: int) -> None:
            s = case.sets[i]
            kv_flat = s.kv_cache.view(-1, D_QK)
            for b in range(B):
                k = kv_flat.index_select(0, slots[b])  # [L, 576] gather through the page table
                q_b = s.q[qo[b] : qo[b + 1]].reshape(n * H, D_QK)  # rows (node, head)
                mask = masks[b][:, None, :].expand(n, H, L).reshape(n * H, L)
                o = F.scaled_dot_product_attention(
                    q_b[None, None], k[None, None], k[None, None, :, :D_V], attn_mask=mask[None, None], scale=scale
                )
                s.out[qo[b] : qo[b + 1]].copy_(o.view(n, H, D_V))

        return Prepared(run=run, keep=[slots, masks])


# ----------------------------------------------------------------------------------------------
# Optional peers (never vendored: used only when the user has them installed)


def _flat_tree_masks(case: BenchCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence ``[n, P+n]`` bool masks flattened and concatenated, and their int64 indptr."""
    sh = case.shape
    flat = torch.cat([case.visible(b).reshape(-1) for b in range(sh.batch)])
    indptr = torch.arange(sh.batch + 1, device=case.device, dtype=torch.int64) * (sh.q_len * sh.kv_len)
    return flat, indptr


class SGLangExtend(Impl):
    name = "sglang"
    has_lse = False
    description = "SGLang Triton extend_attention_fwd with a custom (tree) mask"
    MODULE = "sglang.srt.layers.attention.triton_ops.extend_attention"
    NEEDED = ("qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr", "max_len_extend")

    def __init__(self):
        self._fn = None
        self.version = ""

    def detect(self) -> str | None:
        """None when usable, else why not."""
        try:
            mod = importlib.import_module(self.MODULE)
            fn = mod.extend_attention_fwd
        except Exception as e:  # not installed, or its import chain fails
            return f"not importable ({type(e).__name__}: {str(e)[:80]})"
        params = inspect.signature(fn).parameters
        missing = [p for p in self.NEEDED if p not in params]
        if missing:
            return f"extend_attention_fwd of this version lacks {missing}"
        self._fn = fn
        try:
            self.version = importlib.import_module("sglang").__version__
        except Exception:
            self.version = "?"
        return None

    def extra_bytes(self, shape: Shape) -> int:
        return shape.batch * shape.q_len * shape.kv_len + shape.batch * shape.kv_len * 8 + shape.rows * D_QK * 2

    def est_tflops(self) -> float:
        return 25.0  # docs/benchmark.md "The problem in numbers": ~4% of the floor on compute-bound shapes

    def prepare(self, case: BenchCase) -> Prepared:
        if self._fn is None and self.detect() is not None:
            raise Unavailable("sglang not importable")
        fn = self._fn
        params = inspect.signature(fn).parameters
        sh = case.shape
        B, n, P = sh.batch, sh.q_len, sh.prefix
        dev = case.device
        slots = [case.slots(b) for b in range(B)]
        kv_indptr = torch.arange(B + 1, device=dev, dtype=torch.int32) * P
        kv_indices = torch.cat([s[:P] for s in slots]) if P > 0 else torch.zeros(1, device=dev, dtype=torch.int64)
        ext_slots = torch.cat([s[P:] for s in slots])
        # the tree nodes' own KV rows, as SGLang receives them (k_extend), gathered once per set
        k_ext = [s.kv_cache.view(-1, D_QK)[ext_slots].view(-1, 1, D_QK) for s in case.sets]
        custom_mask, mask_indptr = _flat_tree_masks(case)
        qo_indptr = case.qo_indptr

        def run(i: int) -> None:
            s = case.sets[i]
            k_buf = s.kv_cache.view(-1, 1, D_QK)
            kw = dict(
                q_extend=s.q,
                k_extend=k_ext[i],
                v_extend=k_ext[i][..., :D_V],
                o_extend=s.out,
                k_buffer=k_buf,
                v_buffer=k_buf[..., :D_V],
                qo_indptr=qo_indptr,
                kv_indptr=kv_indptr,
                kv_indices=kv_indices,
                custom_mask=custom_mask,
                is_causal=False,
                mask_indptr=mask_indptr,
                max_len_extend=n,
                sm_scale=case.sm_scale,
                skip_prefix_custom_mask=True,
            )
            fn(**{k: v for k, v in kw.items() if k in params})

        return Prepared(run=run, keep=[slots, kv_indices, k_ext, custom_mask], note=f"sglang {self.version}")


class FlashInferPrefill(Impl):
    name = "flashinfer"
    has_lse = False
    description = "FlashInfer BatchPrefillWithPagedKVCacheWrapper, custom mask, 576/512, 1 KV head"

    def __init__(self):
        self._fi = None
        self.version = ""

    def detect(self) -> str | None:
        try:
            self._fi = importlib.import_module("flashinfer")
        except Exception as e:
            return f"not importable ({type(e).__name__}: {str(e)[:80]})"
        self.version = getattr(self._fi, "__version__", "?")
        if not hasattr(self._fi, "BatchPrefillWithPagedKVCacheWrapper"):
            return "flashinfer lacks BatchPrefillWithPagedKVCacheWrapper"
        return None

    def extra_bytes(self, shape: Shape) -> int:
        return 256 * 2**20 + shape.batch * shape.q_len * shape.kv_len

    def est_tflops(self) -> float:
        return 25.0

    def prepare(self, case: BenchCase) -> Prepared:
        if self._fi is None and self.detect() is not None:
            raise Unavailable("flashinfer not importable")
        fi = self._fi
        sh = case.shape
        B, ps, pps = sh.batch, sh.page_size, sh.pages_per_seq
        dev = case.device
        workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        kv_indptr = torch.arange(B + 1, device=dev, dtype=torch.int32) * pps
        kv_indices = case.page_table[:, :pps].reshape(-1).contiguous()
        last_len = torch.full((B,), sh.kv_len - (pps - 1) * ps, device=dev, dtype=torch.int32)
        custom_mask, _ = _flat_tree_masks(case)
        dtype = case.sets[0].q.dtype
        try:
            wrapper.plan(
                case.qo_indptr,
                kv_indptr,
                kv_indices,
                last_len,
                sh.heads,
                1,
                D_QK,
                ps,
                head_dim_vo=D_V,
                custom_mask=custom_mask,
                causal=False,
                sm_scale=case.sm_scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        except Exception as e:
            raise Unavailable(f"flashinfer plan failed: {type(e).__name__}: {str(e)[:100]}") from e
        run_params = inspect.signature(wrapper.run).parameters
        has_out = "out" in run_params

        def run(i: int) -> None:
            s = case.sets[i]
            k_cache = s.kv_cache.view(-1, ps, 1, D_QK)
            kv = (k_cache, k_cache[..., :D_V])
            if has_out:
                wrapper.run(s.q, kv, out=s.out)
            else:
                s.out.copy_(wrapper.run(s.q, kv))

        return Prepared(run=run, keep=[workspace, wrapper, kv_indptr, kv_indices, last_len, custom_mask],
                        note=f"flashinfer {self.version}")


def detect_peers(requested: list[str] | None) -> tuple[list[Impl], dict[str, str]]:
    """The peers to run (``torch`` always when asked; sglang/flashinfer when importable) and a
    note per peer that is left out."""
    want = set(requested) if requested is not None else {"torch", "sglang", "flashinfer"}
    impls: list[Impl] = []
    notes: dict[str, str] = {}
    if "torch" in want:
        impls.append(TorchSDPA())
    for cls in (SGLangExtend, FlashInferPrefill):
        if cls.name not in want:
            continue
        impl = cls()
        why = impl.detect()
        if why is None:
            impls.append(impl)
        else:
            notes[cls.name] = why
    return impls, notes
