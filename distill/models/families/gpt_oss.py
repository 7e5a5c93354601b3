"""gpt-oss (20b, 120b): attention sinks, biases on every attention projection, 128-token
sliding layers alternating with full ones, YaRN RoPE, and a mixture of experts whose router
has a bias and takes the softmax of its top-k logits, whose experts have biases and the
clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 * gate), both clamped at 7), stored fused:
`mlp.experts.gate_up_proj` [E, D, 2F] with gate and up interleaved column by column, and
`mlp.experts.down_proj` [E, F, D] (in MXFP4 in the released files: `teacher.quantized`)."""

from __future__ import annotations

from distill.models.families.record import Family, register


def _read(raw: dict, where) -> dict:
    return {
        "qkv_bias": True,
        "o_bias": True,
        "attn_sinks": True,
        "n_experts": raw.get("num_local_experts", 128),
        "experts_per_token": raw.get("num_experts_per_tok", 4),
        "d_ff_expert": raw["intermediate_size"],
        "norm_topk_prob": True,  # the softmax over the k chosen logits
        "router_bias": True,
        "expert_bias": True,
        "activation": "swiglu_clamped",
        "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
    }


def _write(cfg) -> dict:
    return {
        "attention_bias": True,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "intermediate_size": cfg.f_expert,
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha,
        "hidden_act": "silu",
    }


GPT_OSS = register(
    Family(
        model_type="gpt_oss",
        architecture="GptOssForCausalLM",
        parts=(
            "attention sinks",
            "q/k/v/o biases",
            "sliding window (alternating)",
            "YaRN",
            "routed experts (router bias, softmax of the top-k logits)",
            "expert biases",
            "clamped SwiGLU",
            "fused expert tensors",
        ),  # fmt: skip
        read=_read,
        write=_write,
        accepts=frozenset({"attention_bias"}),
        router_name="router",
        fused_experts=True,
        chat="harmony: reasoning goes to the analysis channel (`thinking`), the answer to "
        "final; earlier turns' analysis is dropped once a later turn follows.",
    )
)
