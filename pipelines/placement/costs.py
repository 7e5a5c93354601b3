"""The role costs `auto` compares, from compiled programs, and the memory plan of
colocated meshes; `resolve` applies auto's choice to a config (`pipelines.placement`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from distill.compiled_flops import compiled_dot_flops
from distill.config import Config
from distill.errors import DistillError
from distill.handoff import teacher_output_bytes_per_step
from distill.mesh import DP, EP, FSDP, TP, Placement, check_placement_mode
from pipelines.placement.cache import cached_costs, stored_costs
from pipelines.placement.choice import (
    ROOFLINE,
    Layout,
    RoleCost,
    _gib,
    candidates,
    choose,
    colocated_bytes,
    configured,
    fixed,
    format_table,
    host_memory_bytes,
    predict,
    written_axes,
    written_keys,
)

log = logging.getLogger("distill")


# -- the costs, from compiled programs --------------------------------------------------


def layers_factor(mcfg, seq_len: int) -> float:
    """XLA's cost analysis counts a loop's body once: the scanned layers (`nnx.scan`) as one
    layer. Its bytes accessed are scaled by the model's analytic FLOPs over those of its
    LM head and one average layer (`counts.flops_per_token`)."""
    from distill.models import counts

    total = counts.flops_per_token(mcfg, seq_len)
    head = 2.0 * mcfg.vocab_size * mcfg.d_model
    return total / (head + (total - head) / mcfg.n_layers)


def _cost_seconds(compiled, platform: str, factor: float) -> float:
    """A compiled SPMD program's time on one device over the platform's nominal roofline:
    its matmul FLOPs with every loop counted (`distill.compiled_flops`: layers, microbatches,
    an MoE layer's tiles) and its bytes accessed (XLA's cost analysis, which counts a loop's
    body once: x `factor` for the scanned layers)."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    flops_per_s, bytes_per_s = ROOFLINE.get(platform, ROOFLINE["gpu"])
    flops, bytes_ = compiled_dot_flops(compiled), factor * ca.get("bytes accessed", 0.0)
    return max(flops / flops_per_s, bytes_ / bytes_per_s)


def output_bytes_per_device(cfg: Config) -> int:
    """One teacher output's bytes on a device of the inference mesh: its rows (split over
    dp x ep, replicated over tp)."""
    t = cfg.mesh.teacher
    return teacher_output_bytes_per_step(cfg) // (t.dp * t.ep)


def teacher_cost(cfg: Config, seconds: float, figures: dict) -> RoleCost:
    """The teacher's cost from its memory figures (`plan_memory.teacher_memory`): resident,
    its weights, batch and the `pipeline.prefetch` outputs in flight (the compiled peak
    counts one). A run from the teacher cache or a server (`teacher.source: cache`,
    `endpoint`) loads no teacher
    and runs no forward: nothing, whatever the compiled figures (its outputs come from the
    host with the batch, in the student's figures)."""
    if not cfg.teacher.loaded():
        return RoleCost(0.0, 0)
    peak, temp = figures["peak_bytes_per_device"], figures["forward_temp_bytes_per_device"]
    in_flight = (cfg.pipeline.prefetch - 1) * output_bytes_per_device(cfg)
    return RoleCost(seconds, peak + in_flight, peak - temp + in_flight, temp)


def student_cost(seconds: float, figures: dict) -> RoleCost:
    """The student's cost from its memory figures (`plan_memory.student_memory`): resident,
    its state, batch and the teacher output it takes."""
    peak, temp = figures["peak_bytes_per_device"], figures["step_temp_bytes_per_device"]
    return RoleCost(seconds, peak, peak - temp, temp)


def compiled_costs(cfg: Config, devices: list, layouts: list[Layout]) -> dict:
    """{(role, shape): RoleCost} for every role layout of `layouts`, each compiled once from
    abstract shapes over the first devices (`pipelines.plan.memory`), nothing run. A run
    from the teacher cache compiles no teacher: its output's shapes are traced once."""
    from distill.mesh import student_mesh, teacher_mesh
    from pipelines.plan import memory as plan_memory

    platform, costs, out = devices[0].platform, {}, None
    seq = cfg.train.seq_len
    t_factor = layers_factor(cfg.teacher.model, seq)
    s_factor = layers_factor(cfg.student_model(), seq)
    pp, t_cp, s_cp = fixed(cfg)  # kept as the config gives them (`Layout.fixed`)
    for shape in dict.fromkeys(x.teacher for x in layouts):
        dp, ep, tp = shape
        c = Layout(Placement.SPLIT, shape, (1, 1)).apply(cfg)
        mesh = teacher_mesh(devices[: dp * ep * tp * pp * t_cp], dp, tp, ep, pp, t_cp)
        if c.teachers:  # several: each compiled, their forwards one after another
            costs["teacher", shape], out = _several_teachers(c, mesh, platform)
            continue
        if not cfg.teacher.loaded():  # no teacher on any device: nothing to compile
            out = plan_memory.teacher_output_shapes(c, mesh, None) if out is None else out
            costs["teacher", shape] = RoleCost(0.0, 0)
            continue
        compiled, out = plan_memory._teacher(c, mesh, None)
        costs["teacher", shape] = _teacher_cost(c, compiled, platform, t_factor)
    for shape in dict.fromkeys(x.student for x in layouts):
        dp, fsdp = shape
        c = Layout(Placement.SPLIT, (1, 1, 1), shape).apply(cfg)
        mesh = student_mesh(devices[: dp * fsdp * s_cp], dp, fsdp, s_cp)
        compiled, _ = plan_memory._student(c, mesh, out, None)
        figures = plan_memory._figures(compiled)
        fig = {
            "peak_bytes_per_device": figures["peak"],
            "step_temp_bytes_per_device": figures["temp"],
        }
        costs["student", shape] = student_cost(_cost_seconds(compiled, platform, s_factor), fig)
    return costs


