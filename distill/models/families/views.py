"""Weight names that view part of a stored tensor (`distill.models.hf.weight_names`): every
other column of a fused tensor (gpt-oss's interleaved gate and up, `VIEW`), a range of
its rows (Qwen3.5's q, k and v of `in_proj_qkv` and `conv1d`, `ROWS`) or of its columns
(Gemma 4's per-layer slices of its per-layer embedding table, `COLS`) or of each expert's
rows (Gemma 4's gate and up halves, `HALVES`), so that each part
is read, split over `tp` and exported as a weight of its own."""

from __future__ import annotations

from distill.config import ModelConfig
from distill.models.families import gemma4, qwen35, record

# A name `stored{VIEW}k` in `weight_names` is every other column of the stored tensor from
# column k: gpt-oss interleaves its experts' gate (k = 0) and up (k = 1) projections.
VIEW = "#"
# A name `stored{ROWS}a:b` is the rows [a, b) of the stored tensor.
ROWS = qwen35.ROWS
# A name `stored{COLS}a:b` is the columns [a, b) of the stored tensor (Gemma 4's per-layer
# slices of `embed_tokens_per_layer`).
COLS = gemma4.COLS
# A name `stored{HALVES}a:b` is the rows [a, b) of each expert of a stored [E, ., .] tensor
# (Gemma 4's gate and up halves of `experts.gate_up_proj`).
HALVES = "&"
FUSED_EXPERTS = {
    "we_gate": f"gate_up_proj{VIEW}0",
    "we_up": f"gate_up_proj{VIEW}1",
    "we_down": "down_proj",
}
FUSED_BIASES = {
    "be_gate": f"gate_up_proj_bias{VIEW}0",
    "be_up": f"gate_up_proj_bias{VIEW}1",
    "be_down": "down_proj_bias",
}


def fused_expert_names(cfg: ModelConfig) -> dict[str, str]:
    """distill expert weight -> its fused tensor's name after `experts.`: gpt-oss's
    interleaved gate and up, or Gemma 4's halves (`Family.fused_halves`)."""
    if record.get(cfg.family).fused_halves:
        f = cfg.f_expert
        halves = (f"gate_up_proj{HALVES}0:{f}", f"gate_up_proj{HALVES}{f}:{2 * f}")
        return {"we_gate": halves[0], "we_up": halves[1], "we_down": "down_proj"}
    return {**FUSED_EXPERTS, **(FUSED_BIASES if cfg.expert_bias else {})}


def stored(name: str) -> tuple[str, int | tuple[int, int] | slice | None]:
    """(the stored tensor's name, the first of every other column it takes, or its rows
    (start, stop), or its columns slice(start, stop), or None: the whole tensor) of a
    `weight_names` name."""
    if ROWS in name:
        base, rows = name.split(ROWS)
        return base, tuple(map(int, rows.split(":")))
    if COLS in name:
        base, cols = name.split(COLS)
        return base, slice(*map(int, cols.split(":")))
    if HALVES in name:
        base, rows = name.split(HALVES)
        return base, range(*map(int, rows.split(":")))
    base, _, start = name.partition(VIEW)
    return base, (int(start) if start else None)


def view_shape(shape: tuple[int, ...], view) -> tuple[int, ...]:
    """The shape of every other last-axis column of `shape` from `view`, of its rows
    `view` = (start, stop) or of its columns `view` = slice(start, stop) (None: all)."""
    if view is None:
        return tuple(shape)
    if isinstance(view, tuple):
        return (len(range(*view)) if view[1] <= shape[0] else -1, *shape[1:])
    if isinstance(view, slice):
        return (*shape[:-1], len(range(view.start, view.stop)) if view.stop <= shape[-1] else -1)
    if isinstance(view, range):
        return (shape[0], len(view) if view.stop <= shape[1] else -1, *shape[2:])
    return (*shape[:-1], len(range(view, shape[-1], 2)))
