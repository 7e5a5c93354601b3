"""DeepSeek-V3 / V3.1 / R1 and Kimi K2 (`deepseek_v3`, `kimi_k2`: one architecture), and
GLM-4.5 / 4.6 (`glm4_moe`), which composes the same routing with grouped-query attention.

DeepSeek-V3: multi-head latent attention (low-rank queries, one compressed KV latent, a
decoupled RoPE key shared by every head, interleaved RoPE, YaRN), DeepSeekMoE routing
(sigmoid scores, a selection-only correction bias, group-limited top-k, a routed scale,
ungated shared experts) and its first `first_k_dense_replace` layers dense. The checkpoint's
multi-token-prediction layers (`num_nextn_predict_layers`, stored past `num_hidden_layers`)
are not part of the decoder and are not read.
"""

from __future__ import annotations

from distill.models.families.record import Family, register

ROUTED = ("routed experts (sigmoid scores, selection-only correction bias)",
          "group-limited top-k", "routed scale", "ungated shared experts",
          "first layers dense")  # fmt: skip


def _deepseek_moe(raw: dict) -> dict:
    """DeepSeekMoE's routing keys (transformers' DeepseekV3Config defaults where absent)."""
    e, k = raw.get("n_routed_experts", 256), raw.get("num_experts_per_tok", 8)
    first, n = raw.get("first_k_dense_replace", 3), raw["num_hidden_layers"]
    width = raw.get("moe_intermediate_size", 2048)
    return {
        "n_experts": e,
        "experts_per_token": k,
        "d_ff_expert": width,
        "dense_layers": tuple(range(min(first, n))),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "router_score": "sigmoid",
        "router_correction_bias": True,
        "n_group": raw.get("n_group") or 1,
        "topk_group": raw.get("topk_group") or 1,
        "routed_scale": float(raw.get("routed_scaling_factor", 1.0)),
        "d_ff_shared": (raw.get("n_shared_experts") or 0) * width,
        "shared_expert_gate": False,
    }


def _write_moe(cfg) -> dict:
    shared, width = cfg.f_shared, cfg.f_expert
    first = len(cfg.dense_layers)
    return {
        "n_routed_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": width,
        "first_k_dense_replace": first,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scale,
        "n_shared_experts": shared // width if shared else 0,
        "num_nextn_predict_layers": 0,
    }


def _deepseek(raw: dict, where) -> dict:
    return {
        **_deepseek_moe(raw),
        "head_dim": None,  # config.json's head_dim is qk_rope_head_dim; MLA has its own widths
        "kv_lora_rank": raw.get("kv_lora_rank", 512),
        "q_lora_rank": raw.get("q_lora_rank"),
        "qk_nope_head_dim": raw.get("qk_nope_head_dim", 128),
        "qk_rope_head_dim": raw.get("qk_rope_head_dim", 64),
        "v_head_dim": raw.get("v_head_dim", 128),
        "rope_interleave": bool(raw.get("rope_interleave", True)),
    }


def _write_deepseek(cfg) -> dict:
    return {
        **_write_moe(cfg),
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,
        "rope_interleave": cfg.rope_interleave,
    }


def _glm(raw: dict, where) -> dict:
    return {
        **_deepseek_moe(raw),
        "qkv_bias": bool(raw.get("attention_bias")),  # q, k, v only: o_proj has none
        "qk_norm": bool(raw.get("use_qk_norm")),
    }


def _write_glm(cfg) -> dict:
    return {**_write_moe(cfg), "attention_bias": cfg.qkv_bias, "use_qk_norm": cfg.qk_norm}


MLA = ("multi-head latent attention", "interleaved RoPE", "YaRN")
DEEPSEEK_CHAT = (
    "Its template drops an earlier answer's reasoning (before </think>) once a later turn "
    "follows: each prefix is rendered whole."
)
DEEPSEEK_V3 = register(
    Family(
        model_type="deepseek_v3",
        architecture="DeepseekV3ForCausalLM",
        parts=(*MLA, *ROUTED),
        read=_deepseek,
        write=_write_deepseek,
        expert_names={
            "we_gate": "gate_proj.weight",
            "we_up": "up_proj.weight",
            "we_down": "down_proj.weight",
        },  # fmt: skip
        shared_names={
            "ws_gate": "shared_experts.gate_proj.weight",
            "ws_up": "shared_experts.up_proj.weight",
            "ws_down": "shared_experts.down_proj.weight",
        },
        extra_layers_key="num_nextn_predict_layers",
        chat=DEEPSEEK_CHAT,
    )
)
KIMI_K2 = register(
    Family(
        model_type="kimi_k2",
        architecture="DeepseekV3ForCausalLM",  # Kimi K2's text model is DeepSeek-V3's
        parts=DEEPSEEK_V3.parts,
        read=_deepseek,
        write=_write_deepseek,
        shared_names=DEEPSEEK_V3.shared_names,
        extra_layers_key="num_nextn_predict_layers",
        exports_as="deepseek_v3",
    )
)
GLM4_MOE = register(
    Family(
        model_type="glm4_moe",
        architecture="Glm4MoeForCausalLM",
        parts=("partial RoPE", "q/k/v biases", *ROUTED),
        read=_glm,
        write=_write_glm,
        accepts=frozenset({"attention_bias"}),
        shared_names=DEEPSEEK_V3.shared_names,
        extra_layers_key="num_nextn_predict_layers",
    )
)
