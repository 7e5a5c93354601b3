"""Sampling from the shared Llama model with a KV cache: prefill, decode, generate.

Pure functions of a parameter dict (`distill.models.model`), jit-able on any mesh; the student's
sampler on the training mesh (`student.generate`) and `distill generate` (student or
teacher) both use them.

A prompt is a batch of rows [B, P] with their segment ids and positions, as packed rows
have them: the continuation extends each row's *last* document (its last segment). Rows of
different prompt lengths are left-padded with segment 0. The prefill runs the prompt
through the model with the configured attention backend (segment-aware: earlier documents
and padding of the row are never attended to by the last one) and keeps every layer's keys
and values in a cache of P + max_new_tokens positions. Each decode step feeds one token per
row, writes its keys and values at the next cache position and attends over the cache
entries of the row's last document (a [B, KV, G, 1, T] score array: O(T) per step).

In a model with linear-attention layers (Qwen3.5's Gated DeltaNet,
`distill.models.linear_attention`) the cache holds keys and values of the attention layers
only, and beside them each linear layer's recurrent state and its convolution's last K - 1
inputs (of the row's last document): a decode step runs its recurrence one token on, O(1)
per step. The layers are then scanned with the caches carried, each layer reading and
writing its own slot (`layer_slots`).

A row stops at a stop id (EOS, or BOS: the start of another document); the stop token is
part of its continuation, what follows is padding and marked invalid.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distill.config import ModelConfig
from distill.models import full_layers, linear_attention, model, parts, per_layer_inputs
from distill.models.attention import over_rows
from distill.models.topk import sort_descending
from distill.types import Batch, Continuations, Prompts

_NEG = jnp.finfo(jnp.float32).min


class Cache(NamedTuple):
    """Every attention layer's keys and values (under latent attention each head's
    expanded k and v, H of them, v narrower than k, not the compressed latent:
    `distill.models.mla`), and every linear-attention layer's state and convolution tails."""

    k: jax.Array  # [L, B, T, KV, hd] in the compute dtype (L: the attention layers)
    v: jax.Array  # [L, B, T, KV, v_dim]: values may be narrower than keys (MLA)
    valid: jax.Array  # [B, T] bool: entries a decode step may attend to
    # Each linear layer's state and convolution tails [L_linear, B, ...]; None without.
    linear: linear_attention.Cache | None = None
    # Where full layers have shapes of their own (Gemma 4, `distill.models.full_layers`) and
    # sliding layers are beside them: the full layers' keys and values [L_full, B, T, ...],
    # k and v above holding the sliding layers'; None otherwise.
    full: tuple[jax.Array, jax.Array] | None = None


