"""The kernels behind one name: a launcher per kernel, and the ``kdtree::verify_attention`` op.

The layer above the kernels and below the API: imports the contract and the plan at import time,
the kernel modules (and so Triton) only when a launcher is first asked for.

The op lets ``torch.compile(fullgraph=True)`` trace a model step through verify without a graph
break: it takes the caller's tensors, the plan's tables and partial buffers (as tensors: a new
plan changes their content, never their shapes, so nothing recompiles) and the kernel config as
ints, and returns fresh ``out [T, H, 512]`` (q's dtype) and ``lse [T, H]`` (float32). Its fake
implementation gives those shapes without running anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .contract import D_V
from .plan import FlashConfig, FlashTables

__all__ = ["KERNELS", "launcher", "verify_attention_op"]

KERNELS = ("naive", "flash")


def launcher(kernel: str) -> Callable:
    """The ``launch(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse,
    plan)`` function of ``kernel`` (imports its module, and Triton, on first use)."""
    if kernel == "naive":
        from .triton_naive import launch
    elif kernel == "flash":
        from .triton_flash import launch
    else:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return launch


@torch.library.custom_op("kdtree::verify_attention", mutates_args=("partial_out", "partial_lse"))
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
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    sm_scale: float,
    kernel: str,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-verify attention on checked inputs with a plan's tables (see :class:`FlashTables`;
    the naive kernel ignores them). Returns ``(out [T, H, 512] q.dtype, lse [T, H] float32)``.
    The combine kernel always runs (the host count of split groups does not cross the op)."""
    T, H, _ = q.shape
    out = q.new_empty(T, H, D_V)
    lse = q.new_empty(T, H, dtype=torch.float32)
    tables = FlashTables(FlashConfig(block_m, block_n, num_warps, num_stages), prog_first_seg, segments, groups,
                         group_count, partial_out, partial_lse, num_groups=None)
    launcher(kernel)(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, tables)
    return out, lse


@verify_attention_op.register_fake
def _(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, prog_first_seg, segments, groups, group_count,
      partial_out, partial_lse, sm_scale, kernel, block_m, block_n, num_warps, num_stages):
    T, H, _ = q.shape
    return q.new_empty(T, H, D_V), q.new_empty(T, H, dtype=torch.float32)