def _teacher_cost(cfg: Config, compiled, platform: str, factor: float) -> RoleCost:
    from pipelines.plan import memory as plan_memory

    figures = plan_memory._figures(compiled)
    fig = {
        "peak_bytes_per_device": figures["peak"],
        "forward_temp_bytes_per_device": figures["temp"],
    }
    return teacher_cost(cfg, _cost_seconds(compiled, platform, factor), fig)


def _several_teachers(cfg: Config, mesh, platform: str) -> tuple[RoleCost, object]:
    """Several teachers on one inference mesh (`teachers:`): the seconds of their forwards
    summed (they run one after another on every batch), every local one's weights held at
    once with the largest temporaries; the abstract output the student steps on
    (`distill.types.TeacherMix`)."""
    import jax
    import jax.numpy as jnp

    from distill.types import TeacherMix
    from pipelines.plan import memory as plan_memory

    each, outs = [], []
    for one in cfg.each_teacher():
        if not one.teacher.loaded():
            outs.append(plan_memory.teacher_output_shapes(one, mesh, None))
            continue
        compiled, out = plan_memory._teacher(one, mesh, None)
        factor = layers_factor(one.teacher.model, cfg.train.seq_len)
        each.append(_teacher_cost(one, compiled, platform, factor))
        outs.append(out)
    resident, temp = sum(c.resident for c in each), max((c.temp for c in each), default=0)
    cost = RoleCost(sum(c.seconds for c in each), resident + temp, resident, temp)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    weights = jax.ShapeDtypeStruct((b, s, len(outs)), jnp.float32)
    return cost, TeacherMix(tuple(outs), weights)


def role_keys(layouts: list[Layout]) -> list[tuple[str, tuple]]:
    """Each role layout of `layouts` once: ("teacher", (dp, ep, tp)), ("student", (dp, fsdp))."""
    keys = [("teacher", x.teacher) for x in layouts] + [("student", x.student) for x in layouts]
    return list(dict.fromkeys(keys))


def measured_or_compiled(cfg: Config, devices: list, layouts: list[Layout]) -> dict:
    """The role costs `auto` compares: those `distill bench --placement` measured on these
    devices where the cache holds one for every role layout of `layouts` (measured times and
    roofline predictions are not mixed), else the compiled ones (cached in turn)."""
    measured = stored_costs(cfg, devices, "measured")
    if measured is not None and all(k in measured for k in role_keys(layouts)):
        return measured

    def compile_them() -> dict:
        n = len(role_keys(layouts))
        log.info(
            "mesh.placement auto: compiling the %d role layouts of %d candidates from shapes "
            "(once for this config and these devices: the costs are cached)",
            n,
            len(layouts),
        )
        return compiled_costs(cfg, devices, layouts)

    return cached_costs(cfg, devices, compile_them, role_keys(layouts))


def ranked(cfg: Config, devices: list, layouts: list[Layout], costs: dict):
    """(the rows of `layouts` from role `costs`, the row `choose` picks on `devices`)."""
    platform = devices[0].platform
    rows = [
        predict(x, costs["teacher", x.teacher], costs["student", x.student], platform)
        for x in layouts
    ]
    limit = None if platform == "cpu" else (devices[0].memory_stats() or {}).get("bytes_limit")
    host = host_memory_bytes() if platform == "cpu" else None
    return rows, choose(rows, configured(cfg), limit, host)