def layer_slots(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each layer's slot in its kind's cache [L], the attention layers, the linear
    layers): slot i of a linear layer is its linear cache's i-th entry, of an attention
    layer its keys' and values'."""
    linear = np.asarray(cfg.linear_layers(), bool)
    slots = np.where(linear, np.cumsum(linear) - 1, np.cumsum(~linear) - 1)
    return slots.astype(np.int32), np.flatnonzero(~linear), np.flatnonzero(linear)


def _constrain(x, rows):
    return x if rows is None else jax.lax.with_sharding_constraint(x, rows)


def prefill(
    cfg: ModelConfig, params, prompts: Prompts, total: int, *, dtype: str, rows=None
) -> tuple[jax.Array, Cache]:
    """(float32 logits [B, V] at each row's last prompt token, the cache of `total`
    positions holding the prompt's keys and values)."""
    module = model._module(cfg, params)
    dt = model._dtype(dtype)
    x = _constrain(module.embed_tokens(prompts.tokens, None, dt), rows)
    backend = module.backend(cfg.attention, dt, prompts.tokens.shape[1])
    attend = over_rows(backend, rows)

    stacks, inputs = module.stacks(), per_layer_inputs.layer_inputs(module, prompts.tokens, x)

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    def run_layers(carry, block, layer):  # x, and what KV-sharing layers take (or None)
        layer = per_layer_inputs.with_inputs(parts.with_stacks(layer, stacks), inputs)
        x, kv, _, shared = block.run(
            carry[0], prompts.segment_ids, prompts.positions, None, backend, layer,
            attend=attend, states=True, shared=carry[1],
        )  # fmt: skip
        return (_constrain(x, rows), shared), kv

    # k, v [L, B, P, KV, hd(_v)], the linear layers' caches [L, B, ...] (zeros where the
    # layer is of the other kind: each kind keeps its own layers'); full layers of their own
    # shapes: a pair (k, v) per kind (`full_layers.kinds`)
    shared = full_layers.no_shared(module, x, prompts.positions) if cfg.kv_shared_layers else None
    (x, _), (kv, linear) = run_layers((x, shared), module.layers, module.layer_data())
    full = None
    if cfg.full_apart():  # a pair per kind: each keeps its own layers'
        _, at = full_layers.slots(cfg)
        kinds = full_layers.kinds(cfg)
        pairs = [tuple(a[at[kind]] for a in pair) for kind, pair in zip(kinds, kv, strict=True)]
        (k, v), full = pairs[0], (pairs[1] if len(pairs) > 1 else None)
    else:
        k, v = kv
    if linear is not None:
        _, attn_layers, linear_layers = layer_slots(cfg)
        k, v = k[attn_layers], v[attn_layers]
        linear = jax.tree.map(lambda a: a[linear_layers], linear)
    logits = model.logits(module.final(x[:, -1:]), module.head(), cfg.final_softcap)[:, 0]
    p = prompts.tokens.shape[1]
    pad = ((0, 0), (0, 0), (0, total - p), (0, 0), (0, 0))
    seg = prompts.segment_ids
    last_doc = (seg == seg[:, -1:]) & (seg != 0)
    valid = jnp.pad(last_doc, ((0, 0), (0, total - p)))
    full = None if full is None else tuple(jnp.pad(a, pad) for a in full)
    return logits, Cache(jnp.pad(k, pad), jnp.pad(v, pad), valid, linear, full)


def cached_attention(
    q_b1hd, k_btkd, v_btkd, valid_bt, *, scale=None, softcap=None, window=None, index=None,
    sinks=None,
) -> jax.Array:  # fmt: skip
    """One query per row against the cache: [B, 1, H, hd_v] (v_btkd [B, T, KV, hd_v]),
    float32 scores and softmax. `scale` (default 1/sqrt(hd)), `softcap` and `sinks` (float32
    [H], joining each head's denominator) as `distill.models.attention`; with a `window`,
    only the entries after cache position `index` - window are seen."""
    b, s, h, d = q_b1hd.shape
    n_kv = k_btkd.shape[2]
    q = q_b1hd.reshape(b, s, n_kv, h // n_kv, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k_btkd, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d) if scale is None else scores * scale
    scores = model.softcap(scores, softcap)
    if window is not None:
        valid_bt = valid_bt & (jnp.arange(valid_bt.shape[1]) > index - window)[None, :]
    scores = jnp.where(valid_bt[:, None, None, None, :], scores, _NEG)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink's column joins the softmax and is dropped (transformers' gpt_oss)
        sink = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, n_kv, -1, 1, 1), (*scores.shape[:-1], 1)
        )
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(q.dtype), v_btkd)
    return out.reshape(b, s, h, v_btkd.shape[-1])


