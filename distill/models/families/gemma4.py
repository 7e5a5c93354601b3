"""Gemma 4 text (`gemma4_text`): Gemma 3's four norms per block, GeGLU, scaled embeddings
and sliding layers with every sixth full (the last always full), but norms without the
offset of 1, an RMSNorm without scale on the values, an attention scale of 1, a stored
scalar per layer times its output, and full layers of their own shapes: a head width of
their own (`global_head_dim`), with `attention_k_eq_v` their own KV heads
(`num_global_key_value_heads`) and values that are the keys' projection
(`distill.models.full_layers`); transformers' proportional RoPE on the full layers, the
default on the sliding ones at their own base.

The released checkpoints are `gemma4` image-text models: their text model (`text_config`,
the weights under `model.language_model.`) is read, the vision and audio towers are not.
config.json says the full layers' shapes either as `global_head_dim` and
`num_global_key_value_heads` (the released checkpoints) or as transformers'
`per_layer_config` (overrides per layer index, as transformers 5.25 writes it). What this
decoder does not run is refused in one line naming the key: bidirectional attention
(`use_bidirectional_attention: all`), a per-layer input table of another vocabulary
(`vocab_size_per_layer_input`). The MoE block (`enable_moe_block`) runs the dense MLP and the
routed experts side by side (`distill.models.ffn.beside`). Per-layer input
embeddings (`hidden_size_per_layer_input`) are `distill.models.per_layer_inputs`; the last
`num_kv_shared_layers` layers take their keys and values from the last earlier layer of
their type (`distill.models.full_layers`), with `use_double_wide_mlp` an MLP twice as
wide."""

from __future__ import annotations

from distill.errors import DistillError
from distill.models.families.qwen35 import ROWS
from distill.models.families.record import Family, register

COLS = "%"  # a name `stored{COLS}a:b`: the columns [a, b) (`distill.models.families.views`)

DEFAULT_HEAD_DIM = 256  # transformers' Gemma4TextConfig defaults, where config.json is silent
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_PER_LAYER_WIDTH = 256  # hidden_size_per_layer_input
DEFAULT_VOCAB = 262_144  # vocab_size_per_layer_input
# config.json keys with a value this decoder does not run: key -> whether the value is
# refused (`vision`, the released checkpoints' value, is causal for text).
REFUSED = {
    "use_bidirectional_attention": lambda v: v not in (None, "vision"),
}


def layer_types(raw: dict, n: int) -> list[str]:
    """Per layer, full or sliding, as `Gemma4TextConfig` makes them: config.json's
    `layer_types`, else every sixth full; the last layer always full."""
    given = raw.get("layer_types")
    types = (
        [t.removesuffix("_attention") for t in given]
        if given is not None
        else ["full" if (i + 1) % 6 == 0 else "sliding" for i in range(n)]
    )
    return [*types[:-1], "full"] if types else types


def _windows(raw: dict, n: int, where, kind: str) -> list[str]:
    return layer_types(raw, n)


def _full_shapes(raw: dict, where, types: list[str]) -> tuple[int, int]:
    """(head width, KV heads) of the full layers: from `per_layer_config` where config.json
    has one (every full layer's overrides alike, none on a sliding layer), else
    `global_head_dim` and, under `attention_k_eq_v`, `num_global_key_value_heads`."""
    hd = raw.get("head_dim") or DEFAULT_HEAD_DIM
    kv = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    overrides = raw.get("per_layer_config")
    if overrides is None:
        global_kv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
        return raw.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM), global_kv or kv
    found = set()
    for index, keys in overrides.items():
        i = int(index)
        extra = sorted(set(keys) - {"head_dim", "num_key_value_heads"})
        if extra or not 0 <= i < len(types) or types[i] != "full":
            what = f"key {extra[0]!r}" if extra else "overrides on a layer that is not full"
            raise DistillError(f"{where}: per_layer_config[{index}]: {what} is not supported")
        found.add((keys.get("head_dim", hd), keys.get("num_key_value_heads", kv)))
    found |= {(hd, kv)} if len(overrides) < types.count("full") else set()
    if len(found) > 1:
        raise DistillError(f"{where}: per_layer_config: full layers of different shapes")
    return found.pop() if found else (hd, kv)


