"""The absorbed-MLA runner against Hugging Face DeepseekV3 itself (CPU, tiny configs).

One verify step over a batch of draft trees (ragged prefixes, shuffled node order, paged KV pool
with scattered pages and NaN-poisoned free slots) must give HF's own logits for the same tokens
under the equivalent 4-D tree mask (HF eager attention). Attention runs through
``verify_attention(kernel="naive")`` (Triton interpreter) or, for the config grid where only
the model math is under test, through the float64 ``reference`` on the same 16-bit cache.
"""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kvpool import KVPool
from kdtree_engine.model import MLARunner, build_random_model, hf_tree_logits, load_model, tiny_config
from kdtree_engine.model.speculative import verify_once
from kdtree_engine.testing import compare

V = 128


def _tree(n: int, gen: torch.Generator) -> list[int]:
    """Random parent array with the root at 0 and the other nodes in shuffled order."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    perm = [0] + (torch.randperm(n - 1, generator=gen) + 1).tolist()  # old -> new, root stays 0
    new = [0] * n
    for old, p in enumerate(parents):
        new[perm[old]] = -1 if p < 0 else perm[p]
    return new


def _case(seed: int = 1, prefix_lens=(7, 19, 1), tree_sizes=(5, 9, 1)):
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(0, V, (P,), generator=g).tolist() for P in prefix_lens]
    trees = []
    for n in tree_sizes:
        parents = _tree(n, g)
        tokens = torch.randint(0, V, (n,), generator=g).tolist()
        # siblings need distinct tokens for acceptance, not for the forward: keep them random
        trees.append((tokens, parents))
    return prefixes, trees


def verify_step(runner: MLARunner, prefixes, trees, *, page_size: int = 4):
    """Prefill each prefix into a fresh KV pool (scattered pages, NaN-poisoned free slots), then
    one verify forward over all trees."""
    return verify_once(runner, prefixes, trees, page_size=page_size, shuffle_seed=3, debug=True)


YARN_NO_MSCALE_ALL = dict(rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 512,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0})
CONFIGS = {
    "yarn-interleave": {},
    "yarn-attention-factor": YARN_NO_MSCALE_ALL,  # cos/sin scaled by 0.1 ln 8 + 1
    "yarn-mscale-softmax": dict(rope_parameters={**YARN_NO_MSCALE_ALL["rope_parameters"], "mscale_all_dim": 0.707}),
    "default-rope-no-interleave": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                       rope_interleave=False),
    "no-q-lora-odd-heads": dict(q_lora_rank=None, num_attention_heads=3, num_key_value_heads=3),
    "all-moe-wide-nope": dict(first_k_dense_replace=0, qk_nope_head_dim=32, v_head_dim=24),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verify_step_matches_hf_eager_reference_attention(name):
    """Model math (absorption, rope incl. yarn / interleave, mscale, MoE) across configs: float64
    attention on the fp16 cache, fp32 model; only the fp16 rounding of q and the cache differs."""
    cfg = tiny_config(**CONFIGS[name])
    model = build_random_model(cfg, seed=0, dtype=torch.float32)
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    prefixes, trees = _case()
    logits, _, _ = verify_step(runner, prefixes, trees)
    expected = torch.cat(hf_tree_logits(model, prefixes, trees))
    # logits ~N(0, 1.7); a 10% softmax-scale error moves them by ~0.2, swapped rope halves by ~1
    res = compare(logits, expected, atol=5e-3, rtol=2e-3)
    assert res.ok, f"{name}: {res} {res.detail}"
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kernel", ["naive", "flash"])
@pytest.mark.parametrize("model_dtype,cache_dtype,atol", [
    ("fp32", torch.float16, 5e-3),
    ("bf16", torch.bfloat16, 6e-2),  # HF itself runs in bf16 here; 2 bf16 ulps at |logit| ~ 3
], ids=["fp32-model-fp16-cache", "bf16-model-bf16-cache"])
def test_verify_step_matches_hf_eager_kernel(kernel, model_dtype, cache_dtype, atol, device):
    """The real kernels in the verify step (on the CPU under the Triton interpreter, tiny sizes;
    on CUDA a 300-token prefix and a 33-node tree too)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[model_dtype]
    model = build_random_model(tiny_config(), seed=0, dtype=dtype, device=device)
    runner = MLARunner(model, kernel=kernel, cache_dtype=cache_dtype)
    if device == "cuda":
        prefixes, trees = _case(seed=2, prefix_lens=(300, 41, 1), tree_sizes=(33, 9, 1))
    else:
        prefixes, trees = _case(seed=2, prefix_lens=(11, 3), tree_sizes=(7, 4))
    logits, _, _ = verify_step(runner, prefixes, trees, page_size=16 if device == "cuda" else 4)
    expected = torch.cat(hf_tree_logits(model, prefixes, trees))
    res = compare(logits, expected, atol=atol, rtol=2e-3)
    assert res.ok, f"{res} {res.detail}"


