"""Gated DeltaNet linear attention (Qwen3.5's `linear_attention` layers), as transformers'
`Qwen3_5GatedDeltaNet` computes it with its torch fallbacks (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`).

A layer: the input projections (transformers fuses q, k and v in `in_proj_qkv`; distill
holds them as `lin_wq`, `lin_wk`, `lin_wv` so that each splits over `tp` by heads, and the
depthwise convolution's channels likewise as `lin_conv_q/k/v` [C, 1, K]), a short causal
depthwise convolution over q, k and v with SiLU, L2-normalised q and k (q also times
dk^-1/2), each value head's decay g = -exp(A_log) * softplus(a + dt_bias) (log space) and
step beta = sigmoid(b), the gated delta rule over the per-head state S [dk, dv]:

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t

then an RMSNorm of each head's output times SiLU(z) (`in_proj_z`) and the output
projection. Query/key heads are shared by Hv / Hk consecutive value heads.

Training runs the chunked form (`gated_delta_rule`): within a chunk of `CHUNK` positions the
updates are condensed by a unit-triangular solve (the WY / UT transform; on CPU an
inverse by squarings, `solve_unit_lower`), and a
`jax.lax.scan` over chunks carries S [B, H, dk, dv]; what the scan needs is computed for
every chunk at once beforehand. Memory is linear in the row: the largest intermediates are
[B, H, S/C, C, C]. Packed documents (segment ids) start from a zero state and a zero
convolution window exactly as separate rows do: pairs of positions in different documents
are masked out of every within-chunk product, and the carried state reaches only the
positions of the document it belongs to. Decoding runs the per-token recurrence
(`recurrent_gated_delta_rule`, also the tests' reference) on a cache of the state and the
convolution's last K - 1 inputs.

Under tensor parallelism every weight here is this shard's slice of whole heads (the
projections column-parallel, `lin_wo` row-parallel and summed by the block): nothing
crosses shards inside the rule.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from distill import collectives as cc
from distill.config import ModelConfig
from distill.models import attention
from distill.models.families import qwen35

CHUNK = 64
L2_EPS = 1e-6  # transformers' l2norm (FLA's)

# One layer's weights, by distill name (the model stacks them [L, ...]).
NORMS = ("lin_norm",)
VECTORS = ("lin_a_log", "lin_dt_bias")


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of one linear-attention layer's weights (projections [in, out], the
    convolution as transformers stores it, [channels, 1, kernel])."""
    return qwen35.linear_shapes(cfg)


def init_params(cfg: ModelConfig, rngs: nnx.Rngs, std: float, out_std: float) -> dict:
    """A linear-attention layer's fresh weights (`linear_attention.weight_shapes`): decay
    rates exp(A_log) drawn in [1, 16] and dt_bias 1 as transformers draws them, the gated
    norm's scale 1 (none when the model has no linear layers)."""
    params = {}
    for name, shape in weight_shapes(cfg).items() if any(cfg.linear_layers()) else ():
        if name == "lin_a_log":
            rate = jax.random.uniform(rngs.params(), shape, jnp.float32, 1.0, 16.0)
            params[name] = nnx.Param(jnp.log(rate))
        elif name in ("lin_dt_bias", "lin_norm"):
            params[name] = nnx.Param(jnp.ones(shape, jnp.float32))
        elif name.startswith("lin_conv"):
            params[name] = nnx.Param(jax.random.normal(rngs.params(), shape) * shape[-1] ** -0.5)
        else:
            params[name] = nnx.Param(
                jax.random.normal(rngs.params(), shape) * (out_std if name == "lin_wo" else std)
            )
    return params


class Cache(NamedTuple):
    """A linear layer's decode cache: the state [B, Hv, dk, dv] (float32) and the
    convolution's last K - 1 inputs of q, k and v [B, K - 1, C]."""

    state: jax.Array
    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array


def doc_index(segment_ids_bs: jax.Array) -> jax.Array:
    """Each position's document within its row [B, S] int32: 0 up to the first change of
    segment id, then one more at each change (a document start)."""
    starts = segment_ids_bs[:, 1:] != segment_ids_bs[:, :-1]
    zero = jnp.zeros_like(segment_ids_bs[:, :1], jnp.int32)
    return jnp.concatenate([zero, jnp.cumsum(starts, axis=1, dtype=jnp.int32)], axis=1)


