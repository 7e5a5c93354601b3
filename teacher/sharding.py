"""The teacher's layout on the inference mesh (axes `pp` x `dp` x `ep` x `tp`): one
PartitionSpec per weight, and the specs of the batch going in and the outputs coming out.

Weights, Megatron-style over `tp` and replicated over `dp`: column-parallel in (QKV, gate,
up: output features split over `tp`), row-parallel out (attention output and down
projections: input features split, summed by `psum`), vocab-parallel embedding and LM head.
Layer weights carry a leading stacked-layer axis, split over `pp` when the mesh has
pipeline stages: stage s holds layers [s*L/pp, (s+1)*L/pp) (`teacher.stages`); the
embedding, the final norm and the LM head are replicated over `pp` (the first stage embeds,
every stage runs the head on its share of the rows). A mixture of experts' expert weights
[L, E, ...] are split over `ep` by expert and over `tp` as a dense MLP's; its router is
replicated, and a shared expert is laid out as a dense MLP (replicated over `ep`). When
there are fewer KV heads than `tp`, each KV head is repeated so that every shard holds the
one KV head its query heads use (`expand_kv_heads`).

Activations: the batch comes in rows split over `dp` and `ep` (each tensor-parallel group
runs its own rows, replicated over its `tp` devices; attention is data-parallel over
`ep`); outputs go out batch-major, whole rows split over every device of the mesh (`dp`
major, `tp` minor), so that moving them to the
student's batch sharding is a copy of each device's buffer (`distill.handoff`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill.config import ModelConfig
from distill.errors import DistillError
from distill.mesh import CP, DP, EP, PP, TP
from distill.models import model
from teacher import stages

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
    "bo": P(None, None),  # [L, D] added after the psum: replicated
    "wq": P(None, None, TP),  # [L, D, H*hd] column-parallel
    "wk": P(None, None, TP),  # [L, D, KV*hd]
    "wv": P(None, None, TP),
    "wo": P(None, TP, None),  # [L, H*v_dim, D] row-parallel
    # latent attention (distill.models.mla): the up projections column-parallel by heads,
    # the down projections and their norms replicated
    "wq_a": P(None, None, None),  # [L, D, q_lora]
    "q_a_norm": P(None, None),  # [L, q_lora]
    "wq_b": P(None, None, TP),  # [L, q_lora, H*(nope+rope)]
    "wkv_a": P(None, None, None),  # [L, D, kv_lora+rope]
    "kv_a_norm": P(None, None),  # [L, kv_lora]
    "wkv_b": P(None, None, TP),  # [L, kv_lora, H*(nope+v)]
    "sinks": P(None, TP),  # [L, H] attention sinks, split with the query heads
    "w_gate": P(None, None, TP),  # [L, D, F]
    "w_up": P(None, None, TP),
    "w_down": P(None, TP, None),  # [L, F, D]
    "router": P(None, None, None),  # [L, D, E] replicated: every device routes its tokens
    "router_bias": P(None, None),  # [L, E] gpt-oss' logit bias
    "router_correction": P(None, None),  # [L, E] DeepSeek's selection-only bias
    "we_gate": P(None, EP, None, TP),  # [L, E, D, F] experts over ep, columns over tp
    "we_up": P(None, EP, None, TP),
    "we_down": P(None, EP, TP, None),  # [L, E, F, D]
    "be_gate": P(None, EP, TP),  # [L, E, F] gpt-oss' expert biases, as their experts
    "be_up": P(None, EP, TP),
    "be_down": P(None, EP, None),  # [L, E, D] (added on one tp shard: `moe._experts`)
    "ws_gate": P(None, None, TP),  # [L, D, Fs] a shared expert: as a dense MLP, on every ep
    "ws_up": P(None, None, TP),
    "ws_down": P(None, TP, None),  # [L, Fs, D]
    "shared_gate": P(None, None, None),  # [L, D, 1]
    # linear attention (distill.models.linear_attention): column-parallel by heads (the
    # convolution's channels and the per-head decay with them), out_proj row-parallel
    "lin_wq": P(None, None, TP),  # [L, D, Hk*dk]
    "lin_wk": P(None, None, TP),
    "lin_wv": P(None, None, TP),  # [L, D, Hv*dv]
    "lin_wz": P(None, None, TP),
    "lin_wb": P(None, None, TP),  # [L, D, Hv]
    "lin_wa": P(None, None, TP),
    "lin_conv_q": P(None, TP, None, None),  # [L, Hk*dk, 1, K]
    "lin_conv_k": P(None, TP, None, None),
    "lin_conv_v": P(None, TP, None, None),  # [L, Hv*dv, 1, K]
    "lin_a_log": P(None, TP),  # [L, Hv]
    "lin_dt_bias": P(None, TP),
    "lin_norm": P(None, None),  # [L, dv] per head, the same on every shard
    "lin_wo": P(None, TP, None),  # [L, Hv*dv, D]
    "layer_scalar": P(None, None),  # [L, 1] Gemma 4's scalar per layer
    # Gemma 4's per-layer inputs: the table vocabulary-parallel as the embedding, the rest
    # replicated (computed on every shard's positions: no collective but the table's)
    "ple_embed": P(None, TP, None),  # [L, V, P]
    "ple_model_proj": P(None, None, None),  # [L, D, P]
    "ple_gate": P(None, None, None),  # [L, D, P]
    "ple_proj": P(None, None, None),  # [L, P, D]
    "ple_norm": P(None, None),  # [L, D]
    # Gemma 4's MoE block: its two sides' norms and its router's scales, replicated
    "post_dense_norm": P(None, None),
    "pre_moe_norm": P(None, None),
    "post_moe_norm": P(None, None),
    "router_scale": P(None, None),  # [L, D]
    "router_expert_scale": P(None, None),  # [L, E]
}
# Full layers of their own shapes (Gemma 4, `distill.models.full_layers`): as the others'.
LAYER_SPECS.update({f"full_{k}": LAYER_SPECS[k] for k in ("wq", "wk", "wv", "wo", "q_norm",
                                                           "k_norm")})  # fmt: skip
LAYER_SPECS.update({f"wide_{k}": LAYER_SPECS[f"w_{k}"] for k in ("gate", "up", "down")})
# OLMoE's query/key norms span all heads' features: split over tp as the projections.
FULL_QK_NORM_SPECS = {"q_norm": P(None, TP), "k_norm": P(None, TP)}

# The layer weights whose columns are KV heads: repeated when there are fewer than `tp`.
KV_KEYS = ("wk", "wv", "bk", "bv", "full_wk", "full_wv")


def kv_keys(cfg: ModelConfig) -> tuple[str, ...]:
    """`KV_KEYS`, and OLMoE's key norm, which spans the KV heads' features."""
    return (*KV_KEYS, "k_norm") if cfg.qk_norm_full else KV_KEYS


def kv_layout(cfg: ModelConfig, key: str, tp: int) -> tuple[int, int]:
    """(copies of each KV head, head width) of layer weight `key` on `tp` shards: each KV
    head once per shard using it where there are fewer than `tp` (`expand_kv_heads`), for
    the KV heads and width of the layers holding it (a full layer's may be its own)."""
    kind = "full" if key.startswith("full_") else "sliding"
    if key not in kv_keys(cfg):
        return 1, cfg.kind_hd(kind)
    return max(1, tp // cfg.kind_kv_heads(kind)), cfg.kind_hd(kind)


# [B, S] batch fields: rows split over dp and ep, replicated over tp (and pp: every stage
# reads the rows' positions and segments; the first embeds their tokens)
BATCH_BS = P((DP, EP))
OUT_ROWS = P((DP, EP, TP))  # [B, S, k or V] outputs: whole rows split over every device
# the same on a mesh with pipeline stages: a dp group's rows over its stages, each stage's
# over its tp devices
OUT_ROWS_PP = P((DP, EP, PP, TP))
OUT_ROWS_DP = P((DP, EP))  # the same when B is not a multiple of the devices: kept over pp, tp


def out_spec(rows: int, mesh) -> P:
    """The outputs' spec for a batch of `rows` rows on `mesh`: split over every device when
    the rows divide evenly, else over `dp` (and `ep`) only. With a `cp` axis each row's
    positions are split over it too, in row order (`P(rows, cp)`, as the student's
    `batch_spec`), the rows over the other axes."""
    cp = CP in mesh.shape
    if rows % (mesh.devices.size // mesh.shape.get(CP, 1)):
        spec = OUT_ROWS_DP
    else:
        spec = OUT_ROWS_PP if PP in mesh.shape else OUT_ROWS
    return P(spec[0], CP) if cp else spec


def batch_spec(mesh) -> P:
    """[B, S] batch fields on `mesh`: `BATCH_BS`, and with a `cp` axis each row's positions
    split over it in row order (the forward lays its chunks out for ring attention)."""
    return P(BATCH_BS[0], CP) if CP in mesh.shape else BATCH_BS


def batch_sharding(mesh) -> NamedSharding:
    """Where a batch is put for the teacher forward."""
    return NamedSharding(mesh, batch_spec(mesh))


def param_specs(cfg: ModelConfig, pp: int = 1) -> dict:
    """The weights' specs; with `pp` > 1 pipeline stages the layer axis split over `pp`."""
    specs = {
        "embed": P(TP, None),  # [V, D] vocab-parallel
        "final_norm": P(None),
        "layers": {k: layer_spec(cfg, k, pp) for k in model.abstract_params(cfg)["layers"]},
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = P(None, TP)  # [D, V] vocab-parallel
    if cfg.per_layer_input:
        specs["ple_proj_norm"] = P(None)
    return specs


def layer_spec(cfg: ModelConfig, key: str, pp: int = 1) -> P:
    """The PartitionSpec of layer weight `key` of `cfg`'s model (its layer axis over `pp`
    when there are stages)."""
    spec = LAYER_SPECS[key]
    if cfg.qk_norm_full and key in FULL_QK_NORM_SPECS:
        spec = FULL_QK_NORM_SPECS[key]
    return P(PP, *spec[1:]) if pp > 1 else spec


def check_divisible(cfg: ModelConfig, tp: int, where: str = "teacher.model", ep: int = 1) -> None:
    """Raise DistillError naming the field that `tp` (or `ep`) does not divide."""
    if cfg.n_experts and cfg.n_experts % ep:
        raise DistillError(
            f"{where}.n_experts: {cfg.n_experts} is not divisible by mesh.teacher.ep={ep}"
        )
    if any(cfg.linear_layers()) and cfg.linear_k_heads % tp:
        raise DistillError(
            f"{where}.linear_k_heads: {cfg.linear_k_heads} is not divisible by mesh.teacher.tp={tp}"
        )
    if ep > 1 and not cfg.n_experts:
        raise DistillError(f"mesh.teacher.ep: {ep} needs a mixture of experts (n_experts > 0)")
    fields = ["n_heads", "vocab_size"]
    fields += ["d_ff"] if cfg.has_dense_ffn() else []
    fields += ["d_ff_expert"] if cfg.n_experts else []
    fields += ["d_ff_shared"] if cfg.f_shared else []
    for field in fields:
        value = cfg.f_expert if field == "d_ff_expert" else getattr(cfg, field)
        if value % tp:
            raise DistillError(f"{where}.{field}: {value} is not divisible by mesh.teacher.tp={tp}")
    kvs = {"n_kv_heads": cfg.n_kv_heads, "global_kv_heads": cfg.global_kv_heads}
    for field, kv in kvs.items():
        if kv is not None and kv % tp and tp % kv:
            raise DistillError(
                f"{where}.{field}: {kv} must divide or be a multiple of mesh.teacher.tp={tp}"
            )


def expand_kv_heads(params: dict, cfg: ModelConfig, tp: int) -> dict:
    """Repeat KV heads up to `tp` when n_kv_heads < tp, so each shard owns one KV head.

    Query head h uses KV head h // (H / KV); with H/tp query heads per shard, shard i uses
    KV head i * KV // tp, which is what `repeat` by tp // KV puts at position i.
    """

    def rep(w, reps, hd):  # [L, D, KV*hd] -> [L, D, tp*hd] (a bias: [L, KV*hd] -> [L, tp*hd])
        lead = w.shape[:-1]
        return jnp.repeat(w.reshape(*lead, -1, hd), reps, axis=-2).reshape(*lead, -1)

    layers = dict(params["layers"])
    for key in kv_keys(cfg):
        reps, hd = kv_layout(cfg, key, tp)
        if key in layers and reps > 1:
            layers[key] = rep(layers[key], reps, hd)
    return dict(params, layers=layers)


def shardings(cfg: ModelConfig, mesh, pp: int | None = None) -> dict:
    """NamedShardings of `param_specs` on `mesh` (a spec names only `tp`: replicated over
    `dp`; the layers split over `pp` where it has stages, `pp` = 1: kept whole)."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(cfg, mesh.shape.get(PP, 1) if pp is None else pp),
        is_leaf=lambda x: isinstance(x, P),
    )


def shard_params(params: dict, cfg: ModelConfig, mesh) -> dict:
    """Place full teacher weights on the inference mesh in the TP layout (with pipeline
    stages, the stack padded with zero layers where pp does not divide it)."""
    params = stages.pad_layers(params, cfg, mesh.shape.get(PP, 1))
    params = expand_kv_heads(params, cfg, mesh.shape[TP])
    return jax.device_put(params, shardings(cfg, mesh))
