"""The Hugging Face format on disk: config.json <-> ModelConfig, weight names, shards, for
every family registered in `distill.models.families` (`MODEL_TYPES`). What the families
share is read here; what sets one apart is in its record there.

Only the format lives here, without JAX, because the config loader reads config.json before
JAX starts. `teacher.hf` loads a checkpoint into the tensor-parallel layout,
`distill.models.hf.export` writes a config.json back, `distill.models.hf.files` reads the
safetensors files' index and headers, and `student.export` writes a
checkpoint with these names.

Weights: Hugging Face stores `nn.Linear` weights as [out, in] per layer
(`model.layers.{i}.self_attn.q_proj.weight`, ...); distill stores `x @ W` weights as
[in, out] with the layers stacked on a leading [L] axis. Embeddings are [V, D] in both; the
untied `lm_head.weight` [V, D] is distill's `lm_head` [D, V].
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import ValidationError

from distill.config import ModelConfig, RopeScaling
from distill.errors import DistillError
from distill.models import families
from distill.models.families.views import (  # noqa: F401  (hf.stored, hf.VIEW: the names' home before)
    COLS,
    FUSED_BIASES,
    FUSED_EXPERTS,
    ROWS,
    VIEW,
    fused_expert_names,
    stored,
    view_shape,
)

log = logging.getLogger("distill")
CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# config.json model_type: what `distill.config.ModelConfig.family` records.
MODEL_TYPES = families.names()
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = {f"{t}_attention": t for t in ("full", "sliding", "linear")}  # as config.json

# distill layer weight -> (name after `model.layers.{i}.`, stored transposed as [out, in])
LAYER_WEIGHTS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# Gemma names its four norms per block so: its post_attention_layernorm norms the attention
# output, where Llama's is the MLP's input norm.
GEMMA_NORMS = {
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
}
GEMMA4_MOE_NORMS = {
    "post_dense_norm": ("post_feedforward_layernorm_1.weight", False),
    "pre_moe_norm": ("pre_feedforward_layernorm_2.weight", False),
    "post_moe_norm": ("post_feedforward_layernorm_2.weight", False),
}
QKV_BIASES = {
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
}
QK_NORMS = {
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
}
# Multi-head latent attention (DeepSeek-V3): replaces q_proj (unless queries are full rank),
# k_proj and v_proj.
MLA_WEIGHTS = {
    "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", True),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight", False),
    "wkv_b": ("self_attn.kv_b_proj.weight", True),
}
LOW_RANK_Q = {
    "wq_a": ("self_attn.q_a_proj.weight", True),
    "q_a_norm": ("self_attn.q_a_layernorm.weight", False),
    "wq_b": ("self_attn.q_b_proj.weight", True),
}
DENSE_FFN = ("w_gate", "w_up", "w_down")
# distill top-level weight -> (name, stored transposed)
TOP_WEIGHTS = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def config_file(path: str | Path) -> Path:
    return Path(path) / CONFIG


def layer_weights(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """distill layer weight -> (Hugging Face name after `model.layers.{i}.`, transposed), for
    the weights `cfg`'s model has."""
    names = dict(LAYER_WEIGHTS)
    if cfg.mla:
        for key in ("wk", "wv", *(("wq",) if cfg.q_lora_rank else ())):
            del names[key]
        names.update(MLA_WEIGHTS, **(LOW_RANK_Q if cfg.q_lora_rank else {}))
    if cfg.post_norms:
        names.update(GEMMA_NORMS)
    if cfg.qkv_bias:
        names.update(QKV_BIASES)
    if cfg.o_bias:
        names["bo"] = ("self_attn.o_proj.bias", False)
    if cfg.qk_norm:
        names.update(QK_NORMS)
    if cfg.attn_sinks:
        names["sinks"] = ("self_attn.sinks", False)
    if cfg.layer_scalar:
        names["layer_scalar"] = ("layer_scalar", False)
    if cfg.moe_beside_dense:  # Gemma 4's MoE block: its dense MLP's and experts' norms
        names.update(GEMMA4_MOE_NORMS)
    return names