def decode_step(
    cfg: ModelConfig, params, tokens_b, positions_b, index, writes_b, cache: Cache, *,
    dtype: str, rows=None,
) -> tuple[jax.Array, Cache]:  # fmt: skip
    """Feed one token per row at cache position `index` (a traced scalar); `writes_b`: the
    rows whose token is real (a finished row's entry stays invalid). Returns (float32
    logits [B, V] of the next token, the updated cache)."""
    module = model._module(cfg, params)
    dt = model._dtype(dtype)
    x = _constrain(module.embed_tokens(tokens_b[:, None], None, dt), rows)
    hit = jnp.arange(cache.valid.shape[1]) == index
    valid = cache.valid | (hit[None, :] & writes_b[:, None])

    stacks = module.stacks()
    inputs = per_layer_inputs.layer_inputs(module, tokens_b[:, None], x)

    def attend(block, x, k_1l, v_1l, layer, kind=None, shared=None):  # a [1, B, T, ...] cache
        """(x, the layer's cache, what KV-sharing layers take after it: `kind`, `shared`
        as `full_layers.qkv`'s, None without sharing)."""
        layer = per_layer_inputs.with_inputs(parts.with_stacks(layer, stacks), inputs)
        window, rope = block.layer(layer, kind)
        q, k, v, gate = block.qkv(x, positions_b[:, None], rope, None, layer, kind, shared)
        if shared is not None:
            shared = full_layers.share(layer, shared, kind, full_layers.kinds(cfg), (k, v))
        at = (0, 0, index, 0, 0)
        k_1l = jax.lax.dynamic_update_slice(k_1l, k[None].astype(k_1l.dtype), at)
        v_1l = jax.lax.dynamic_update_slice(v_1l, v[None].astype(v_1l.dtype), at)
        o = cached_attention(
            q, k_1l[0], v_1l[0], valid, scale=cfg.scale(), softcap=cfg.attn_softcap,
            window=window, index=index, sinks=block.w("sinks", layer) if cfg.attn_sinks else None,
        )  # fmt: skip
        o = o if gate is None else o * jax.nn.sigmoid(gate)  # Qwen3.5's output gate
        x, _ = block.finish(x, o, None, layer, kind=kind)
        return _constrain(x, rows), k_1l, v_1l, shared

    if cfg.full_apart():
        x, (k, v), full = _kinds_layers(cfg, module, x, cache, attend)
        logits = model.logits(module.final(x), module.head(), cfg.final_softcap)
        return logits[:, 0], Cache(k, v, valid, None, full)
    if cache.linear is None:

        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0, 0), out_axes=(nnx.Carry, 0))
        def run_layers(x, block, k_l, v_l, layer):
            x, k_l, v_l, _ = attend(block, x, k_l[None], v_l[None], layer)
            return x, (k_l[0], v_l[0])

        x, (k, v) = run_layers(x, module.layers, cache.k, cache.v, module.layer_data())
        linear = None
    else:
        x, k, v, linear = _mixed_layers(cfg, module, x, cache, attend, rows, stacks)
    logits = model.logits(module.final(x), module.head(), cfg.final_softcap)
    return logits[:, 0], Cache(k, v, valid, linear)


def _mixed_layers(cfg: ModelConfig, module, x, cache: Cache, attend, rows, stacks):
    """(x, keys, values, linear caches) after every layer of a model with linear layers:
    the caches carried through the layer scan, each layer updating its slot (`layer_slots`):
    an attention layer by `attend(block, x, k, v, layer)` on the one-slot window of the
    keys and values [1, B, T, ...], a linear layer by its recurrence."""
    slots = jnp.asarray(layer_slots(cfg)[0])
    data = module.layer_data()

    @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0))
    def run_layers(carry, block, layer, slot):
        def attention(carry):
            x, k, v, linear = carry
            k_l, v_l = (jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=0) for c in (k, v))
            x, k_l, v_l, _ = attend(block, x, k_l, v_l, layer)
            k, v = (jax.lax.dynamic_update_slice_in_dim(c, new, slot, axis=0)
                    for c, new in ((k, k_l), (v, v_l)))  # fmt: skip
            return x, k, v, linear

        def recurrence(carry):
            x, k, v, linear = carry
            mine = jax.tree.map(lambda a: a[slot], linear)
            with_stacks = parts.with_stacks(layer, stacks)
            o, mine = linear_attention.decode_mixer(block, x, mine, model.matmul, with_stacks)
            x, _ = block.residual(x, o, None, with_stacks)
            linear = jax.tree.map(lambda a, n: a.at[slot].set(n), linear, mine)
            return _constrain(x, rows), k, v, linear

        if not cfg.mixed_mixers():  # every layer linear
            return recurrence(carry), None
        return jax.lax.cond(layer["linear"], recurrence, attention, carry), None

    carry = (x, cache.k, cache.v, cache.linear)
    carry, _ = run_layers(carry, module.layers, data, slots)
    return carry