def resolve(
    cfg: Config,
    devices: list,
    log_table: bool = True,
    check: Callable[[Config], None] | None = None,
) -> str | None:
    """`mesh.placement: auto` resolved in place for `devices` (the chosen placement and
    axes written into `cfg.mesh`); the table of candidates (logged unless `log_table` is
    false: `distill plan` prints it once, with the plan), or None when the placement was
    not auto. `check(layout_cfg)`: the run's checks of one layout; a candidate that fails
    them is dropped before anything compiles, and when none is left the line says why."""
    if cfg.mesh.placement != Placement.AUTO:
        return None
    check_placement_mode(cfg)
    for role in ("teacher", "student"):  # auto lays out the devices: a list would be dropped
        if getattr(cfg.mesh, role).devices is not None:
            raise DistillError(
                f"mesh.{role}.devices: mesh.placement auto lays the devices out itself; remove "
                "the list, or set mesh.placement split or colocated"
            )
    cfg.resolve_dtypes(devices[0].platform)  # the programs compile in the run's dtypes
    n, platform = len(devices), devices[0].platform
    layouts = candidates(cfg, n, check)
    if not layouts:
        raise DistillError(_no_layout(cfg, n, platform, check))
    if len(layouts) == 1:  # nothing to compare (one device: colocated, every axis 1)
        chosen = layouts[0]
        table = f"mesh.placement auto: the one layout of {n} {platform} device(s): {chosen.label()}"
    else:
        rows, row = ranked(cfg, devices, layouts, measured_or_compiled(cfg, devices, layouts))
        chosen = row.layout
        tokens = cfg.train.batch_size * cfg.train.seq_len
        table = format_table(rows, row, tokens, platform == "cpu")
    resolved = chosen.apply(cfg).mesh
    cfg.mesh.placement, cfg.mesh.teacher, cfg.mesh.student = (
        resolved.placement, resolved.teacher, resolved.student,
    )  # fmt: skip
    if log_table:
        log.info("%s", table)
    return table


def _no_layout(cfg: Config, n: int, platform: str, check) -> str:
    """Why auto has no candidate: the run's own line for the axes the user wrote (every
    other axis 1) where that layout fails a check, or for the first candidate the checks
    dropped; else which axes no layout keeps."""
    written = written_axes(cfg)
    if check is not None and any(written.values()):
        t, s = written["teacher"], written["student"]
        given = Layout(
            Placement.SPLIT,
            (t.get(DP, 1), t.get(EP, 1), t.get(TP, 1)),
            (s.get(DP, 1), s.get(FSDP, 1)),
            fixed(cfg),
        )
        try:
            check(given.apply(cfg))
        except DistillError as e:
            return str(e)
    for layout in candidates(cfg, n)[:1] if check is not None else ():  # the checks refused
        try:
            check(layout.apply(cfg))
        except DistillError as e:
            return str(e)
    if any(written.values()):
        return (
            f"mesh.placement: auto keeps the axes written ({written_keys(cfg)}), and no layout "
            f"of {n} {platform} device(s) with them passes the run's checks; leave them unset "
            "for auto to choose, or use mesh.placement split or colocated"
        )
    return (
        f"mesh.placement: auto finds no layout of {n} {platform} devices that the model, "
        "train.batch_size and the run's checks allow"
    )


# -- the memory plan of colocated meshes -------------------------------------------------


def colocated_memory(cfg: Config, mem: dict) -> dict:
    """A colocated device's bytes from both roles' figures (`plan_memory.memory`): the
    teacher's weights, batch and `pipeline.prefetch` outputs in flight, the student's
    state, batch and teacher output, and the larger of the two programs' temporaries (they
    run in turn)."""
    t = teacher_cost(cfg, 0.0, mem["teacher"])
    s = student_cost(0.0, mem["student"])
    return {
        "teacher_resident_bytes_per_device": t.resident,
        "student_resident_bytes_per_device": s.resident,
        "temp_bytes_per_device": max(t.temp, s.temp),
        "peak_bytes_per_device": colocated_bytes(t, s),
    }


def check_colocated_fits(mem: dict) -> None:
    """One DistillError line when a colocated device cannot hold both roles."""
    limit, both = mem["device_memory_bytes"], mem.get("colocated")
    if limit is None or both is None or both["peak_bytes_per_device"] <= limit:
        return
    raise DistillError(
        f"mesh.placement: colocated needs {_gib(both['peak_bytes_per_device'])} per device "
        f"(teacher {_gib(both['teacher_resident_bytes_per_device'])} + student "
        f"{_gib(both['student_resident_bytes_per_device'])} resident + "
        f"{_gib(both['temp_bytes_per_device'])} temporaries) but a device has {_gib(limit)}; "
        "use more devices, mesh.placement: split, or lower pipeline.prefetch / train.remat"
    )


def format_colocated(mem: dict) -> str:
    both = mem["colocated"]
    return (
        f"colocated: {_gib(both['peak_bytes_per_device'])} per device holding both roles "
        f"(teacher {_gib(both['teacher_resident_bytes_per_device'])} + student "
        f"{_gib(both['student_resident_bytes_per_device'])} resident + the larger "
        f"temporaries {_gib(both['temp_bytes_per_device'])})"
    )
