"""What a checkpoint family is, as one record: `Family`, and the registry of them.

A family is a Hugging Face `model_type` whose checkpoints the one decoder runs. Its record
says everything that sets it apart, so that adding a family touches its record and, only
where it brings a new part, the model: how its config.json keys become `ModelConfig` keys
(`read`) and back (`write`), which layers slide when config.json has no `layer_types`
(`windows`), its tensor names where they are not the shared ones (`moe_prefix`,
`expert_names`), the dense family a student of it becomes, the shared parts it composes
(`parts`, for the model-families guide) and its chat template's quirks (`chat`).

No JAX and no import of `distill.config` here: the config schema reads the registry's
names (`ModelConfig.family`) before JAX starts. Records take and give plain dicts;
`distill.models.hf` builds the `ModelConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from distill.errors import DistillError

# Qwen2-MoE's shared expert and its sigmoid gate, after `model.layers.{i}.mlp.`
SHARED_NAMES = MappingProxyType(
    {
        "ws_gate": "shared_expert.gate_proj.weight",
        "ws_up": "shared_expert.up_proj.weight",
        "ws_down": "shared_expert.down_proj.weight",
        "shared_gate": "shared_expert_gate.weight",
    }
)
# Each routed expert's weights after `model.layers.{i}.{moe_prefix}experts.{j}.`, as most
# families save them one by one (transformers 5 fuses them in memory only).
EXPERT_NAMES = MappingProxyType(
    {"we_gate": "gate_proj.weight", "we_up": "up_proj.weight", "we_down": "down_proj.weight"}
)


def _nothing(*_) -> dict:
    return {}


def no_windows(raw: dict, n: int, where, kind: str) -> list[str]:
    """Every layer full; a sliding_window is an error (Llama, OLMoE)."""
    if raw.get("sliding_window") is not None:
        raise DistillError(
            f"{where}: sliding_window={raw['sliding_window']!r} is not supported by {kind}"
        )
    return ["full"] * n


def all_sliding(raw: dict, n: int, where, kind: str) -> list[str]:
    """Every layer sliding when sliding_window is set (Mistral, Mixtral)."""
    return ["sliding" if raw.get("sliding_window") else "full"] * n


def qwen_windows(raw: dict, n: int, where, kind: str) -> list[str]:
    """Sliding from max_window_layers on when use_sliding_window (Qwen2, Qwen3)."""
    first = raw.get("max_window_layers", n) if raw.get("use_sliding_window") else n
    window = raw.get("sliding_window")
    return ["sliding" if window and i >= first else "full" for i in range(n)]


def every_nth(default: int, key: str | None = None) -> Callable:
    """Sliding except every n-th layer (Gemma 2: n = 2; Gemma 3: sliding_window_pattern)."""

    def windows(raw: dict, n: int, where, kind: str) -> list[str]:
        every = raw.get(key, default) if key else default
        return ["full" if (i + 1) % every == 0 else "sliding" for i in range(n)]

    return windows


@dataclass(frozen=True)
class Family:
    """One checkpoint family. `read(raw, where)`: the ModelConfig keys that set it apart
    from Llama, from its parsed config.json (`where` names the file in errors); `write(cfg)`:
    its config.json keys beyond the shared ones, from a ModelConfig (a DistillError line
    for what the family cannot express)."""

    model_type: str
    architecture: str  # config.json `architectures` on export: the transformers class
    parts: tuple[str, ...] = ()  # the shared parts it composes beyond Llama's, for the guide
    read: Callable[[dict, object], dict] = _nothing
    write: Callable[[object], dict] = _nothing
    # Per-layer attention types when config.json has no `layer_types`.
    windows: Callable[[dict, int, object, str], list[str]] = no_windows
    writes_layer_types: bool = True  # whether its config.json says `layer_types`
    sliding_flag: bool = False  # Qwen's `use_sliding_window` / `max_window_layers`
    rope_per_layer_type: bool = False  # Gemma 3: `rope_parameters` per layer type
    proportional_rope: bool = False  # Gemma 4: its full layers' `proportional` rope_type
    tied_by_default: bool = False  # tie_word_embeddings when config.json does not say
    activation_key: str = "hidden_act"  # Gemma: hidden_activation
    # config.json switches the shared reader refuses (biases, shared experts) that this
    # family reads itself.
    accepts: frozenset[str] = frozenset()
    # A mixture of experts' router and experts after `model.layers.{i}.{moe_prefix}`.
    moe_prefix: str = "mlp."
    router_name: str = "gate"  # `{moe_prefix}{router_name}.weight` (gpt-oss: router)
    expert_names: Mapping[str, str] = field(default_factory=lambda: EXPERT_NAMES)
    shared_names: Mapping[str, str] = field(default_factory=lambda: SHARED_NAMES)
    # The experts stored fused, one tensor per layer with a leading expert axis
    # (`experts.gate_up_proj` [E, D, 2F], gate and up interleaved, `experts.down_proj`
    # [E, F, D], and their biases), rather than one tensor per expert.
    fused_experts: bool = False
    # Fused experts as transformers' Gemma 4 stores them: `experts.gate_up_proj` [E, 2F, D]
    # (each expert's gate rows, then its up rows), `experts.down_proj` [E, D, F], each
    # expert [out, in] (read transposed).
    fused_halves: bool = False
    # config.json's count of extra layers stored past num_hidden_layers that the decoder
    # does not run (DeepSeek-V3's multi-token prediction), skipped on load.
    extra_layers_key: str | None = None
    exports_as: str | None = None  # the model_type written on export, when another's
    dense: str | None = None  # the family a dense student of it becomes (Mixtral: mistral)
    # The model_type of the image-text checkpoints released around this text model (Qwen3.5:
    # `qwen3_5`), whose config.json nests it as `text_config` and whose weights hold it
    # under `model.language_model.`: read as this family, the vision tower left unread.
    image_text: str | None = None
    chat: str = ""  # what its chat template does that a renderer must respect


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.model_type in _REGISTRY:
        raise ValueError(f"family {family.model_type!r} is registered twice")
    _REGISTRY[family.model_type] = family
    return family


def get(model_type: str) -> Family:
    return _REGISTRY[model_type]


def known(model_type: str | None) -> bool:
    return model_type in _REGISTRY


def text_of(model_type: str | None) -> Family | None:
    """The family whose text model an image-text checkpoint of `model_type` holds, if any."""
    found = (f for f in _REGISTRY.values() if f.image_text and f.image_text == model_type)
    return next(found, None)


def names() -> tuple[str, ...]:
    """Every registered model_type, in registration order."""
    return tuple(_REGISTRY)
