"""Per-device memory of both roles' programs, from XLA's compile-time analysis.

`distill plan` lowers and compiles the teacher forward and the student train step on the
run's meshes from abstract shapes (`jax.ShapeDtypeStruct` with shardings): nothing is
executed and no weights are loaded. XLA's `memory_analysis()` of an SPMD program is per
device: arguments (weights, optimizer state, the batch), outputs, and temporaries (the
activations kept for the backward pass, attention and loss workspaces). Peak is
arguments + outputs + temporaries - the donated buffers that outputs reuse. With on-policy
steps the student's peak also covers its sampler (compiled the same way) and the recent
parameters kept for it (`_on_policy`).

On an accelerator `distill validate` and `distill run` refuse a config whose peak exceeds
the device's memory, before any weights are loaded. `train.remat: auto` is resolved here,
from the compiled peaks of the candidate policies (`student.remat`), before either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distill.checkpoint import abstract_like
from distill.config import Config
from distill.errors import DistillError
from distill.handoff import dense_blocks
from distill.mesh import PP, TP, Meshes, check_context
from distill.models import model
from distill.types import Batch, Prompts, TeacherMix, TeacherOutput
from pipelines.plan import flops as plan_flops
from student import sharding as student_sharding
from student import train
from student.generate import Sampler
from student.remat import Choice, choose
from teacher import sharding, stages
from teacher.forward import make_output_forward
from teacher.weights import held_dtype


def abstract_batch(cfg: Config, shard, rows: int | None = None, seq: int | None = None) -> Batch:
    """A batch's shapes, `rows` x `seq` (default: the training batch), placed by `shard`."""
    b, s = rows or cfg.train.batch_size, seq or cfg.train.seq_len
    i32 = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=shard)
    return Batch(i32, i32, i32, i32, jax.ShapeDtypeStruct((b, s), jnp.float32, sharding=shard))


def _figures(compiled) -> dict:
    m = compiled.memory_analysis()
    args, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    return {"temp": temp, "peak": args + out + temp - m.alias_size_in_bytes}


def teacher_params(cfg: Config, mesh):
    """The teacher's weights as loaded onto `mesh`, as abstract sharded arrays."""
    mcfg = cfg.teacher.model
    held = held_dtype(cfg)  # as loaded
    pp = mesh.shape.get(PP, 1)  # the stack padded with zero layers where pp does not divide it
    shapes = jax.eval_shape(
        lambda p: sharding.expand_kv_heads(stages.pad_layers(p, mcfg, pp), mcfg, mesh.shape[TP]),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, held), model.abstract_params(mcfg)),
    )
    return abstract_like(shapes, sharding.shardings(mcfg, mesh))


def _teacher(cfg: Config, mesh, vocab_limit: int | None):
    """(the compiled teacher output forward, its abstract output for a training batch): a
    dense output in blocks (`distill.handoff.dense_blocks`) is n forwards of a block."""
    fwd, params, batch, out = _teacher_program(cfg, mesh, vocab_limit)
    return fwd.lower(params, batch).compile(), out


def teacher_output_shapes(cfg: Config, mesh, vocab_limit: int | None):
    """The teacher's abstract output for a training batch (as `_teacher`'s), traced only:
    nothing compiled."""
    return _teacher_program(cfg, mesh, vocab_limit)[3]


def _teacher_program(cfg: Config, mesh, vocab_limit: int | None):
    fwd = make_output_forward(cfg, mesh, vocab_limit)
    params = teacher_params(cfg, mesh)
    n = dense_blocks(cfg)
    batch = abstract_batch(cfg, sharding.batch_sharding(mesh), cfg.train.batch_size // n)
    out = jax.eval_shape(fwd, params, batch)
    if n > 1:
        out = TeacherOutput((out.logprobs,) * n, None)
    return fwd, params, batch, out


def _student(cfg: Config, mesh, teacher_out, vocab_limit: int | None):
    tx, step = train.distill_step_for(cfg, mesh, vocab_limit=vocab_limit)
    split = train.batch_sharding(mesh)
    out = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split), teacher_out
    )
    state = train.abstract_state(cfg.student_model(), tx, mesh)
    return step.lower(state, abstract_batch(cfg, split), out).compile(), state


