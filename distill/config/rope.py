"""The config sections' base class and the RoPE scaling section of the model schema
(`distill.config.model`), apart so the model schema stays one idea."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(Section):
    """RoPE frequency scaling of long-context checkpoints (Hugging Face `rope_scaling`, or
    transformers 5's `rope_parameters`; each field is the key of the same name there, `type`
    its `rope_type`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # hashable: a static model attribute

    type: Literal["linear", "llama3", "yarn"] = Field(
        ...,
        description="linear: every frequency / factor; llama3: Llama 3.1's band-wise scaling; "
        "yarn: YaRN's ramp between interpolated and original frequencies, cos and sin scaled "
        "by its attention factor (DeepSeek-V3, Qwen3, gpt-oss).",
    )
    factor: float = Field(..., gt=0, description="Context extension factor.")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: low-frequency band edge.")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: high-frequency band edge.")
    original_max_position_embeddings: int = Field(
        8192, ge=1, description="llama3, yarn: the context length before extension."
    )
    beta_fast: float = Field(
        32.0, gt=0, description="yarn: rotations per context above which a dim is not scaled."
    )
    beta_slow: float = Field(
        1.0, gt=0, description="yarn: rotations per context below which a dim is fully scaled."
    )
    mscale: float | None = Field(
        None,
        description="yarn: the attention factor's numerator coefficient (with mscale_all_dim).",
    )
    mscale_all_dim: float | None = Field(
        None,
        description="yarn: the attention factor's denominator coefficient; with latent "
        "attention (kv_lora_rank) the softmax scale is also multiplied by "
        "(0.1 * mscale_all_dim * ln(factor) + 1)^2, as DeepSeek-V3 does.",
    )
    attention_factor: float | None = Field(
        None,
        gt=0,
        description="yarn: cos and sin are multiplied by this; None: from factor, mscale and "
        "mscale_all_dim (transformers' formula).",
    )
    truncate: bool = Field(
        True, description="yarn: round the ramp's ends to whole dims (gpt-oss: false)."
    )

    def yarn_attention_factor(self) -> float:
        """The scale of cos and sin (transformers' `_compute_yarn_parameters`): 1 for the
        other types."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, coefficient: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * coefficient * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0
