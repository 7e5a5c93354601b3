"""Rotary position embeddings as Hugging Face checkpoints use them.

Inverse frequencies with every scaling the supported families read from their config.json
(`linear`, Llama 3.1's `llama3`, `yarn`: transformers' `modeling_rope_utils` is the
reference), YaRN's attention factor (a scale of cos and sin, so of the rotated dims only),
and their application to a head: rotate-half pairs (Llama), on the first R dims only
(partial rotary: GLM-4.5), or interleaved pairs (DeepSeek-V3's `rope_interleave`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from distill.config import ModelConfig, RopeScaling


class Rope(NamedTuple):
    """One layer's RoPE: what the layer scan carries per layer when layers differ."""

    inv_freq: jax.Array  # [R/2] float32: R is the rotated dims of a head
    factor: jax.Array | float  # cos and sin times this (YaRN's attention factor; else 1)


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Inverse frequencies [dim/2] of `dim` rotated dims, with Hugging Face's `linear`,
    `llama3` or `yarn` scaling."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "yarn":
        return _yarn(inv_freq, dim, theta, scaling)
    # llama3: short wavelengths kept, long ones divided by factor, a smooth blend in between
    old_len = scaling.original_max_position_embeddings
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > old_len / lo, inv_freq / scaling.factor, blended)
    return jnp.where(wavelen < old_len / hi, inv_freq, scaled)


def _yarn(inv_freq: jax.Array, dim: int, theta: float, scaling: RopeScaling) -> jax.Array:
    """YaRN (transformers' `_compute_yarn_parameters`): dims that turn more than beta_fast
    times over the original context keep their frequency, those turning fewer than
    beta_slow times are divided by factor, a linear ramp over the dims in between."""

    def correction_dim(rotations: float) -> float:  # the dim turning `rotations` times
        old_len = scaling.original_max_position_embeddings
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def rope_table(cfg: ModelConfig, kind: str) -> Rope:
    """The RoPE of a layer of type `kind`: sliding layers use `rope_local_theta`, unscaled,
    when it is set; under `rope_proportional` (Gemma 4) each kind's over its own head."""
    if cfg.rope_proportional:
        return _proportional(cfg, kind)
    if kind == "sliding" and cfg.rope_local_theta is not None:
        return Rope(rope_frequencies(cfg.rope_dim, cfg.rope_local_theta, None), 1.0)
    scaling = cfg.rope_scaling
    factor = 1.0 if scaling is None else scaling.yarn_attention_factor()
    return Rope(rope_frequencies(cfg.rope_dim, cfg.rope_theta, scaling), factor)


def _proportional(cfg: ModelConfig, kind: str) -> Rope:
    """Gemma 4's RoPE (transformers' `_compute_proportional_rope_parameters`): a sliding
    layer's the default over its whole head at `rope_local_theta`; a full layer's over its
    whole head hd too, frequencies theta^(-2i/hd) for the first int(hd * factor // 2) pairs
    and zero (unrotated) for the rest, so that rotate-half pairs dims (i, i + hd/2)."""
    hd = cfg.kind_hd(kind)
    if kind == "sliding":
        theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        return Rope(rope_frequencies(hd, theta), 1.0)
    angles = int(cfg.partial_rotary_factor * hd // 2)
    rotated = 1.0 / (cfg.rope_theta ** (jnp.arange(0, 2 * angles, 2, dtype=jnp.float32) / hd))
    return Rope(jnp.concatenate([rotated, jnp.zeros((hd // 2 - angles,), jnp.float32)]), 1.0)


def layer_rope(cfg: ModelConfig, i: int) -> Rope:
    """The RoPE of layer `i`: its type's (`rope_table`), or for a layer without RoPE
    (`ModelConfig.rope_layers`, SmolLM3's NoPE layers) zero frequencies and factor 1, a
    rotation by zero that leaves queries and keys as they are, so that the layer scan
    carries one table for every layer and every attention path runs it unchanged."""
    kind = cfg.types()[i]
    table = rope_table(cfg, cfg.attention_type() if kind == "linear" else kind)
    return table if cfg.ropes()[i] else Rope(jnp.zeros_like(table.inv_freq), 1.0)


def apply_rope(
    x_bshd: jax.Array, positions_bs: jax.Array, rope: Rope, interleave: bool = False
) -> jax.Array:
    """x [B, S, heads, hd] with its first R = 2 * len(inv_freq) dims rotated (the rest, under
    partial rotary, unchanged), times the factor. Rotate-half pairs dims (i, i + R/2);
    `interleave` pairs (2i, 2i + 1) and returns the rotated pairs' first members, then
    their second (transformers' `apply_rotary_pos_emb_interleave`), in float32, cast back."""
    r = 2 * rope.inv_freq.shape[-1]
    angles = positions_bs[..., None].astype(jnp.float32) * rope.inv_freq  # [B, S, R/2]
    cos = (jnp.cos(angles) * rope.factor)[:, :, None, :]
    sin = (jnp.sin(angles) * rope.factor)[:, :, None, :]
    x32 = x_bshd.astype(jnp.float32)
    rot, rest = x32[..., :r], x32[..., r:]
    if interleave:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x_bshd.dtype)
