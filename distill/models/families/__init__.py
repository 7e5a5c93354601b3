"""Every checkpoint family the one decoder runs, one record each (`record.Family`),
registered when this package is imported: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2,
Gemma 3, Gemma 4 text, SmolLM3, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V3 (and Kimi K2, its architecture), GLM-4.5 and gpt-oss;
Qwen3.5's text model (linear and full attention layers).

A new family is a new record here (and, only where it brings a new part, the model).
"""

from distill.models.families import (  # noqa: F401
    deepseek,
    gemma,
    gemma4,
    gpt_oss,
    llama,
    mixtral,
    qwen,
    qwen35,
    smollm3,
)
from distill.models.families.record import Family, get, known, names, text_of

__all__ = ["Family", "get", "known", "names", "text_of"]
