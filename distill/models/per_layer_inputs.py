"""Gemma 4's per-layer input embeddings (`ModelConfig.per_layer_input` = P, its
`hidden_size_per_layer_input`): each layer adds, after its feed-forward, a P-wide signal of
the token and of the input embeddings, gated by the layer's own hidden state.

transformers packs every layer's slice in one table `embed_tokens_per_layer` [V, L * P]
and one projection `per_layer_model_projection` [L * P, D]; here each layer holds its own
slices (`ple_embed` [V, P], `ple_model_proj` [D, P]), stacked and scanned with its other
weights, so that a depth-pruned student keeps its layers' slices and nothing else, and a
layer reads its table by the tokens inside the layer scan (vocabulary-parallel over `tp`,
as the embedding). Layer i's input is

    (rms_norm(x0 @ ple_model_proj_i / sqrt(D), ple_proj_norm)
     + ple_embed_i[tokens] * sqrt(P)) / sqrt(2)

(x0: the scaled input embeddings; `ple_proj_norm` [P] shared by the layers), and the layer's
output x becomes x + rms_norm(act(x @ ple_gate) * input @ ple_proj, ple_norm)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from distill import collectives as cc

# A layer's weights (`distill.models.parts`: every layer holds them) and their dims.
LAYER_KEYS = ("ple_embed", "ple_model_proj", "ple_gate", "ple_proj", "ple_norm")


def layer_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """One layer's per-layer-input weights in distill's layout ([in, out])."""
    d, p = cfg.d_model, cfg.per_layer_input
    return {
        "ple_embed": (cfg.vocab_size, p),
        "ple_model_proj": (d, p),
        "ple_gate": (d, p),
        "ple_proj": (p, d),
        "ple_norm": (d,),
    }


def init_params(cfg, draw, norm) -> dict:
    """One layer's fresh per-layer-input weights (none without them): `draw(shape, out)`
    normal draws (`out`: an output projection's scale), `norm(width)` a norm's scale."""
    if not cfg.per_layer_input:
        return {}
    shapes = layer_shapes(cfg)
    out = {k: draw(shape, k == "ple_proj") for k, shape in shapes.items() if k != "ple_norm"}
    return {**out, "ple_norm": norm(cfg.d_model)}


def layer_inputs(module, tokens_bs, x0_bsd) -> dict | None:
    """What every layer reads beside its scanned data (`with_inputs`): the tokens, the
    scaled input embeddings x0 (as the residual stream holds them: under sequence
    parallelism this device's positions) and the shared norm; None without per-layer
    inputs."""
    if not module.cfg.per_layer_input:
        return None
    return {"tokens": tokens_bs, "embeds": x0_bsd, "norm": module.ple_proj_norm[...]}


def with_inputs(layer: dict | None, inputs: dict | None) -> dict | None:
    """A layer's scanned data with the per-layer inputs' sources (`layer_inputs`)."""
    return layer if inputs is None else dict(layer or {}, inputs=inputs)


def act(cfg):
    """The gate's activation: the MLP's (Gemma 4: GELU, tanh approximation)."""
    if cfg.activation == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


def add(block, x_bsd, layer: dict, tp_axis) -> jax.Array:
    """x [B, S, D] (this device's positions under sequence parallelism) plus the layer's
    gated per-layer input (`distill.models.model.Block.residual`)."""
    cfg, dt = block.cfg, x_bsd.dtype
    p, inputs = cfg.per_layer_input, layer["inputs"]
    w = lambda k: block.w(k, layer).astype(dt)  # noqa: E731
    matmul, norm = block.matmul, block._norm
    table = cc.embed_lookup(block.w("ple_embed", layer), inputs["tokens"], tp_axis).astype(dt)
    token = table * jnp.asarray(math.sqrt(p), dt)
    context = matmul(inputs["embeds"], w("ple_model_proj")) * jnp.asarray(cfg.d_model**-0.5, dt)
    per_layer = (norm(context, inputs["norm"]) + token) * jnp.asarray(2**-0.5, dt)
    gated = act(cfg)(matmul(x_bsd, w("ple_gate"))) * per_layer
    return x_bsd + norm(matmul(gated, w("ple_proj")), block.w("ple_norm", layer))
