"""One decoder for both roles and every family: RoPE, grouped-query or latent attention
(`distill.models.mla`), a gated MLP, RMSNorm. What Mistral, Qwen2/3, Gemma 2/3 and
DeepSeek-V3 change (biases, query/key norms, norm offset and placement, activation,
embedding scale, soft-caps, sliding windows, RoPE per layer type, partial or interleaved
RoPE, latent attention) is data in `ModelConfig`; a parameter exists only where its family
has it. Gemma 4's layers of two kinds, per-layer inputs and KV sharing are
`distill.models.full_layers` and `distill.models.per_layer_inputs`.

Parallelism enters as an argument, not a copy: `tp_axis=None` is the plain single-device
model (the student, and the reference in tests); `tp_axis="tp"` runs the same code inside
`jax.shard_map` on tensor-parallel shards (the teacher), where every weight holds only this
shard's slice. The code therefore reads local sizes off the weights' shapes (heads per
shard = columns / head_dim), never off the config, and the only cross-shard steps are the
collectives of `distill.collectives`.

Layers are stacked ([L, ...] leading axis) and run with `nnx.scan`: one compiled block. When
layers differ (full and sliding attention, a local RoPE base) each layer's window and RoPE
frequencies are scanned alongside its weights (`layer_data`), not a Python branch per layer.
Parameters travel as plain nested dicts (`nnx.to_pure_dict`); `apply` rebuilds the module
around them at trace time.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from distill import collectives as cc
from distill import programs
from distill.config import ModelConfig
from distill.models import ffn, full_layers, linear_attention, mla, moe, parts, per_layer_inputs
from distill.models.attention import attention, over_rows, resolve_backend
from distill.models.parts import PARTS, apart, is_union, part_layers, weight_part
from distill.models.rope import Rope, apply_rope, layer_rope, rope_table

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


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis in float32, times (offset + scale): Gemma's offset is 1."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scale = scale.astype(jnp.float32)
    return (y * (scale + offset if offset else scale)).astype(x.dtype)


def softcap(z: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(z / cap) (Gemma's logit soft-capping); z unchanged when cap is None."""
    return z if cap is None else cap * jnp.tanh(z / cap)