def _per_device_bytes(tree, mesh) -> int:
    """Bytes one device holds of a tree of sharded abstract arrays."""
    specs = jax.tree.map(lambda x: x.sharding.spec, tree)
    return student_sharding.bytes_per_device(tree, specs, dict(mesh.shape))


def _on_policy(cfg: Config, mesh, state, step_peak: int, vocab_limit: int | None) -> dict:
    """The student's figures with on-policy generation (`distill.on_policy.fraction` > 0):
    the sampler's compiled temporaries (the KV cache, the sampling workspace), the copies
    of recent parameters `pipeline.max_staleness` keeps (`student.generate.ParamHistory`),
    and the peak: the larger of the step's and the generation's (whose arguments hold the
    parameters, while the optimizer state stays resident), plus those copies."""
    op, scfg = cfg.distill.on_policy, cfg.student_model()
    prompt_len, new_tokens = op.lengths(cfg.train.seq_len)
    sampler = Sampler(
        scfg, mesh, seq_len=cfg.train.seq_len, max_new_tokens=new_tokens,
        temperature=op.temperature, top_p=op.top_p, stop=(0,), vocab_limit=vocab_limit,
        dtype=cfg.student.dtype,
    )  # fmt: skip
    i32 = jax.ShapeDtypeStruct((cfg.train.batch_size, prompt_len), jnp.int32, sharding=sampler.put)
    key = jax.eval_shape(lambda: jax.random.key(0))
    gen = _figures(sampler.compiled(state.params, Prompts(i32, i32, i32), key))
    params = _per_device_bytes(state.params, mesh)
    staleness = cfg.pipeline.max_staleness
    history = (staleness + 1) * params if staleness else 0
    resident = _per_device_bytes(state, mesh) - params  # the optimizer state while sampling
    return {
        "generate_temp_bytes_per_device": gen["temp"],
        "param_history_bytes_per_device": history,
        "peak_bytes_per_device": max(step_peak, gen["peak"] + resident) + history,
    }


def device_memory(mesh) -> int | None:
    """Bytes of memory of one device of `mesh`; None where unknown (CPU)."""
    device = list(mesh.devices.flat)[0]
    if device.platform == "cpu":
        return None
    return (device.memory_stats() or {}).get("bytes_limit")


def memory(cfg: Config, meshes: Meshes, vocab_limit: int | None) -> dict:
    """The plan's memory figures (bytes per device) of both roles' compiled programs."""
    if cfg.teachers:
        teacher, t_out = several_teachers_memory(cfg, meshes.teacher, vocab_limit)
    else:
        teacher, t_out = teacher_memory(cfg, meshes.teacher, vocab_limit)
    return {
        "teacher": teacher,
        "student": student_memory(cfg, meshes.student, t_out, vocab_limit),
        "device_memory_bytes": device_memory(meshes.student),
    }


def teacher_memory(cfg: Config, mesh, vocab_limit: int | None) -> tuple[dict, object]:
    """(the teacher forward's figures on `mesh`, the abstract output it hands on)."""
    compiled, out = _teacher(cfg, mesh, vocab_limit)
    t = _figures(compiled)
    mem = {"forward_temp_bytes_per_device": t["temp"], "peak_bytes_per_device": t["peak"]}
    return {**mem, **plan_flops.figures(compiled, mesh, cfg, "teacher")}, out