def _read(raw: dict, where) -> dict:
    for key, refused in REFUSED.items():
        if refused(raw.get(key)):
            raise DistillError(f"{where}: {key}={raw[key]!r} is not supported by this decoder")
    per_layer = raw.get("hidden_size_per_layer_input", DEFAULT_PER_LAYER_WIDTH) or 0
    table = raw.get("vocab_size_per_layer_input", DEFAULT_VOCAB)
    if per_layer and table != raw["vocab_size"]:  # one table row per token id, as the embedding
        raise DistillError(f"{where}: vocab_size_per_layer_input={table!r} other than "
                           f"vocab_size={raw['vocab_size']} is not supported")  # fmt: skip
    n = raw["num_hidden_layers"]
    types = layer_types(raw, n)
    shared = raw.get("num_kv_shared_layers") or 0
    if shared >= n:
        raise DistillError(f"{where}: num_kv_shared_layers={shared} leaves no layer its own "
                           f"keys and values (num_hidden_layers={n})")  # fmt: skip
    hd = raw.get("head_dim") or DEFAULT_HEAD_DIM
    kv = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    global_hd, global_kv = _full_shapes(raw, where, types)
    full_rope = (raw.get("rope_parameters") or {}).get("full_attention") or {}
    kind = full_rope.get("rope_type", "proportional")
    if kind not in ("proportional", "default"):  # scalings other families read
        raise DistillError(f"{where}: rope_parameters.full_attention rope_type {kind!r} is not "
                           "supported for gemma4_text (proportional or default)")  # fmt: skip
    proportional = kind == "proportional"
    keys = {
        "head_dim": hd,
        "post_norms": True,
        "embed_scale": True,
        "query_scale": 1.0,
        "qk_norm": True,
        "v_norm": True,
        "layer_scalar": True,
        "rope_proportional": True,
        "global_head_dim": global_hd if global_hd != hd else None,
        "global_kv_heads": global_kv if global_kv != kv else None,
        "attn_k_eq_v": bool(raw.get("attention_k_eq_v")),
        # the default RoPE on full layers rotates every dim, as proportional at factor 1
        "partial_rotary_factor": full_rope.get("partial_rotary_factor", 1.0)
        if proportional
        else 1.0,
        "final_softcap": raw.get("final_logit_softcapping"),
        "per_layer_input": per_layer,
        "kv_shared_layers": shared,
        "wide_mlp": bool(raw.get("use_double_wide_mlp")) and shared > 0,
    }
    if raw.get("enable_moe_block"):  # a dense MLP and routed experts in every layer
        keys.update(
            n_experts=raw["num_experts"], experts_per_token=raw["top_k_experts"],
            d_ff_expert=raw["moe_intermediate_size"], norm_topk_prob=True,
            moe_beside_dense=True, router_norm=True, expert_scale=True,
        )  # fmt: skip
    if "sliding" in types:
        keys["layer_types"] = tuple(types)
    if not raw.get("hidden_activation") and not raw.get("hidden_act"):
        keys["activation"] = "gelu_tanh"  # transformers' default
    return keys


def _write(cfg) -> dict:
    full = {"rope_type": "proportional", "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor}  # fmt: skip
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    return {
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        },
        "global_head_dim": cfg.kind_hd("full"),
        "attention_k_eq_v": cfg.attn_k_eq_v,
        "num_global_key_value_heads": cfg.global_kv_heads,
        "final_logit_softcapping": cfg.final_softcap,
        "hidden_size_per_layer_input": cfg.per_layer_input,
        "vocab_size_per_layer_input": cfg.vocab_size,
        "num_kv_shared_layers": cfg.kv_shared_layers,
        "use_double_wide_mlp": cfg.wide_mlp,
        "enable_moe_block": bool(cfg.n_experts),
        "num_experts": cfg.n_experts or None,
        "top_k_experts": cfg.experts_per_token if cfg.n_experts else None,
        "moe_intermediate_size": cfg.f_expert if cfg.n_experts else None,
    }


# ---------------------------------------------- full layers of their own shapes (names)

PREFIX = "full_"
# The attention weights a full layer holds under its own names (`PREFIX` + the name).
ATTENTION_KEYS = ("wq", "wk", "wv", "wo", "q_norm", "k_norm")
NORMS = ("full_q_norm", "full_k_norm")
KV_KEYS = ("wk", "wv", "k_norm")  # what a KV-sharing layer does not hold
DENSE_KEYS = ("w_gate", "w_up", "w_down")  # a wide layer's: `wide_gate`, ...


