"""Tree-verify attention for MLA: public function, float64 reference, kernels."""

from .api import D_QK, D_ROPE, D_V, KERNELS, check_inputs, verify_attention
from .reference import reference

__all__ = ["verify_attention", "reference", "check_inputs", "D_QK", "D_V", "D_ROPE", "KERNELS"]
