"""`distill bench CONFIG --placement`: `mesh.placement: auto`'s role costs measured here.

Every role layout of auto's candidates on this host's devices (`pipelines.placement`) is
timed alone, as `distill bench --role` times a role (`pipelines.bench.role`: random teacher
weights made on the mesh, random teacher outputs of the run's shapes, the data's first
batch): the teacher's forward with the configured output and the student's step from it,
each the median of `repeats` steps after a warm-up (`pipelines.bench.phases`). A role
layout whose compiled peak exceeds a device's memory is not run (its time infinite: the
candidates that use it do not fit anyway). The measured costs (the compiled memory, the
measured seconds) are stored in the placement cache beside the compiled ones, under the same
key (config shapes, devices, code: `pipelines.placement.cache`), where `auto` then takes
them instead of the compiled predictions. The table: every candidate's tokens/s predicted
from the measured and from the compiled role costs, and the choice from the measured ones.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import jax

from distill.config import Config
from distill.data.tokenizers import vocab_limit
from distill.errors import DistillError
from distill.mesh import Placement, available_devices, role_mesh
from pipelines.bench.phases import _interleaved_ms, _stepper, teacher_forward
from pipelines.bench.role import random_outputs
from pipelines.placement import Layout, candidates, compiled_costs
from pipelines.placement.cache import cached_costs, store_costs
from pipelines.placement.choice import _gib
from pipelines.placement.costs import ranked, role_keys
from pipelines.preflight import preflight_role
from student import train
from teacher import sharding as teacher_sharding
from teacher.weights import random_teacher

log = logging.getLogger("distill")


def bench_placement(cfg: Config, repeats: int) -> dict:
    """Every candidate's role layouts timed, stored for auto; the figures of the table."""
    cfg = cfg.model_copy(deep=True)
    devices = available_devices(cfg.mesh.platform)
    corpus = preflight_role(cfg, "teacher")  # resolves the dtypes, as auto's resolve does
    layouts = candidates(cfg, len(devices))
    if not layouts:
        raise DistillError(
            f"--placement: no layout of {len(devices)} {devices[0].platform} devices that the "
            "model and train.batch_size divide"
        )
    compiled = cached_costs(
        cfg, devices, lambda: compiled_costs(cfg, devices, layouts), role_keys(layouts)
    )
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
    host_batch = next(corpus.train_iterator(cfg.train.batch_size, seed=cfg.run.seed))
    device_bytes = (devices[0].memory_stats() or {}).get("bytes_limit")
    measured = {}
    for role, shape in role_keys(layouts):
        cost = compiled[role, shape]
        if device_bytes is not None and cost.peak > device_bytes:
            log.info("--placement: %s %s does not fit a device; not run", role, shape)
            seconds = math.inf
        else:
            seconds = _role_seconds(cfg, role, shape, host_batch, limit, repeats)
            log.info("--placement: %s %s: %.1f ms per step", role, shape, 1e3 * seconds)
        measured[role, shape] = replace(cost, seconds=seconds, measured=True)
    store_costs(cfg, devices, measured, "measured")
    rows, chosen = ranked(cfg, devices, layouts, measured)
    predicted, _ = ranked(cfg, devices, layouts, compiled)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    table = [
        {
            "layout": m.layout.label(),
            "tokens_per_s": round(tokens / m.seconds, 1),
            "compiled_tokens_per_s": round(tokens / c.seconds, 1),
            "bytes_per_device": m.bytes_per_device,
            "chosen": m is chosen,
        }
        for m, c in zip(rows, predicted, strict=True)
    ]
    return {"placement_candidates": table, "placement_choice": chosen.layout.label()}


def _role_seconds(cfg: Config, role: str, shape: tuple, host_batch, limit, repeats: int) -> float:
    """One role alone on `shape` over the first devices: its median step, in seconds."""
    layout = (
        Layout(Placement.SPLIT, shape, (1, 1))
        if role == "teacher"
        else Layout(Placement.SPLIT, (1, 1, 1), shape)
    )
    lcfg = layout.apply(cfg)
    mesh = role_mesh(lcfg, role)
    if role == "teacher":
        params = random_teacher(lcfg, mesh)
        batch = jax.device_put(host_batch, teacher_sharding.batch_sharding(mesh))
        fwd = teacher_forward(lcfg, mesh, limit, "topk" if lcfg.teacher.top_k else "dense")
        one = lambda: fwd(params, batch)  # noqa: E731
    else:
        batch = jax.device_put(host_batch, train.batch_sharding(mesh))
        outs = random_outputs(lcfg, mesh, limit, dense=not lcfg.teacher.top_k)
        out = outs["topk" if lcfg.teacher.top_k else "dense"]
        one = _stepper(lcfg, mesh, limit, batch, out)
    return _interleaved_ms({"step": one}, repeats, warmup=1)["step"] / 1e3


def format_placement(r: dict) -> str:
    rows = r["placement_candidates"]
    lines = [
        f"placement: {len(rows)} candidates (tokens/s from role times measured here | "
        "predicted from compiled costs, memory/device)"
    ]
    for row in sorted(rows, key=lambda x: -x["tokens_per_s"]):
        mark = "->" if row["chosen"] else "  "
        lines.append(
            f" {mark} {row['layout']:<58} {row['tokens_per_s']:>10.0f} | "
            f"{row['compiled_tokens_per_s']:>10.0f} {_gib(row['bytes_per_device']):>11}"
        )
    lines.append(f"stored for mesh.placement: auto; it chooses {r['placement_choice']}")
    return "\n".join(lines)