def _kinds_layers(cfg: ModelConfig, module, x, cache: Cache, attend):
    """(x, the sliding layers' (or the one kind's) keys and values, the full layers' or
    None) after every layer of a model whose layers run per kind
    (`distill.models.full_layers`): each kind's cache carried through the layer scan, each
    layer updating its slot of its own kind's by `attend(block, x, k, v, layer, kind,
    shared)`, and under KV sharing the token's keys and values the sharing layers take
    (which write them to caches of their own: each equals its source's)."""
    kinds = full_layers.kinds(cfg)
    slots = jnp.asarray(full_layers.slots(cfg)[0])
    caches = ((cache.k, cache.v), *((cache.full,) if len(kinds) > 1 else ()))
    shared = None
    if cfg.kv_shared_layers:  # [B, 1, KV, hd] per kind, of the token
        shared = tuple(tuple(jnp.zeros((x.shape[0], 1, *c.shape[-2:]), x.dtype) for c in kv)
                       for kv in caches)  # fmt: skip

    @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0))
    def run_layers(carry, block, layer, slot):
        def one(kind):
            def run(carry):
                x, caches, shared = carry
                k, v = caches[kinds.index(kind)]
                k_l, v_l = (jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=0) for c in (k, v))
                x, k_l, v_l, shared = attend(block, x, k_l, v_l, layer, kind, shared)
                k, v = (jax.lax.dynamic_update_slice_in_dim(c, new, slot, axis=0)
                        for c, new in ((k, k_l), (v, v_l)))  # fmt: skip
                caches = tuple((k, v) if i == kinds.index(kind) else c
                               for i, c in enumerate(caches))  # fmt: skip
                return x, caches, shared

            return run

        if len(kinds) == 1:
            return one(kinds[0])(carry), None
        return jax.lax.cond(layer["full"], one("full"), one("sliding"), carry), None

    (x, caches, _), _ = run_layers((x, caches, shared), module.layers, module.layer_data(), slots)
    return x, caches[0], (caches[1] if len(kinds) > 1 else None)


def sample(logits_bv, key, *, temperature: float, top_p: float, vocab_limit: int | None):
    """(token ids [B], their float32 log-probabilities under softmax(logits / temperature)
    (softmax(logits) when greedy), before any top-p cut): greedy at temperature 0, else
    drawn from softmax(logits / temperature) restricted to the smallest set of top ids whose
    probability reaches `top_p`. Padded ids (>= vocab_limit) are never drawn."""
    if vocab_limit is not None and vocab_limit < logits_bv.shape[-1]:
        live = jnp.arange(logits_bv.shape[-1]) < vocab_limit
        logits_bv = jnp.where(live, logits_bv, -jnp.inf)
    z = logits_bv / (temperature or 1.0)
    logp_bv = jax.nn.log_softmax(z, axis=-1)
    tok = jnp.argmax(z, axis=-1) if temperature == 0 else _draw(z, key, top_p)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp_bv, tok[:, None], axis=-1)[:, 0]


def _draw(z, key, top_p: float):
    if top_p < 1.0:
        desc = sort_descending(z)
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the ids ranked above each
        kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1
        cutoff = jnp.take_along_axis(desc, kept - 1, axis=-1)
        z = jnp.where(z >= cutoff, z, -jnp.inf)
    return jax.random.categorical(key, z, axis=-1)


