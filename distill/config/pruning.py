"""Depth pruning: the teacher layers a student of another depth starts from or mirrors.

A ``student.init: from_teacher`` student keeps a subset of the teacher's layers
(``student.init_layers``, else evenly spaced, the first and last included), and each kept
layer brings what is per layer in the model config: its attention type (``layer_types``:
the layer's window and RoPE), whether it applies RoPE at all (``rope_layers``: SmolLM3's
NoPE layers) and, in a mixture of experts, whether its feed-forward is the
dense one (``dense_layers``). A student that sets these keys itself is checked against the
kept layers instead.
"""

from __future__ import annotations

from distill.config.model import RUNTIME_KEYS, ModelConfig
from distill.errors import DistillError


def evenly_spaced(n: int, total: int) -> list[int]:
    """``n`` layer indices evenly spaced in [0, total), the first and last included."""
    span = total - 1  # n evenly spaced in [0, span], rounded
    return [(i * span + (n - 1) // 2) // (n - 1) for i in range(n)] if n > 1 else [0]


def kept_layers(t: ModelConfig, n: int, chosen: list[int] | None) -> list[int]:
    """The teacher (``t``) layers a ``from_teacher`` student of ``n`` layers keeps:
    ``chosen`` (``student.init_layers``, validated), else evenly spaced."""
    if chosen is None:
        if n > t.n_layers:
            raise DistillError(
                f"student.model.n_layers: {n} exceeds the teacher's {t.n_layers};"
                " student.init: from_teacher takes a subset of the teacher's layers"
            )
        return evenly_spaced(n, t.n_layers)
    if len(chosen) != n:
        raise DistillError(
            f"student.init_layers: {len(chosen)} layers given, but student.model.n_layers is {n}"
        )
    if any(not 0 <= i < t.n_layers for i in chosen) or sorted(set(chosen)) != chosen:
        raise DistillError(
            f"student.init_layers: {chosen} must be increasing teacher layer indices in "
            f"[0, {t.n_layers})"
        )
    return chosen


def kept_layer_fields(
    t: ModelConfig, overrides: dict, from_teacher: bool, chosen: list[int] | None
) -> dict:
    """The teacher's per-layer keys for a student (``student.model`` ``overrides``) of
    another depth that does not set them: those of the layers it keeps (``from_teacher``),
    or, starting from random weights with fewer layers, of the layers it would keep."""
    n = overrides.get("n_layers", t.n_layers)
    if n == t.n_layers or not (from_teacher or n < t.n_layers):
        return {}
    layers = kept_layers(t, n, chosen) if from_teacher else evenly_spaced(n, t.n_layers)
    out = {}
    if t.layer_types is not None and "layer_types" not in overrides:
        out["layer_types"] = tuple(t.layer_types[i] for i in layers)
    if t.rope_layers is not None and "rope_layers" not in overrides:
        out["rope_layers"] = tuple(t.rope_layers[i] for i in layers)
    if from_teacher and t.n_experts and "dense_layers" not in overrides:
        out["dense_layers"] = tuple(j for j, i in enumerate(layers) if not t.moe_layers()[i])
    return out


def init_layers(t: ModelConfig, s: ModelConfig, chosen: list[int] | None) -> list[int]:
    """The teacher layers a ``from_teacher`` student ``s`` starts from, checked: the
    student has the teacher's width and the kept layers' per-layer keys."""
    for key in ModelConfig.model_fields:
        per_layer = ("n_layers", "layer_types", "rope_layers", "dense_layers", *RUNTIME_KEYS)
        if key not in per_layer and getattr(s, key) != getattr(t, key):
            raise DistillError(
                f"student.model.{key}: {getattr(s, key)} differs from the teacher's "
                f"{getattr(t, key)}; student.init: from_teacher keeps the teacher's width"
            )
    layers = kept_layers(t, s.n_layers, chosen)
    dense = [j for j, i in enumerate(layers) if not t.moe_layers()[i]]
    if t.n_experts and list(s.dense_layers) != dense:
        raise DistillError(
            f"student.model.dense_layers: {list(s.dense_layers)} are not the kept teacher "
            f"layers' dense ones {dense} (student.init: from_teacher)"
        )
    want = tuple(t.types()[i] for i in layers)
    if s.types() != want:
        raise DistillError(
            f"student.model.layer_types: {list(s.types())} are not the kept teacher layers' "
            f"types {list(want)} (student.init: from_teacher)"
        )
    ropes = tuple(t.ropes()[i] for i in layers)
    if s.ropes() != ropes:
        raise DistillError(
            f"student.model.rope_layers: {list(s.ropes())} are not the kept teacher layers' "
            f"{list(ropes)} (student.init: from_teacher)"
        )
    return layers