def test_prefill_matches_hf_logits_and_cache():
    """Dense prefill = HF forward (last logits), and the pool rows = HF's own latent cache
    (kv_a_layernorm(c_kv) | roped k_pe) for every position: bit-exact in layer 0 (same inputs),
    within one fp16 rounding in deeper layers (their input went through attention)."""
    from transformers import DynamicCache

    model = build_random_model(tiny_config(), seed=0, dtype=torch.float32)
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    tokens = torch.randint(0, V, (21,), generator=torch.Generator().manual_seed(5))
    pool = KVPool(16, 4, num_layers=runner.num_layers, dtype=torch.float16, device="cpu", max_seqs=1, debug=True)
    sid = pool.add_sequence()
    last = runner.prefill(tokens, pool.kv_layers, pool.extend([sid], [21]))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=tokens[None], past_key_values=cache, use_cache=True)
    res = compare(last, out.logits[0, -1], atol=1e-5, rtol=1e-4)
    assert res.ok, f"{res} {res.detail}"
    for li in range(runner.num_layers):
        hf_rows = torch.cat([cache.layers[li].keys[0, 0], cache.layers[li].values[0, 0]], -1)  # [21, 576]
        atol, rtol = (0.0, 0.0) if li == 0 else (1e-5, 2e-3)
        res = compare(pool.gather_kv(sid, li), hf_rows.to(torch.float16), atol=atol, rtol=rtol)
        assert res.ok, f"layer {li}: {res} {res.detail}"


def test_tree_of_chain_equals_sequential_decode():
    """A chain tree verified in one step gives the logits of feeding its tokens one by one (up to
    the fp16 rounding of layer-1 cache rows, computed by the verify path vs the dense prefill)."""
    model = build_random_model(tiny_config(), seed=0, dtype=torch.float32)
    runner = MLARunner(model, kernel="reference", cache_dtype=torch.float16)
    prefix = list(range(10, 19))
    chain = [5, 6, 7, 8]
    one, _, _ = verify_step(runner, [prefix], [(chain, [-1, 0, 1, 2])])
    rows = []
    for i in range(len(chain)):
        logits, _, _ = verify_step(runner, [prefix + chain[:i]], [([chain[i]], [-1])])
        rows.append(logits[0])
    res = compare(one, torch.stack(rows), atol=2e-3, rtol=1e-3)
    assert res.ok, f"{res} {res.detail}"


def test_config_checks():
    with pytest.raises(ValueError, match="kv_lora_rank=512"):
        build_random_model(tiny_config(kv_lora_rank=256))
    with pytest.raises(ValueError, match="qk_rope_head_dim=64"):
        build_random_model(tiny_config(qk_rope_head_dim=32))
    # frequencies rescaled by a forward's longest position: one sequence's tree logits moved by 0.17
    # when batched beside a longer sequence (max_position_embeddings 8, prefixes 3 and 20)
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        build_random_model(tiny_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
                                       max_position_embeddings=8))
    model = build_random_model(tiny_config(), dtype=torch.float32)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        MLARunner(model, kernel="naive", cache_dtype=torch.float32)
    with pytest.raises(ValueError, match="kernel"):
        MLARunner(model, kernel="sdpa")


def test_load_model_from_checkpoint_dir(tmp_path):
    """A local save_pretrained directory loads (nothing downloaded) and runs the same."""
    model = build_random_model(tiny_config(), seed=4, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float32)
    prefixes, trees = _case(seed=6, prefix_lens=(5,), tree_sizes=(3,))
    a, _, _ = verify_step(MLARunner(model, kernel="reference", cache_dtype=torch.float16), prefixes, trees)
    b, _, _ = verify_step(MLARunner(loaded, kernel="reference", cache_dtype=torch.float16), prefixes, trees)
    assert torch.equal(a, b)