def router_weights(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """The router's tensors after `model.layers.{i}.{moe_prefix}`: its weight, and its
    logit bias (gpt-oss) or selection-only correction bias (DeepSeek-V3) where it has one."""
    name = families.get(cfg.family).router_name
    names = {"router": (f"{name}.weight", True)}
    if cfg.router_norm:  # Gemma 4's router: `router.proj`, its input scale beside it
        names["router_scale"] = (f"{name.rpartition('.')[0]}.scale", False)
    if cfg.expert_scale:
        names["router_expert_scale"] = (f"{name.rpartition('.')[0]}.per_expert_scale", False)
    if cfg.router_bias:
        names["router_bias"] = (f"{name}.bias", False)
    if cfg.router_correction_bias:
        names["router_correction"] = (f"{name}.e_score_correction_bias", False)
    return names


def weight_names(cfg: ModelConfig) -> dict[str, tuple[str, int | None, bool]]:
    """Every Hugging Face tensor the model needs -> (distill key, layer or None, transposed)."""
    names = {}
    for key, (name, transposed) in TOP_WEIGHTS.items():
        if key != "lm_head" or not cfg.tie_embeddings:
            names[name] = (key, None, transposed)
    if cfg.per_layer_input:  # Gemma 4's norm shared by the per-layer inputs
        names["model.per_layer_projection_norm.weight"] = ("ple_proj_norm", None, False)
    moe_layers = cfg.moe_layers()
    family = families.get(cfg.family)
    prefix, experts = family.moe_prefix, family.expert_names
    for i, linear in enumerate(cfg.linear_layers()):
        layer = families.gemma4.hf_names(cfg, i, layer_weights(cfg))
        for key, (name, transposed) in families.qwen35.mixer_weights(cfg, linear, layer).items():
            if not (moe_layers[i] and key in DENSE_FFN) or cfg.moe_beside_dense:
                names[f"model.layers.{i}.{name}"] = (key, i, transposed)
        for name, (key, transposed) in families.gemma4.per_layer_names(cfg, i).items():
            names[name] = (key, i, transposed)
        if not moe_layers[i]:
            continue
        for key, (name, transposed) in router_weights(cfg).items():
            names[f"model.layers.{i}.{prefix}{name}"] = (key, i, transposed)
        for key, name in family.shared_names.items() if cfg.f_shared else ():
            if key != "shared_gate" or cfg.shared_expert_gate:
                names[f"model.layers.{i}.{prefix}{name}"] = (key, i, True)
        if family.fused_experts:  # one [E, ...] tensor a layer, [in, out] but Gemma 4's
            for key, name in fused_expert_names(cfg).items():
                names[f"model.layers.{i}.{prefix}experts.{name}"] = (key, i, family.fused_halves)
            continue
        for j in range(cfg.n_experts):  # an expert's weight: its layer and expert, (i, j)
            for key, name in experts.items():
                names[f"model.layers.{i}.{prefix}experts.{j}.{name}"] = (key, (i, j), True)
    return names


def hf_shape(cfg: ModelConfig, key: str) -> tuple[int, ...]:
    """The Hugging Face shape of one layer's (or a top-level) weight: an expert's, or with
    fused experts a layer's [E, in, out] (a view's: its columns)."""
    d, v, f, fe, fs = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.f_expert, cfg.f_shared
    e = cfg.n_experts
    family = families.get(cfg.family)
    if family.fused_halves and key in FUSED_EXPERTS:  # each expert [out, in]
        return {"we_gate": (e, fe, d), "we_up": (e, fe, d), "we_down": (e, d, fe)}[key]
    if family.fused_experts and key in {**FUSED_EXPERTS, **FUSED_BIASES}:
        fused = {"we_gate": (e, d, fe), "we_up": (e, d, fe), "we_down": (e, fe, d)}
        return {**fused, "be_gate": (e, fe), "be_up": (e, fe), "be_down": (e, d)}[key]
    q, kv = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd
    full = cfg.qk_norm_full
    if key.startswith("lin_"):
        return families.qwen35.hf_shape(cfg, key)
    if key.startswith(families.gemma4.PREFIX):
        return families.gemma4.hf_shape(cfg, key)
    if key.startswith("ple_"):
        return families.gemma4.per_layer_shapes(cfg)[key]
    return {
        "embed": (v, d),
        "final_norm": (d,),
        "lm_head": (v, d),
        "attn_norm": (d,),
        "mlp_norm": (d,),
        "post_attn_norm": (d,),
        "post_mlp_norm": (d,),
        "q_norm": (q if full else cfg.hd,),
        "k_norm": (kv if full else cfg.hd,),
        "bq": (q,),
        "bk": (kv,),
        "bv": (kv,),
        "wq": (q * (2 if cfg.attn_output_gate else 1), d),
        "wk": (kv, d),
        "wv": (kv, d),
        "wo": (d, cfg.n_heads * cfg.v_dim),
        "bo": (d,),
        "sinks": (cfg.n_heads,),
        "layer_scalar": (1,),
        "post_dense_norm": (d,),
        "pre_moe_norm": (d,),
        "post_moe_norm": (d,),
        "router_scale": (d,),
        "router_expert_scale": (e,),
        "wq_a": (cfg.q_lora_rank, d),
        "q_a_norm": (cfg.q_lora_rank,),
        "wq_b": (q, cfg.q_lora_rank),
        "wkv_a": ((cfg.kv_lora_rank or 0) + (cfg.qk_rope_head_dim or 0), d),
        "kv_a_norm": (cfg.kv_lora_rank,),
        "wkv_b": (cfg.n_heads * ((cfg.qk_nope_head_dim or 0) + cfg.v_dim), cfg.kv_lora_rank),
        "w_gate": (f, d),
        "w_up": (f, d),
        "w_down": (d, f),
        "wide_gate": (2 * f, d),  # Gemma 4's KV-sharing layers' (`use_double_wide_mlp`)
        "wide_up": (2 * f, d),
        "wide_down": (d, 2 * f),
        "router": (cfg.n_experts, d),
        "router_bias": (cfg.n_experts,),
        "router_correction": (cfg.n_experts,),
        "we_gate": (fe, d),
        "we_up": (fe, d),
        "we_down": (d, fe),
        "ws_gate": (fs, d),
        "ws_up": (fs, d),
        "ws_down": (d, fs),
        "shared_gate": (1, d),
    }[key]


# ----------------------------------------------------------------------------- config.json


def _rope(raw: dict, where: Path, proportional: bool) -> tuple[float, RopeScaling | None, float]:
    """(theta, scaling, partial rotary factor) from either layout: transformers 5
    `rope_parameters` (the full layers' when it has one per layer type), or the older
    top-level `rope_theta` with an optional `rope_scaling`. `proportional`: the family's
    full layers may say `proportional` (Gemma 4, `ModelConfig.rope_proportional`)."""
    params = raw.get("rope_parameters")
    if params is not None and "full_attention" in params:
        params = params["full_attention"]
    if params is None:
        params = {"rope_theta": raw.get("rope_theta", 10000.0), **(raw.get("rope_scaling") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if proportional and kind == "proportional":
        if params.get("factor", 1.0) != 1.0:
            raise DistillError(f"{where}: proportional RoPE factor={params['factor']!r} "
                               "is not supported (only 1)")  # fmt: skip
        kind = "default"
    if kind not in ROPE_TYPES:
        raise DistillError(
            f"{where}: RoPE type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    theta = float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return theta, None, partial
    original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    scaling = {"type": kind, "factor": params.get("factor")}
    if kind == "llama3":
        scaling.update(
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            original_max_position_embeddings=original,
        )
    if kind == "yarn":  # transformers' _compute_yarn_parameters, its defaults included
        if scaling["factor"] is None:
            scaling["factor"] = raw["max_position_embeddings"] / original
        scaling.update(
            original_max_position_embeddings=original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=params.get("truncate", True),
        )
    try:
        return theta, RopeScaling(**scaling), partial
    except ValidationError as e:
        err = e.errors()[0]
        raise DistillError(f"{where}: rope scaling {err['loc'][0]}: {err['msg']}") from None


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory of a supported family; DistillError naming
    the file and the key for anything this decoder cannot run exactly."""
    where = config_file(path)
    if not where.is_file():
        raise DistillError(f"teacher.checkpoint: {where} not found (teacher.format is hf)")
    try:
        raw = json.loads(where.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DistillError(f"{where}: not readable JSON: {e}") from None
    return model_config_from_raw(raw, where)


def model_config_from_raw(raw: dict, where: Path | str) -> ModelConfig:
    """`read_model_config` of a parsed config.json; `where` names it in errors. The keys
    every family shares are read here, the rest by the family's record
    (`distill.models.families`)."""
    kind = raw.get("model_type")
    if families.text_of(kind) is not None:
        raw, kind = text_config(raw, where), families.text_of(kind).model_type
    if not families.known(kind):
        raise DistillError(
            f"{where}: model_type {kind!r} ({', '.join(raw.get('architectures') or [])}) is not "
            f"a supported decoder family ({', '.join(MODEL_TYPES)})"
        )
    family = families.get(kind)
    act = raw.get(family.activation_key) or raw.get("hidden_act", "silu")
    act_key = family.activation_key if raw.get(family.activation_key) else "hidden_act"
    unsupported = {
        act_key: act not in ACTIVATIONS,
        "attention_bias": bool(raw.get("attention_bias")),
        "mlp_bias": bool(raw.get("mlp_bias")),
        "use_bidirectional_attention": bool(raw.get("use_bidirectional_attention")),
        "clip_qkv": raw.get("clip_qkv") is not None,
        "shared_expert_intermediate_size": bool(raw.get("shared_expert_intermediate_size")),
    }
    for key, bad in unsupported.items():
        if bad and key not in family.accepts:
            raise DistillError(f"{where}: {key}={raw[key]!r} is not supported by this decoder")
    theta, scaling, partial = _rope(raw, where, family.proportional_rope)
    try:
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim")
        keys = dict(
            vocab_size=raw["vocab_size"],
            d_model=raw["hidden_size"],
            n_layers=raw["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=None if head_dim in (None, raw["hidden_size"] // heads) else head_dim,
            d_ff=raw.get("intermediate_size", 1),  # absent where every layer is routed
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_embeddings=raw.get("tie_word_embeddings", family.tied_by_default),
            activation=ACTIVATIONS[act],
            family=kind,
            **_windows(raw, family, where),
        )
        cfg = ModelConfig(**{**keys, **family.read(raw, where)})  # the family's own win
        if cfg.has_dense_ffn() and "intermediate_size" not in raw:
            raise KeyError("intermediate_size")
        return cfg
    except KeyError as e:
        raise DistillError(f"{where}: required key {e.args[0]!r} is missing") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise DistillError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None


def text_config(raw: dict, where: Path | str) -> dict:
    """The text model's config.json keys of an image-text checkpoint (`Family.image_text`):
    its `text_config`, with the top level's `tie_word_embeddings` (what transformers ties
    by) where it has one."""
    nested = raw.get("text_config")
    if not isinstance(nested, dict):
        raise DistillError(f"{where}: model_type {raw.get('model_type')!r} without a text_config")
    out = {**nested, "model_type": families.text_of(raw["model_type"]).model_type}
    if "tie_word_embeddings" in raw:
        out["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return out


def _windows(raw: dict, family: families.Family, where: Path) -> dict:
    """sliding_window, layer_types and the sliding layers' RoPE base, from `layer_types` when
    config.json has it, else from the family's own keys (`Family.windows`)."""
    window, n = raw.get("sliding_window"), raw["num_hidden_layers"]
    if raw.get("layer_types") is not None:
        bad = [t for t in raw["layer_types"] if t not in LAYER_TYPES]
        if bad:
            raise DistillError(f"{where}: layer_types entry {bad[0]!r} is not supported")
        types = [LAYER_TYPES[t] for t in raw["layer_types"]]
    else:
        types = family.windows(raw, n, where, family.model_type)
    if "sliding" not in types:  # linear layers among full ones are said per layer
        return {"layer_types": tuple(types)} if "linear" in types else {}
    if window is None:
        raise DistillError(f"{where}: sliding layers without a sliding_window")
    keys = {"sliding_window": window}
    if "full" in types:
        keys["layer_types"] = tuple(types)
    local = _local_theta(raw, where)
    if local is not None and "full" in types:
        keys["rope_local_theta"] = local
    return keys


def _local_theta(raw: dict, where: Path) -> float | None:
    """The sliding layers' RoPE base when it is their own (Gemma 3), else None."""
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention")
    if local is None:
        base = raw.get("rope_local_base_freq")
        return None if base is None else float(base)
    if local.get("rope_type", "default") != "default":
        raise DistillError(
            f"{where}: rope_parameters.sliding_attention rope_type "
            f"{local['rope_type']!r} is not supported (only default)"
        )
    return float(local.get("rope_theta", 10000.0))
