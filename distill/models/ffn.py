"""A block's feed-forward: the gated MLP (column-parallel gate and up, row-parallel down,
summed over `tp`), the routed experts (`distill.models.moe`), or in a model mixing both,
the one its layer's scanned flag picks (`jax.lax.cond`: one compiled block)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distill import collectives as cc
from distill.models import moe

DENSE = ("w_gate", "w_up", "w_down")
WIDE = ("wide_gate", "wide_up", "wide_down")  # Gemma 4's KV-sharing layers', 2 * d_ff wide


def dense(block, h_bsd, tp_axis: str | None, layer=None):
    """The gated MLP of `block` (`distill.models.model.Block`) on h [B, S, D]; where some
    layers' are wide, the one `layer["wide"]` picks."""
    if not any(block.cfg.wide_layers()):
        return _glu(block, h_bsd, tp_axis, layer, DENSE)
    run = lambda names: lambda h: _glu(block, h, tp_axis, layer, names)  # noqa: E731
    return jax.lax.cond(layer["wide"], run(WIDE), run(DENSE), h_bsd)


def _glu(block, h_bsd, tp_axis, layer, names: tuple[str, str, str]):
    dt = h_bsd.dtype
    w = lambda k: block.w(k, layer).astype(dt)  # noqa: E731
    matmul, (gate, up, down) = block.matmul, names
    hidden = moe.glu(block.cfg)(matmul(h_bsd, w(gate)), matmul(h_bsd, w(up)))
    return cc.psum(matmul(hidden, w(down)), tp_axis)


def block_ffn(block, h_bsd, tp_axis, layer, moe_opts, x_bsd=None):
    """The feed-forward output and the expert stats (tokens per expert [E], dropped
    assignments): the dense MLP, the routed experts, or the one `layer["moe"]` picks; in
    Gemma 4's MoE block (`moe_beside_dense`) both (`beside`). h: the normed residual x."""
    cfg = block.cfg
    zero = jnp.zeros_like(h_bsd[0, 0, 0], jnp.int32)  # varying over the mesh as h is
    balance = None
    if moe_opts.get("token_mask") is not None:  # the student's load-balancing sums
        balance = (jnp.zeros((cfg.n_experts,), jnp.float32),) * 2
    none = moe.ExpertLoad(jnp.broadcast_to(zero, (cfg.n_experts,)), zero, balance)

    def routed(h):
        experts = {k: block.w(k, layer) for k in moe.weight_keys(cfg)}
        return moe.moe_ffn(h, experts, cfg, tp_axis=tp_axis, **moe_opts)

    if cfg.moe_beside_dense and cfg.n_experts:
        return beside(block, h_bsd, x_bsd, tp_axis, layer, moe_opts)
    if not cfg.n_experts:
        return dense(block, h_bsd, tp_axis, layer), none
    if not cfg.mixed_ffn():
        return routed(h_bsd)
    return jax.lax.cond(
        layer["moe"], routed, lambda h: (dense(block, h, tp_axis, layer), none), h_bsd
    )


def beside(block, h_bsd, x_bsd, tp_axis, layer, moe_opts):
    """Gemma 4's MoE block (transformers' Gemma4TextDecoderLayer with enable_moe_block): the
    dense MLP on h (the pre-feed-forward norm of the residual x), normed after; the routed
    experts on another norm of x, routed on x itself (the router norms it: `moe.scores`),
    normed after; their sum. (output, expert stats)."""
    norm = block._norm
    y_dense = norm(dense(block, h_bsd, tp_axis, layer), block.post_dense_norm)
    h_moe = cc.gather_positions(norm(x_bsd, block.pre_moe_norm), tp_axis)
    experts = {k: block.w(k, layer) for k in moe.weight_keys(block.cfg)}
    routed, stats = moe.moe_ffn(
        h_moe, experts, block.cfg, tp_axis=tp_axis,
        router_input=cc.gather_positions(x_bsd, tp_axis), **moe_opts,
    )  # fmt: skip
    return y_dense + norm(routed, block.post_moe_norm), stats
