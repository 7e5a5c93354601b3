"""Mixtral and OLMoE: mixtures of experts on Mistral's and Llama's attention (OLMoE's
query/key norms span all heads' features together)."""

from __future__ import annotations

from distill.errors import DistillError
from distill.models.families.moe import read_experts, write_experts
from distill.models.families.record import Family, all_sliding, register


def _write_olmoe(cfg) -> dict:
    if cfg.hd * cfg.n_heads != cfg.d_model:
        raise DistillError(
            f"export: student.model.head_dim={cfg.hd} cannot be written as an olmoe checkpoint "
            f"(its heads are d_model / n_heads = {cfg.d_model // cfg.n_heads} wide)"
        )
    return write_experts(cfg)


MIXTRAL = register(
    Family(
        model_type="mixtral",
        architecture="MixtralForCausalLM",
        parts=("sliding window", "routed experts (softmax top-k, renormalised)"),
        read=lambda raw, where: read_experts(raw, always_norm=True),
        write=lambda cfg: write_experts(cfg, n_key="num_local_experts", norm=False),
        windows=all_sliding,
        writes_layer_types=False,
        moe_prefix="block_sparse_moe.",
        expert_names={"we_gate": "w1.weight", "we_up": "w3.weight", "we_down": "w2.weight"},
        dense="mistral",
        chat="Mistral's template: the system message moves into the last user turn.",
    )
)
OLMOE = register(
    Family(
        model_type="olmoe",
        architecture="OlmoeForCausalLM",
        parts=("query/key RMSNorm over all heads", "routed experts (softmax top-k)"),
        read=lambda raw, where: {"qk_norm": True, "qk_norm_full": True, **read_experts(raw)},
        write=_write_olmoe,
    )
)
