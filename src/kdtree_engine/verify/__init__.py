"""Tree-verify attention for MLA, in layers that import downward only:

- :mod:`.contract`: dimensions and input checks;
- :mod:`.reference`: the float64 reference (any device);
- :mod:`.launch`: kernel launches that skip Triton's Python launcher once compiled, and launches
  laid out once per call signature (:class:`~.launch.Launch`);
- :mod:`.scheduler`: the device scheduler (a plan's tables from device lengths, no sync);
- :mod:`.plan`: tile configs, the persistent schedule, the workspace (:class:`VerifyPlan`);
- :mod:`.combine`: merging a plan's KV splits (shared by the planned kernels): the grid barrier
  and merge a kernel runs itself after its segments (one launch per call on a GPU), and the
  combine kernel where it cannot;
- :mod:`.triton_naive`, :mod:`.triton_flash`, :mod:`.hopper`, :mod:`.hopper_cuda`: one module per
  kernel implementation (the Triton oracle, the portable Triton flash kernel, the Gluon sm_90a
  kernel, the CUDA C++ sm_90a kernel built with nvcc at first use and run only where named), each a
  ``prepare(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan)``
  that lays out its launches for every call with those tensors' signature;
- :mod:`.op`: the preparers by name, which kernel ``"auto"`` runs, and the
  ``kdtree::verify_attention`` torch op;
- :mod:`.api`: :func:`verify_attention` and :class:`VerifyAttention` (plan once, run per layer).

Importing this package does not import Triton; a kernel module loads on first use.
"""

from .api import KERNELS, VerifyAttention, verify_attention
from .op import OPT_IN_KERNELS, available_kernels
from .contract import D_QK, D_ROPE, D_V, check_inputs
from .plan import VerifyPlan, plan_verify
from .reference import reference

__all__ = ["verify_attention", "VerifyAttention", "plan_verify", "VerifyPlan", "reference", "check_inputs",
           "D_QK", "D_V", "D_ROPE", "KERNELS", "OPT_IN_KERNELS", "available_kernels"]
