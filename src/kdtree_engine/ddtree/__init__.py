"""DDTree draft trees and lossless acceptance (issue 6).

* :mod:`.tree`: best-first tree construction from per-position draft logits (vectorised on the
  device, plus the host-heap reference) and compilation into verify_attention's tensors.
* :mod:`.accept`: greedy and lossless sampling acceptance, batched, no host sync.
* :mod:`.interop`: SGLang EAGLE tree formats (FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING, parent
  and retrieve lists) to and from this project's contract.
* :mod:`.bench`: timings (``python -m kdtree_engine.ddtree.bench``).

See ``docs/ddtree.md``.
"""

from .accept import (
    AcceptResult,
    accept_greedy,
    accept_reference,
    accept_sampling,
    accept_tokens,
    commit_positions,
    filter_logits,
    filter_probs,
    greedy_workspace,
    sample_from_logits,
    sample_from_probs,
    target_tokens_greedy,
    target_tokens_sampled,
)
from .tree import (
    LOGPROB_FLOOR,
    LOGPROB_SCALE,
    DraftTopK,
    DraftTree,
    VerifyBatch,
    ancestor_words,
    build_ddtree,
    build_ddtree_reference,
    check_tree,
    compile_tree,
    draft_topk,
    expand_topk,
    expand_topk_reference,
    tree_from_parents,
    tree_links,
)

__all__ = [
    "LOGPROB_FLOOR",
    "LOGPROB_SCALE",
    "DraftTopK",
    "DraftTree",
    "VerifyBatch",
    "AcceptResult",
    "draft_topk",
    "expand_topk",
    "expand_topk_reference",
    "build_ddtree",
    "build_ddtree_reference",
    "tree_from_parents",
    "tree_links",
    "ancestor_words",
    "compile_tree",
    "check_tree",
    "filter_logits",
    "filter_probs",
    "sample_from_probs",
    "sample_from_logits",
    "target_tokens_greedy",
    "target_tokens_sampled",
    "accept_tokens",
    "accept_greedy",
    "greedy_workspace",
    "accept_sampling",
    "accept_reference",
    "commit_positions",
]