def matmul(x_bsd: jax.Array, w_df: jax.Array) -> jax.Array:
    """x @ w [B, S, F], computed on the [B * S, D] rows (a free reshape): a dot with one
    contracting dimension, whose weight gradient XLA:CPU forms without first copying the
    output's gradient transposed (over [B, S] it contracts two dimensions and does)."""
    b, s, d = x_bsd.shape
    return (x_bsd.reshape(b * s, d) @ w_df).reshape(b, s, w_df.shape[-1])


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, parts: tuple[str, ...] = PARTS):
        """One layer's weights of the `parts` (`PARTS`) it holds, as far as the model has
        them: a scanned block holds those every layer has, a stack of the layers holding a
        part holds only that part's (`apart`)."""
        d, f = cfg.d_model, cfg.d_ff
        std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)

        def norm(width):  # an effective scale of 1 whatever the offset
            return nnx.Param(jnp.full((width,), 1.0 - cfg.norm_offset, jnp.float32))

        draw = lambda shape, out: _normal(rngs, shape, out_std if out else std)  # noqa: E731
        self.cfg = cfg
        if "all" in parts:
            self.attn_norm, self.mlp_norm = norm(d), norm(d)
            if cfg.post_norms:
                self.post_attn_norm, self.post_mlp_norm = norm(d), norm(d)
            if cfg.layer_scalar:
                self.layer_scalar = nnx.Param(jnp.ones((1,), jnp.float32))
            if cfg.moe_beside_dense:  # Gemma 4's MoE block: each side's norms
                self.post_dense_norm, self.pre_moe_norm, self.post_moe_norm = (
                    norm(d), norm(d), norm(d))  # fmt: skip
            for name, param in per_layer_inputs.init_params(cfg, draw, norm).items():
                setattr(self, name, param)
        for name, make in full_layers.attention_weights(cfg, norm, draw).items():
            if weight_part(name) in parts:  # drawn only where held
                setattr(self, name, make())
        if "linear" in parts:  # Gated DeltaNet's, where the model has linear layers
            for name, param in linear_attention.init_params(cfg, rngs, std, out_std).items():
                setattr(self, name, param)
        if "dense" in parts and cfg.has_dense_ffn():
            self.w_gate, self.w_up, self.w_down = draw((d, f), 0), draw((d, f), 0), draw((f, d), 1)
        if "wide" in parts and any(cfg.wide_layers()):  # Gemma 4's sharing layers', 2 * d_ff
            f = 2 * f
            self.wide_gate, self.wide_up = draw((d, f), 0), draw((d, f), 0)
            self.wide_down = draw((f, d), 1)
        if "moe" in parts and cfg.n_experts:  # the router, the experts, a shared expert
            for name, param in moe.layer_params(cfg, draw).items():
                setattr(self, name, param)

    def w(self, name: str, layer: dict | None) -> jax.Array:
        """This layer's weight `name`: the block's own (scanned with it), or, where only
        some layers hold its part (`apart`), its slot of the part's stack, which the layer
        scan passes in `layer` (`Transformer.stacks`, `layer_data`)."""
        own = getattr(self, name, None)
        if own is not None:
            return own[...]
        slot = layer[f"slot_{weight_part(name)}"]
        return jax.lax.dynamic_index_in_dim(layer["stacks"][name], slot, keepdims=False)

    def _norm(self, x, scale):
        return rms_norm(x, scale[...], self.cfg.norm_eps, self.cfg.norm_offset)

    def _project(self, h, w, b, hd: int | None = None):
        """h @ w (+ b) (arrays), split into heads [B, S, heads, hd]."""
        dt = h.dtype
        y = matmul(h, w.astype(dt))
        if b is not None:
            y = y + b.astype(dt)
        return y.reshape(*h.shape[:2], -1, hd or self.cfg.hd)

    def layer(self, layer: dict | None, kind: str | None = None) -> tuple:
        """(window, `Rope`) of this layer: from `layer`, its scanned data, where layers
        differ in them; else static, from the config or the layer's `kind` (full layers of
        their own shapes, `distill.models.full_layers`)."""
        layer = layer or {}
        if kind is not None:
            return parts.window_of(self.cfg, kind), rope_table(self.cfg, kind)
        kind = self.cfg.attention_type()
        window = layer["window"] if "window" in layer else parts.window_of(self.cfg, kind)
        if "inv_freq" in layer:
            return window, Rope(layer["inv_freq"], layer["rope_factor"])
        return window, layer_rope(self.cfg, 0)

    def _full_norm(self, y_bshd, scale, tp_axis):
        """RMSNorm over all heads' features of y [B, S, heads, hd] (OLMoE), whose heads are
        split over `tp`: the mean square is summed across the shards."""
        y32 = y_bshd.astype(jnp.float32)
        ss = cc.psum_whole(jnp.sum(y32 * y32, axis=(-2, -1), keepdims=True), tp_axis)
        width = y_bshd.shape[-2] * y_bshd.shape[-1] * cc.axis_size(tp_axis)
        y = y32 * jax.lax.rsqrt(ss / width + self.cfg.norm_eps)
        return (y * scale.astype(jnp.float32).reshape(y.shape[-2:])).astype(y_bshd.dtype)

    def qkv(
        self, x_bsd, positions_bs, rope: Rope, tp_axis=None, layer=None, kind=None, shared=None
    ):  # fmt: skip
        """Queries [B, S, H, hd] and keys [B, S, KV, hd], values [B, S, KV, v_dim] (local
        heads), RoPE applied, and the output gate's logits [B, S, H, hd] (else None).
        `layer`: this layer's scanned data (`w`); `kind`: its type where full layers have
        shapes of their own, `shared` the keys and values sharing layers take
        (`distill.models.full_layers.qkv`)."""
        if kind is not None:
            return full_layers.qkv(self, x_bsd, positions_bs, rope, tp_axis, layer, kind, shared)
        bias, normed = self.cfg.qkv_bias, self._norm(x_bsd, self.attn_norm)
        w = functools.partial(self.w, layer=layer)
        if self.cfg.mla:
            weights = {k: w(k) for k in mla.weight_shapes(self.cfg)}
            qkv = mla.qkv(weights, normed, positions_bs, rope, self.cfg, tp_axis, rms_norm, matmul)
            return (*qkv, None)
        h = cc.gather_positions(normed, tp_axis)
        q, gate = self._project(h, w("wq"), w("bq") if bias else None), None
        if self.cfg.attn_output_gate:  # each head's hd queries, then its hd gate logits
            q, gate = jnp.split(q.reshape(*q.shape[:2], -1, 2 * self.cfg.hd), 2, axis=-1)
        k = self._project(h, w("wk"), w("bk") if bias else None)
        v = self._project(h, w("wv"), w("bv") if bias else None)
        if self.cfg.qk_norm and self.cfg.qk_norm_full:
            q = self._full_norm(q, w("q_norm"), tp_axis)
            k = self._full_norm(k, w("k_norm"), tp_axis)
        elif self.cfg.qk_norm:
            q, k = self._norm(q, w("q_norm")), self._norm(k, w("k_norm"))
        inter = self.cfg.rope_interleave
        q, k = apply_rope(q, positions_bs, rope, inter), apply_rope(k, positions_bs, rope, inter)
        return q, k, v, gate

    @staticmethod
    def matmul(x_bsd: jax.Array, w_df: jax.Array) -> jax.Array:
        """The module's `matmul`, looked up at each call (`distill.models.ffn` calls it)."""
        return matmul(x_bsd, w_df)

    def finish(self, x_bsd, o_bshd, tp_axis: str | None, layer=None, moe_opts=None, kind=None):
        """(the block's output, expert stats) from its input and its attention output: the
        output projection, the residuals and the feed-forward (with Gemma's post-norms).
        `moe_opts`: `distill.models.moe.moe_ffn`'s ep_axis and capacity_factor (the
        teacher), layout and token_mask (the student's training step)."""
        b, s = o_bshd.shape[:2]  # x holds S/tp of them under sequence parallelism
        wo = self.w(full_layers.key(self.cfg, "wo", kind), layer)  # `kind`: as `qkv`'s
        o = matmul(o_bshd.reshape(b, s, -1), wo.astype(x_bsd.dtype))
        return self.residual(x_bsd, o, tp_axis, layer, moe_opts)

    def residual(self, x_bsd, o_bsd, tp_axis: str | None, layer=None, moe_opts=None):
        """`finish` from the output projection's partial sums o [B, S, D] (this shard's)."""
        dt = x_bsd.dtype
        o = cc.psum(o_bsd, tp_axis)
        if self.cfg.o_bias:
            o = o + self.w("bo", layer).astype(dt)
        x_bsd = x_bsd + (self._norm(o, self.post_attn_norm) if self.cfg.post_norms else o)
        h = cc.gather_positions(self._norm(x_bsd, self.mlp_norm), tp_axis)
        y, stats = ffn.block_ffn(self, h, tp_axis, layer, moe_opts or {}, x_bsd)
        x_bsd = x_bsd + (self._norm(y, self.post_mlp_norm) if self.cfg.post_norms else y)
        if self.cfg.per_layer_input:
            x_bsd = per_layer_inputs.add(self, x_bsd, layer, tp_axis)
        if self.cfg.layer_scalar:  # Gemma 4: the stream times the layer's scalar, a buffer
            x_bsd = x_bsd * jax.lax.stop_gradient(self.layer_scalar[...]).astype(dt)
        return x_bsd, stats

    def __call__(
        self, x_bsd, segment_ids_bs, positions_bs, tp_axis, backend, layer=None, moe_opts=None,
        attend=None,
    ):  # fmt: skip
        """(the block's output, expert stats: tokens per expert, dropped assignments)."""
        x, _, stats, _ = self.run(
            x_bsd, segment_ids_bs, positions_bs, tp_axis, backend, layer, moe_opts, attend
        )
        return x, stats

    def with_kv(
        self, x_bsd, segment_ids_bs, positions_bs, tp_axis, backend, layer=None, attend=None
    ):  # fmt: skip
        """(the block's output, (its keys and values, its linear layer's decode cache,
        `distill.models.linear_attention.Cache`, None in a model without linear layers)):
        a prefill fills the decode caches with them. `layer`: this layer's scanned data
        (`layer_data`), None when layers are alike. `attend`: as `run`'s."""
        x, kv, _, _ = self.run(
            x_bsd, segment_ids_bs, positions_bs, tp_axis, backend, layer, attend=attend,
            states=True,
        )  # fmt: skip
        return x, kv

    def run(
        self, x_bsd, segment_ids_bs, positions_bs, tp_axis, backend, layer, moe_opts=None,
        attend=None, states=False, shared=None,
    ):  # fmt: skip
        """(the block's output, its keys and values (zeros in a linear layer; with `states`
        paired with the linear layer's decode cache, `with_kv`), its expert stats, the keys
        and values KV-sharing layers take after it (`shared`, the ones before it: Gemma 4,
        `distill.models.full_layers`; None without sharing)). `attend`: attention in place
        of `attention` with `backend` (`hidden`)."""

        def attn(x, kind=None):
            window, rope = self.layer(layer, kind)
            q, k, v, gate = self.qkv(x, positions_bs, rope, tp_axis, layer, kind, shared)
            o = (attend or functools.partial(attention, backend=backend))(
                q, k, v, segment_ids_bs, scale=self.cfg.scale(), window=window,
                softcap=self.cfg.attn_softcap,
                sinks=self.w("sinks", layer) if self.cfg.attn_sinks else None,
            )  # fmt: skip
            o = o if gate is None else o * jax.nn.sigmoid(gate)  # Qwen3.5's, per head and dim
            wo = self.w(full_layers.key(self.cfg, "wo", kind), layer).astype(x.dtype)
            return matmul(o.reshape(*o.shape[:2], -1), wo), (k, v)

        if self.cfg.full_apart():  # each kind its own attention; no linear layers
            o, kv, shared = full_layers.mixer(self.cfg, x_bsd, attn, layer, states, shared)
            kv = (kv, None) if states else kv
        else:
            args = (segment_ids_bs, tp_axis, layer, attn, matmul, states)
            o, *kv = linear_attention.block_mixer(self, x_bsd, *args)  # kv, and the cache
            kv = tuple(kv) if states else kv[0]
        x, stats = self.residual(x_bsd, o, tp_axis, layer, moe_opts)
        return x, kv, stats, shared


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, union: bool = False):
        """`layers`: the blocks scanned over all L layers, holding the parts every layer
        holds; `<part>_layers` for each part only some hold (`apart`): its stack over those
        layers, which the scan indexes by slot (`Block.w`). `union`: every part in
        `layers`, zeros where a layer lacks it (pipeline stages: `to_union`)."""
        self.cfg, self.union = cfg, union
        self.embed = _normal(rngs, (cfg.vocab_size, cfg.d_model), 0.02)
        self.apart = () if union else apart(cfg)

        def make_layers(n: int, parts: tuple[str, ...]):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs, parts)

            return make(rngs)

        self.layers = make_layers(cfg.n_layers, tuple(p for p in PARTS if p not in self.apart))
        for part in self.apart:
            setattr(self, f"{part}_layers", make_layers(sum(part_layers(cfg, part)), (part,)))
        self.final_norm = nnx.Param(jnp.full((cfg.d_model,), 1.0 - cfg.norm_offset, jnp.float32))
        if not cfg.tie_embeddings:
            self.lm_head = _normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02)
        if cfg.per_layer_input:  # shared by every layer's per-layer input
            self.ple_proj_norm = nnx.Param(jnp.full((cfg.per_layer_input,), 1.0 - cfg.norm_offset))

    def hidden(
        self, tokens_bs, segment_ids_bs, positions_bs, *, tp_axis, dtype, remat, attention,
        rows=None, unroll=False, moe_opts=None, attend=None,
    ):  # fmt: skip
        """(the final normed hidden states [B, S, D] (before the LM head), expert stats per
        layer: tokens per expert [L, E], dropped assignments [L]). `rows`: a sharding the
        activations are held to (the batch's, under fully sharded training), so that XLA
        gathers each layer's weights rather than moving activations between devices.
        `unroll`: each layer its own code rather than one block looped over the stacked
        layers (`student.train.unrolls`). `moe_opts`: `distill.models.moe.moe_ffn`'s
        ep_axis and capacity_factor. `attend(q, k, v, segment_ids, *, scale, window,
        softcap, sinks)`: attention in place of the `attention` backend (the student's context
        parallelism, `student.context`)."""
        dt = _dtype(dtype)
        x = self.embed_tokens(tokens_bs, tp_axis, dt)
        if rows is not None:
            x = jax.lax.with_sharding_constraint(x, rows)
        backend = self.backend(attention, dt, tokens_bs.shape[1])
        attend = attend or over_rows(backend, rows)  # a kernel XLA cannot split: per device
        x, stats = self.blocks(
            x, segment_ids_bs, positions_bs, self.layer_data(), tp_axis=tp_axis,
            backend=backend, remat=remat, unroll=unroll, moe_opts=moe_opts, attend=attend,
            inputs=per_layer_inputs.layer_inputs(self, tokens_bs, x),
        )  # fmt: skip
        return self.final(x), stats

    def blocks(
        self, x_bsd, segment_ids_bs, positions_bs, data, *, tp_axis, backend, remat="none",
        unroll=False, moe_opts=None, attend=None, inputs=None,
    ):  # fmt: skip
        """(x [B, S, D] through the stacked layers this module holds, expert stats per
        layer): one block scanned over them with `data` (`layer_data` of those layers, or
        None when layers are alike). A pipeline stage holds a run of the layers and passes
        their slice of the data (`teacher.stages`). `attend`: as `hidden`'s; `inputs`: what
        each layer's per-layer input is made of (`per_layer_inputs.layer_inputs`)."""

        sharing = bool(self.cfg.kv_shared_layers)

        def block_fn(block, carry, layer):  # the carry: x, and what KV-sharing layers take
            x, shared = carry if sharing else (carry, None)
            args = (tp_axis, backend, layer, moe_opts, attend)
            x, _, stats, shared = block.run(x, segment_ids_bs, positions_bs, *args, shared=shared)
            return ((x, shared) if sharing else x), stats

        if remat != "none":  # recompute each block in the backward pass, saving per policy
            block_fn = nnx.remat(block_fn, policy=REMAT_POLICIES[remat])
        stacks = self.stacks()

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0), unroll=unroll)
        def run_layers(x, block, layer):
            layer = per_layer_inputs.with_inputs(parts.with_stacks(layer, stacks), inputs)
            return block_fn(block, x, layer)

        if not sharing:
            return run_layers(x_bsd, self.layers, data)
        start = full_layers.no_shared(self, x_bsd, positions_bs)
        (x, _), stats = run_layers((x_bsd, start), self.layers, data)
        return x, stats

    def layer_data(self) -> dict | None:
        """`layer_data` of this module's layers."""
        return parts.layer_data(self.cfg, self.union)

    def stacks(self) -> dict:
        """The stacks of the parts only some layers hold (`apart`), weight name -> array
        [layers holding it, ...]: passed whole into the layer scan, which indexes each
        layer's slot (`Block.w`)."""
        stacks = {}
        for part in self.apart:
            stacks.update(nnx.to_pure_dict(nnx.state(getattr(self, f"{part}_layers"))))
        return stacks

    def embed_tokens(self, tokens_bs, tp_axis, dt) -> jax.Array:
        """Embeddings [B, S, D] in the compute dtype, times sqrt(D) in that dtype for Gemma
        (as Hugging Face rounds the factor)."""
        x = cc.embed_lookup(self.embed[...], tokens_bs, tp_axis).astype(dt)
        return x * jnp.asarray(math.sqrt(self.cfg.d_model), dt) if self.cfg.embed_scale else x

    def final(self, x_bsd) -> jax.Array:
        """The final norm."""
        return rms_norm(x_bsd, self.final_norm[...], self.cfg.norm_eps, self.cfg.norm_offset)

    def backend(self, attention: str, dt, seq_len: int | None) -> str:
        """The attention backend `attention` stands for with this model's soft-cap and
        windows."""
        cfg = self.cfg
        return resolve_backend(
            attention, dt, max(cfg.hd, cfg.kind_hd("full")), seq_len,
            softcap=cfg.attn_softcap is not None, mixed_windows=cfg.mixed_windows(),
        )  # fmt: skip

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
        x, _ = self.hidden(
            tokens_bs, segment_ids_bs, positions_bs,
            tp_axis=tp_axis, dtype=dtype, remat=remat, attention=attention,
        )  # fmt: skip
        return logits(x, self.head(), self.cfg.final_softcap)