def causal_conv(
    x_bsc: jax.Array, w_c1k: jax.Array, docs_bs: jax.Array, tail_bkc: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(SiLU of the depthwise causal convolution of x [B, S, C] with w [C, 1, K], the last
    K - 1 inputs [B, K - 1, C] of the row's last document, zeros before its start: the
    decode cache): y_t = sum_k w[k] x_{t - K + 1 + k}, counting only inputs of t's
    document (`docs_bs`, `doc_index`); `tail` (the cache: inputs before the row, of its
    first document) else zeros."""
    b, s, c = x_bsc.shape
    k = w_c1k.shape[-1]
    if tail_bkc is None:
        tail_bkc = jnp.zeros((b, k - 1, c), x_bsc.dtype)
    xx = jnp.concatenate([tail_bkc.astype(x_bsc.dtype), x_bsc], axis=1)
    docs = jnp.concatenate([jnp.zeros((b, k - 1), docs_bs.dtype), docs_bs], axis=1)
    w = w_c1k[:, 0, :].astype(jnp.float32)
    y = jnp.zeros((b, s, c), jnp.float32)
    for j in range(k):  # tap j reads the input K - 1 - j positions back
        same = (docs[:, j : j + s] == docs_bs)[..., None]
        y = y + jnp.where(same, xx[:, j : j + s].astype(jnp.float32), 0.0) * w[:, j]
    last = (docs[:, s:] == docs_bs[:, -1:])[..., None]
    return jax.nn.silu(y).astype(x_bsc.dtype), jnp.where(last, xx[:, s:], 0)


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis, in float32 (transformers' l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def prepare_qk(q_bshd: jax.Array, k_bshd: jax.Array, v_heads: int):
    """Queries and keys as the rule takes them: L2-normalised, queries times dk^-1/2, each
    head repeated for the Hv / Hk value heads it serves, float32 [B, S, Hv, dk]."""
    rep = v_heads // q_bshd.shape[2]
    q = l2_normalize(q_bshd) * q_bshd.shape[-1] ** -0.5
    k = l2_normalize(k_bshd)
    return jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)


def _carry(state, *xs):
    """`state` varying over every mesh axis that `xs` vary over (inside `jax.shard_map`),
    as the scan's carry, which they update, must start."""
    vma = frozenset().union(*(cc.varying(x) for x in xs))
    return cc.vary(state, vma - cc.varying(state))


def recurrent_gated_delta_rule(
    q, k, v, g, beta, docs_bs=None, state=None
) -> tuple[jax.Array, jax.Array]:
    """(o [B, S, H, dv], the final state [B, H, dk, dv]): the rule one position at a time
    (decoding, and the reference of the chunked form), float32. q, k [B, S, H, dk] as
    `prepare_qk` gives them, v [B, S, H, dv], g and beta [B, S, H]; the state resets at
    each document start of `docs_bs` (`doc_index`)."""
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        state = jnp.zeros((b, h, dk, dv), jnp.float32)
    if docs_bs is None:
        docs_bs = jnp.zeros((b, s), jnp.int32)
    prev = jnp.concatenate([docs_bs[:, :1], docs_bs[:, :-1]], axis=1)
    keep = (docs_bs == prev).astype(jnp.float32)  # 0 at a document start
    xs = [jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta, keep)]
    state = _carry(state, *xs)

    def step(st, x):
        q_t, k_t, v_t, g_t, b_t, keep_t = x
        st = st * (jnp.exp(g_t) * keep_t[:, None])[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", st, k_t)) * b_t[..., None]
        st = st + k_t[..., :, None] * delta[..., None, :]
        return st, jnp.einsum("bhkv,bhk->bhv", st, q_t)

    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def solve_unit_lower(a: jax.Array, rhs: jax.Array) -> jax.Array:
    """(I + a)^-1 rhs for strictly lower triangular a [..., C, C]: XLA's triangular solve,
    or on CPU (`attention.platform`), where XLA:CPU's batched solve of such small matrices
    runs about 100x slower than matmuls of more FLOPs, the inverse as the product
    (I - a)(I + a^2)(I + a^4)... (a is nilpotent: a^C = 0), ceil(log2 C) - 1 squarings and
    as many products, then applied: at C = 64 some 12x the solve's FLOPs, the whole rule
    1.7x (dk = dv = 128) to 2.7x (64) its analytic count (`rule_flops`), and 70x faster."""
    c = a.shape[-1]
    if attention.platform() != "cpu":
        return jax.lax.linalg.triangular_solve(
            a + jnp.eye(c), rhs, left_side=True, lower=True, unit_diagonal=True
        )
    power = -a
    inverse = jnp.eye(c) + power
    for _ in range(max(math.ceil(math.log2(c)) - 1, 0)):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse @ rhs


def gated_delta_rule(
    q, k, v, g, beta, docs_bs=None, state=None, chunk: int = CHUNK, unroll: int | bool = 1
) -> tuple[jax.Array, jax.Array]:
    """`recurrent_gated_delta_rule` in chunked form (training, prefill): the same arguments
    and results, float32. `unroll`: the chunk scan's (True: every chunk its own code, as
    XLA's cost analysis counts a loop's body once)."""
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    if docs_bs is None:
        docs_bs = jnp.zeros((b, s), jnp.int32)
    if state is None:
        state = jnp.zeros((b, h, dk, dv), jnp.float32)
    c = min(chunk, s)
    pad = -s % c
    n = (s + pad) // c

    # Padded positions change nothing: beta = 0 writes nothing, g = 0 decays nothing.
    def chunks(x):  # [B, S, H, ...] -> [B, H, N, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 3, 1)

    q, k, v, g, beta = (chunks(x.astype(jnp.float32)) for x in (q, k, v, g, beta))
    docs = jnp.pad(docs_bs, [(0, 0), (0, pad)], mode="edge").reshape(b, 1, n, c)
    # The document of the state each chunk starts from: the one before its first position.
    carried = jnp.concatenate([jnp.zeros_like(docs[:, :, :1, :1]), docs[:, :, :-1, -1:]], 2)

    # Within a chunk: D[t, j] = exp(cum_t - cum_j) for j <= t of one document, else 0;
    # gamma_t = exp(cum_t) where t still belongs to the carried state's document.
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    causal = jnp.tril(jnp.ones((c, c), bool))
    same = (docs[..., :, None] == docs[..., None, :]) & causal
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    gamma = jnp.where(docs == carried, jnp.exp(cum), 0.0)  # [B, H, N, C]

    # u = (I + A)^-1 (beta v - beta gamma k S0), A[t, j] = beta_t D[t, j] k_t.k_j (j < t):
    # the values the delta rule writes, solved for all of a chunk's positions at once.
    kb = k * beta[..., None]
    a = jnp.einsum("...tk,...jk->...tj", kb, k) * decay * (1 - jnp.eye(c))
    rhs = jnp.concatenate([v * beta[..., None], kb * gamma[..., None]], axis=-1)
    solved = solve_unit_lower(a, rhs)
    u_new, w = solved[..., :dv], solved[..., dv:]
    attn = jnp.einsum("...tk,...jk->...tj", q, k) * decay  # [B, H, N, C, C]
    q_in = q * gamma[..., None]
    k_out = k * decay[..., -1, :, None]  # D[C - 1, j] k_j: what reaches the chunk's end
    g_end = gamma[..., -1]  # [B, H, N]

    def step(st, x):
        u_c, w_c, q_c, k_c, attn_c, g_c = x
        u = u_c - jnp.einsum("bhtk,bhkv->bhtv", w_c, st)
        o = jnp.einsum("bhtk,bhkv->bhtv", q_c, st) + jnp.einsum("bhtj,bhjv->bhtv", attn_c, u)
        st = st * g_c[..., None, None] + jnp.einsum("bhtk,bhtv->bhkv", k_c, u)
        return st, o

    xs = [jnp.moveaxis(x, 2, 0) for x in (u_new, w, q_in, k_out, attn, g_end)]
    state = _carry(state, *xs)
    state, o = jax.lax.scan(step, state, xs, unroll=unroll)  # o [N, B, H, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * c, dv)[:, :, :s]
    return jnp.moveaxis(o, 1, 2), state


def gated_rms_norm(o_bshd: jax.Array, z_bshd: jax.Array, w: jax.Array, eps: float):
    """RMSNorm of each head's output times weight, times SiLU(z) (transformers'
    Qwen3_5RMSNormGated: the weight applied in the input dtype, the gate in float32)."""
    dt = o_bshd.dtype
    x = o_bshd.astype(jnp.float32)
    x = (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(dt)
    y = w.astype(dt) * x
    return (y.astype(jnp.float32) * jax.nn.silu(z_bshd.astype(jnp.float32))).astype(dt)


def mixer(
    w: dict, h_bsd: jax.Array, segment_ids_bs: jax.Array, cfg: ModelConfig, matmul,
    cache: Cache | None = None, chunked: bool = True,
) -> tuple[jax.Array, Cache]:  # fmt: skip
    """(the core output before the output projection [B, S, Hv_local * dv], the cache
    after these positions) of the normed input h [B, S, D] (whole rows) with this shard's
    weights `w` (`weight_shapes`' names). `cache`: a decode's (the row continues its first
    document); `chunked` False runs the per-token recurrence (one decode step).
    `matmul(x, w)`: the model's."""
    dt = h_bsd.dtype
    b, s, _ = h_bsd.shape
    dk, dv = cfg.linear_k_dim, cfg.linear_v_dim
    docs = doc_index(segment_ids_bs)
    tails = (None,) * 3 if cache is None else (cache.conv_q, cache.conv_k, cache.conv_v)
    conv, new_tails = [], []
    for name, tail in zip("qkv", tails, strict=True):
        y, t = causal_conv(matmul(h_bsd, w[f"lin_w{name}"].astype(dt)), w[f"lin_conv_{name}"],
                           docs, tail)  # fmt: skip
        conv.append(y)
        new_tails.append(t)
    q, k, v = (x.reshape(b, s, -1, d) for x, d in zip(conv, (dk, dk, dv), strict=True))
    hv = v.shape[2]
    q, k = prepare_qk(q, k, hv)
    beta = jax.nn.sigmoid(matmul(h_bsd, w["lin_wb"].astype(dt)).astype(jnp.float32))
    a = matmul(h_bsd, w["lin_wa"].astype(dt)).astype(jnp.float32)
    g = -jnp.exp(w["lin_a_log"].astype(jnp.float32)) * jax.nn.softplus(
        a + w["lin_dt_bias"].astype(jnp.float32)
    )
    rule = gated_delta_rule if chunked else recurrent_gated_delta_rule
    o, state = rule(q, k, v, g, beta, docs, None if cache is None else cache.state)
    z = matmul(h_bsd, w["lin_wz"].astype(dt)).reshape(b, s, hv, dv)
    o = gated_rms_norm(o.astype(dt), z, w["lin_norm"], cfg.norm_eps)
    return o.reshape(b, s, hv * dv), Cache(state, *new_tails)


def empty_cache(cfg: ModelConfig, batch: int, v_heads: int, dtype) -> Cache:
    """A zero decode cache for `batch` rows and `v_heads` (local) value heads."""
    rep = cfg.linear_v_heads // cfg.linear_k_heads
    qk = v_heads // rep * cfg.linear_k_dim
    tail = cfg.linear_conv_kernel - 1
    state = jnp.zeros((batch, v_heads, cfg.linear_k_dim, cfg.linear_v_dim), jnp.float32)
    z = lambda c: jnp.zeros((batch, tail, c), dtype)  # noqa: E731
    return Cache(state, z(qk), z(qk), z(v_heads * cfg.linear_v_dim))


def rule_flops(batch: int, seq: int, heads: int, dk: int, dv: int, chunk: int = CHUNK) -> float:
    """The chunked rule's analytic FLOPs (multiply-adds counted as 2): per chunk and head
    the within-chunk products k k^T and q k^T (2 C^2 dk each), the triangular solve of
    dv + dk columns (C^2 each), and in the scan W S, q S (2 C dk dv each), the within-chunk
    attention applied to u (2 C^2 dv) and the state update (2 C dk dv)."""
    c = min(chunk, seq)
    n = -(-seq // c)
    per_chunk = 4 * c * c * dk + c * c * (dv + dk) + 6 * c * dk * dv + 2 * c * c * dv
    return float(batch * heads * n * per_chunk)


def vector_params(cfg: ModelConfig) -> int:
    """One linear layer's parameters that are not matmul weights (the gated norm's scale,
    A_log, dt_bias); its depthwise convolution does one multiply-add per weight and token,
    as a matmul weight does."""
    return cfg.linear_v_dim + 2 * cfg.linear_v_heads


def layer_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """One linear layer's FLOPs per token beyond its weights' 2 per parameter: the chunked
    rule's (`rule_flops`) over a row of `seq_len`, every value head."""
    dk, dv = cfg.linear_k_dim, cfg.linear_v_dim
    return rule_flops(1, seq_len, cfg.linear_v_heads, dk, dv) / seq_len


def unused_param_count(cfg: ModelConfig, sizes: dict[str, int]) -> int:
    """Stored parameters of the one layer stack that no token uses where linear and
    attention layers mix, or all are linear: a linear layer's attention weights and an
    attention layer's linear ones. `sizes`: one layer's parameters by weight name."""
    kinds = cfg.linear_layers()
    if not any(kinds):
        return 0
    attn = sum(n for k, n in sizes.items() if k in qwen35.ATTENTION_KEYS)
    linear = sum(n for k, n in sizes.items() if k in weight_shapes(cfg))
    return sum(kinds) * attn + (len(kinds) - sum(kinds)) * linear


def block_mixer(block, x_bsd, segment_ids_bs, tp_axis, layer, attn, matmul, states=False):
    """(the output projection's partial sums [B, S, D] (this shard's heads), keys and
    values, and with `states` the linear layer's decode `Cache`) of `block`'s token mixer
    on its input x: `attn(x)` in an attention layer, Gated DeltaNet in a linear one (where
    layers mix, `layer["linear"]` picks by `jax.lax.cond`: one compiled block), whose keys
    and values are zeros of attention's shapes, as an attention layer's cache is zeros of
    the linear layer's. `matmul`: the model's. Without linear layers the cache is None."""
    cfg = block.cfg
    kinds = cfg.linear_layers()
    if not any(kinds):
        return (*attn(x_bsd), None) if states else attn(x_bsd)

    def zeros_like(shapes, like):  # varying over the mesh as `like` is
        zero = lambda a: cc.vary(jnp.zeros(a.shape, a.dtype), cc.varying(like))  # noqa: E731
        return jax.tree.map(zero, shapes)

    def linear(x):
        h = cc.gather_positions(block._norm(x, block.attn_norm), tp_axis)
        w = layer_weights(block, layer)
        o, cache = mixer(w, h, segment_ids_bs, cfg, matmul)
        o = matmul(o, w["lin_wo"].astype(x.dtype))
        kv = zeros_like(jax.eval_shape(attn, x)[1], o)
        return (o, kv, cache) if states else (o, kv)

    def attention(x):
        o, kv = attn(x)
        return (o, kv, zeros_like(jax.eval_shape(linear, x)[2], o)) if states else (o, kv)

    if all(kinds):
        return linear(x_bsd)
    return jax.lax.cond(layer["linear"], linear, attention, x_bsd)


def layer_weights(block, layer: dict | None) -> dict:
    """`block`'s linear-attention weights by name (`weight_shapes`); `layer`: its scanned
    data (`distill.models.model.Block.w`)."""
    return {k: block.w(k, layer) for k in weight_shapes(block.cfg)}


def decode_mixer(block, x_b1d, cache: Cache, matmul, layer=None) -> tuple[jax.Array, Cache]:
    """(the output projection [B, 1, D], the cache after it) of one token per row through
    `block`'s linear layer by the per-token recurrence (a decode step, single device)."""
    h = block._norm(x_b1d, block.attn_norm)
    w = layer_weights(block, layer)
    segment_ids = jnp.zeros(x_b1d.shape[:2], jnp.int32)
    o, cache = mixer(w, h, segment_ids, block.cfg, matmul, cache, chunked=False)
    return matmul(o, w["lin_wo"].astype(x_b1d.dtype)), cache
