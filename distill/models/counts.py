"""What a model costs, from its config alone: parameters (stored, unused, active) and
forward FLOPs per token, as the planner, remat and the benchmarks count them."""

from __future__ import annotations

import math

import jax

from distill.config import ModelConfig
from distill.models import linear_attention, parts
from distill.models.model import abstract_params
from distill.models.parts import window_of


def stored_param_count(cfg: ModelConfig, union: bool = False) -> int:
    """Parameters stored: each part of a layer in the layers that hold it
    (`distill.models.parts.apart`); with `union` (pipeline stages' one-shape stack) every
    part in every layer (`unused_param_count`)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg, union)))


def unused_param_count(cfg: ModelConfig, union: bool = False) -> int:
    """Stored parameters no token uses: in the one-shape stack (`union`) where dense and
    MoE feed-forwards mix (DeepSeek-V3's first_k_dense_replace, GLM-4.5, Qwen's
    mlp_only_layers), each MoE layer's dense MLP and each dense layer's router and experts
    (57B of DeepSeek-V3's stack), and where linear-attention layers are (Qwen3.5) each
    linear layer's attention weights and each attention layer's linear ones; without it,
    only the attention weights of a model whose every layer is linear."""
    return stored_param_count(cfg, union) - param_count(cfg)


def _union_unused(cfg: ModelConfig) -> int:
    """The one-shape stack's parameters no token uses: each part's weights in the layers
    that do not hold it (`distill.models.parts.part_layers`)."""
    layers = abstract_params(cfg, union=True)["layers"]
    unused = 0
    for key, x in layers.items():
        held = sum(parts.part_layers(cfg, parts.weight_part(key)))
        unused += (cfg.n_layers - held) * math.prod(x.shape[1:])
    return unused


def param_count(cfg: ModelConfig) -> int:
    """The model's parameters, as its checkpoint holds them."""
    return stored_param_count(cfg, union=True) - _union_unused(cfg)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a token uses: all but the routed experts it is not routed to."""
    per_expert = 3 * cfg.d_model * cfg.f_expert
    per_expert += (2 * cfg.f_expert + cfg.d_model) if cfg.expert_bias else 0
    idle = (cfg.n_experts - cfg.experts_per_token) * per_expert
    return param_count(cfg) - sum(cfg.moe_layers()) * idle


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token (PaLM appendix B): 2 * matmul params + attention's
    (`attention_flops_per_token`) and the linear layers' rule
    (`linear_attention.layer_flops_per_token`), counting only the experts a token is routed
    to (and not the router, a vector-sized matmul). Training (forward + backward) is 3x
    this."""
    embed = cfg.vocab_size * cfg.d_model
    matmul_params = active_param_count(cfg) - embed * (1 if cfg.tie_embeddings else 2) + embed
    n_linear = sum(cfg.linear_layers())
    norms = (4 if cfg.post_norms else 2) * cfg.d_model
    # an attention layer's weights that are not matmuls: query/key norms, biases, sinks
    attn = 2 * cfg.hd if cfg.qk_norm else 0
    if cfg.qk_norm_full:
        attn += (cfg.n_heads + cfg.n_kv_heads) * cfg.hd - 2 * cfg.hd
    if cfg.mla:  # the latents' norms
        attn += cfg.kv_lora_rank + (cfg.q_lora_rank or 0)
    attn += (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.hd if cfg.qkv_bias else 0
    attn += cfg.d_model if cfg.o_bias else 0
    attn += cfg.n_heads if cfg.attn_sinks else 0
    linear = linear_attention.vector_params(cfg) * n_linear
    matmul_params -= cfg.n_layers * norms + (cfg.n_layers - n_linear) * attn + linear
    matmul_params -= cfg.d_model  # the final norm: not matmuls
    mixers = attention_flops_per_token(cfg, seq_len)
    mixers += n_linear * linear_attention.layer_flops_per_token(cfg, seq_len)
    return 2.0 * matmul_params + mixers


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Attention's FLOPs per token over the whole causal square (not halved), keys S or a
    sliding layer's min(window, S): per layer QK^T 2 * keys * H * hd, PV 2 * keys * H *
    v_dim; linear layers have none (`linear_attention.layer_flops_per_token`)."""
    total = 0
    for t in cfg.types():
        if t != "linear":  # a full layer's heads may be wider (Gemma 4's global_head_dim)
            apart = t == "full" and cfg.full_apart()
            width = cfg.kind_hd(t) + (cfg.kind_hd(t) if apart else cfg.v_dim)
            total += min(window_of(cfg, t) or seq_len, seq_len) * width
    return 2.0 * total * cfg.n_heads
