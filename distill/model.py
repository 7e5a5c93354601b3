"""One Llama-style decoder for both roles: RoPE, grouped-query attention, SwiGLU, RMSNorm.

Parallelism enters as an argument, not a copy: `tp_axis=None` is the plain single-device
model (the student, and the reference in tests); `tp_axis="tp"` runs the same code inside
`jax.shard_map` on tensor-parallel shards (the teacher), where every weight holds only this
shard's slice. The code therefore reads local sizes off the weights' shapes (heads per
shard = columns / head_dim), never off the config, and the only cross-shard steps are the
collectives of `distill.collectives`.

Layers are stacked ([L, ...] leading axis) and run with `nnx.scan`: one compiled block.
Parameters travel as plain nested dicts (`nnx.to_pure_dict`); `apply` rebuilds the module
around them at trace time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from distill import collectives as cc
from distill.config import ModelConfig, RopeScaling

Params = dict  # nested dict of arrays, the layout of `nnx.to_pure_dict(nnx.state(model))`

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(hd: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Inverse frequencies [hd/2], with Hugging Face's `linear` or `llama3` scaling."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3: short wavelengths kept, long ones divided by factor, a smooth blend in between
    old_len = scaling.original_max_position_embeddings
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > old_len / lo, inv_freq / scaling.factor, blended)
    return jnp.where(wavelen < old_len / hi, inv_freq, scaled)


def rope(
    x_bshd: jax.Array,
    positions_bs: jax.Array,
    theta: float,
    scaling: RopeScaling | None = None,
) -> jax.Array:
    """Rotary embedding, rotate-half convention (as Hugging Face Llama)."""
    hd = x_bshd.shape[-1]
    inv_freq = rope_frequencies(hd, theta, scaling)
    angles = positions_bs[..., None].astype(jnp.float32) * inv_freq  # [B, S, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x32 = x_bshd.astype(jnp.float32)
    x1, x2 = x32[..., : hd // 2], x32[..., hd // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x_bshd.dtype)


def attention_mask(segment_ids_bs: jax.Array) -> jax.Array:
    """[B, 1, 1, S, S] causal mask that never crosses a packed-document boundary."""
    s = segment_ids_bs.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    same_doc = segment_ids_bs[:, :, None] == segment_ids_bs[:, None, :]
    return (causal & same_doc)[:, None, None, :, :]


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, hd, f = cfg.d_model, cfg.hd, cfg.d_ff
        std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = nnx.Param(jnp.ones((d,), jnp.float32))
        self.wq = _normal(rngs, (d, cfg.n_heads * hd), std)
        self.wk = _normal(rngs, (d, cfg.n_kv_heads * hd), std)
        self.wv = _normal(rngs, (d, cfg.n_kv_heads * hd), std)
        self.wo = _normal(rngs, (cfg.n_heads * hd, d), out_std)
        self.mlp_norm = nnx.Param(jnp.ones((d,), jnp.float32))
        self.w_gate = _normal(rngs, (d, f), std)
        self.w_up = _normal(rngs, (d, f), std)
        self.w_down = _normal(rngs, (f, d), out_std)
        self.hd, self.eps, self.theta = hd, cfg.norm_eps, cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling

    def __call__(self, x_bsd, mask, positions_bs, tp_axis: str | None):
        dt = x_bsd.dtype
        b, s, _ = x_bsd.shape
        h = rms_norm(x_bsd, self.attn_norm[...], self.eps)
        q = (h @ self.wq[...].astype(dt)).reshape(b, s, -1, self.hd)  # local heads
        k = (h @ self.wk[...].astype(dt)).reshape(b, s, -1, self.hd)
        v = (h @ self.wv[...].astype(dt)).reshape(b, s, -1, self.hd)
        q = rope(q, positions_bs, self.theta, self.rope_scaling)
        k = rope(k, positions_bs, self.theta, self.rope_scaling)
        n_kv = k.shape[2]
        q = q.reshape(b, s, n_kv, q.shape[2] // n_kv, self.hd)  # [B, S, KV, G, hd]
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask, scores / math.sqrt(self.hd), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        o = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, -1)
        x_bsd = x_bsd + cc.psum(o @ self.wo[...].astype(dt), tp_axis)

        h = rms_norm(x_bsd, self.mlp_norm[...], self.eps)
        gate = jax.nn.silu(h @ self.w_gate[...].astype(dt))
        up = h @ self.w_up[...].astype(dt)
        return x_bsd + cc.psum((gate * up) @ self.w_down[...].astype(dt), tp_axis)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _normal(rngs, (cfg.vocab_size, cfg.d_model), 0.02)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.layers = make_layers(rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,), jnp.float32))
        if not cfg.tie_embeddings:
            self.lm_head = _normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02)

    def __call__(self, tokens_bs, segment_ids_bs, positions_bs, *, tp_axis=None, dtype="float32"):
        """Logits [B, S, V] (with `tp_axis`: this shard's [B, S, V/tp] vocabulary slice)."""
        dt = _DTYPES[dtype]
        x = cc.embed_lookup(self.embed[...], tokens_bs, tp_axis).astype(dt)
        mask = attention_mask(segment_ids_bs)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run_layers(x, block):
            return block(x, mask, positions_bs, tp_axis)

        x = rms_norm(run_layers(x, self.layers), self.final_norm[...], self.cfg.norm_eps)
        head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return (x @ head.astype(dt)).astype(jnp.float32)


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Freshly initialised parameters as a plain nested dict (float32)."""
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(seed))))


def abstract_params(cfg: ModelConfig) -> Params:
    """Shapes and dtypes of the parameters, without allocating them."""
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))))


def apply(
    cfg: ModelConfig,
    params: Params,
    tokens,
    segment_ids,
    positions,
    *,
    tp_axis=None,
    dtype="float32",
) -> jax.Array:
    """Run the model on a parameter dict (full weights, or this shard's slices under tp)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    return model(tokens, segment_ids, positions, tp_axis=tp_axis, dtype=dtype)


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token (PaLM appendix B): 2 * matmul params + 4 * L * S * H * hd.

    Training (forward + backward) is 3x this.
    """
    embed = cfg.vocab_size * cfg.d_model
    matmul_params = param_count(cfg) - embed * (1 if cfg.tie_embeddings else 2) + embed
    matmul_params -= (2 * cfg.n_layers + 1) * cfg.d_model  # norms are not matmuls
    attn = 4 * cfg.n_layers * seq_len * cfg.n_heads * cfg.hd  # QK^T and PV, not halved
    return 2.0 * matmul_params + attn
