"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), as transformers'
`DeepseekV3Attention` computes it, in the one decoder block (`distill.models.model.Block`).

Queries: one `wq` [D, H * (nope + rope)] (q_proj), or with `q_lora_rank` a low-rank path
`wq_a` [D, q_lora] -> RMSNorm `q_a_norm` -> `wq_b` [q_lora, H * (nope + rope)] (q_a_proj,
q_a_layernorm, q_b_proj). Keys and values: `wkv_a` [D, kv_lora + rope] (kv_a_proj_with_mqa)
gives, per token, a latent of kv_lora_rank dims (RMSNorm `kv_a_norm`, then `wkv_b`
[kv_lora, H * (nope + v)], kv_b_proj: each head's unrotated key and its value) and ONE
rotated key head k_pe of qk_rope_head_dim dims that every head shares. Each head's
q = [q_nope, rope(q_pe)] and k = [k_nope, rope(k_pe)] are qk_nope + qk_rope wide (192 in
DeepSeek-V3), its value v_head_dim (128); the output projection `wo` is [H * v, D].

Tensor parallelism over heads: `wq` / `wq_b` and `wkv_b` are column-parallel (whole heads
per shard: their columns are head-major), `wo` row-parallel and summed (`psum`), the
down projections `wq_a`, `wkv_a` and their norms replicated (small: DeepSeek-V3's are
7,168 x 1,536 and 7,168 x 576, its wq_b 1,536 x 24,576 and wo 16,384 x 7,168), so every
shard computes the latents and k_pe itself.

The decode KV cache (`distill.models.decode`) holds each layer's per-head k [T, H, nope +
rope] and v [T, H, v], as grouped-query attention's does. The compressed cache that MLA
is designed for (the normed latent [T, kv_lora] and k_pe [T, rope] per layer, with kv_b_proj
absorbed into the query and output projections at decode time) is not used: it would hold
kv_lora + rope = 576 numbers per token and layer instead of H * (nope + rope + v) =
128 * 320 = 40,960 for DeepSeek-V3, about 71x less.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distill import collectives as cc
from distill.config import ModelConfig
from distill.models.rope import Rope, apply_rope

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default
# epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6

# The block's weights of latent attention (besides `wo`), their HF names for the record:
# wq (q_proj) or wq_a, q_a_norm, wq_b (q_a_proj, q_a_layernorm, q_b_proj); wkv_a, kv_a_norm,
# wkv_b (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj).
NORMS = ("q_a_norm", "kv_a_norm")


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of one layer's latent-attention weights but `wo` ([H * v_head_dim, D]),
    by name (the norms: `NORMS`)."""
    d, h = cfg.d_model, cfg.n_heads
    q_cols = h * cfg.hd
    shapes = {}
    if cfg.q_lora_rank is None:
        shapes["wq"] = (d, q_cols)
    else:
        r = cfg.q_lora_rank
        shapes |= {"wq_a": (d, r), "q_a_norm": (r,), "wq_b": (r, q_cols)}
    r = cfg.kv_lora_rank
    shapes["wkv_a"] = (d, r + cfg.qk_rope_head_dim)
    shapes["kv_a_norm"] = (r,)
    shapes["wkv_b"] = (r, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    return shapes


def qkv(
    w: dict, n_bsd: jax.Array, positions_bs: jax.Array, rope: Rope, cfg: ModelConfig,
    tp_axis: str | None, rms_norm, matmul,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """(q, k [B, S, H, nope + rope], v [B, S, H, v]) of this shard's heads from the block's
    normed input n [B, S, D] (under sequence parallelism S / tp of its positions) and its
    weights `w` (`weight_shapes`' names, this shard's slices). With `q_lora_rank` the
    replicated down projections run on this shard's positions and their narrow outputs
    are gathered (DeepSeek-V3: 1,536 + 512 + 64 numbers a position, not 7,168), so no
    shard repeats another's; a plain `wq` takes the gathered input as grouped-query
    attention does. `rms_norm(x, scale, eps, offset)` and `matmul(x, w)` are the model's."""
    dt, r = n_bsd.dtype, cfg.kv_lora_rank

    def latent_norm(x, scale):
        return rms_norm(x, scale, LATENT_NORM_EPS, cfg.norm_offset)

    def down(x, key):
        return matmul(x, w[key].astype(dt))

    if cfg.q_lora_rank is None:
        h = cc.gather_positions(n_bsd, tp_axis)
        q, kv_a = down(h, "wq"), down(h, "wkv_a")
        latent, k_pe = latent_norm(kv_a[..., :r], w["kv_a_norm"]), kv_a[..., r:]
    else:
        q_latent = latent_norm(down(n_bsd, "wq_a"), w["q_a_norm"])
        kv_a = down(n_bsd, "wkv_a")
        local = [q_latent, latent_norm(kv_a[..., :r], w["kv_a_norm"]), kv_a[..., r:]]
        sizes = np.cumsum([x.shape[-1] for x in local])[:-1]
        whole = cc.gather_positions(jnp.concatenate(local, axis=-1), tp_axis)
        q_latent, latent, k_pe = jnp.split(whole, sizes, axis=-1)
        q = down(q_latent, "wq_b")
    return heads(q, down(latent, "wkv_b"), k_pe, positions_bs, rope, cfg)


def heads(
    q_bsf: jax.Array, kv_bsf: jax.Array, k_pe_bsr: jax.Array, positions_bs: jax.Array,
    rope: Rope, cfg: ModelConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """(q [B, S, H, nope + rope], k [B, S, H, nope + rope], v [B, S, H, v]) of this shard's
    heads, from the queries' projection q [B, S, H * (nope + rope)], the latent's up
    projection kv [B, S, H * (nope + v)] and the shared key k_pe [B, S, rope] (not yet
    rotated): RoPE on the rope dims of q and on k_pe, which every head's key then repeats."""
    nope, r, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    b, s = q_bsf.shape[:2]
    q = q_bsf.reshape(b, s, -1, nope + r)
    kv = kv_bsf.reshape(b, s, -1, nope + vd)
    n = q.shape[2]
    q_pe = apply_rope(q[..., nope:], positions_bs, rope, cfg.rope_interleave)
    k_pe = apply_rope(k_pe_bsr[:, :, None, :], positions_bs, rope, cfg.rope_interleave)
    q = jnp.concatenate([q[..., :nope], q_pe], axis=-1)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_pe, (b, s, n, r))], axis=-1)
    return q, k, kv[..., nope:]
