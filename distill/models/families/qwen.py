"""Qwen2/2.5 (q, k, v biases), Qwen3 (query/key norms) and their mixtures of experts,
Qwen2-MoE / Qwen1.5-MoE (a shared expert with a sigmoid gate) and Qwen3-MoE. Sliding
layers, where a checkpoint has them, start at `max_window_layers`."""

from __future__ import annotations

from distill.errors import DistillError
from distill.models.families.moe import read_experts, write_experts
from distill.models.families.record import Family, qwen_windows, register

QWEN3_CHAT = (
    "Qwen3's template drops an earlier answer's <think> block once a later turn follows: "
    "each prefix is rendered whole; reasoning goes in as reasoning_content."
)


def _qwen2_moe_windows(raw: dict, n: int, where, kind: str) -> list[str]:
    if raw.get("use_sliding_window"):  # transformers 4 and 5 place its sliding layers differently
        raise DistillError(
            f"{where}: use_sliding_window=True without layer_types is not supported by "
            "qwen2_moe (which layers slide is not said)"
        )
    return qwen_windows(raw, n, where, kind)


def _qwen2_moe(raw: dict, where) -> dict:
    return {
        "qkv_bias": bool(raw.get("qkv_bias", True)),
        **read_experts(raw, qwen_layers=True),
        "d_ff_shared": raw.get("shared_expert_intermediate_size") or 0,
    }


def _write_qwen2_moe(cfg) -> dict:
    return {
        **write_experts(cfg, qwen_layers=True),
        "shared_expert_intermediate_size": cfg.f_shared,
        "qkv_bias": cfg.qkv_bias,
    }


QWEN2 = register(
    Family(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        parts=("q/k/v biases", "sliding window from max_window_layers"),
        read=lambda raw, where: {"qkv_bias": True},  # always, whatever attention_bias says
        windows=qwen_windows,
        sliding_flag=True,
    )
)
QWEN3 = register(
    Family(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        parts=("per-head query/key RMSNorm", "sliding window from max_window_layers"),
        read=lambda raw, where: {"qk_norm": True},
        windows=qwen_windows,
        sliding_flag=True,
        chat=QWEN3_CHAT,
    )
)
QWEN2_MOE = register(
    Family(
        model_type="qwen2_moe",
        architecture="Qwen2MoeForCausalLM",
        parts=(
            "q/k/v biases",
            "routed experts (softmax top-k)",
            "gated shared expert",
            "dense layers by index",
        ),  # fmt: skip
        read=_qwen2_moe,
        write=_write_qwen2_moe,
        windows=_qwen2_moe_windows,
        sliding_flag=True,
        accepts=frozenset({"shared_expert_intermediate_size"}),
        dense="qwen2",
    )
)
QWEN3_MOE = register(
    Family(
        model_type="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        parts=(
            "per-head query/key RMSNorm",
            "routed experts (softmax top-k)",
            "dense layers by index",
        ),  # fmt: skip
        read=lambda raw, where: {"qk_norm": True, **read_experts(raw, qwen_layers=True)},
        write=lambda cfg: write_experts(cfg, qwen_layers=True),
        windows=qwen_windows,
        dense="qwen3",
        chat=QWEN3_CHAT,
    )
)
