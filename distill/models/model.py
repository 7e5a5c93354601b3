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
from distill import programs
from distill.config import ModelConfig, RopeScaling
from distill.models.attention import attention, resolve_backend

Params = dict  # nested dict of arrays, the layout of `nnx.to_pure_dict(nnx.state(model))`

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# `train.remat`: what a block keeps for the backward pass. none: everything (no recompute);
# block: only its input (the whole block is recomputed); dots: its matmul outputs without a
# batch dimension (the attention core and elementwise ops are recomputed).
REMAT_POLICIES = {
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _dtype(name: str):
    if name not in _DTYPES:  # "auto" must be resolved for the platform first
        raise ValueError(f"compute dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


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


def matmul(x_bsd: jax.Array, w_df: jax.Array) -> jax.Array:
    """x @ w [B, S, F], computed on the [B * S, D] rows (a free reshape): a dot with one
    contracting dimension, whose weight gradient XLA:CPU forms without first copying the
    output's gradient transposed (over [B, S] it contracts two dimensions and does)."""
    b, s, d = x_bsd.shape
    return (x_bsd.reshape(b * s, d) @ w_df).reshape(b, s, w_df.shape[-1])


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

    def qkv(self, x_bsd, positions_bs):
        """Queries [B, S, H, hd] and keys, values [B, S, KV, hd] (local heads), RoPE applied."""
        dt = x_bsd.dtype
        b, s, _ = x_bsd.shape
        h = rms_norm(x_bsd, self.attn_norm[...], self.eps)
        q = matmul(h, self.wq[...].astype(dt)).reshape(b, s, -1, self.hd)
        k = matmul(h, self.wk[...].astype(dt)).reshape(b, s, -1, self.hd)
        v = matmul(h, self.wv[...].astype(dt)).reshape(b, s, -1, self.hd)
        q = rope(q, positions_bs, self.theta, self.rope_scaling)
        k = rope(k, positions_bs, self.theta, self.rope_scaling)
        return q, k, v

    def finish(self, x_bsd, o_bshd, tp_axis: str | None):
        """The block's output from its input and its attention output: the output
        projection, the residuals and the SwiGLU MLP."""
        dt = x_bsd.dtype
        b, s, _ = x_bsd.shape
        x_bsd = x_bsd + cc.psum(matmul(o_bshd.reshape(b, s, -1), self.wo[...].astype(dt)), tp_axis)
        h = rms_norm(x_bsd, self.mlp_norm[...], self.eps)
        gate = jax.nn.silu(matmul(h, self.w_gate[...].astype(dt)))
        up = matmul(h, self.w_up[...].astype(dt))
        return x_bsd + cc.psum(matmul(gate * up, self.w_down[...].astype(dt)), tp_axis)

    def __call__(self, x_bsd, segment_ids_bs, positions_bs, tp_axis: str | None, backend: str):
        x, _ = self.with_kv(x_bsd, segment_ids_bs, positions_bs, tp_axis, backend)
        return x

    def with_kv(self, x_bsd, segment_ids_bs, positions_bs, tp_axis: str | None, backend: str):
        """(the block's output, its keys and values): a prefill fills a KV cache with them."""
        q, k, v = self.qkv(x_bsd, positions_bs)
        o = attention(q, k, v, segment_ids_bs, backend=backend, scale=1 / math.sqrt(self.hd))
        return self.finish(x_bsd, o, tp_axis), (k, v)


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

    def hidden(
        self, tokens_bs, segment_ids_bs, positions_bs, *, tp_axis, dtype, remat, attention,
        rows=None, unroll=False,
    ):  # fmt: skip
        """The final normed hidden states [B, S, D] (before the LM head). `rows`: a sharding
        the activations are held to (the batch's, under fully sharded training), so that XLA
        gathers each layer's weights rather than moving activations between devices.
        `unroll`: each layer its own code rather than one block looped over the stacked
        layers (`student.train.unrolls`)."""
        dt = _dtype(dtype)
        x = cc.embed_lookup(self.embed[...], tokens_bs, tp_axis).astype(dt)
        if rows is not None:
            x = jax.lax.with_sharding_constraint(x, rows)
        backend = resolve_backend(attention, dt, self.cfg.hd, tokens_bs.shape[1])

        def block_fn(block, x):
            return block(x, segment_ids_bs, positions_bs, tp_axis, backend)

        if remat != "none":  # recompute each block in the backward pass, saving per policy
            block_fn = nnx.remat(block_fn, policy=REMAT_POLICIES[remat])

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, unroll=unroll)
        def run_layers(x, block):
            return block_fn(block, x)

        return rms_norm(run_layers(x, self.layers), self.final_norm[...], self.cfg.norm_eps)

    def head(self) -> jax.Array:
        """The LM head [D, V] (with `tp_axis`: this shard's [D, V/tp] vocabulary slice)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def __call__(
        self,
        tokens_bs,
        segment_ids_bs,
        positions_bs,
        *,
        tp_axis=None,
        dtype="float32",
        remat="none",
        attention="reference",
    ):
        """Logits [B, S, V] in float32 (with `tp_axis`: this shard's [B, S, V/tp] slice)."""
        x = self.hidden(
            tokens_bs, segment_ids_bs, positions_bs,
            tp_axis=tp_axis, dtype=dtype, remat=remat, attention=attention,
        )  # fmt: skip
        return logits(x, self.head())


def logits(x_bsd: jax.Array, head_dv: jax.Array) -> jax.Array:
    """x @ head in the hidden states' dtype, accumulated and returned in float32: never
    rounded through bfloat16 (which would bias log-probabilities and top-k)."""
    dt = x_bsd.dtype
    return jnp.einsum("bsd,dv->bsv", x_bsd, head_dv.astype(dt), preferred_element_type=jnp.float32)


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Freshly initialised parameters as a plain nested dict (float32)."""
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(seed))))


def abstract_params(cfg: ModelConfig) -> Params:
    """Shapes and dtypes of the parameters, without allocating them."""
    return nnx.to_pure_dict(_abstract(cfg)[1])  # a new dict: the cached state is untouched


def _abstract(cfg: ModelConfig):
    """(graphdef, abstract state) of the model: built once per config in a process (every
    trace of a forward needs it; `nnx.eval_shape` takes tens of milliseconds). Callers copy
    the state before changing it."""
    return programs.cached(_split_abstract, cfg)


def _split_abstract(cfg: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))


def _module(cfg: ModelConfig, params: Params) -> Transformer:
    graphdef, state = _abstract(cfg)
    state = jax.tree.map(lambda x: x, state)  # a copy: the cached one stays abstract
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def apply_hidden(
    cfg: ModelConfig,
    params: Params,
    tokens,
    segment_ids,
    positions,
    *,
    tp_axis=None,
    dtype="float32",
    remat="none",
    rows=None,
    unroll=False,
) -> tuple[jax.Array, jax.Array]:
    """(final normed hidden states [B, S, D] in the compute dtype, the LM head [D, V]): for
    losses that form the logits a chunk at a time (`distill.models.vocab_loss`). `rows`, `unroll`:
    see `Transformer.hidden`."""
    module = _module(cfg, params)
    x = module.hidden(
        tokens, segment_ids, positions, tp_axis=tp_axis, dtype=dtype, remat=remat,
        attention=cfg.attention, rows=rows, unroll=unroll,
    )  # fmt: skip
    return x, module.head()


def apply(cfg: ModelConfig, params: Params, tokens, segment_ids, positions, **kw) -> jax.Array:
    """Float32 logits of the model on a parameter dict (full weights, or this shard's
    slices under tp); keywords as `apply_hidden` (tp_axis, dtype, remat, rows, unroll)."""
    return logits(*apply_hidden(cfg, params, tokens, segment_ids, positions, **kw))


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
