"""Absorbed-MLA runner over a Hugging Face ``DeepseekV3ForCausalLM`` (DeepSeek-V3 / Kimi K2 layout).

The HF module is the source of the weights and the reference of the numerics; this runner runs
the layers itself so that attention goes through :func:`kdtree_engine.verify_attention` over a
paged latent KV cache:

- per layer, one cache tensor ``[num_pages, page_size, 576]``: row = ``[c_kv (512) | k_pe (64)]``,
  ``c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[:512])`` and ``k_pe`` = the rope part of
  ``kv_a_proj_with_mqa(x)`` rotated at the token's position (HF's interleave convention and
  yarn ``attention_scaling`` included: cos/sin come from the HF rotary module itself).
- absorbed attention: ``kv_b_proj.weight`` viewed as ``[H, nope + v, 512]`` splits into
  ``W_UK [H, nope, 512]`` and ``W_UV [H, v, 512]``. ``q_lat = q_nope @ W_UK`` (``[T, H, 512]``) and
  ``q = [q_lat | rope(q_rot)]`` (``[T, H, 576]``); the kernel returns the latent output
  ``o_lat [T, H, 512]``; the head output is ``o_lat @ W_UV^T`` (``[T, H, v]``), then ``o_proj``.
  Softmax scale = the HF module's ``scaling`` (``(nope + rope)^-0.5``, times yarn ``mscale^2``).
- RMSNorms, the dense MLP / MoE, embeddings and ``lm_head`` are the HF submodules, called as-is.

Two forward paths:

- :meth:`MLARunner.forward` (verify / decode): a batch of draft trees, all sequences at once; node
  ``j`` of sequence ``b`` is written to cache position ``P_b + j`` and rotated at ``P_b + depth_j``.
- :meth:`MLARunner.prefill` (one sequence's prompt): dense causal attention in the expanded
  (HF-equivalent, non-absorbed) form through ``torch.nn.functional.scaled_dot_product_attention``;
  it writes the same latent rows into the cache. On CUDA the SDPA math fallback is excluded (a
  128k-token prompt would need terabytes), so flash / memory-efficient attention must accept the
  shapes (head dim ``nope + rope`` <= 256; V is zero-padded to it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kvpool.step import VerifyStep
from ..verify.contract import D_QK, D_ROPE, D_V
from ..verify.op import KERNELS, OPT_IN_KERNELS

__all__ = [
    "MLARunner",
    "Phase",
    "PHASE_KINDS",
    "ForwardState",
    "check_mla_config",
    "tiny_config",
    "kimi_k2_attention_config",
    "build_random_model",
    "load_model",
    "hf_tree_logits",
]

KERNEL_CHOICES = (*KERNELS, *OPT_IN_KERNELS, "auto", "reference")


# ----------------------------------------------------------------------------------------------
# configs and model construction


# RoPE whose frequencies depend on the forward's longest position (HF's dynamic_rope_update): one
# verify forward over a batch rotates a sequence's tree by the longest sequence's frequencies,
# while its cached keys were rotated by its own
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_mla_config(config) -> None:
    """Raise ``ValueError`` unless the config's attention is what ``verify_attention`` supports."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        raise ValueError(f"expected a deepseek_v3 config, got model_type={getattr(config, 'model_type', None)!r}")
    if config.kv_lora_rank != D_V or config.qk_rope_head_dim != D_ROPE:
        raise ValueError(
            f"verify_attention needs kv_lora_rank={D_V} and qk_rope_head_dim={D_ROPE} "
            f"(cache row {D_QK}); this config has kv_lora_rank={config.kv_lora_rank}, "
            f"qk_rope_head_dim={config.qk_rope_head_dim}"
        )
    if config.num_attention_heads > 128:
        raise ValueError(f"at most 128 heads per GPU are supported, config has {config.num_attention_heads}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"rope_type {rope.get('rope_type', rope.get('type'))!r} rescales its frequencies with the "
                         f"longest position of a forward: the cache's keys and a batch's trees would disagree "
                         f"(supported: default, linear, yarn, llama3)")


