"""Gemma 2 and Gemma 3 text: norms offset by one, four norms per block, embeddings scaled
by sqrt(d_model), a query scale of their own, soft-caps (Gemma 2's on attention too),
sliding layers with every n-th full, and Gemma 3's own RoPE base for the sliding layers."""

from __future__ import annotations

from distill.models.families.record import Family, every_nth, register


def _read(raw: dict, where) -> dict:
    scalar = raw.get("query_pre_attn_scalar", 256)
    return {
        "norm_offset": 1.0,
        "post_norms": True,
        "embed_scale": True,
        "query_scale": scalar**-0.5,  # as transformers computes it
        "attn_softcap": raw.get("attn_logit_softcapping"),
        "final_softcap": raw.get("final_logit_softcapping"),
    }


def _write(cfg) -> dict:
    scalar = cfg.scale() ** -2
    whole = abs(scalar - round(scalar)) < 1e-6  # written as the integer it was read from
    keys = {
        "query_pre_attn_scalar": round(scalar) if whole else scalar,
        "final_logit_softcapping": cfg.final_softcap,
    }
    if cfg.family == "gemma2":
        keys["attn_logit_softcapping"] = cfg.attn_softcap
    return keys


GEMMA_PARTS = ("norm offset 1", "post-attention and post-MLP norms", "embedding scale",
               "query scale", "GeGLU", "sliding window every n-th full")  # fmt: skip
GEMMA_CHAT = (
    "Its template names the assistant `model` and folds a system turn into the first user turn."
)

GEMMA2 = register(
    Family(
        model_type="gemma2",
        architecture="Gemma2ForCausalLM",
        parts=(*GEMMA_PARTS, "attention and final soft-caps"),
        read=_read,
        write=_write,
        windows=every_nth(2),
        tied_by_default=True,
        activation_key="hidden_activation",
        chat=GEMMA_CHAT,
    )
)
GEMMA3 = register(
    Family(
        model_type="gemma3_text",
        architecture="Gemma3ForCausalLM",
        parts=(*GEMMA_PARTS, "per-head query/key RMSNorm", "local RoPE base"),
        read=lambda raw, where: {"qk_norm": True, **_read(raw, where)},
        write=_write,
        windows=every_nth(6, "sliding_window_pattern"),
        rope_per_layer_type=True,
        tied_by_default=True,
        activation_key="hidden_activation",
        chat=GEMMA_CHAT,
    )
)
