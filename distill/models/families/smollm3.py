"""SmolLM3: Llama with layers without RoPE (NoPE: `no_rope_layers`, 1 for a layer that
rotates, else every `no_rope_layer_interval`-th layer is NoPE) and a tied embedding; its
sliding layers, where `use_sliding_window` is set, default to the NoPE ones."""

from __future__ import annotations

from distill.errors import DistillError
from distill.models.families.record import Family, register


def _ropes(raw: dict, where) -> list[bool]:
    """Per layer, whether it applies RoPE, as `SmolLM3Config` reads it."""
    n = raw["num_hidden_layers"]
    flags = raw.get("no_rope_layers")
    if flags is None:
        every = raw.get("no_rope_layer_interval", 4)
        return [(i + 1) % every != 0 for i in range(n)]
    if len(flags) < n:
        raise DistillError(f"{where}: no_rope_layers has {len(flags)} entries for {n} layers")
    return [bool(f) for f in flags[:n]]


def _windows(raw: dict, n: int, where, kind: str) -> list[str]:
    """Without `layer_types`: the NoPE layers slide when use_sliding_window is set."""
    sliding = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
    return ["sliding" if sliding and not rope else "full" for rope in _ropes(raw, where)]


def _read(raw: dict, where) -> dict:
    types = raw.get("layer_types") or []
    if "sliding_attention" in types and not raw.get("use_sliding_window"):
        raise DistillError(  # transformers' masks would slide where its attention does not
            f"{where}: layer_types has sliding layers but use_sliding_window is not set"
        )
    ropes = _ropes(raw, where)
    return {"rope_layers": None if all(ropes) else tuple(ropes)}


def _write(cfg) -> dict:
    return {
        "no_rope_layers": [int(r) for r in cfg.ropes()],
        "use_sliding_window": "sliding" in cfg.types(),
    }


SMOLLM3 = register(
    Family(
        model_type="smollm3",
        architecture="SmolLM3ForCausalLM",
        parts=("layers without RoPE (NoPE)",),
        read=_read,
        write=_write,
        windows=_windows,
        tied_by_default=True,
        chat="Its template opens every conversation with a system block of its own (today's "
        "date by strftime_now, so the ids depend on the day rendered; the reasoning mode from "
        "/think or /no_think in the system message, else enable_thinking); in /no_think "
        "mode each answer opens with an empty <think></think>.",
    )
)
