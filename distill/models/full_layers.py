"""Attention layers that run per kind (Gemma 4: `ModelConfig.full_apart`). Full layers of
their own shapes: a head width of their own (`global_head_dim`, 512 where the sliding
layers' is 256), KV heads of their own (`global_kv_heads`) and values that are the keys'
projection (`attn_k_eq_v`). Their attention weights are a part of their own
(`distill.models.parts`: `full_wq`, `full_wk`, ... stacked over the full layers), and a
block runs either kind's attention as its layer's `full` flag picks (`jax.lax.cond`: one
compiled block), each kind's window and RoPE static in its branch. Keys and values leave a
branch as a pair per kind, zeros of the other kind's shapes, so that a prefill keeps each
kind's cache (`distill.models.decode`).

KV sharing (`kv_shared_layers`): the last layers take their kind's keys and values from the
last earlier layer of that kind (`ModelConfig.kv_stores`) and hold no key or value weights
(parts `kv` and `full_kv`); the layer scan carries one pair per kind from those layers to
the sharing ones (`no_shared`, `share`, `qkv`), as a decode step carries the token's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distill import collectives as cc
from distill.config import ModelConfig
from distill.models import mla
from distill.models.families.gemma4 import (
    NORMS,
    PREFIX,
    hf_names,
    hf_shape,
    key,
    kinds,
    weight_shapes,
)
from distill.models.rope import apply_rope


def attention_weights(cfg: ModelConfig, norm, draw) -> dict:
    """Every attention weight of a layer, name -> a function making it (`draw(shape, out)`:
    a normal draw, `out` an output projection's scale; `norm(width)`: a norm's scale): the
    queries' and output's, the keys' and values' (part `kv`), and where full layers have
    shapes of their own, theirs (`full`, `full_kv`) and the sliding layers' where there
    are any. A block makes those of the parts it holds (`distill.models.parts`)."""
    d, hd, h, kv = cfg.d_model, cfg.hd, cfg.n_heads, cfg.n_kv_heads
    zeros = lambda n: lambda: nnx.Param(jnp.zeros((n,), jnp.float32))  # noqa: E731
    made = {}
    if cfg.mla:
        for name, shape in mla.weight_shapes(cfg).items():
            norms = name in mla.NORMS
            made[name] = lambda s=shape, n=norms: norm(s[0]) if n else draw(s, False)
    else:  # with an output gate, each head's queries then its gate
        made["wq"] = lambda: draw((d, h * hd * (2 if cfg.attn_output_gate else 1)), False)
        made["wk"] = made["wv"] = lambda: draw((d, kv * hd), False)
    if cfg.qkv_bias:
        made.update(bq=zeros(h * hd), bk=zeros(kv * hd), bv=zeros(kv * hd))
    if cfg.qk_norm:  # OLMoE's span all heads' features, the others' each head's
        made["q_norm"] = lambda: norm(h * hd if cfg.qk_norm_full else hd)
        made["k_norm"] = lambda: norm(kv * hd if cfg.qk_norm_full else hd)
    made["wo"] = lambda: draw((h * cfg.v_dim, d), True)
    if cfg.attn_sinks:  # gpt-oss: a logit per query head in its softmax denominator
        made["sinks"] = zeros(h)
    if cfg.o_bias:  # added once, after the sum over tp shards
        made["bo"] = zeros(d)
    if not cfg.full_apart():
        return made
    made = made if "sliding" in cfg.types() else {}
    for name, shape in weight_shapes(cfg).items() if "full" in cfg.types() else ():
        own, out = name in NORMS, name == "full_wo"
        made[name] = lambda s=shape, n=own, o=out: norm(s[0]) if n else draw(s, o)
    return made


def _v_norm(v, eps: float):
    """RMSNorm over each value head's features, without a scale (Gemma 4's v_norm)."""
    v32 = v.astype(jnp.float32)
    return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + eps)).astype(v.dtype)


def qkv(block, x_bsd, positions_bs, rope, tp_axis, layer, kind: str, shared=None):
    """(queries [B, S, H, hd], keys and values [B, S, KV, hd], None) of a `kind` layer of a
    model whose layers run per kind (`ModelConfig.full_apart`, Gemma 4): per-head query and
    key norms, RoPE, values from their own projection or the keys' (`attn_k_eq_v`),
    RMS-normed without scale under `v_norm`. A KV-sharing layer (`layer["kv_shared"]`)
    takes its kind's keys and values from `shared` (`share`) instead."""
    cfg = block.cfg
    hd = cfg.kind_hd(kind)
    w = lambda name: block.w(key(cfg, name, kind), layer)  # noqa: E731
    h = cc.gather_positions(block._norm(x_bsd, block.attn_norm), tp_axis)
    q = block._project(h, w("wq"), None, hd)
    q = apply_rope(block._norm(q, w("q_norm")) if cfg.qk_norm else q, positions_bs, rope)

    def own(h):
        k = block._project(h, w("wk"), None, hd)
        v = k if kind == "full" and cfg.attn_k_eq_v else block._project(h, w("wv"), None, hd)
        v = _v_norm(v, cfg.norm_eps) if cfg.v_norm else v
        k = block._norm(k, w("k_norm")) if cfg.qk_norm else k
        return apply_rope(k, positions_bs, rope), v

    if shared is None:
        return (q, *own(h), None)
    k, v = jax.lax.cond(layer["kv_shared"], lambda h: shared[kinds(cfg).index(kind)], own, h)
    return q, k, v, None


