"""One decode step's verify inputs, handed out together by :meth:`KVPool.reserve_step`.

The pool owns where the KV lives (slots, page table, lengths); the DDTree compiler owns what the
tree looks like (node tokens, RoPE positions, row offsets, mask). :class:`VerifyStep` joins the two
for one step so that a model step reads every input of ``verify_attention`` (and the host lengths
its plan is built from) from one object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..verify import plan_verify

__all__ = ["VerifyStep"]


@dataclass(frozen=True)
class VerifyStep:
    """The inputs of one verify forward over the draft trees of ``B`` sequences.

    Rows: tree node j of sequence b is flat row ``qo_indptr[b] + j`` (T rows in all). Every tensor
    is on the pool's device and contiguous.

    seq_ids:        the B pool sequence ids (host ints), in row order.
    tokens:         ``[T]`` int64, the token of each tree node.
    rope_pos:       ``[T]`` int64, RoPE position ``P_b + depth`` (P_b = committed length).
    slots:          ``[T]`` int64, flat cache slot ``page * page_size + offset`` of cache
                    position ``P_b + j``, where node j's KV must be written (a row of
                    ``kv_cache.view(-1, 576)``).
    page_table:     ``[B, max_pages]`` int32, verify's ``page_table``.
    kv_lens:        ``[B]`` int32, ``P_b + n_b``, verify's ``kv_lens``.
    qo_indptr:      ``[B+1]`` int32, verify's ``qo_indptr``.
    tree_mask:      ``[T, W]`` int32, verify's bit-packed ancestor-or-self mask.
    kv_lens_host:   the same lengths as host ints (for the flash plan; no device read).
    qo_indptr_host: the same offsets as host ints.
    """

    seq_ids: tuple[int, ...]
    tokens: torch.Tensor
    rope_pos: torch.Tensor
    slots: torch.Tensor
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    qo_indptr: torch.Tensor
    tree_mask: torch.Tensor
    kv_lens_host: tuple[int, ...]
    qo_indptr_host: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        """T, all tree nodes of the step."""
        return self.qo_indptr_host[-1]

    @property
    def tree_sizes(self) -> tuple[int, ...]:
        """n_b per sequence."""
        q = self.qo_indptr_host
        return tuple(q[b + 1] - q[b] for b in range(len(q) - 1))

    def plan(self, num_heads: int):
        """The flash kernel's plan of this step (built once, reused by every layer) from the host
        lengths: :func:`kdtree_engine.verify.plan_verify`, no device read."""
        return plan_verify(self.kv_lens_host, self.qo_indptr_host, num_heads, self.kv_lens.device)
