"""Llama (the decoder's defaults) and Mistral (every layer sliding when it has a window)."""

from __future__ import annotations

from distill.models.families.record import Family, all_sliding, register

LLAMA = register(
    Family(
        model_type="llama",
        architecture="LlamaForCausalLM",
        write=lambda cfg: {"mlp_bias": False},
        writes_layer_types=False,
    )
)
MISTRAL = register(
    Family(
        model_type="mistral",
        architecture="MistralForCausalLM",
        parts=("sliding window",),
        windows=all_sliding,
        writes_layer_types=False,
        chat="Its template moves the system message into the last user turn, rewriting "
        "earlier turns: each prefix is rendered whole, never by concatenation.",
    )
)
