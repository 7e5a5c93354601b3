"""Full-attention layers of their own shapes (Gemma 4: `ModelConfig.full_apart`): a head
width of their own (`global_head_dim`, 512 where the sliding layers' is 256), KV heads of
their own (`global_kv_heads`) and values that are the keys' projection (`attn_k_eq_v`).
Their attention weights are a part of their own (`distill.models.parts`: `full_wq`,
`full_wk`, ... stacked over the full layers), and a block runs either kind's attention as
its layer's `full` flag picks (`jax.lax.cond`: one compiled block), each kind's window and
RoPE static in its branch. Keys and values leave a branch as a pair per kind, zeros of the
other kind's shapes, so that a prefill keeps each kind's cache (`distill.models.decode`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distill import collectives as cc
from distill.config import ModelConfig
from distill.models.families.gemma4 import (
    NORMS,
    PREFIX,
    hf_names,
    hf_shape,
    key,
    kinds,
    weight_shapes,
)


def values(cfg: ModelConfig, kind: str | None, k_raw, v_raw, eps: float):
    """A layer's values from its projections: the keys' projection itself where full
    layers take their values from it (`attn_k_eq_v`), RMS-normed without a scale under
    `v_norm` (Gemma 4)."""
    v = k_raw if kind == "full" and cfg.attn_k_eq_v else v_raw
    if not cfg.v_norm:
        return v
    v32 = v.astype(jnp.float32)
    return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + eps)).astype(v.dtype)


def mixer(cfg: ModelConfig, x_bsd, attn, layer: dict | None, states: bool):
    """(the output projection's partial sums [B, S, D], keys and values) of a layer whose
    kind is its own (`kinds`): `attn(x, kind)`, by `layer["full"]` where both kinds are
    present. With `states` the keys and values are a pair per kind (`kinds` order), zeros
    of the other kind's shapes; without, None."""
    present = kinds(cfg)

    def run(kind):
        def branch(x):
            o, kv = attn(x, kind)
            if not states:
                return o, None
            zero = lambda a: cc.vary(jnp.zeros(a.shape, a.dtype), cc.varying(o))  # noqa: E731
            pairs = [kv if k == kind else jax.tree.map(zero, shape_of(k, x)) for k in present]
            return o, tuple(pairs)

        return branch

    def shape_of(kind, x):
        return jax.eval_shape(lambda x: attn(x, kind)[1], x)

    if len(present) == 1:
        return run(present[0])(x_bsd)
    return jax.lax.cond(layer["full"], run("full"), run("sliding"), x_bsd)


def slots(cfg: ModelConfig):
    """Per layer, its index among the layers of its kind (`kinds`), and each kind's layers."""
    types = np.asarray(cfg.types())
    slot = np.zeros(cfg.n_layers, np.int32)
    layers = {}
    for kind in kinds(cfg):
        at = np.flatnonzero(types == kind) if len(kinds(cfg)) > 1 else np.arange(cfg.n_layers)
        slot[at] = np.arange(len(at))
        layers[kind] = at
    return slot, layers


__all__ = ["NORMS", "PREFIX", "hf_names", "hf_shape", "key", "kinds", "mixer", "slots", "values",
           "weight_shapes"]  # fmt: skip