def tiny_config(**overrides):
    """A CPU-sized DeepseekV3 config (2 layers: one dense, one MoE) with the MLA cache dims 512+64.

    ``initializer_range`` is 0.1 (HF's default 0.02 leaves a tiny random model's logits almost
    blind to attention: a 10% softmax-scale error would move them by less than bf16 noise).
    """
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=D_V,
        q_lora_rank=32,
        qk_rope_head_dim=D_ROPE,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def kimi_k2_attention_config(num_layers: int = 2, **overrides):
    """Attention exactly as Kimi K2 per GPU (TP1): 64 heads, q_lora 1536, nope 128 + rope 64,
    v 128, latent 512, hidden 7168, yarn (factor 32 over 4096, mscale 1/1 as K2 ships); the rest
    shrunk so a few layers fit: dense MLP (intermediate 18432, K2's dense-layer size), vocab 32768.
    """
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=32768,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=num_layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_shared_experts=1,
        n_routed_experts=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=num_layers,  # all layers dense
        kv_lora_rank=D_V,
        q_lora_rank=1536,
        qk_rope_head_dim=D_ROPE,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=131072,  # K2's (= yarn factor 32 x 4096); longer contexts still rotate
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def build_random_model(config, *, seed: int = 0, dtype=torch.float32, device="cpu", attn_implementation="eager"):
    """``DeepseekV3ForCausalLM(config)`` with seeded random weights, in ``dtype`` on ``device``, eval mode.

    Weights are initialised directly on ``device`` (the same seed gives different weights on CPU
    and CUDA). ``attn_implementation`` is the HF attention used by HF's own forward / generate.
    """
    from transformers import DeepseekV3ForCausalLM

    check_mla_config(config)
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(seed)
    # _from_config builds under `dtype` like from_pretrained does (rotary inv_freq stays fp32)
    with torch.device(device):
        model = DeepseekV3ForCausalLM._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def load_model(path: str | Path, *, dtype=torch.bfloat16, device="cpu", attn_implementation="eager"):
    """Load a local ``save_pretrained`` directory (nothing is downloaded)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config.from_pretrained(path, local_files_only=True)
    check_mla_config(config)
    model = DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
    )
    return model.to(device).eval()


# ----------------------------------------------------------------------------------------------
# the phases of a forward


@dataclass(frozen=True)
class Phase:
    """One piece of a model step, run as a unit (eagerly, or captured in a CUDA graph).

    kind: what the time goes to, ``"tree"`` (draft-tree construction), ``"attention"`` (the verify
    kernel), ``"accept"`` (acceptance and KV commit) or ``"rest"`` (everything else).
    name: a label (``"layer0.attention"``). run: reads and writes the step's state, no arguments.
    """

    kind: str
    name: str
    run: Callable[[], None]


PHASE_KINDS = ("attention", "tree", "accept", "rest")


@dataclass
class ForwardState:
    """Tensors handed from one forward phase to the next (:meth:`MLARunner.phases`).

    step: the step's :class:`VerifyStep` (set before the first phase runs); h: ``[T, hidden]``
    hidden states; cos, sin: ``[T, 64]`` RoPE tables; q: ``[T, H, 576]`` absorbed queries of the
    current layer; o_lat: ``[T, H, 512]`` its latent attention output; logits: ``[T, vocab]`` float32.
    """

    step: VerifyStep | None = None
    h: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    q: torch.Tensor | None = None
    o_lat: torch.Tensor | None = None
    logits: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------
# the runner


class MLARunner:
    """Runs a ``DeepseekV3ForCausalLM``'s layers in absorbed-MLA form over a paged latent KV cache.

    Args:
        hf_model: a ``DeepseekV3ForCausalLM`` (eval mode). Its parameters are used in place.
        kernel: ``"naive"``, ``"flash"``, ``"hopper"``, ``"hopper_cuda"``, ``"auto"`` (kernels of
            :func:`verify_attention`) or ``"reference"`` (:func:`kdtree_engine.reference`: float64 on
            the same 16-bit q and cache; for CPU tests of the loop, where the Triton interpreter is
            slow). May be changed between calls.
        cache_dtype: bf16 or fp16: the KV cache and the kernel's q. Default: the model dtype when
            it is 16-bit, else bf16.
    """

    def __init__(self, hf_model, *, kernel: str = "auto", cache_dtype: torch.dtype | None = None):
        if kernel not in KERNEL_CHOICES:
            raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
        self.hf = hf_model
        self.config = hf_model.config
        check_mla_config(self.config)
        self.kernel = kernel
        p = next(hf_model.parameters())
        self.device = p.device
        self.dtype = p.dtype
        if cache_dtype is None:
            cache_dtype = self.dtype if self.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if cache_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the KV cache (and the kernel's q) must be bf16 or fp16, got {cache_dtype}")
        self.cache_dtype = cache_dtype
        c = self.config
        self.num_layers = c.num_hidden_layers
        self.num_heads = c.num_attention_heads
        self.nope = c.qk_nope_head_dim
        self.v_dim = c.v_head_dim
        self.vocab_size = c.vocab_size
        self.layers = list(hf_model.model.layers[: self.num_layers])
        # [H, nope + v, 512] views of kv_b_proj: no copies, the HF parameters stay the source
        self._w_uk = []
        self._w_uv = []
        for layer in self.layers:
            w = layer.self_attn.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, D_V)
            self._w_uk.append(w[:, : self.nope, :])  # [H, nope, 512]
            self._w_uv.append(w[:, self.nope :, :])  # [H, v, 512]
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mod

        self._rope_fn = hf_mod.apply_rotary_pos_emb_interleave if c.rope_interleave else hf_mod.apply_rotary_pos_emb
        self.sm_scale = float(self.layers[0].self_attn.scaling)

    # -- shared pieces ------------------------------------------------------------------------

    def _rope(self, pos: torch.Tensor, like: torch.Tensor):
        cos, sin = self.hf.model.rotary_emb(like, pos.view(1, -1))  # [1, T, 64] in like's dtype
        return cos[0], sin[0]

    def _project(self, li: int, x: torch.Tensor, cos, sin):
        """q (nope, roped rope part) and the cache rows of ``x [T, hidden]`` for layer ``li``."""
        attn = self.layers[li].self_attn
        T = x.shape[0]
        if attn.q_lora_rank is None:
            q = attn.q_proj(x)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q = q.view(T, self.num_heads, self.nope + D_ROPE)
        q_nope, q_rot = torch.split(q, [self.nope, D_ROPE], dim=-1)
        ckv = attn.kv_a_proj_with_mqa(x)
        c, k_rot = torch.split(ckv, [D_V, D_ROPE], dim=-1)
        c = attn.kv_a_layernorm(c)  # [T, 512]
        q_rot, k_rot = self._rope_fn(q_rot, k_rot.view(T, 1, D_ROPE), cos, sin)  # [T, H, 64], [T, 1, 64]
        rows = torch.cat([c, k_rot.view(T, D_ROPE)], dim=-1)  # [T, 576]
        return q_nope, q_rot, c, k_rot, rows

    def _mlp_block(self, li: int, h: torch.Tensor) -> torch.Tensor:
        layer = self.layers[li]
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(self.hf.model.norm(h)).float()

    # -- verify / decode ----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, step: VerifyStep, kv_layers: Sequence[torch.Tensor], attn=None) -> torch.Tensor:
        """One target forward over a batch of draft trees. Writes every node's KV, returns logits.

        ``step``: the step's inputs from :meth:`kdtree_engine.kvpool.KVPool.reserve_step`.
        ``kv_layers[l]``: layer l's cache ``[num_pages, page_size, 576]`` (contiguous; e.g.
        ``KVPool.kv_layers``). ``attn``: a :class:`~kdtree_engine.VerifyAttention` planned for this
        step (``attn.plan(step.kv_lens_host, step.qo_indptr_host)``), run by every layer; without
        it each layer calls :func:`~kdtree_engine.verify_attention`, which plans (one sync).
        Returns the float32 logits ``[T, vocab]`` of every tree node.
        """
        st = ForwardState(step=step)
        for phase in self.phases(st, kv_layers, attn):
            phase.run()
        return st.logits

    def phases(self, st: ForwardState, kv_layers: Sequence[torch.Tensor], attn=None) -> list[Phase]:
        """:meth:`forward` as phases over ``st`` (``st.step`` is read when the first phase runs, so
        an earlier phase may set it): ``embed``, per layer ``layer{l}.qkv`` (norms, projections,
        cache write, absorbed q), ``layer{l}.attention`` (the verify kernel) and ``layer{l}.out``
        (``W_UV``, ``o_proj``, MLP), then ``lm_head`` (``st.logits``). With a planned ``attn``
        (see :meth:`forward`) and a model without MoE layers every phase is free of host syncs
        and of shape changes for a given step shape: it can be captured in a CUDA graph."""
        out = [Phase("rest", "embed", lambda: self._embed(st))]
        for li in range(self.num_layers):
            out += [Phase("rest", f"layer{li}.qkv", lambda li=li: self._qkv(st, li, kv_layers[li])),
                    Phase("attention", f"layer{li}.attention", lambda li=li: self._attend(st, kv_layers[li], attn)),
                    Phase("rest", f"layer{li}.out", lambda li=li: self._out(st, li))]
        out.append(Phase("rest", "lm_head", lambda: setattr(st, "logits", self._logits(st.h))))
        return out

    @property
    def capturable(self) -> bool:
        """True when every layer's MLP is dense: HF's MoE routes tokens with data-dependent shapes
        (host syncs), which a CUDA graph can not hold."""
        return all(type(layer.mlp).__name__ == "DeepseekV3MLP" for layer in self.layers)

    def _embed(self, st: ForwardState) -> None:
        st.h = self.hf.model.embed_tokens(st.step.tokens)  # [T, hidden]
        st.cos, st.sin = self._rope(st.step.rope_pos, st.h)

    def _qkv(self, st: ForwardState, li: int, kv: torch.Tensor) -> None:
        x = self.layers[li].input_layernorm(st.h)
        q_nope, q_rot, _, _, rows = self._project(li, x, st.cos, st.sin)
        kv.view(-1, D_QK).index_copy_(0, st.step.slots, rows.to(kv.dtype))
        T = x.shape[0]
        q = torch.empty(T, self.num_heads, D_QK, dtype=self.cache_dtype, device=self.device)
        # absorbed: q_lat[t, h] = q_nope[t, h] @ W_UK[h]  -> [H, T, 512]
        q[..., :D_V] = torch.bmm(q_nope.transpose(0, 1), self._w_uk[li]).transpose(0, 1)
        q[..., D_V:] = q_rot
        st.q = q

    def _attend(self, st: ForwardState, kv: torch.Tensor, attn) -> None:
        from ..verify import verify_attention
        from ..verify.reference import reference

        s = st.step
        if self.kernel == "reference":
            st.o_lat, _ = reference(st.q, kv, s.page_table, s.kv_lens, s.qo_indptr, s.tree_mask, self.sm_scale)
        elif attn is not None:
            st.o_lat, _ = attn.run(st.q, kv, s.page_table, s.tree_mask, sm_scale=self.sm_scale)
        else:
            st.o_lat, _ = verify_attention(st.q, kv, s.page_table, s.kv_lens, s.qo_indptr, s.tree_mask,
                                           self.sm_scale, kernel=self.kernel)

    def _out(self, st: ForwardState, li: int) -> None:
        T = st.h.shape[0]
        o_lat = st.o_lat.to(self.dtype)  # [T, H, 512]
        o = torch.bmm(o_lat.transpose(0, 1), self._w_uv[li].transpose(1, 2))  # [H, T, v]
        o = self.layers[li].self_attn.o_proj(o.transpose(0, 1).reshape(T, self.num_heads * self.v_dim))
        st.h = self._mlp_block(li, st.h + o)

    # -- prefill ------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, kv_layers: Sequence[torch.Tensor], slots: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Dense causal forward over one sequence's prompt ``tokens [P]`` at positions 0..P-1.

        Writes the latent rows of every position into ``slots [P]`` of each layer's cache and
        returns the float32 logits of the last position ``[vocab]``. ``on_layer(i)`` is called
        after each layer (progress reporting).
        """
        tokens = tokens.to(self.device)
        P = tokens.shape[0]
        pos = torch.arange(P, device=self.device)
        h = self.hf.model.embed_tokens(tokens)
        cos, sin = self._rope(pos, h)
        slots = slots.to(self.device)
        H, nope, vd = self.num_heads, self.nope, self.v_dim
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q_nope, q_rot, c, k_rot, rows = self._project(li, x, cos, sin)
            kv_layers[li].view(-1, D_QK)[slots] = rows.to(kv_layers[li].dtype)
            kvx = attn.kv_b_proj(c).view(P, H, nope + vd)
            k_nope, v = torch.split(kvx, [nope, vd], dim=-1)
            del kvx
            q = torch.cat([q_nope, q_rot], dim=-1).transpose(0, 1)  # [H, P, nope+64]
            k = torch.cat([k_nope, k_rot.expand(P, H, D_ROPE)], dim=-1).transpose(0, 1)
            del k_nope, q_nope, q_rot
            dk = nope + D_ROPE
            v = v.transpose(0, 1)
            if v.shape[-1] != dk and self.device.type == "cuda":
                v = F.pad(v, (0, dk - vd))  # flash attention wants one head dim for q, k, v
            o = _sdpa_causal(q[None], k[None], v[None], attn.scaling)[0, :, :, :vd]  # [H, P, v]
            del q, k, v
            o = attn.o_proj(o.transpose(0, 1).reshape(P, H * vd))
            h = self._mlp_block(li, h + o)
            del o
            if on_layer:
                on_layer(li)
        return self._logits(h[-1:])[0]


