"""The student's layout on the training mesh (`dp` x `fsdp`): one PartitionSpec per weight.

ZeRO-3 style: every weight is split over `fsdp` (and `cp` when the mesh has it:
`weight_axes`) along its largest dimension that `fsdp` divides and replicated over `dp`;
gradients and the optimizer state (Adam's moments) are laid out like the weights they
belong to. The stacked-layer axis is never split (the layer scan takes one whole layer per
step), nor are the norms (a few kilobytes). A mixture of experts' weights [L, E, ., .] are
split over their experts when `fsdp` divides E (the MoE layer then sends each device's
tokens to the devices of their experts), else like any other weight (gathered whole for the
layer). The batch is split over both axes, every device its own rows (and with a `cp`
axis, each row's sequence split over it: `batch_spec`, `student.context`). From these specs
alone, as the train step's `jax.jit` in/out shardings, XLA's SPMD partitioner gathers each
weight where it is used and reduce-scatters its gradient. On a mesh without an `fsdp` axis
(the teacher bootstrap's 1-D `dp` mesh, one device) every weight is replicated: plain data
parallelism.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill.config import ModelConfig
from distill.mesh import CP, DP, FSDP
from distill.models import model, parts

# Every weight's dimensions by name ([L, ...]: the stacked layers); read with `dim_sizes`.
WEIGHT_DIMS = {
    "embed": ("vocab", "d_model"),
    "lm_head": ("d_model", "vocab"),
    "final_norm": ("d_model",),
    "ple_proj_norm": ("ple_dim",),
    "layers": {
        "attn_norm": ("layer", "d_model"),
        "wq": ("layer", "d_model", "q_out"),  # n_heads * head_dim, twice with an output gate
        "wk": ("layer", "d_model", "kv_dim"),  # kv_dim = n_kv_heads * head_dim
        "wv": ("layer", "d_model", "kv_dim"),
        "wo": ("layer", "o_dim", "d_model"),  # o_dim = n_heads * v_dim
        "sinks": ("layer", "heads"),  # attention sinks, one per query head
        "mlp_norm": ("layer", "d_model"),
        "post_attn_norm": ("layer", "d_model"),
        "post_mlp_norm": ("layer", "d_model"),
        "q_norm": ("layer", "head_dim"),
        "k_norm": ("layer", "head_dim"),
        "wq_a": ("layer", "d_model", "q_lora"),  # latent attention (distill.models.mla)
        "q_a_norm": ("layer", "q_lora"),
        "wq_b": ("layer", "q_lora", "q_dim"),
        "wkv_a": ("layer", "d_model", "kv_latent"),  # kv_latent = kv_lora + qk_rope_head_dim
        "kv_a_norm": ("layer", "kv_lora"),
        "wkv_b": ("layer", "kv_lora", "kv_b_dim"),  # kv_b_dim = n_heads * (nope + v)
        "bq": ("layer", "q_dim"),
        "bk": ("layer", "kv_dim"),
        "bv": ("layer", "kv_dim"),
        "bo": ("layer", "d_model"),
        "w_gate": ("layer", "d_model", "d_ff"),
        "w_up": ("layer", "d_model", "d_ff"),
        "w_down": ("layer", "d_ff", "d_model"),
        "router": ("layer", "d_model", "experts"),
        "router_bias": ("layer", "experts"),
        "router_correction": ("layer", "experts"),
        "we_gate": ("layer", "experts", "d_model", "d_ff_expert"),
        "we_up": ("layer", "experts", "d_model", "d_ff_expert"),
        "we_down": ("layer", "experts", "d_ff_expert", "d_model"),
        "be_gate": ("layer", "experts", "d_ff_expert"),  # gpt-oss' expert biases
        "be_up": ("layer", "experts", "d_ff_expert"),
        "be_down": ("layer", "experts", "d_model"),
        "ws_gate": ("layer", "d_model", "d_ff_shared"),  # a shared expert
        "ws_up": ("layer", "d_model", "d_ff_shared"),
        "ws_down": ("layer", "d_ff_shared", "d_model"),
        "shared_gate": ("layer", "d_model", "one"),
        "lin_wq": ("layer", "d_model", "lin_qk"),  # linear attention: Hk * dk
        "lin_wk": ("layer", "d_model", "lin_qk"),
        "lin_wv": ("layer", "d_model", "lin_v"),  # Hv * dv
        "lin_wz": ("layer", "d_model", "lin_v"),
        "lin_wb": ("layer", "d_model", "lin_heads"),
        "lin_wa": ("layer", "d_model", "lin_heads"),
        "lin_conv_q": ("layer", "lin_qk", "one", "lin_kernel"),
        "lin_conv_k": ("layer", "lin_qk", "one", "lin_kernel"),
        "lin_conv_v": ("layer", "lin_v", "one", "lin_kernel"),
        "lin_a_log": ("layer", "lin_heads"),
        "lin_dt_bias": ("layer", "lin_heads"),
        "lin_norm": ("layer", "lin_v_dim"),
        "lin_wo": ("layer", "lin_v", "d_model"),
        "layer_scalar": ("layer", "one"),
        "full_wq": ("layer", "d_model", "full_q_dim"),  # full layers of their own shapes
        "full_wk": ("layer", "d_model", "full_kv_dim"),
        "full_wv": ("layer", "d_model", "full_kv_dim"),
        "full_wo": ("layer", "full_q_dim", "d_model"),
        "full_q_norm": ("layer", "full_head_dim"),
        "full_k_norm": ("layer", "full_head_dim"),
        "wide_gate": ("layer", "d_model", "d_ff_wide"),  # Gemma 4's KV-sharing layers'
        "wide_up": ("layer", "d_model", "d_ff_wide"),
        "wide_down": ("layer", "d_ff_wide", "d_model"),
        "ple_embed": ("layer", "vocab", "ple_dim"),  # Gemma 4's per-layer inputs
        "ple_model_proj": ("layer", "d_model", "ple_dim"),
        "ple_gate": ("layer", "d_model", "ple_dim"),
        "ple_proj": ("layer", "ple_dim", "d_model"),
        "ple_norm": ("layer", "d_model"),
        "post_dense_norm": ("layer", "d_model"),  # Gemma 4's MoE block
        "pre_moe_norm": ("layer", "d_model"),
        "post_moe_norm": ("layer", "d_model"),
        "router_scale": ("layer", "d_model"),
        "router_expert_scale": ("layer", "experts"),
    },
}
EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down", "be_gate", "be_up", "be_down")
NEVER_SPLIT = ("layer",)
# Norms, biases, a shared expert's gate vector and attention sinks: a few kilobytes each.
REPLICATED = (
    "attn_norm", "mlp_norm", "final_norm", "post_attn_norm", "post_mlp_norm", "q_norm",
    "k_norm", "bq", "bk", "bv", "bo", "shared_gate", "router_bias", "router_correction",
    "q_a_norm", "kv_a_norm", "sinks", "lin_conv_q", "lin_conv_k", "lin_conv_v", "lin_a_log",
    "lin_dt_bias", "lin_norm", "layer_scalar", "full_q_norm", "full_k_norm", "ple_norm",
    "ple_proj_norm", "post_dense_norm", "pre_moe_norm", "post_moe_norm", "router_scale",
    "router_expert_scale",
)  # fmt: skip


def dim_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The size of every dimension named in WEIGHT_DIMS, for the model `cfg`."""
    return {
        "layer": cfg.n_layers,
        "vocab": cfg.vocab_size,
        "d_model": cfg.d_model,
        "q_dim": cfg.n_heads * cfg.hd,
        "q_out": cfg.n_heads * cfg.hd * (2 if cfg.attn_output_gate else 1),
        "kv_dim": cfg.n_kv_heads * cfg.hd,
        "o_dim": cfg.n_heads * cfg.v_dim,
        "q_lora": cfg.q_lora_rank or 0,
        "kv_lora": cfg.kv_lora_rank or 0,
        "kv_latent": (cfg.kv_lora_rank or 0) + (cfg.qk_rope_head_dim or 0),
        "kv_b_dim": cfg.n_heads * ((cfg.qk_nope_head_dim or 0) + cfg.v_dim),
        "d_ff": cfg.d_ff,
        "d_ff_wide": 2 * cfg.d_ff,
        "head_dim": cfg.hd,
        "heads": cfg.n_heads,
        "experts": cfg.n_experts,
        "d_ff_expert": cfg.f_expert,
        "d_ff_shared": cfg.f_shared,
        "one": 1,
        "lin_qk": cfg.linear_k_heads * cfg.linear_k_dim,
        "lin_v": cfg.linear_v_heads * cfg.linear_v_dim,
        "lin_heads": cfg.linear_v_heads,
        "lin_kernel": cfg.linear_conv_kernel,
        "lin_v_dim": cfg.linear_v_dim,
        "full_q_dim": cfg.n_heads * cfg.kind_hd("full"),
        "full_kv_dim": cfg.kind_kv_heads("full") * cfg.kind_hd("full"),
        "full_head_dim": cfg.kind_hd("full"),
        "ple_dim": cfg.per_layer_input,
    }


