"""The model schema both roles share: one decoder's shape and how it runs.

A teacher's `teacher.model` is a `ModelConfig`; a student's is the teacher's with the
`student.model` overrides (`StudentModelOverrides`) applied.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from distill.config.model_views import ModelViews
from distill.config.rope import RopeScaling, Section
from distill.models import families

# The attention kernels (`distill.models.attention.BACKENDS` is read from this) and compute
# dtypes.
AttentionBackend = Literal["auto", "reference", "blockwise", "prefix", "cudnn", "splash"]
DType = Literal["auto", "float32", "bfloat16"]
DTYPE_DOC = (
    "Compute dtype. auto: bfloat16 on GPU and TPU, float32 on CPU. Logits, log-softmax, "
    "top-k and losses are float32 either way."
)


def backend_problem(backend: str, softcap: bool, mixed_windows: bool) -> str | None:
    """Why attention `backend` cannot run a model with soft-capped scores (`softcap`) or
    with full and sliding layers mixed (`mixed_windows`: the window is per-layer data);
    None when it can. `auto` never picks a backend with a problem."""
    if backend == "cudnn" and softcap:
        return "cudnn has no attention soft-capping (attn_softcap); use auto or blockwise"
    if backend == "splash" and mixed_windows:
        return (
            "splash takes one static window, and this model mixes full and sliding layers "
            "(layer_types); use auto or blockwise"
        )
    return None


# Checkpoint families whose config.json and tensor names `distill.models.hf` reads: one
# record each in `distill.models.families`.
Family = Literal[families.names()]
LayerType = Literal["full", "sliding", "linear"]

# ModelConfig keys that say how the model runs, not what its weights are: never compared
# with a checkpoint's shape (Hugging Face config.json, a teacher's provenance record).
RUNTIME_KEYS = ("attention",)


class ModelConfig(Section, ModelViews):
    """One decoder for every family: RoPE, grouped-query attention, a gated MLP, RMSNorm.

    The defaults are Llama; the other families (Mistral, Qwen2/3, Gemma 2/3) differ only in
    the keys below `tie_embeddings`, read from their config.json by `distill.models.hf`."""

    vocab_size: int = Field(512, ge=2, description="Vocabulary size (>= tokenizer's).")
    d_model: int = Field(256, ge=1, description="Residual width.")
    n_layers: int = Field(4, ge=1, description="Number of transformer blocks.")
    n_heads: int = Field(8, ge=1, description="Query heads.")
    n_kv_heads: int = Field(4, ge=1, description="Key/value heads (GQA); divides n_heads.")
    head_dim: int | None = Field(
        None,
        description="Per-head width; default d_model/n_heads (not read under latent attention).",
    )
    d_ff: int = Field(704, ge=1, description="Gated MLP hidden width.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE scaling; None: plain RoPE.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(False, description="Share the embedding and LM head.")
    family: Family = Field(
        "llama", description="The checkpoint family (tensor names on load and export)."
    )
    qkv_bias: bool = Field(False, description="Biases on the q, k, v projections (Qwen2).")
    o_bias: bool = Field(False, description="A bias on the attention output projection (gpt-oss).")
    qk_norm: bool = Field(
        False, description="RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3)."
    )
    norm_offset: float = Field(
        0.0, description="Every RMSNorm scales by (offset + weight): 1 for Gemma, 0 elsewhere."
    )
    post_norms: bool = Field(
        False,
        description="Gemma's four norms per block: the attention and MLP outputs are normed "
        "too, before each residual add.",
    )
    activation: Literal["silu", "gelu_tanh", "swiglu_clamped"] = Field(
        "silu",
        description="The gated MLPs' activation (dense and experts): silu (SwiGLU), gelu_tanh "
        "(GeGLU), swiglu_clamped (gpt-oss: gate = min(gate, limit), up = clip(up, -limit, "
        "limit), (up + 1) * gate * sigmoid(alpha * gate); swiglu_limit, swiglu_alpha).",
    )
    swiglu_limit: float = Field(
        7.0, gt=0, description="swiglu_clamped: the clamp of gate and up (gpt-oss swiglu_limit)."
    )
    swiglu_alpha: float = Field(
        1.702, gt=0, description="swiglu_clamped: the sigmoid's gain (gpt-oss swiglu_alpha)."
    )
    embed_scale: bool = Field(
        False, description="Embeddings times sqrt(d_model), in the compute dtype (Gemma)."
    )
    query_scale: float | None = Field(
        None, gt=0, description="Attention score scale; None: 1/sqrt(head_dim)."
    )
    attn_softcap: float | None = Field(
        None, gt=0, description="Attention scores -> cap * tanh(scores / cap) (Gemma 2)."
    )
    attn_sinks: bool = Field(
        False,
        description="A learned logit per query head that joins each query's softmax "
        "denominator and adds no value (gpt-oss's attention sinks, `sinks` [n_heads] per layer).",
    )
    final_softcap: float | None = Field(
        None, gt=0, description="Logits -> cap * tanh(logits / cap) (Gemma 2)."
    )
    sliding_window: int | None = Field(
        None,
        ge=1,
        description="Sliding layers attend to the last this many tokens, themselves included.",
    )
    layer_types: tuple[LayerType, ...] | None = Field(
        None,
        description="Per layer, full or sliding attention, or linear: Gated DeltaNet linear "
        "attention (Qwen3.5, `distill.models.linear_attention`); None: every layer sliding "
        "when sliding_window is set, else full.",
    )
    rope_layers: tuple[bool, ...] | None = Field(
        None,
        description="Per layer, whether it applies RoPE (SmolLM3's no_rope_layers: 1 RoPE, 0 "
        "NoPE, a layer whose queries and keys carry no position); None: every layer.",
    )
    rope_local_theta: float | None = Field(
        None,
        gt=0,
        description="Sliding layers' RoPE base, unscaled (Gemma 3); None: as the full layers.",
    )
    qk_norm_full: bool = Field(
        False,
        description="The query/key RMSNorm spans all heads' features together, not each head "
        "(OLMoE); with qk_norm.",
    )
    n_experts: int = Field(
        0,
        ge=0,
        description="Routed experts per MoE layer; 0: every feed-forward is dense. A student "
        "does not inherit an MoE teacher's experts: it is dense unless student.model sets "
        "this, its student.checkpoint has experts, or student.init is from_teacher.",
    )
    experts_per_token: int = Field(2, ge=1, description="Experts each token is routed to (top-k).")
    d_ff_expert: int | None = Field(
        None, ge=1, description="Each expert's SwiGLU hidden width; None: d_ff."
    )
    norm_topk_prob: bool = Field(
        False,
        description="Renormalise the top-k router probabilities to sum to 1 (Mixtral always; "
        "Qwen2-MoE, Qwen3-MoE and OLMoE per their config).",
    )
    d_ff_shared: int = Field(
        0,
        ge=0,
        description="A shared expert in every MoE layer: a SwiGLU of this hidden width that "
        "every token runs, times sigmoid of a learned gate on the token, added to the routed "
        "experts' output (Qwen2-MoE's shared_expert_intermediate_size); 0: none.",
    )
    shared_expert_gate: bool = Field(
        True,
        description="The shared expert's output times sigmoid(h @ gate) (Qwen2-MoE); false: "
        "added ungated (DeepSeek-V3, GLM-4.5's shared_experts, d_ff_shared = n_shared_experts "
        "* moe_intermediate_size).",
    )
    router_score: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="The router's expert scores from its logits: softmax over the experts "
        "(Mixtral, Qwen-MoE, OLMoE, gpt-oss), or each expert's sigmoid (DeepSeek-V3, Kimi K2, "
        "GLM-4.5). A token's weights are its k chosen scores (renormalised per "
        "norm_topk_prob; softmax renormalised is gpt-oss' softmax over the k chosen logits).",
    )
    router_bias: bool = Field(
        False, description="A learned bias [E] added to the router logits (gpt-oss)."
    )
    router_correction_bias: bool = Field(
        False,
        description="A bias [E] added to the scores for choosing the experts only, the "
        "weights being the unbiased scores (DeepSeek-V3's e_score_correction_bias; not "
        "trained by the gradient, nor decayed).",
    )
    n_group: int = Field(
        1,
        ge=1,
        description="Group-limited routing: the experts in this many equal groups, each "
        "scored by the sum of its two best selection scores; a token's k experts come from "
        "its topk_group best groups (DeepSeek-V3 n_group); 1: no groups.",
    )
    topk_group: int = Field(
        1, ge=1, description="Group-limited routing: the groups kept per token (topk_group)."
    )
    routed_scale: float = Field(
        1.0,
        gt=0,
        description="The routed experts' weights times this (DeepSeek-V3 routed_scaling_factor).",
    )
    expert_bias: bool = Field(
        False, description="Biases on each expert's gate, up and down projections (gpt-oss)."
    )
    dense_layers: tuple[int, ...] = Field(
        (),
        description="In an MoE model, the layers whose feed-forward is the dense one (d_ff) "
        "(Qwen's mlp_only_layers and decoder_sparse_step).",
    )
    moe_beside_dense: bool = Field(
        False,
        description="Gemma 4's MoE block: each MoE layer runs the dense MLP (d_ff) and the "
        "routed experts side by side, each on its own norm of the residual and normed after, "
        "and sums them (enable_moe_block).",
    )
    router_norm: bool = Field(
        False,
        description="The router's input is the residual RMS-normed without a scale, times a "
        "learned scale [D] (`router_scale`) and 1/sqrt(D) (Gemma 4).",
    )
    expert_scale: bool = Field(
        False,
        description="Each chosen expert's weight, after renormalising, times a learned scale "
        "of its expert (`router_expert_scale` [E], Gemma 4's per_expert_scale).",
    )
    partial_rotary_factor: float = Field(
        1.0,
        gt=0,
        le=1,
        description="The share of each head's dims that RoPE rotates: the first "
        "int(head_dim * factor), rotate-half among themselves, the rest pass unrotated "
        "(GLM-4.5: 0.5; config.json's partial_rotary_factor).",
    )
    rope_interleave: bool = Field(
        False,
        description="RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... and returns them "
        "de-interleaved, as transformers' DeepSeek-V3 (its rope_interleave, default true "
        "there); false: rotate-half pairs (x_i, x_i+R/2).",
    )
    kv_lora_rank: int | None = Field(
        None,
        ge=1,
        description="Multi-head latent attention (DeepSeek-V3, Kimi K2) when set: keys and "
        "values come from one shared latent of this width (kv_a_proj_with_mqa, "
        "kv_a_layernorm, kv_b_proj), and head_dim, qkv_bias and qk_norm are not used; "
        "None: grouped-query attention.",
    )
    q_lora_rank: int | None = Field(
        None,
        ge=1,
        description="Latent attention: queries through a low-rank latent of this width "
        "(q_a_proj, q_a_layernorm, q_b_proj); None: one q_proj.",
    )
    qk_nope_head_dim: int | None = Field(
        None, ge=1, description="Latent attention: each query/key head's dims without RoPE."
    )
    qk_rope_head_dim: int | None = Field(
        None,
        ge=2,
        description="Latent attention: each query/key head's RoPE dims (after the others); the "
        "key's are one head shared by every head.",
    )
    v_head_dim: int | None = Field(
        None, ge=1, description="Latent attention: each value head's width."
    )
    attn_output_gate: bool = Field(
        False,
        description="Attention's output times sigmoid of a per-head gate that q_proj also "
        "projects (Qwen3.5: q_proj is 2 * n_heads * head_dim wide, each head's queries then "
        "its gate).",
    )
    global_head_dim: int | None = Field(
        None,
        ge=1,
        description="Full-attention layers' head width where it is their own (Gemma 4's "
        "global_head_dim); None: head_dim. Full layers with a width, KV heads or values of "
        "their own hold attention weights of their own shapes (`full_wq`, ...).",
    )
    global_kv_heads: int | None = Field(
        None,
        ge=1,
        description="Full-attention layers' key/value heads where they are their own (Gemma "
        "4's num_global_key_value_heads, under attention_k_eq_v); None: n_kv_heads.",
    )
    attn_k_eq_v: bool = Field(
        False,
        description="Full-attention layers have no value projection: their values are the "
        "keys' projection before the key norm and RoPE (Gemma 4's attention_k_eq_v).",
    )
    v_norm: bool = Field(
        False, description="RMSNorm without a scale over each value head (Gemma 4)."
    )
    layer_scalar: bool = Field(
        False,
        description="Each layer's output (the whole residual stream) times a stored scalar "
        "of its own (Gemma 4's layer_scalar: a buffer in transformers, not trained here "
        "either: no gradient, no decay).",
    )
    rope_proportional: bool = Field(
        False,
        description="Gemma 4's RoPE: full layers' is transformers' proportional (frequencies "
        "theta^(-2i/hd) over the whole head, the first int(hd * partial_rotary_factor / 2) "
        "nonzero, rotate-half pairs (i, i + hd/2)); sliding layers' the default over their "
        "whole head at rope_local_theta.",
    )
    per_layer_input: int = Field(
        0,
        ge=0,
        description="Per-layer input embeddings' width (Gemma 4's hidden_size_per_layer_input, "
        "`distill.models.per_layer_inputs`): after its feed-forward each layer adds a gated "
        "signal of the token (a table of its own) and of the input embeddings; 0: none.",
    )
    kv_shared_layers: int = Field(
        0,
        ge=0,
        description="The last this many layers take their keys and values from the last "
        "earlier layer of their type and hold no key/value weights (Gemma 4's "
        "num_kv_shared_layers); 0: every layer its own.",
    )
    wide_mlp: bool = Field(
        False,
        description="The KV-sharing layers' MLP is 2 * d_ff wide (Gemma 4's "
        "use_double_wide_mlp); with kv_shared_layers.",
    )
    linear_k_heads: int = Field(
        16, ge=1, description="Linear layers: query/key heads (linear_num_key_heads)."
    )
    linear_v_heads: int = Field(
        32,
        ge=1,
        description="Linear layers: value heads, each with its own state and decay; a "
        "multiple of linear_k_heads (linear_num_value_heads).",
    )
    linear_k_dim: int = Field(
        128, ge=1, description="Linear layers: each query/key head's width (linear_key_head_dim)."
    )
    linear_v_dim: int = Field(
        128, ge=1, description="Linear layers: each value head's width (linear_value_head_dim)."
    )
    linear_conv_kernel: int = Field(
        4,
        ge=1,
        description="Linear layers: the causal depthwise convolution's kernel over q, k and v "
        "(linear_conv_kernel_dim).",
    )
    attention: AttentionBackend = Field(
        "auto",
        description="Attention kernel. auto: cuDNN flash on GPU (bfloat16, no soft-cap), splash "
        "on TPU (not with mixed full and sliding layers), on CPU prefix (64-query blocks "
        "against their causal prefix) up to 512 tokens, blockwise (flash-style XLA, never "
        "S x S) elsewhere. reference: the plain S x S math (tests).",
    )

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads: {self.n_kv_heads} does not divide n_heads {self.n_heads}"
            )
        self._check_rope_and_mla()
        if not self.mla and self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"n_heads: {self.n_heads} does not divide d_model {self.d_model}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"layer_types: {len(self.layer_types)} entries for n_layers {self.n_layers}"
                )
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types: sliding layers need sliding_window")
            if "linear" in self.layer_types and self.linear_v_heads % self.linear_k_heads:
                raise ValueError(
                    f"linear_k_heads: {self.linear_k_heads} does not divide linear_v_heads "
                    f"{self.linear_v_heads}"
                )
        if self.rope_layers is not None and len(self.rope_layers) != self.n_layers:
            raise ValueError(
                f"rope_layers: {len(self.rope_layers)} entries for n_layers {self.n_layers}"
            )
        if self.n_experts:
            if self.experts_per_token > self.n_experts:
                raise ValueError(
                    f"experts_per_token: {self.experts_per_token} exceeds n_experts "
                    f"{self.n_experts}"
                )
            bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(f"dense_layers: layer {bad[0]} is not in 0..{self.n_layers - 1}")
            self._check_groups()
        self._check_full_layers()
        softcap = self.attn_softcap is not None
        problem = backend_problem(self.attention, softcap, self.mixed_windows())
        if problem:
            raise ValueError(f"attention: {problem}")
        return self

    def _check_groups(self) -> None:
        """Group-limited routing needs equal groups of two experts or more (each scored by
        its best two), enough groups kept, and k experts in them."""
        g, e = self.n_group, self.n_experts
        if e % g:
            raise ValueError(f"n_group: {g} does not divide n_experts {e}")
        if g > 1 and e // g < 2:
            raise ValueError(f"n_group: {g} groups of {e // g} expert; each needs two")
        if self.topk_group > g:
            raise ValueError(f"topk_group: {self.topk_group} exceeds n_group {g}")
        if self.experts_per_token > self.topk_group * (e // g):
            raise ValueError(
                f"experts_per_token: {self.experts_per_token} exceeds the "
                f"{self.topk_group * (e // g)} experts of topk_group {self.topk_group} groups"
            )

    def _check_full_layers(self) -> None:
        """Full layers of their own shapes (`full_apart`) come with grouped-query attention
        only, without linear layers, per-layer RoPE or the features no such family has."""
        if self.global_kv_heads is not None and self.n_heads % self.global_kv_heads:
            raise ValueError(
                f"global_kv_heads: {self.global_kv_heads} does not divide n_heads {self.n_heads}"
            )
        self._check_kv_sharing()
        if not self.full_apart():
            return
        unsupported = {
            "kv_lora_rank": self.mla,
            "layer_types": "linear" in self.types(),
            "rope_layers": self.rope_layers is not None,
            "qkv_bias": self.qkv_bias,
            "qk_norm_full": self.qk_norm_full,
            "attn_output_gate": self.attn_output_gate,
            "attn_sinks": self.attn_sinks,
        }
        for key, bad in unsupported.items():
            if bad:
                raise ValueError(
                    f"{key}: not with full layers of their own shapes (global_head_dim, "
                    "global_kv_heads, attn_k_eq_v)"
                )

    def _check_kv_sharing(self) -> None:
        """Each type of the KV-sharing layers has an earlier layer of its own to share."""
        n, shared = self.n_layers, self.kv_shared_layers
        if shared >= n:
            raise ValueError(f"kv_shared_layers: {shared} leaves none of the {n} layers to share")
        types = self.types()
        missing = sorted(set(types[n - shared :]) - set(types[: n - shared]))
        if shared and missing:
            raise ValueError(
                f"kv_shared_layers: {shared} shares {missing[0]} layers' keys and values, but "
                f"no earlier {missing[0]} layer has its own"
            )
        if self.wide_mlp and not shared:
            raise ValueError("wide_mlp: widens the KV-sharing layers' MLP; kv_shared_layers is 0")

    def _check_rope_and_mla(self) -> None:
        mla_keys = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.mla:
            unused = [k for k in mla_keys if getattr(self, k) is not None]
            if unused:
                raise ValueError(f"{unused[0]}: set only with latent attention (kv_lora_rank)")
        else:
            missing = [k for k in mla_keys[1:] if getattr(self, k) is None]
            if missing:
                raise ValueError(f"{missing[0]}: latent attention (kv_lora_rank) needs it")
            if self.n_kv_heads != self.n_heads:
                raise ValueError(
                    f"n_kv_heads: latent attention has a key and a value per query head "
                    f"({self.n_heads}), not {self.n_kv_heads}"
                )
            for key in ("qkv_bias", "qk_norm"):
                if getattr(self, key):
                    raise ValueError(f"{key}: not with latent attention (kv_lora_rank)")
            if self.partial_rotary_factor != 1:
                raise ValueError(
                    "partial_rotary_factor: latent attention rotates qk_rope_head_dim dims"
                )
        if not self.rope_proportional and (self.rope_dim % 2 or self.rope_dim == 0):
            raise ValueError(
                f"RoPE rotates {self.rope_dim} dims of each head; it needs an even number"
            )
