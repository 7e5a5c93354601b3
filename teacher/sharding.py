"""The teacher's layout on the inference mesh (axes `dp` x `tp`): one PartitionSpec per
weight, and the specs of the batch going in and the outputs coming out.

Weights, Megatron-style over `tp` and replicated over `dp`: column-parallel in (QKV, gate,
up: output features split over `tp`), row-parallel out (attention output and down
projections: input features split, summed by `psum`), vocab-parallel embedding and LM head.
Layer weights carry a leading stacked-layer axis. When there are fewer KV heads than `tp`,
each KV head is repeated so that every shard holds the one KV head its query heads use
(`expand_kv_heads`).

Activations: the batch comes in rows split over `dp` (each tensor-parallel group runs its
own rows, replicated over its `tp` devices); outputs go out batch-major, whole rows split
over every device of the mesh (`dp` major, `tp` minor), so that moving them to the
student's batch sharding is a copy of each device's buffer (`distill.handoff`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill.config import ModelConfig
from distill.errors import DistillError
from distill.mesh import DP, TP
from distill.models import model

LAYER_SPECS = {
    "attn_norm": P(None, None),
    "mlp_norm": P(None, None),
    "post_attn_norm": P(None, None),
    "post_mlp_norm": P(None, None),
    "q_norm": P(None, None),  # [L, hd] per head, the same on every shard
    "k_norm": P(None, None),
    "bq": P(None, TP),  # [L, H*hd] split as wq's columns
    "bk": P(None, TP),  # [L, KV*hd]
    "bv": P(None, TP),
    "wq": P(None, None, TP),  # [L, D, H*hd] column-parallel
    "wk": P(None, None, TP),  # [L, D, KV*hd]
    "wv": P(None, None, TP),
    "wo": P(None, TP, None),  # [L, H*hd, D] row-parallel
    "w_gate": P(None, None, TP),  # [L, D, F]
    "w_up": P(None, None, TP),
    "w_down": P(None, TP, None),  # [L, F, D]
}

# The layer weights whose columns are KV heads: repeated when there are fewer than `tp`.
KV_KEYS = ("wk", "wv", "bk", "bv")

BATCH_BS = P(DP)  # [B, S] batch fields: rows split over dp, replicated over tp
OUT_ROWS = P((DP, TP))  # [B, S, k or V] outputs: whole rows split over every device
OUT_ROWS_DP = P(DP)  # the same when B is not a multiple of dp * tp: replicated over tp


def out_spec(rows: int, mesh) -> P:
    """The outputs' spec for a batch of `rows` rows on `mesh`: split over every device when
    the rows divide evenly, else over `dp` only."""
    return OUT_ROWS if rows % mesh.devices.size == 0 else OUT_ROWS_DP


def batch_sharding(mesh) -> NamedSharding:
    """Where a batch is put for the teacher forward."""
    return NamedSharding(mesh, BATCH_BS)


def param_specs(cfg: ModelConfig) -> dict:
    specs = {
        "embed": P(TP, None),  # [V, D] vocab-parallel
        "final_norm": P(None),
        "layers": {k: LAYER_SPECS[k] for k in model.abstract_params(cfg)["layers"]},
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = P(None, TP)  # [D, V] vocab-parallel
    return specs


def check_divisible(cfg: ModelConfig, tp: int, where: str = "teacher.model") -> None:
    """Raise DistillError naming the field that `tp` does not divide."""
    for field in ("n_heads", "d_ff", "vocab_size"):
        value = getattr(cfg, field)
        if value % tp:
            raise DistillError(f"{where}.{field}: {value} is not divisible by mesh.teacher.tp={tp}")
    kv = cfg.n_kv_heads
    if kv % tp and tp % kv:
        raise DistillError(
            f"{where}.n_kv_heads: {kv} must divide or be a multiple of mesh.teacher.tp={tp}"
        )


def expand_kv_heads(params: dict, cfg: ModelConfig, tp: int) -> dict:
    """Repeat KV heads up to `tp` when n_kv_heads < tp, so each shard owns one KV head.

    Query head h uses KV head h // (H / KV); with H/tp query heads per shard, shard i uses
    KV head i * KV // tp, which is what `repeat` by tp // KV puts at position i.
    """
    if cfg.n_kv_heads >= tp:
        return params
    reps, hd = tp // cfg.n_kv_heads, cfg.hd

    def rep(w):  # [L, D, KV*hd] -> [L, D, tp*hd] (a bias: [L, KV*hd] -> [L, tp*hd])
        lead = w.shape[:-1]
        return jnp.repeat(w.reshape(*lead, cfg.n_kv_heads, hd), reps, axis=-2).reshape(*lead, -1)

    layers = dict(params["layers"])
    for key in KV_KEYS:
        if key in layers:
            layers[key] = rep(layers[key])
    return dict(params, layers=layers)


def shardings(cfg: ModelConfig, mesh) -> dict:
    """NamedShardings of `param_specs` on `mesh` (a spec names only `tp`: replicated over
    `dp`)."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(cfg),
        is_leaf=lambda x: isinstance(x, P),
    )


def shard_params(params: dict, cfg: ModelConfig, mesh) -> dict:
    """Place full teacher weights on the inference mesh in the TP layout."""
    params = expand_kv_heads(params, cfg, mesh.shape[TP])
    return jax.device_put(params, shardings(cfg, mesh))
