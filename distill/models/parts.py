"""How the layers of one model differ: their windows, RoPE tables and kinds, scanned beside
their weights (`layer_data`), and the parts of a layer's weights and which layers hold
them: where layers differ
(DeepSeek-V3's dense first layers beside MoE ones, Qwen3.5's linear and full attention
layers), each part is stacked over the layers holding it, and a layer reads its slice of a
part's stack at its slot (`layer_slot`). Pipeline stages, which run one program over equal
slices of the stack, hold the one-shape stack instead (`to_union`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from distill.config import ModelConfig
from distill.models import moe
from distill.models.rope import layer_rope

Params = dict  # nested dict of arrays, as `distill.models.model.Params`

# A full-attention layer's window when layers differ: wider than any row.
NO_WINDOW = 2**30


# The parts of a layer's weights, by which layers hold them: the norms every layer, the
# attention's the attention layers (but full layers of their own shapes, which hold the
# `full` part's: Gemma 4), their keys' and values' projections (`kv`, `full_kv`) those of
# them that do not share an earlier layer's (Gemma 4's KV sharing), Gated DeltaNet's the
# linear ones, the gated MLP's the dense feed-forward layers (`wide`: Gemma 4's twice as
# wide in its sharing layers), the router's and experts' the MoE ones (`part_layers`).
PARTS = ("all", "attention", "kv", "full", "full_kv", "linear", "dense", "wide", "moe")
_ALL_LAYERS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "layer_scalar",
               "ple_embed", "ple_model_proj", "ple_gate", "ple_proj", "ple_norm",
               "post_dense_norm", "pre_moe_norm", "post_moe_norm")  # fmt: skip
_DENSE_FFN = ("w_gate", "w_up", "w_down")
WIDE_FFN = ("wide_gate", "wide_up", "wide_down")  # the same as a wide layer's
_KV = ("wk", "wv", "bk", "bv", "k_norm")


def weight_part(key: str) -> str:
    """The part (`PARTS`) layer weight `key` belongs to."""
    if key in _ALL_LAYERS:
        return "all"
    if key.startswith("lin_"):
        return "linear"
    if key.startswith("full_"):
        return "full_kv" if key.removeprefix("full_") in _KV else "full"
    if key in _DENSE_FFN:
        return "dense"
    if key in WIDE_FFN:
        return "wide"
    if key in _KV:
        return "kv"
    return "moe" if key in moe.ALL_KEYS else "attention"


def part_layers(cfg: ModelConfig, part: str) -> tuple[bool, ...]:
    """Per layer, whether it holds `part`'s weights."""
    linear, routed, shared = cfg.linear_layers(), cfg.moe_layers(), cfg.kv_shared()
    full = tuple(cfg.full_apart() and t == "full" for t in cfg.types())
    attention = tuple(not (x or f) for x, f in zip(linear, full, strict=True))
    own = lambda holds: tuple(h and not s for h, s in zip(holds, shared, strict=True))  # noqa: E731
    return {
        "all": (True,) * cfg.n_layers,
        "attention": attention,
        "kv": own(attention),
        "full": full,
        "full_kv": own(full),
        "linear": linear,
        "dense": tuple(
            (not x or cfg.moe_beside_dense) and not w
            for x, w in zip(routed, cfg.wide_layers(), strict=True)
        ),  # fmt: skip
        "wide": tuple(
            (not x or cfg.moe_beside_dense) and w
            for x, w in zip(routed, cfg.wide_layers(), strict=True)
        ),  # fmt: skip
        "moe": routed,
    }[part]


def apart(cfg: ModelConfig) -> tuple[str, ...]:
    """The parts only some layers hold (DeepSeek-V3's dense and MoE feed-forwards, Qwen3.5's
    linear and attention mixers): each is stored as its own stack of the layers holding it,
    so no layer stores a part it does not run (`Transformer`). The others are stacked over
    every layer and scanned with the block."""
    n = cfg.n_layers
    return tuple(p for p in PARTS if 0 < sum(part_layers(cfg, p)) < n)


def layer_slot(cfg: ModelConfig, key: str, layer: int) -> int:
    """Layer `layer`'s index in the stack of weight `key` (`apart`; the layer itself where
    every layer holds it)."""
    part = weight_part(key)
    if part not in apart(cfg):
        return layer
    holds = part_layers(cfg, part)
    if not holds[layer]:
        raise ValueError(f"layer {layer} of this model holds no {key}")
    return sum(holds[:layer])


def stack_size(cfg: ModelConfig, key: str) -> int:
    """How many layers' slices the stack of weight `key` holds."""
    part = weight_part(key)
    return sum(part_layers(cfg, part)) if part in apart(cfg) else cfg.n_layers


