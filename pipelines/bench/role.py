"""`distill bench CONFIG --role teacher|student`: one role alone on this host's devices.

A run needs both meshes at once; sizing one role, or measuring its speed on a host too
small for both (one GPU), needs only that role's. Its mesh is the configured one
(`mesh.<role>`), over the host's first devices (`distill.mesh.role_mesh`), and its program
is built exactly as runs build it (dtype, `teacher.microbatch`; `train.remat`,
`train.grad_accum`). Nothing is read but the data's first batch: the teacher's weights are
random, made on the mesh in the layout a checkpoint would load into
(`teacher.weights.random_teacher`); the student learns from random teacher outputs of the
run's shapes (dense log-probs over the live ids and their top-k), made on the student's
devices. Speed does not care what the numbers are.

Before it runs anything the role's program is compiled and, on an accelerator, refused in
one line when its peak exceeds the device's memory (as `distill validate` does for both
roles). The figures: each variant's median step (`pipelines.bench.phases`), tokens/s, MFU against
the device's bfloat16 peak (the measured float32 matmul rate on CPU), and the compiled
per-device memory; with `--torch` also the role's PyTorch + transformers peer's figures
(`pipelines.bench.torch_role`) and distill's tokens/s over the peer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from distill.collectives import mask_vocab
from distill.config import Config
from distill.data.tokenizers import vocab_limit
from distill.limits import MAX_ELEMENTS
from distill.mesh import role_mesh
from distill.models.topk import top_k
from distill.types import TeacherOutput
from pipelines.bench.phases import _interleaved_ms as interleaved_ms
from pipelines.bench.phases import (
    bench_top_k,
    student_figures,
    student_phases_ms,
    teacher_figures,
    teacher_phases_ms,
)
from pipelines.bench.stages import format_bubble, measured_bubble
from pipelines.plan import memory as plan_memory
from pipelines.preflight import preflight_role
from student import train
from teacher import sharding as teacher_sharding
from teacher.weights import random_teacher

ROLES = ("teacher", "student")


def bench_role(
    cfg: Config,
    role: str,
    repeats: int = 10,
    *,
    device_memory: Callable[[object], int | None] = plan_memory.device_memory,
    torch_mode: bool = False,
) -> dict:
    """Every figure of `distill bench --role ROLE` (module docstring). `device_memory(mesh)`:
    the bytes of one device, None where unknown (CPU); tests give one to run the
    accelerator's checks on CPU. `torch_mode`: also the role's PyTorch + transformers peer
    (`pipelines.bench.torch_role`), run first: JAX, once started, holds most of a GPU."""
    peer = {}
    if torch_mode:
        from pipelines.bench.torch_role import torch_role_bench

        peer = torch_role_bench(cfg, role, repeats)
    corpus = preflight_role(cfg, role)
    mesh = role_mesh(cfg, role)
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
    host_batch = next(corpus.train_iterator(cfg.train.batch_size, seed=cfg.run.seed))
    if role == "teacher":
        mem, _ = plan_memory.teacher_memory(cfg, mesh, limit)
    else:
        outputs = jax.eval_shape(lambda: random_outputs(cfg, mesh, limit))
        configured = outputs["topk" if cfg.teacher.top_k else "dense"]
        mem = plan_memory.student_memory(cfg, mesh, configured, limit)
    device_bytes = device_memory(mesh)
    plan_memory.check_fits({role: mem, "device_memory_bytes": device_bytes}, cfg)
    if role == "teacher":
        params = random_teacher(cfg, mesh)
        batch = jax.device_put(host_batch, teacher_sharding.batch_sharding(mesh))
        res, _ = teacher_phases_ms(cfg, mesh, params, batch, limit, repeats)
        res.update(teacher_figures(res, cfg, mesh))
        if cfg.mesh.teacher.pp > 1:  # the stages' bubble, measured and predicted
            timed = lambda fns: interleaved_ms(fns, repeats)  # noqa: E731
            res.update(measured_bubble(cfg, mesh, params, host_batch, timed))
    else:
        batch = jax.device_put(host_batch, train.batch_sharding(mesh))
        dense = _dense_fits(cfg, outputs["dense"], mesh, device_bytes)
        outs = random_outputs(cfg, mesh, limit, dense=dense)
        res = student_phases_ms(cfg, mesh, batch, outs, limit, repeats)
        res.update(student_figures(res, cfg, mesh))
    res.update(
        {f"{role}_{k}": v for k, v in mem.items()},
        role=role,
        mesh={str(a): int(n) for a, n in mesh.shape.items()},
        device_kind=mesh.devices.flat[0].device_kind,
        device_memory_bytes=device_bytes,
        tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
    )
    if peer:
        res.update(
            peer,
            distill_over_torch=res[f"{role}_tokens_per_s"] / peer[f"torch_{role}_tokens_per_s"],
        )
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}


def random_outputs(
    cfg: Config, mesh, limit: int | None, *, dense: bool = True
) -> dict[str, TeacherOutput]:
    """{"dense", "topk"} ("topk" alone unless `dense`): teacher outputs of the run's shapes,
    in the student's batch sharding on `mesh`: log softmax(z / T) of random logits z over
    the live ids (padded ids -inf, as the teacher gives them) and its top-k.

    Each device makes its own rows, a block of rows at a time (`_block_rows`), so no random
    logits, log-softmax or top-k operand reaches MAX_ELEMENTS; only the dense output itself,
    when asked for, is the run's whole shape (`_dense_fits` bounds it)."""
    b, s, v = cfg.train.batch_size, cfg.train.seq_len, cfg.teacher.model.vocab_size
    split = train.batch_sharding(mesh)
    axes = split.spec[0]
    local = b // math.prod(mesh.shape[a] for a in axes)
    rows, k, temp = _block_rows(local, s * v), bench_top_k(cfg), cfg.distill.temperature

    def block(key):  # [rows, S, V] log-probs, and their top-k [rows, S, k]
        z = mask_vocab(2.0 * jax.random.normal(key, (rows, s, v), jnp.float32), limit, None)
        lp = jax.nn.log_softmax(z / temp, axis=-1)
        top, ids = top_k(lp, k)
        return lp if dense else None, top, ids

    def make():  # this device's rows
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), jax.lax.axis_index(axes))
        made = jax.lax.map(block, jax.random.split(key, local // rows))
        lp, top, ids = (None if x is None else x.reshape(local, *x.shape[2:]) for x in made)
        return {"topk": TeacherOutput(top, ids), **({"dense": TeacherOutput(lp)} if dense else {})}

    out_specs = {"topk": TeacherOutput(split.spec, split.spec)}
    if dense:
        out_specs["dense"] = TeacherOutput(split.spec)
    return jax.jit(jax.shard_map(make, mesh=mesh, in_specs=(), out_specs=out_specs))()


def _block_rows(rows: int, per_row: int) -> int:
    """The most rows, a divisor of `rows`, whose `per_row` elements each stay below
    MAX_ELEMENTS together (at least one row)."""
    fit = (r for r in range(1, rows + 1) if rows % r == 0 and r * per_row < MAX_ELEMENTS)
    return max(fit, default=1)


def _dense_fits(cfg: Config, dense: TeacherOutput, mesh, device_bytes: int | None) -> bool:
    """Whether to time KD from dense teacher log-probs too: always when the run uses them,
    else only while each device's share stays below 2^31 elements and takes at most a
    quarter of the device (B x S x V floats: at a 128k vocabulary 2 GiB per 4,096-token row).
    `dense` may be abstract (`jax.eval_shape`): its bytes come from its shape and dtype."""
    if not cfg.teacher.top_k or device_bytes is None:
        return True
    per_device = math.prod(dense.logprobs.shape) // mesh.size
    itemsize = dense.logprobs.dtype.itemsize
    return per_device < MAX_ELEMENTS and per_device * itemsize <= device_bytes // 4


def format_role(r: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    mesh = " x ".join(f"{a}={n}" for a, n in r["mesh"].items())
    if r["role"] == "teacher":
        lines = [
            f"teacher alone on {mesh} ({r['device_kind']}): plain {r['teacher_plain_ms']:.1f} "
            f"ms, dense log-probs {r['teacher_dense_ms']:.1f} ms, top-k "
            f"{r['teacher_topk_ms']:.1f} ms ({r['topk_over_plain_teacher']:.2f}x plain)",
            f"configured output: {r['teacher_ms']:.1f} ms, {r['teacher_tokens_per_s']:.0f} "
            f"tok/s, MFU {100 * r['teacher_mfu']:.1f}%",
            f"compiled per device: {gib(r['teacher_forward_temp_bytes_per_device'])} "
            f"temporaries, peak {gib(r['teacher_peak_bytes_per_device'])}",
        ]
        if "bubble_measured" in r:
            lines.insert(-1, format_bubble(r))
    else:
        lines = [
            f"student alone on {mesh} ({r['device_kind']}): CE {r['student_ce_ms']:.1f} ms"
            + "".join(
                f", KD {name} {r[f'student_kd_{kind}_ms']:.1f} ms ({r[f'kd_over_ce_{kind}']:.2f}x)"
                for kind, name in (("dense", "dense"), ("topk", "top-k"))
                if f"student_kd_{kind}_ms" in r
            ),
            f"configured output: {r['student_ms']:.1f} ms, {r['student_tokens_per_s']:.0f} "
            f"tok/s, MFU {100 * r['mfu']:.1f}% (HFU {100 * r['hfu']:.1f}% with remat "
            f"{r['student_remat']})",
            f"compiled per device: {gib(r['student_step_temp_bytes_per_device'])} "
            f"temporaries, peak {gib(r['student_peak_bytes_per_device'])}",
        ]
    if r["device_memory_bytes"]:
        lines[-1] += f" of {gib(r['device_memory_bytes'])}"
    if "distill_over_torch" in r:
        role, peak = r["role"], r["torch_peak_bytes"]
        where = r["torch_device"] if peak is None else f"{r['torch_device']}, cuda:0"
        threads = f", {r['torch_threads']} threads" if r["torch_threads"] else ""
        lines.append(
            f"PyTorch {r['torch_version']} + transformers peer ({where}{threads}): "
            f"{r[f'torch_{role}_ms']:.1f} ms, {r[f'torch_{role}_tokens_per_s']:.0f} tok/s, "
            f"peak {'n/a' if peak is None else gib(peak)}; distill "
            f"{r['distill_over_torch']:.2f}x its tokens/s"
        )
    return "\n".join(lines)
