"""The model schema both roles share: one decoder's shape and how it runs.

A teacher's `teacher.model` is a `ModelConfig`; a student's is the teacher's with the
`student.model` overrides (`StudentModelOverrides`) applied.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The attention kernels (`distill.models.attention.BACKENDS` is read from this) and compute
# dtypes.
AttentionBackend = Literal["auto", "reference", "blockwise", "prefix", "cudnn", "splash"]
DType = Literal["auto", "float32", "bfloat16"]
DTYPE_DOC = (
    "Compute dtype. auto: bfloat16 on GPU and TPU, float32 on CPU. Logits, log-softmax, "
    "top-k and losses are float32 either way."
)


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(Section):
    """RoPE frequency scaling of long-context checkpoints (Hugging Face `rope_scaling`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # hashable: a static model attribute

    type: Literal["linear", "llama3"] = Field(
        ..., description="linear: every frequency / factor; llama3: Llama 3.1's band-wise scaling."
    )
    factor: float = Field(..., gt=0, description="Context extension factor.")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: low-frequency band edge.")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: high-frequency band edge.")
    original_max_position_embeddings: int = Field(
        8192, ge=1, description="llama3: the context length before extension."
    )


# ModelConfig keys that say how the model runs, not what its weights are: never compared
# with a checkpoint's shape (Hugging Face config.json, a teacher's provenance record).
RUNTIME_KEYS = ("attention",)


class ModelConfig(Section):
    """A Llama-style decoder: RoPE, grouped-query attention, SwiGLU, RMSNorm."""

    vocab_size: int = Field(512, ge=2, description="Vocabulary size (>= tokenizer's).")
    d_model: int = Field(256, ge=1, description="Residual width.")
    n_layers: int = Field(4, ge=1, description="Number of transformer blocks.")
    n_heads: int = Field(8, ge=1, description="Query heads.")
    n_kv_heads: int = Field(4, ge=1, description="Key/value heads (GQA); divides n_heads.")
    head_dim: int | None = Field(None, description="Per-head width; default d_model/n_heads.")
    d_ff: int = Field(704, ge=1, description="SwiGLU hidden width.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE scaling; None: plain RoPE.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(False, description="Share the embedding and LM head.")
    attention: AttentionBackend = Field(
        "auto",
        description="Attention kernel. auto: cuDNN flash on GPU (bfloat16), splash on TPU, on "
        "CPU prefix (64-query blocks against their causal prefix) up to 512 tokens, blockwise "
        "(flash-style XLA, never S x S) elsewhere. reference: the plain S x S math (tests).",
    )

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads: {self.n_kv_heads} does not divide n_heads {self.n_heads}"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"n_heads: {self.n_heads} does not divide d_model {self.d_model}")
        return self

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


class StudentModelOverrides(Section):
    """Any `teacher.model` key; unset keys inherit the teacher's value."""

    vocab_size: int | None = None
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    rope_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    attention: AttentionBackend | None = None