def fsdp_spec(name: str, dims: tuple[str, ...], sizes: dict[str, int], fsdp: int, axis=FSDP) -> P:
    """The spec of one weight: its largest dimension that `fsdp` divides (on a tie, the
    later one: output features) over `fsdp` (the mesh axis or axes `axis`); replicated if
    none, or if it is a norm. An expert weight [L, E, ., .] whose E `fsdp` divides is split
    over its experts, so that each device holds whole experts and the tokens travel to them
    (`experts_split`)."""
    if name in EXPERT_WEIGHTS and fsdp > 1 and sizes["experts"] % fsdp == 0:
        return P(None, axis, *(None,) * (len(dims) - 2))
    splittable = [
        (sizes[d], i) for i, d in enumerate(dims) if d not in NEVER_SPLIT and sizes[d] % fsdp == 0
    ]
    if fsdp == 1 or name in REPLICATED or not splittable:
        return P()
    _, split = max(splittable)
    return P(*(axis if i == split else None for i in range(len(dims))))


def param_specs(cfg: ModelConfig, fsdp: int, axis=FSDP) -> dict:
    """A PartitionSpec per parameter of `cfg`'s model (the tree of `model.abstract_params`)
    for an `fsdp`-way split over the mesh axis or axes `axis` (`weight_axes`). A parameter
    missing from WEIGHT_DIMS is an error, not a silently replicated weight."""
    sizes = dim_sizes(cfg)

    def spec(path, leaf) -> P:
        keys = _dict_keys(path)
        dims = WEIGHT_DIMS
        for k in keys:
            dims = dims.get(k) if isinstance(dims, dict) else None
            if dims is None:
                raise KeyError(f"student.sharding: no WEIGHT_DIMS entry for {'/'.join(keys)}")
        shape = tuple(sizes[d] for d in dims)
        if keys[0] == "layers":  # a part only some layers hold is stacked over those
            shape = (parts.stack_size(cfg, keys[-1]), *shape[1:])
        if shape != tuple(leaf.shape):
            raise ValueError(f"{'/'.join(keys)}: WEIGHT_DIMS gives {shape}, model {leaf.shape}")
        return fsdp_spec(keys[-1], dims, sizes, fsdp, axis)

    return jax.tree_util.tree_map_with_path(spec, model.abstract_params(cfg))