def several_teachers_memory(cfg: Config, mesh, vocab_limit: int | None) -> tuple[dict, object]:
    """Several teachers (`teachers:`): the first's figures, with the peak of holding every
    local one's weights at once on the inference mesh, their forwards run one after another
    (each one's arguments, then the largest temporaries); the abstract output the student
    steps on (`distill.types.TeacherMix`)."""
    each = [(one, *teacher_memory(one, mesh, vocab_limit)) for one in cfg.each_teacher()]
    local = [m for one, m, _ in each if one.teacher.loaded()]
    first = dict(each[0][1])
    if local:
        held = sum(m["peak_bytes_per_device"] - m["forward_temp_bytes_per_device"] for m in local)
        first["forward_temp_bytes_per_device"] = max(
            m["forward_temp_bytes_per_device"] for m in local
        )
        first["peak_bytes_per_device"] = held + first["forward_temp_bytes_per_device"]
    outs = tuple(out for _, _, out in each)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    weights = jax.ShapeDtypeStruct((b, s, len(outs)), jnp.float32)
    return first, TeacherMix(outs, weights)


def student_memory(cfg: Config, mesh, teacher_out, vocab_limit: int | None) -> dict:
    """The student step's figures on `mesh`, given the teacher output's abstract shapes
    (and the on-policy sampler's, with on-policy steps). Resolves `train.remat: auto` in
    `cfg` first (`resolve_remat`); the figures are the resolved policy's, with the choice
    ("remat", "remat_reason") and each compiled candidate's peak ("remat_peaks")."""
    choice, figures = resolve_remat(cfg, mesh, teacher_out, vocab_limit)
    student = figures.get(choice.policy) or _student_figures(cfg, mesh, teacher_out, vocab_limit)
    return {**student, "remat": choice.policy, "remat_reason": choice.reason,
            "remat_peaks": choice.peaks}  # fmt: skip


def _student_figures(cfg: Config, mesh, teacher_out, vocab_limit: int | None) -> dict:
    compiled, state = _student(cfg, mesh, teacher_out, vocab_limit)
    s = _figures(compiled)
    student = {"step_temp_bytes_per_device": s["temp"], "peak_bytes_per_device": s["peak"]}
    student.update(plan_flops.figures(compiled, mesh, cfg, "student"))
    if cfg.distill.on_policy.fraction > 0:
        student.update(_on_policy(cfg, mesh, state, s["peak"], vocab_limit))
    return student


def resolve_remat(
    cfg: Config, mesh, teacher_out=None, vocab_limit: int | None = None, device_bytes=...
) -> tuple[Choice, dict[str, dict]]:
    """Resolve `train.remat: auto` in `cfg` for the student on `mesh` (`student.remat.choose`:
    the least recompute whose compiled peak fits a device of `device_bytes`, by default
    `device_memory(mesh)`; on CPU `none`, compiling nothing). Returns (the choice, the
    figures of each candidate compiled, by policy). `teacher_out`: the abstract teacher
    output the step takes (default: the configured one, `abstract_teacher_output`)."""
    if device_bytes is ...:
        device_bytes = device_memory(mesh)
    if teacher_out is None:
        teacher_out = abstract_teacher_output(cfg, train.batch_sharding(mesh))
    figures: dict[str, dict] = {}

    def peak_of(policy: str) -> int:
        trial = cfg.model_copy(update={"train": cfg.train.model_copy(update={"remat": policy})})
        figures[policy] = _student_figures(trial, mesh, teacher_out, vocab_limit)
        return figures[policy]["peak_bytes_per_device"]

    choice = choose(cfg.train.remat, peak_of, device_bytes)
    cfg.train.remat = choice.policy
    return choice, figures


def abstract_teacher_output(cfg: Config, shard) -> TeacherOutput:
    """The teacher output a step of `cfg` takes, as abstract arrays in `shard`: top-k
    values and ids [B, S, k], or dense log-probs [B, S, V]."""
    b, s, k = cfg.train.batch_size, cfg.train.seq_len, cfg.teacher.top_k
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=shard)  # noqa: E731
    if k is None:
        return TeacherOutput(f32(b, s, cfg.teacher.model.vocab_size))
    return TeacherOutput(f32(b, s, k), jax.ShapeDtypeStruct((b, s, k), jnp.int32, sharding=shard))