def _sdpa_causal(q, k, v, scale):
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


# ----------------------------------------------------------------------------------------------
# HF reference of a verify step


@torch.inference_mode()
def hf_tree_logits(hf_model, prefixes: Sequence[Sequence[int]], trees: Sequence[tuple[Sequence[int], Sequence[int]]]):
    """HF's own forward over ``prefix + tree tokens`` with the equivalent 4-D tree mask.

    ``trees[b] = (tokens, parents)`` in node order (root's parent -1). Sequence by sequence (no
    padding): positions ``0..P-1`` then ``P + depth_j``; a float additive mask ``[1, 1, P+n, P+n]``
    (prefix causal, every node sees the prefix and its ancestors). Returns a list of float32
    ``[n_b, vocab]`` logits of the tree nodes.
    """
    from ..masks import ancestor_matrix

    dev = next(hf_model.parameters()).device
    dtype = next(hf_model.parameters()).dtype
    out = []
    for prefix, (tok, parents) in zip(prefixes, trees):
        P, n = len(prefix), len(tok)
        vis = ancestor_matrix(parents)  # [n, n]
        depth = vis.sum(1) - 1
        allowed = torch.zeros(P + n, P + n, dtype=torch.bool)
        allowed[:P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
        allowed[P:, :P] = True
        allowed[P:, P:] = vis
        mask = torch.zeros(P + n, P + n, dtype=dtype)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        ids = torch.tensor(list(prefix) + list(tok), dtype=torch.long)[None]
        pos = torch.cat([torch.arange(P), P + depth])[None]
        logits = hf_model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask[None, None].to(dev),
                          use_cache=False).logits
        out.append(logits[0, P:].float())
    return out