def per_layer_names(cfg, i: int) -> dict[str, tuple[str, bool]]:
    """Layer `i`'s per-layer-input tensors (`distill.models.per_layer_inputs`): Hugging Face
    name -> (distill key, transposed); its slices of the packed table and projection (the
    columns, rows [i * P, (i + 1) * P)) and its own gate, projection and norm."""
    p, at = cfg.per_layer_input, f"{i * cfg.per_layer_input}:{(i + 1) * cfg.per_layer_input}"
    if not p:
        return {}
    layer = f"model.layers.{i}."
    return {
        f"model.embed_tokens_per_layer.weight{COLS}{at}": ("ple_embed", False),
        f"model.per_layer_model_projection.weight{ROWS}{at}": ("ple_model_proj", True),
        f"{layer}per_layer_input_gate.weight": ("ple_gate", True),
        f"{layer}per_layer_projection.weight": ("ple_proj", True),
        f"{layer}post_per_layer_input_norm.weight": ("ple_norm", False),
    }


def per_layer_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The per-layer-input tensors as transformers stores them (a layer's slice of the
    packed ones), and the shared norm's."""
    d, v, p = cfg.d_model, cfg.vocab_size, cfg.per_layer_input
    return {"ple_embed": (v, p), "ple_model_proj": (p, d), "ple_gate": (p, d),
            "ple_proj": (d, p), "ple_norm": (d,), "ple_proj_norm": (p,)}  # fmt: skip


def key(cfg, name: str, kind: str | None) -> str:
    """The weight name of attention weight `name` in a layer of type `kind`."""
    return PREFIX + name if kind == "full" and cfg.full_apart() else name


def kinds(cfg) -> tuple[str, ...]:
    """The attention kinds whose layers hold weights of their own shapes, in cache order:
    (sliding, full) where full layers are apart and both kinds are present; else the one
    kind (`ModelConfig.attention_type`)."""
    if not cfg.full_apart():
        return (cfg.attention_type(),)
    return tuple(k for k in ("sliding", "full") if k in cfg.types())


def weight_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The full layers' attention weights in distill's layout ([in, out] projections, one
    head's norms), where full layers are apart."""
    d, h, hd, kv = cfg.d_model, cfg.n_heads, cfg.kind_hd("full"), cfg.kind_kv_heads("full")
    shapes = {
        "full_wq": (d, h * hd),
        "full_wk": (d, kv * hd),
        "full_wv": (d, kv * hd),
        "full_wo": (h * hd, d),
    }
    if cfg.attn_k_eq_v:
        del shapes["full_wv"]
    if cfg.qk_norm:
        shapes.update(full_q_norm=(hd,), full_k_norm=(hd,))
    return shapes


def hf_shape(cfg, name: str) -> tuple[int, ...]:
    """A full layer's attention weight as transformers stores it ([out, in])."""
    shape = weight_shapes(cfg)[name]
    return shape[::-1] if len(shape) == 2 else shape


def hf_names(cfg, i: int, names: dict) -> dict:
    """Layer `i`'s weight names (`distill.models.hf.layer_weights`): in a full layer apart,
    its attention weights under their `full_` keys (no value projection under
    `attn_k_eq_v`); in a KV-sharing layer no key or value weights; in a wide one its MLP
    under the `wide_` keys."""
    full = cfg.types()[i] == "full" and cfg.full_apart()
    out = {}
    for name, value in names.items():
        if cfg.kv_shared()[i] and name in KV_KEYS:
            continue
        if full and name in ATTENTION_KEYS:
            if name == "wv" and cfg.attn_k_eq_v:
                continue
            name = PREFIX + name
        if cfg.wide_layers()[i] and name in DENSE_KEYS:
            name = "wide_" + name.removeprefix("w_")
        out[name] = value
    return out


GEMMA4 = register(
    Family(
        model_type="gemma4_text",
        architecture="Gemma4ForCausalLM",
        parts=(
            "post-attention and post-MLP norms",
            "embedding scale",
            "GeGLU",
            "per-head query/key RMSNorm",
            "value RMSNorm without scale",
            "layer scalar",
            "full layers of their own head width and KV heads (keys as values)",
            "proportional partial RoPE on full layers, local RoPE base",
            "sliding window every n-th full",
            "final soft-cap",
            "per-layer input embeddings",
            "KV sharing across the last layers",
            "double-wide MLP",
            "MoE block (dense MLP beside routed experts)",
        ),  # fmt: skip
        read=_read,
        write=_write,
        windows=_windows,
        proportional_rope=True,
        tied_by_default=True,
        activation_key="hidden_activation",
        accepts=frozenset({"use_bidirectional_attention"}),
        image_text="gemma4",
        fused_experts=True,  # `experts.gate_up_proj` halves and `experts.down_proj`
        fused_halves=True,
        moe_prefix="",  # `model.layers.{i}.router.proj`, `model.layers.{i}.experts.`
        router_name="router.proj",
    )
)
