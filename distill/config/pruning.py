"""Depth pruning: the teacher layers a student of another depth starts from or mirrors.

A ``student.init: from_teacher`` student keeps a subset of the teacher's layers
(``student.init_layers``, else evenly spaced, the first and last included), and each kept
layer brings what is per layer in the model config: its attention type (``layer_types``:
the layer's window and RoPE), whether it applies RoPE at all (``rope_layers``: SmolLM3's
NoPE layers), in a mixture of experts whether its feed-forward is the
dense one (``dense_layers``), and whether it shares an earlier layer's keys and values
(``kv_shared_layers``: Gemma 4's, the last layers'). A student that sets these keys itself
is checked against the kept layers instead. Where linear-attention and full-attention
layers repeat in a pattern (Qwen3.5: three linear, then one full), or sliding and full ones
have shapes of their own (Gemma 4), the default keeps that pattern (``hybrid_layers``).
"""

from __future__ import annotations

from distill.config.model import RUNTIME_KEYS, ModelConfig
from distill.errors import DistillError


def evenly_spaced(n: int, total: int) -> list[int]:
    """``n`` layer indices evenly spaced in [0, total), the first and last included."""
    span = total - 1  # n evenly spaced in [0, span], rounded
    return [(i * span + (n - 1) // 2) // (n - 1) for i in range(n)] if n > 1 else [0]


def period(types: tuple[str, ...]) -> int:
    """The length of the shortest unit the layer types repeat (the last may be cut short)."""
    return next(p for p in range(1, len(types) + 1) if all(
        types[i] == types[i % p] for i in range(len(types))
    ))  # fmt: skip


def hybrid_layers(types: tuple[str, ...], n: int) -> list[int]:
    """``n`` of the layers of ``types`` keeping their repeating pattern: the student's layer
    j is of the type of the teacher's (j + o) modulo its period (the first shift o whose
    first and last layers are of the teacher's first and last types), taken from the
    teacher's layers of that type nearest the evenly spaced position j (ties to the later
    layer, as ``evenly_spaced`` rounds), each after the one before, leaving room for the
    rest."""
    p, total = period(types), len(types)
    shifted = [[types[(j + o) % p] for j in range(n)] for o in range(p)]
    ends = [w for w in shifted if (w[0], w[-1]) == (types[0], types[-1])]
    want = (ends or shifted)[0]  # the pattern starting and ending as the teacher's does

    def room(i: int, j: int) -> bool:  # want[j + 1:] still fits in types[i + 1:]
        rest = iter(types[i + 1 :])
        return all(kind in rest for kind in want[j + 1 :])

    kept, last = [], -1
    for j, kind in enumerate(want):
        target = j * (total - 1) / max(n - 1, 1)
        fits = [i for i in range(last + 1, total) if types[i] == kind and room(i, j)]
        last = min(fits, key=lambda i: (abs(i - target), -i))  # ties up, as evenly_spaced
        kept.append(last)
    return kept


def default_layers(t: ModelConfig, n: int) -> list[int]:
    """The teacher layers a student of ``n`` layers keeps when none are chosen: evenly
    spaced, or in a linear/full hybrid, or where sliding and full layers have shapes of
    their own (Gemma 4: its last layer full), its pattern kept (``hybrid_layers``)."""
    kinds = t.mixed_mixers() or (t.full_apart() and t.mixed_windows())
    if kinds and n < t.n_layers:
        return hybrid_layers(t.types(), n)
    return evenly_spaced(n, t.n_layers)


def kept_layers(t: ModelConfig, n: int, chosen: list[int] | None) -> list[int]:
    """The teacher (``t``) layers a ``from_teacher`` student of ``n`` layers keeps:
    ``chosen`` (``student.init_layers``, validated), else ``default_layers``."""
    if chosen is None:
        if n > t.n_layers:
            raise DistillError(
                f"student.model.n_layers: {n} exceeds the teacher's {t.n_layers};"
                " student.init: from_teacher takes a subset of the teacher's layers"
            )
        return default_layers(t, n)
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
    layers = kept_layers(t, n, chosen) if from_teacher else default_layers(t, n)
    out = {}
    if t.layer_types is not None and "layer_types" not in overrides:
        out["layer_types"] = tuple(t.layer_types[i] for i in layers)
    if t.rope_layers is not None and "rope_layers" not in overrides:
        out["rope_layers"] = tuple(t.rope_layers[i] for i in layers)
    if from_teacher and t.n_experts and "dense_layers" not in overrides:
        out["dense_layers"] = tuple(j for j, i in enumerate(layers) if not t.moe_layers()[i])
    if t.kv_shared_layers and "kv_shared_layers" not in overrides:  # the kept sharing ones
        out["kv_shared_layers"] = sum(t.kv_shared()[i] for i in layers)
    return out


def init_layers(t: ModelConfig, s: ModelConfig, chosen: list[int] | None) -> list[int]:
    """The teacher layers a ``from_teacher`` student ``s`` starts from, checked: the
    student has the teacher's width and the kept layers' per-layer keys."""
    for key in ModelConfig.model_fields:
        per_layer = ("n_layers", "layer_types", "rope_layers", "dense_layers",
                     "kv_shared_layers", *RUNTIME_KEYS)  # fmt: skip
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
    shared = sum(t.kv_shared()[i] for i in layers)
    if s.kv_shared_layers != shared:
        raise DistillError(
            f"student.model.kv_shared_layers: {s.kv_shared_layers} is not the {shared} kept "
            "teacher layers that share keys and values (student.init: from_teacher)"
        )
    ropes = tuple(t.ropes()[i] for i in layers)
    if s.ropes() != ropes:
        raise DistillError(
            f"student.model.rope_layers: {list(s.ropes())} are not the kept teacher layers' "
            f"{list(ropes)} (student.init: from_teacher)"
        )
    return layers
