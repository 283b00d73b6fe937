"""End-to-end pieces: absorbed-MLA runner over HF DeepseekV3 weights, drafters, the speculative loop."""

from .mla import (
    MLARunner,
    Phase,
    build_random_model,
    check_mla_config,
    hf_tree_logits,
    kimi_k2_attention_config,
    load_model,
    tiny_config,
)

__all__ = [
    "MLARunner",
    "Phase",
    "check_mla_config",
    "tiny_config",
    "kimi_k2_attention_config",
    "build_random_model",
    "load_model",
    "hf_tree_logits",
]
