"""`distill bench CONFIG --colocated`: the loop split and colocated on the same devices.

The configured layout (split, on its `n` devices) and the colocated layout over the same
`n` devices (each role's `dp` scaled by `n` / its size: the quick start's teacher tp=4 and
student dp=4 on 8 devices become teacher dp=2 x tp=4 and student dp=8 on all 8) are each
timed as the real local loop (`pipelines.bench.phases`: median of three windows after a
warm-up), beside the tokens/s `mesh.placement: auto` predicts for them from their compiled
costs (`pipelines.placement`), so that the prediction's order can be checked against the
measured one (`bench_layouts` takes any list of layouts).
"""

from __future__ import annotations

import tempfile

from distill.checkpoint import params_exist, save_params
from distill.config import Config
from distill.data.corpus import Corpus
from distill.errors import DistillError
from distill.mesh import (
    Placement,
    available_devices,
    build_meshes,
    check_batch_split,
    check_teacher_split,
    devices_needed,
)
from distill.models import model
from distill.outputs import teacher_path
from pipelines import placement
from pipelines.bench.phases import _pipelined_ms
from pipelines.placement import Layout


def colocated_over(cfg: Config) -> Layout:
    """The colocated layout over the configured split's devices: each role's dp scaled."""
    given, n = placement.configured(cfg), devices_needed(cfg)
    (dp, ep, tp), (sdp, fsdp) = given.teacher, given.student
    t, s = dp * ep * tp, sdp * fsdp
    if n % t or n % s:
        raise DistillError(
            f"--colocated: the teacher's {t} or the student's {s} devices do not divide the "
            f"{n} devices of the split"
        )
    layout = Layout(Placement.COLOCATED, (dp * n // t, ep, tp), (sdp * n // s, fsdp))
    trial = layout.apply(cfg)
    try:
        check_teacher_split(trial)
        check_batch_split(trial)
    except DistillError as e:
        raise DistillError(f"--colocated: {layout.label()}: {e}") from None
    return layout


def bench_layouts(cfg: Config, corpus: Corpus, layouts: list[Layout], repeats: int) -> list:
    """For each layout: its label, predicted and measured tokens/s, measured ms per step."""
    devices = available_devices(cfg.mesh.platform)
    platform = devices[0].platform
    costs = placement.compiled_costs(cfg, devices, layouts)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    rows, cfg = [], cfg.model_copy(deep=True)
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        if not params_exist(teacher_path(cfg)):  # a random teacher: speed does not care
            save_params(f"{tmp}/teacher", model.init_params(cfg.teacher.model, cfg.run.seed))
            cfg.teacher.checkpoint = f"{tmp}/teacher"
        for i, layout in enumerate(layouts):
            lcfg = layout.apply(cfg).model_copy(deep=True)
            meshes = build_meshes(lcfg)
            ms, _, _ = _pipelined_ms(lcfg, corpus, meshes, f"{tmp}/run{i}", repeats)
            row = placement.predict(
                layout, costs["teacher", layout.teacher], costs["student", layout.student], platform
            )
            rows.append(
                {
                    "layout": layout.label(),
                    "predicted_tokens_per_s": round(tokens / row.seconds, 1),
                    "tokens_per_s": round(tokens / (ms / 1e3), 1),
                    "pipeline_ms": round(ms, 2),
                }
            )
    return rows


def bench_colocated(cfg: Config, corpus: Corpus, repeats: int) -> dict:
    """The configured split and the colocated layout over the same devices, timed in turn."""
    rows = bench_layouts(cfg, corpus, [placement.configured(cfg), colocated_over(cfg)], repeats)
    split, colocated = rows
    return {
        "placements": rows,
        "colocated_over_split": round(colocated["tokens_per_s"] / split["tokens_per_s"], 3),
    }


def format_layouts(rows: list[dict]) -> str:
    lines = ["layouts (predicted from compiled costs | measured loop):"]
    for r in rows:
        lines.append(
            f"  {r['layout']:<58} {r['predicted_tokens_per_s']:>10.0f} | "
            f"{r['tokens_per_s']:>10.0f} tok/s ({r['pipeline_ms']:.1f} ms/step)"
        )
    return "\n".join(lines)
