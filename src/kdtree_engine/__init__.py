"""kdtree-engine: tree speculative decoding for MLA models (DeepSeek-V3, Kimi K2).

Importing the package does not import Triton; the kernels load on first use, so a CPU user can
set ``TRITON_INTERPRET=1`` any time before the first kernel call.
"""

from .masks import (
    ancestor_matrix,
    concat_tree_masks,
    mask_words,
    pack_tree_mask,
    tree_mask_from_parents,
    unpack_tree_mask,
)
from .verify import D_QK, D_ROPE, D_V, VerifyAttention, plan_verify, reference, verify_attention

__version__ = "0.1.0"

__all__ = [
    "VerifyAttention",
    "verify_attention",
    "plan_verify",
    "reference",
    "pack_tree_mask",
    "unpack_tree_mask",
    "tree_mask_from_parents",
    "ancestor_matrix",
    "concat_tree_masks",
    "mask_words",
    "D_QK",
    "D_V",
    "D_ROPE",
]