def experts_split(cfg: ModelConfig, fsdp: int) -> bool:
    """Whether the table splits `cfg`'s experts over `fsdp` (each device holds E / fsdp
    whole experts: the student's MoE layers move tokens, not weights); otherwise each
    expert weight is split along another dimension and gathered whole for compute."""
    return bool(cfg.n_experts) and fsdp > 1 and cfg.n_experts % fsdp == 0


def like_params(tree, params, specs: dict):
    """Specs for a tree holding copies of the parameters `params` (shapes) laid out by
    `specs`, e.g. an optax state, whose Adam moments are dicts keyed like the parameters:
    a leaf whose dict-key path and shape are a parameter's gets that parameter's spec;
    any other leaf (a step count) is replicated."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    by_path = {
        _dict_keys(path): (tuple(p.shape), spec)
        for (path, p), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=_is_spec), strict=True)
    }

    def spec(path, leaf) -> P:
        shape, spec = by_path.get(_dict_keys(path), (None, P()))
        return spec if shape == tuple(leaf.shape) else P()

    return jax.tree_util.tree_map_with_path(spec, tree)


def _dict_keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _is_spec(x) -> bool:
    return isinstance(x, P)


def fsdp_size(mesh) -> int:
    """The mesh's `fsdp` degree; 1 for a mesh without that axis."""
    return dict(mesh.shape).get(FSDP, 1)


def weight_axes(mesh_axes) -> str | tuple[str, str]:
    """The axes the weights are split over, of a mesh with axes `mesh_axes`: `fsdp`, and
    with a `cp` axis `(fsdp, cp)`: a row's cp devices hold different positions of the same
    rows but need the same weights, so ZeRO-3 spans them too (each layer's weights gathered
    over both, their gradients reduce-scattered), rather than each holding a copy."""
    return (FSDP, CP) if CP in mesh_axes else FSDP


def weight_shards(mesh_shape: dict) -> int:
    """How many ways `weight_axes` split the weights: fsdp (x cp) of `mesh_shape`."""
    return mesh_shape.get(FSDP, 1) * mesh_shape.get(CP, 1)


def whole_rows_spec(mesh) -> P:
    """Rows split over the training axes `mesh` has of `dp` and `fsdp`, each row whole on
    its devices (replicated over `cp`: the sampler's prompts and continuations)."""
    return P(tuple(a for a in (DP, FSDP) if a in mesh.axis_names))


def batch_spec(mesh) -> P:
    """[B, S, ...] batches and teacher outputs as they reach the training mesh: rows split
    over `dp` and `fsdp` (each device its own), and with a `cp` axis each row's sequence
    split over it in row order (`student.context` lays the pieces out for attention)."""
    rows = whole_rows_spec(mesh)
    return P(rows[0], CP) if CP in mesh.axis_names else rows


def pieces_spec(mesh) -> P:
    """The step's rows after `student.context.Context.pieces`: [B * cp, S / cp, ...], split
    over every training axis (`dp`, `fsdp`, `cp`); without a cp axis, `batch_spec`."""
    return P(tuple(a for a in (DP, FSDP, CP) if a in mesh.axis_names))


def named(mesh, specs):
    """The specs of a tree as NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def bytes_per_device(shapes, specs, axis_sizes: dict[str, int]) -> int:
    """Bytes one device holds of the arrays `shapes` (ShapeDtypeStructs) laid out by
    `specs` (a matching tree) on a mesh of `axis_sizes`, without a mesh or an allocation."""
    total = 0
    shapes_flat = jax.tree.leaves(shapes)
    specs_flat = jax.tree.leaves(specs, is_leaf=_is_spec)
    for x, spec in zip(shapes_flat, specs_flat, strict=True):
        axes = [a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,))]
        split = math.prod(axis_sizes.get(a, 1) for a in axes if a is not None)
        total += math.prod(x.shape) // split * x.dtype.itemsize
    return total