def to_union(cfg: ModelConfig, params: Params) -> Params:
    """`params` with every stack of `apart` parts spread over all the layers, zeros in the
    layers that do not hold it: the one-shape stack pipeline stages split over `pp`
    (`teacher.stages`), where every stage runs the same program. A no-op on params so laid
    out already."""
    layers, parts = dict(params["layers"]), apart(cfg)
    for key, a in layers.items():
        part = weight_part(key)
        if part in parts and a.shape[0] < cfg.n_layers:
            at = np.flatnonzero(part_layers(cfg, part))
            full = jnp.zeros((cfg.n_layers, *a.shape[1:]), a.dtype)
            layers[key] = full.at[at].set(a)
    return dict(params, layers=layers)


def is_union(cfg: ModelConfig, params: Params) -> bool:
    """Whether `params` hold the one-shape stack (`to_union`) of a model with `apart` parts."""
    parts = apart(cfg)
    return any(
        weight_part(k) in parts and a.shape[0] >= cfg.n_layers for k, a in params["layers"].items()
    )


def with_stacks(layer: dict | None, stacks: dict) -> dict | None:
    """A layer's scanned data with the part stacks it indexes (`Transformer.stacks`)."""
    return layer if not stacks else dict(layer, stacks=stacks)


def window_of(cfg: ModelConfig, kind: str) -> int | None:
    """The window of a layer of type `kind` (None: full attention)."""
    return cfg.sliding_window if kind == "sliding" else None


def layer_data(cfg: ModelConfig, union: bool = False) -> dict | None:
    """What the layer scan feeds each block when layers differ: when windows differ,
    window int32 [L] (`NO_WINDOW` for full layers); when windows or RoPE differ (a local
    base, NoPE layers), inv_freq float32 [L, R/2] and rope_factor float32 [L]
    (`distill.models.rope.Rope`); where full layers have shapes of their own (Gemma 4),
    instead full bool [L] (each kind's window and RoPE static in its branch); when dense
    and MoE feed-forwards mix, moe bool [L]; under KV sharing kv_shared and kv_store bool
    [L] (`ModelConfig.kv_shared`, `kv_stores`), and where some MLPs are wide, wide bool
    [L]; when linear and attention layers mix, linear bool [L]; for each part only some
    layers hold (`apart`; not in the one-shape stack, `union`), slot_<part> int32 [L]: each
    layer's index in that part's stack (0 in a layer without it, which never reads it).
    None when layers are alike."""
    data = {}
    for part in () if union else apart(cfg):
        holds = np.asarray(part_layers(cfg, part))
        data[f"slot_{part}"] = jnp.asarray(np.maximum(np.cumsum(holds) - 1, 0), jnp.int32)
    if cfg.full_apart():  # each kind's window and RoPE are static in its own branch
        if 0 < sum(part_layers(cfg, "full")) < cfg.n_layers:
            data["full"] = jnp.asarray(part_layers(cfg, "full"))
    elif cfg.mixed_windows():
        windows = [window_of(cfg, t) or NO_WINDOW for t in cfg.types()]
        data["window"] = jnp.asarray(windows, jnp.int32)
    if cfg.mixed_layers() and not cfg.full_apart():
        tables = [layer_rope(cfg, i) for i in range(cfg.n_layers)]
        data["inv_freq"] = jnp.stack([t.inv_freq for t in tables])
        data["rope_factor"] = jnp.asarray([t.factor for t in tables], jnp.float32)
    if cfg.mixed_ffn():
        data["moe"] = jnp.asarray(cfg.moe_layers())
    if cfg.kv_shared_layers:  # the layers sharing keys and values, and those they share
        data["kv_shared"], data["kv_store"] = map(jnp.asarray, (cfg.kv_shared(), cfg.kv_stores()))
    if len(set(cfg.wide_layers())) > 1:
        data["wide"] = jnp.asarray(cfg.wide_layers())
    if cfg.mixed_mixers():
        data["linear"] = jnp.asarray(cfg.linear_layers())
    return data or None


def flat(tree: dict) -> Params:
    """The module's state with the part stacks (`<part>_layers`) merged into `layers`."""
    out = {k: v for k, v in tree.items() if not (k.endswith("_layers") and k[:-7] in PARTS)}
    out["layers"] = dict(tree["layers"])
    for part in PARTS:
        out["layers"].update(tree.get(f"{part}_layers", {}))
    return out


def nested(cfg: ModelConfig, params: Params, union: bool) -> dict:
    """`params` as the module's state (`flat`'s inverse)."""
    parts = () if union else apart(cfg)
    out = {k: v for k, v in params.items() if k != "layers"}
    out["layers"] = {}
    for key, a in params["layers"].items():
        part = weight_part(key)
        tree = out.setdefault(f"{part}_layers", {}) if part in parts else out["layers"]
        tree[key] = a
    return out
