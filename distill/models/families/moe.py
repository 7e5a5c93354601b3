"""The routed-experts keys of config.json that several families share, read and written
in one place: how many experts, how many per token, whether the top-k weights are
renormalised, each expert's width, and which layers stay dense."""

from __future__ import annotations


def read_experts(raw: dict, *, always_norm: bool = False, qwen_layers: bool = False) -> dict:
    """n_experts (`num_experts` or Mixtral's `num_local_experts`), experts_per_token,
    norm_topk_prob (Mixtral always renormalises: it takes the softmax of the top-k
    logits). `qwen_layers`: each expert's width is `moe_intermediate_size`, and the layers
    of `mlp_only_layers`, and those off `decoder_sparse_step`, are dense."""
    keys = {
        "n_experts": raw.get("num_experts", raw.get("num_local_experts")),
        "experts_per_token": raw.get("num_experts_per_tok", 2),
        "norm_topk_prob": always_norm or bool(raw.get("norm_topk_prob")),
    }
    if qwen_layers:
        keys["d_ff_expert"] = raw["moe_intermediate_size"]
        only, step = set(raw.get("mlp_only_layers") or []), raw.get("decoder_sparse_step", 1)
        moe = [i not in only and (i + 1) % step == 0 for i in range(raw["num_hidden_layers"])]
        keys["dense_layers"] = tuple(i for i, m in enumerate(moe) if not m)
    return keys


def write_experts(cfg, *, n_key: str = "num_experts", norm: bool = True,
                  qwen_layers: bool = False) -> dict:  # fmt: skip
    """The inverse of `read_experts`: Mixtral's and OLMoE's intermediate_size is each
    expert's width, Qwen's the dense layers' beside moe_intermediate_size. `norm`: whether
    config.json says norm_topk_prob (Mixtral's does not: it always renormalises)."""
    keys = {n_key: cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token}
    if qwen_layers:
        keys.update(
            moe_intermediate_size=cfg.f_expert,
            mlp_only_layers=list(cfg.dense_layers),
            decoder_sparse_step=1,
        )
    else:
        keys["intermediate_size"] = cfg.f_expert
    if norm:
        keys["norm_topk_prob"] = cfg.norm_topk_prob
    return keys