def logits(x_bsd: jax.Array, head_dv: jax.Array, cap: float | None = None) -> jax.Array:
    """x @ head in the hidden states' dtype, accumulated and returned in float32: never
    rounded through bfloat16 (which would bias log-probabilities and top-k); soft-capped
    at `cap` (the model's `final_softcap`)."""
    dt = x_bsd.dtype
    z = jnp.einsum("bsd,dv->bsv", x_bsd, head_dv.astype(dt), preferred_element_type=jnp.float32)
    return softcap(z, cap)


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Freshly initialised parameters as a plain nested dict (float32): every layer weight
    in `layers` (name -> [layers holding it, ...]: `apart`, `layer_slot`)."""
    return parts.flat(nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(seed)))))


def abstract_params(cfg: ModelConfig, union: bool = False) -> Params:
    """Shapes and dtypes of the parameters, without allocating them (`union`: laid out as
    `to_union`)."""
    return parts.flat(nnx.to_pure_dict(_abstract(cfg, union)[1]))  # a new dict: cache untouched


def _abstract(cfg: ModelConfig, union: bool = False):
    """(graphdef, abstract state) of the model: built once per config in a process (every
    trace of a forward needs it; `nnx.eval_shape` takes tens of milliseconds). Callers copy
    the state before changing it."""
    return programs.cached(_split_abstract, cfg, union)


def _split_abstract(cfg: ModelConfig, union: bool):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), union)))


def _module(cfg: ModelConfig, params: Params, union: bool | None = None) -> Transformer:
    """The module around `params`; `union`: whether they hold the one-shape stack
    (`to_union`; None: read off their shapes, which a pipeline stage's slice of the stack
    does not show: `teacher.stages` says)."""
    union = is_union(cfg, params) if union is None else union
    graphdef, state = _abstract(cfg, union)
    state = jax.tree.map(lambda x: x, state)  # a copy: the cached one stays abstract
    nnx.replace_by_pure_dict(state, parts.nested(cfg, params, union))
    return nnx.merge(graphdef, state)


def apply_hidden(
    cfg: ModelConfig, params: Params, tokens, segment_ids, positions, *, tp_axis=None,
    dtype="float32", remat="none", rows=None, unroll=False, moe_opts=None, with_stats=False,
    attend=None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(final normed hidden states [B, S, D] in the compute dtype, the LM head [D, V]): for
    losses that form the logits a chunk at a time (`distill.models.vocab_loss`). `rows`,
    `unroll`, `moe_opts`, `attend`: see `Transformer.hidden`. `with_stats`: the expert stats per
    layer (tokens per expert [L, E], dropped assignments [L]) come third."""
    module = _module(cfg, params)
    x, stats = module.hidden(
        tokens, segment_ids, positions, tp_axis=tp_axis, dtype=dtype, remat=remat,
        attention=cfg.attention, rows=rows, unroll=unroll, moe_opts=moe_opts, attend=attend,
    )  # fmt: skip
    return (x, module.head(), stats) if with_stats else (x, module.head())


def apply(cfg: ModelConfig, params: Params, tokens, segment_ids, positions, **kw) -> jax.Array:
    """Float32 logits of the model on a parameter dict (full weights, or this shard's
    slices under tp); keywords as `apply_hidden` (tp_axis, dtype, remat, rows, unroll)."""
    x, head = apply_hidden(cfg, params, tokens, segment_ids, positions, **kw)
    return logits(x, head, cfg.final_softcap)