def generate(
    cfg: ModelConfig,
    params,
    prompts: Prompts,
    key,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    stop_ids: tuple[int, ...] = (),
    vocab_limit: int | None = None,
    dtype: str = "float32",
    rows=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(continuation ids [B, N] int32, valid [B, N] bool, their log-probabilities [B, N]
    float32 under the sampling distribution, see `sample`) of N = `max_new_tokens` tokens per
    row. Token t of every row is drawn with `jax.random.fold_in(key, t)`. A row whose last
    prompt token is already a stop id continues with nothing."""
    p, n = prompts.tokens.shape[1], max_new_tokens
    logits, cache = prefill(cfg, params, prompts, p + n, dtype=dtype, rows=rows)
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
    done = jnp.isin(prompts.tokens[:, -1], stops)
    last_pos = prompts.positions[:, -1]

    def body(carry, t):
        logits, cache, done = carry
        tok, logp = sample(
            logits, jax.random.fold_in(key, t),
            temperature=temperature, top_p=top_p, vocab_limit=vocab_limit,
        )  # fmt: skip
        real = ~done
        tok = jnp.where(real, tok, 0)
        done = done | jnp.isin(tok, stops)
        logits, cache = decode_step(
            cfg, params, tok, last_pos + 1 + t, p + t, real, cache, dtype=dtype, rows=rows
        )
        return (logits, cache, done), (tok, real, jnp.where(real, logp, 0.0))

    _, (tokens, valid, logp) = jax.lax.scan(body, (logits, cache, done), jnp.arange(n))
    return tokens.T, valid.T, logp.T


def continuation_batch(prompts: Prompts, tokens_bn, valid_bn, seq_len: int) -> Continuations:
    """The training rows [B, seq_len] of prompts and their continuations: each row is its
    prompt then its continuation (extending the last document, positions counting on),
    then padding (segment 0); `mask` is 1 exactly where the target is a generated token, so
    a loss on it is a loss on the continuation only. P + N must not exceed seq_len + 1."""
    b, p = prompts.tokens.shape
    n = tokens_bn.shape[1]
    if p + n > seq_len + 1:
        raise ValueError(f"prompt {p} + continuation {n} tokens exceed seq_len {seq_len} + 1")
    last_seg, last_pos = prompts.segment_ids[:, -1:], prompts.positions[:, -1:]
    gen_pos = last_pos + 1 + jnp.arange(n, dtype=jnp.int32)[None, :]
    tok = jnp.concatenate([prompts.tokens, jnp.where(valid_bn, tokens_bn, 0)], axis=1)
    seg = jnp.concatenate([prompts.segment_ids, jnp.where(valid_bn, last_seg, 0)], axis=1)
    pos = jnp.concatenate([prompts.positions, jnp.where(valid_bn, gen_pos, 0)], axis=1)
    gen = jnp.concatenate([jnp.zeros((b, p), bool), valid_bn], axis=1)
    pad = ((0, 0), (0, seq_len + 1 - p - n))
    tok, seg, pos, gen = (jnp.pad(x, pad) for x in (tok, seg, pos, gen))
    return Continuations(
        tokens=tok[:, :-1].astype(jnp.int32),
        targets=tok[:, 1:].astype(jnp.int32),
        segment_ids=seg[:, :-1].astype(jnp.int32),
        positions=pos[:, :-1].astype(jnp.int32),
        mask=gen[:, 1:].astype(jnp.float32),
    )


def prompts_of(batch: Batch, prompt_len: int) -> Prompts:
    """The first `prompt_len` tokens of packed rows, as prompts (plain-text corpora)."""
    return Prompts(
        batch.tokens[:, :prompt_len],
        batch.segment_ids[:, :prompt_len],
        batch.positions[:, :prompt_len],
    )
