"""ModelConfig -> a Hugging Face config.json in the model's own family (`ModelConfig.family`):
the inverse of `distill.models.hf.read_model_config`, which checks every file written here.

The keys every family shares are written here, the rest by the family's record
(`distill.models.families`: `Family.write`), as its transformers configuration class reads
them (Qwen's `use_sliding_window` and explicit `layer_types`, Gemma's
`query_pre_attn_scalar` and soft-caps, Gemma 3's per-layer-type `rope_parameters`). The
written file is read back by the loader and must give the same model: a config its family
cannot express (a Llama with query norms, a Mistral mixing full and sliding layers) is one
DistillError line naming the key.
"""

from __future__ import annotations

from distill.config import RUNTIME_KEYS, ModelConfig
from distill.errors import DistillError
from distill.models import families, hf

# model_type -> the transformers class its config.json names.
ARCHITECTURES = {name: families.get(name).architecture for name in families.names()}
_TYPE_NAMES = {v: k for k, v in hf.LAYER_TYPES.items()}  # full -> full_attention, ...
_ACT_NAMES = {v: k for k, v in hf.ACTIVATIONS.items()}


def to_hf_config(
    cfg: ModelConfig,
    *,
    max_position_embeddings: int,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    dtype: str = "float32",
) -> dict:
    """A config.json of `cfg`'s family that transformers loads as that family's model and
    that `hf.read_model_config` reads back as `cfg` (runtime keys aside)."""
    family = families.get(cfg.family)
    raw = {
        "architectures": [family.architecture],
        "model_type": family.exports_as or cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.hd,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,  # Qwen2's q, k, v biases are implied by its model_type
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": dtype,
        **_rope(cfg, family),
        **_windows(cfg, family),
        family.activation_key: _ACT_NAMES[cfg.activation],
        **family.write(cfg),
    }
    _check_round_trip(cfg, raw)
    return raw


# Each scaling type's keys, as transformers reads them.
_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"),
}  # fmt: skip


def _scaling(cfg: ModelConfig) -> dict | None:
    if cfg.rope_scaling is None:
        return None
    kind = cfg.rope_scaling.type
    keys = {k: getattr(cfg.rope_scaling, k) for k in _SCALING_KEYS[kind]}
    return {"rope_type": kind, **{k: v for k, v in keys.items() if v is not None}}


def _rope(cfg: ModelConfig, family: families.Family) -> dict:
    """The older rope_theta/rope_scaling layout (transformers 4 reads it, 5 converts it),
    except for a family with a local base of its own (Gemma 3): transformers 5's
    per-layer-type `rope_parameters`."""
    scaling = _scaling(cfg)
    if cfg.rope_proportional:  # Gemma 4's per-layer-type rope_parameters: its family's
        return {}
    if cfg.partial_rotary_factor != 1:  # only transformers 5's layout says it (GLM-4.5)
        partial = {"partial_rotary_factor": cfg.partial_rotary_factor}
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}),
                                    "rope_theta": cfg.rope_theta, **partial}}  # fmt: skip
    if not family.rope_per_layer_type or "full" not in cfg.types():
        return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling}
    full = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta}
    local = cfg.rope_local_theta
    if local is None:  # the sliding layers share the full layers' RoPE
        local = cfg.rope_theta
    return {
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
    }


def _windows(cfg: ModelConfig, family: families.Family) -> dict:
    """sliding_window and the per-layer types, in the keys the family reads."""
    types = cfg.types()
    sliding = "sliding" in types
    keys = {"sliding_window": cfg.sliding_window if sliding else None}
    if family.sliding_flag:
        keys["use_sliding_window"] = sliding
        if sliding:
            keys["max_window_layers"] = types.index("sliding")
    if family.writes_layer_types:
        keys["layer_types"] = [_TYPE_NAMES[t] for t in types]
    return keys


def _comparable(cfg: ModelConfig) -> dict:
    """`cfg`'s keys that say what the model computes, in one spelling: per-layer types
    whatever says them, a head width however it is said (a head_dim equal to d_model /
    n_heads is read back as None), which layers rotate however it is said, a local RoPE
    base equal to the global one when unset."""
    keys = cfg.model_dump(exclude=set(RUNTIME_KEYS))
    keys["head_dim"] = cfg.hd
    keys["layer_types"] = cfg.types()
    keys["rope_layers"] = cfg.ropes()
    keys["d_ff"] = cfg.d_ff if cfg.has_dense_ffn() else None  # unused without dense layers
    keys["d_ff_expert"] = cfg.f_expert if cfg.n_experts else None
    keys["d_ff_shared"] = cfg.f_shared
    if not cfg.n_experts:  # the MoE keys say nothing of a dense model
        keys.update(experts_per_token=None, norm_topk_prob=None, dense_layers=None)
    if keys["rope_local_theta"] is None and cfg.rope_scaling is None:
        keys["rope_local_theta"] = cfg.rope_theta
    if "sliding" not in cfg.types():
        keys["sliding_window"] = keys["rope_local_theta"] = None
    return keys


def _check_round_trip(cfg: ModelConfig, raw: dict) -> None:
    """The loader reads `raw` back as `cfg`, else one line naming the first key lost."""
    where = f"export ({cfg.family} config.json)"
    back = _comparable(hf.model_config_from_raw(raw, where))
    back["family"] = cfg.family if families.get(cfg.family).exports_as else back["family"]
    want = _comparable(cfg)
    for key, value in want.items():
        if back[key] != value:
            raise DistillError(
                f"export: student.model.{key}={value!r} cannot be written as a {cfg.family} "
                f"checkpoint (its config.json would say {back[key]!r})"
            )