def share(layer: dict, shared: tuple, kind: str, kinds_: tuple, kv) -> tuple:
    """`shared` (a pair of keys and values per kind, `kinds`) after a `kind` layer whose
    keys and values are `kv`: its kind's replaced where the layer is the one its kind's
    sharing layers take them from (`layer["kv_store"]`)."""
    store = layer["kv_store"]
    new = jax.tree.map(lambda n, o: jnp.where(store, n, o), tuple(kv), shared[kinds_.index(kind)])
    return tuple(new if k == kind else old for k, old in zip(kinds_, shared, strict=True))


def no_shared(module, x_bsd, positions_bs) -> tuple:
    """What KV-sharing layers take before any layer ran: zeros per kind of its keys' and
    values' shapes [B, S, KV, hd] (this shard's KV heads), in the compute dtype, varying
    over the mesh axes the keys do (inside `jax.shard_map`): the residual stream's and the
    key weights'."""
    cfg, stacks = module.cfg, module.stacks()
    out = []
    for kind in kinds(cfg):
        name = key(cfg, "wk", kind)
        w = stacks[name] if name in stacks else getattr(module.layers, name)[...]
        hd = cfg.kind_hd(kind)
        shape = (x_bsd.shape[0], positions_bs.shape[1], w.shape[-1] // hd, hd)
        vma = cc.varying(x_bsd) | cc.varying(w)
        out.append(tuple(cc.vary(jnp.zeros(shape, x_bsd.dtype), vma) for _ in range(2)))
    return tuple(out)


def mixer(cfg: ModelConfig, x_bsd, attn, layer: dict | None, states: bool, shared=None):
    """(the output projection's partial sums [B, S, D], keys and values, what KV-sharing
    layers take after this one (`share`; None without sharing)) of a layer whose kind is
    its own (`kinds`): `attn(x, kind)`, by `layer["full"]` where both kinds are present.
    With `states` the keys and values are a pair per kind (`kinds` order), zeros of the
    other kind's shapes; without, None."""
    present = kinds(cfg)

    def run(kind):
        def branch(x):
            o, kv = attn(x, kind)
            after = None if shared is None else share(layer, shared, kind, present, kv)
            if not states:
                return o, None, after
            zero = lambda a: cc.vary(jnp.zeros(a.shape, a.dtype), cc.varying(o))  # noqa: E731
            pairs = [kv if k == kind else jax.tree.map(zero, shape_of(k, x)) for k in present]
            return o, tuple(pairs), after

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


__all__ = ["NORMS", "PREFIX", "hf_names", "hf_shape", "key", "kinds", "mixer", "no_shared", "qkv",
           "share", "slots", "weight_shapes"]  # fmt: skip