def check_fits(mem: dict, cfg: Config | None = None) -> None:
    """One DistillError line when a role's compiled peak exceeds the device's memory; with
    `cfg`, naming the role's cp that would make its rows fit (`cp_that_fits`)."""
    limit = mem["device_memory_bytes"]
    if limit is None:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    student = "mesh.student.fsdp / mesh.student.cp / train.remat / train.grad_accum"
    if "param_history_bytes_per_device" in mem.get("student", {}):  # on-policy steps
        student += " / pipeline.max_staleness / distill.on_policy"
    for role, keys in (("teacher", "mesh.teacher / teacher.microbatch"), ("student", student)):
        if role not in mem:  # one role alone (`distill bench --role`)
            continue
        peak = mem[role]["peak_bytes_per_device"]
        if peak > limit:
            cp = None if cfg is None else cp_that_fits(cfg, role, mem[role], limit)
            fit = "" if cp is None else (
                f"; its rows would fit with mesh.{role}.cp={cp} (each device 1/cp of a row's "
                f"positions: about {gib(_at_cp(cfg, role, mem[role], cp))})"
            )  # fmt: skip
            raise DistillError(
                f"{role}: the compiled program needs {gib(peak)} per device but a device has "
                f"{gib(limit)}; spread it over more devices or lower its memory ({keys}){fit}"
            )


TEMP_KEYS = {"teacher": "forward_temp_bytes_per_device", "student": "step_temp_bytes_per_device"}


def _at_cp(cfg: Config, role: str, figures: dict, cp: int) -> float:
    """A role's peak per device estimated at `cp`: its compiled temporaries (activations,
    which grow with the positions a device holds) scaled by the configured cp / `cp`, the
    rest (weights, optimizer state, arguments) kept: as when cp takes devices from fsdp or
    dp, an upper bound when it adds devices."""
    temp = figures.get(TEMP_KEYS[role], 0)
    return figures["peak_bytes_per_device"] - temp + temp * getattr(cfg.mesh, role).cp / cp


def cp_that_fits(cfg: Config, role: str, figures: dict, limit: int) -> int | None:
    """The least cp above the role's (doubling) whose estimated peak (`_at_cp`) fits a
    device of `limit` bytes and that the run could use (`distill.mesh.check_context`: the
    rows split into 2 x cp chunks, nothing cp does not support yet), or None."""
    cp = getattr(cfg.mesh, role).cp * 2
    while cfg.train.seq_len % (2 * cp) == 0:
        if _at_cp(cfg, role, figures, cp) <= limit:
            mesh = cfg.mesh.model_copy(
                update={role: getattr(cfg.mesh, role).model_copy(update={"cp": cp})}
            )
            try:
                check_context(cfg.model_copy(update={"mesh": mesh}))
            except DistillError:
                return None
            return cp
        cp *= 2
    return None


def add_to_plan(p: dict, mem: dict) -> dict:
    """The plan with the memory figures merged into its teacher and student sections."""
    p["teacher"].update(mem["teacher"])
    p["student"].update(mem["student"])
    p["device_memory_bytes"] = mem["device_memory_bytes"]
    return p


def format_memory(mem: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    t, s, limit = mem["teacher"], mem["student"], mem["device_memory_bytes"]
    on_policy = (
        f", {gib(s['generate_temp_bytes_per_device'])} in on-policy generation, "
        f"{gib(s['param_history_bytes_per_device'])} of recent parameters"
        if "generate_temp_bytes_per_device" in s
        else ""
    )
    return (
        f"memory per device (XLA, compiled): teacher forward {gib(t['peak_bytes_per_device'])} "
        f"peak ({gib(t['forward_temp_bytes_per_device'])} temporaries), student "
        f"{gib(s['peak_bytes_per_device'])} peak ({gib(s['step_temp_bytes_per_device'])} "
        f"step temporaries{on_policy}); device {gib(limit) if limit else 'n/a (CPU)'}\n"
        f"student blocks: train.remat: {s['remat']} ({s['remat_reason']})"
    )
