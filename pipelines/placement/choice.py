"""`mesh.placement: auto`: the layout predicted fastest on the devices present.

The candidates, on `n` devices: `colocated` (both meshes over all `n`, every teacher
`dp x ep x tp` and student `dp x fsdp` of `n` devices) and every `split` (the teacher on
`k` devices, the student on the other `n - k`, every layout of each), those that keep
every axis the user wrote (`written_axes`: auto chooses only the others) and that the
divisibility rules allow (heads, vocabulary and feed-forward by `tp`, experts by `ep`, the
batch by the teacher's `dp x ep` and the student's `dp x fsdp x grad_accum`) and the run's
other checks of a layout pass; where none of `n` devices exists, those of the largest
smaller count that has some.

Each role's cost on a layout is a `RoleCost`: its time per step and its memory per device.
The time is measured where `distill bench --placement` timed every candidate role layout
on these devices (a few steps of each role alone, `pipelines.bench.measured`, kept in the
placement cache); otherwise it comes from the compiled program (the same abstract compile
`distill plan` makes, nothing run): its matmul FLOPs per device with every loop counted
(`distill.compiled_flops`) and its bytes accessed (XLA's cost analysis, which counts the
scanned layers once: scaled by `layers_factor`), over a nominal roofline of the platform
(`ROOFLINE`). A candidate's step time is

- split: `max(teacher, student)`: the two meshes work at once;
- colocated: `teacher + student`: the same devices take the roles in turn;
- on CPU, a compiled role time is its work summed over its devices (simulated CPU devices
  share the host's cores, so more of them is not more compute; a measured time is already
  the host's), the placements as above: the split loop does overlap its two programs on
  the host's cores (measured: the quick start's pipelined step is about the slower role's,
  `docs/benchmarks/`).

The choice (`choose`) is deterministic for a given table: the candidates that fit
(memory per device on an accelerator; on CPU the sum over the devices, which share the
host's memory); on CPU, of those, the ones whose copies of a model take at most
`REPLICA_SHARE` of the host's available memory, or else the fewest copies (each role's
resident bytes copied over its `dp`: `Row.replicated`; the simulated devices' copies all
live in the one RAM and buy no compute), before any speed; then those predicted within
`MARGIN` of the fastest tie, and a tie goes to the mesh axes the config gives (placement
split) if among them, else to the one with the least memory (per device; on CPU the host's
total), else to the first in the table's order.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from distill.config import Config
from distill.errors import DistillError
from distill.mesh import (
    DP,
    EP,
    FSDP,
    TP,
    Placement,
    check_batch_split,
    check_teacher_split,
)

log = logging.getLogger("distill")

# A candidate within this fraction of the fastest predicted tokens/s ties with it: the
# predictions are rough (a roofline of compiled costs), so the layout given is kept unless
# another is clearly faster.
MARGIN = 0.10
# Nominal per-device peaks (FLOP/s, bytes/s) the compiled costs are timed against; their
# ratio decides whether a program is compute- or memory-bound. CPU: the whole host (its
# simulated devices share it).
ROOFLINE = {"gpu": (989e12, 3.35e12), "tpu": (197e12, 8.2e11), "cpu": (1e11, 2e10)}
# On CPU a layout whose replicas of a model (dp copies of the teacher's weights, of the
# student's weights and optimizer state) take more than this share of the host's available
# memory is passed over for one that copies less, whatever their speeds: the quick start's
# few MB of student replicas are not, a 0.5B model's gigabytes are.
REPLICA_SHARE = 0.05


@dataclass(frozen=True)
class Layout:
    """One candidate: the placement and both meshes' axes. Pipeline stages and context
    parallelism (`mesh.teacher.pp`, `mesh.<role>.cp`) are the config's, never chosen:
    `fixed` is (teacher pp, teacher cp, student cp), each role's devices multiplied by it."""

    placement: Placement  # split or colocated
    teacher: tuple[int, int, int]  # dp, ep, tp
    student: tuple[int, int]  # dp, fsdp
    fixed: tuple[int, int, int] = (1, 1, 1)  # pp, teacher cp, student cp

    def sizes(self) -> tuple[int, int]:
        """Devices of the teacher's mesh and of the student's."""
        pp, t_cp, s_cp = self.fixed
        return math.prod(self.teacher) * pp * t_cp, math.prod(self.student) * s_cp

    def devices(self) -> int:
        t, s = self.sizes()
        return max(t, s) if self.placement == Placement.COLOCATED else t + s

    def label(self) -> str:
        (dp, ep, tp), (sdp, fsdp), (pp, t_cp, s_cp) = self.teacher, self.student, self.fixed
        t = (f"pp={pp} x " if pp > 1 else "") + f"dp={dp}" + (f" x ep={ep}" if ep > 1 else "")
        t += (f" x cp={t_cp}" if t_cp > 1 else "") + f" x tp={tp}"
        s = f"dp={sdp} x fsdp={fsdp}" + (f" x cp={s_cp}" if s_cp > 1 else "")
        return f"{self.placement:<9} teacher {t} | student {s}"

    def apply(self, cfg: Config) -> Config:
        """`cfg` with this layout's placement and axes (device lists cleared)."""
        (dp, ep, tp), (sdp, fsdp) = self.teacher, self.student
        mesh = cfg.mesh.model_copy(deep=True)
        mesh.placement = self.placement
        mesh.teacher = mesh.teacher.model_copy(update={DP: dp, EP: ep, TP: tp, "devices": None})
        mesh.student = mesh.student.model_copy(update={DP: sdp, FSDP: fsdp, "devices": None})
        return cfg.model_copy(update={"mesh": mesh})


@dataclass(frozen=True)
class RoleCost:
    """One role on one layout: seconds per step (predicted or measured) and bytes per device
    (`peak`), with the parts of it a colocated device holds for that role apart from the
    program's temporaries (`resident`) and those temporaries (`temp`)."""

    seconds: float
    peak: int
    resident: int = 0
    temp: int = 0
    measured: bool = False  # seconds timed on this host's devices (else compiled-predicted)


@dataclass(frozen=True)
class Row:
    layout: Layout
    seconds: float  # predicted step time
    bytes_per_device: int
    host_bytes: int  # the sum over the layout's devices
    measured: bool = False  # from measured role times (else compiled costs)
    replicated: int = 0  # on CPU: host bytes of the roles' copies beyond one (dp replicas)


def configured(cfg: Config) -> Layout:
    t, s = cfg.mesh.teacher, cfg.mesh.student
    colocated = cfg.mesh.placement == Placement.COLOCATED
    placement = Placement.COLOCATED if colocated else Placement.SPLIT
    return Layout(placement, (t.dp, t.ep, t.tp), (s.dp, s.fsdp), fixed(cfg))


def fixed(cfg: Config) -> tuple[int, int, int]:
    """The axes auto keeps as the config gives them: (teacher pp, teacher cp, student cp)."""
    return cfg.mesh.teacher.pp, cfg.mesh.teacher.cp, cfg.mesh.student.cp


def _factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [
        (d, *rest)
        for d in range(1, n + 1)
        if n % d == 0
        for rest in _factorisations(n // d, parts - 1)
    ]


def role_layouts(cfg: Config, role: str, n: int) -> list[tuple[int, ...]]:
    """Every layout of `role` over `n` devices the divisibility rules allow: the teacher's
    (dp, ep, tp), the student's (dp, fsdp)."""
    from teacher.sharding import check_divisible

    ok = []
    for shape in _factorisations(n, 3 if role == "teacher" else 2):
        trial = (
            Layout(Placement.SPLIT, shape, (1, 1))
            if role == "teacher"
            else Layout(Placement.SPLIT, (1, 1, 1), shape)
        )
        c = trial.apply(cfg)
        try:
            if role == "teacher":
                check_divisible(c.teacher.model, shape[2], ep=shape[1])
                check_teacher_split(c)
            else:
                check_batch_split(c)
        except DistillError:
            continue
        ok.append(shape)
    return ok


# The axes of each role auto chooses, in `Layout`'s order.
AXES = {"teacher": (DP, EP, TP), "student": (DP, FSDP)}


def written_axes(cfg: Config) -> dict[str, dict[str, int]]:
    """The axes the user wrote (in the YAML or by `--set`: pydantic's `model_fields_set`),
    per role: {"teacher": {"tp": 4}, "student": {}}. Under `auto` they are constraints: a
    candidate keeps every one, and auto chooses only the axes left unset."""
    return {
        role: {a: getattr(m, a) for a in AXES[role] if a in m.model_fields_set}
        for role, m in (("teacher", cfg.mesh.teacher), ("student", cfg.mesh.student))
    }


def written_keys(cfg: Config) -> str:
    """The written axes for messages: `mesh.teacher.tp=4, mesh.student.dp=4`."""
    keys = [f"mesh.{r}.{a}={n}" for r, axes in written_axes(cfg).items() for a, n in axes.items()]
    return ", ".join(keys)


def _keeps(shape: tuple[int, ...], role: str, written: dict[str, int]) -> bool:
    return all(written.get(a, n) == n for a, n in zip(AXES[role], shape, strict=True))


def candidates(cfg: Config, n: int, check: Callable[[Config], None] | None = None) -> list[Layout]:
    """The layouts of `n` devices that keep the axes the user wrote (`written_axes`):
    colocated over all of them first, then every split of them (teacher devices
    ascending); if none, those of the largest smaller count that has any (a device left
    idle). `check(layout_cfg)`: the run's checks of one layout (`pipelines.preflight
    .check_layout`), which drop a candidate that raises."""
    written, keep = written_axes(cfg), fixed(cfg)
    per = {"teacher": keep[0] * keep[1], "student": keep[2]}  # devices a layout multiplies
    roles = {
        (role, k): [
            s for s in role_layouts(cfg, role, k // per[role]) if _keeps(s, role, written[role])
        ]
        if k % per[role] == 0
        else []
        for role in ("teacher", "student")
        for k in range(1, n + 1)
    }
    for used in range(n, 0, -1):
        out = [
            Layout(Placement.COLOCATED, a, b, keep)
            for a in roles["teacher", used]
            for b in roles["student", used]
        ]
        for k in range(1, used):
            out += [
                Layout(Placement.SPLIT, a, b, keep)
                for a in roles["teacher", k]
                for b in roles["student", used - k]
            ]
        out = [x for x in out if check is None or _passes(check, x.apply(cfg))]
        if out:
            return out
    return []


def _passes(check: Callable[[Config], None], cfg: Config) -> bool:
    try:
        check(cfg)
    except DistillError:
        return False
    return True


def predict(layout: Layout, teacher: RoleCost, student: RoleCost, platform: str) -> Row:
    """The candidate's row from its roles' costs (the module's prediction model)."""
    nt, ns = layout.sizes()
    if layout.placement == Placement.COLOCATED:
        per_device = colocated_bytes(teacher, student)
        host = per_device * layout.devices()
    else:
        per_device = max(teacher.peak, student.peak)
        host = teacher.peak * nt + student.peak * ns
    t, s = teacher.seconds, student.seconds
    if platform == "cpu":  # one host's cores: each role's work summed over its devices
        t = t if teacher.measured else t * nt
        s = s if student.measured else s * ns
    seconds = t + s if layout.placement == Placement.COLOCATED else max(t, s)
    copies = replicated_bytes(layout, teacher, student) if platform == "cpu" else 0
    return Row(layout, seconds, per_device, host, teacher.measured and student.measured, copies)


def replicated_bytes(layout: Layout, teacher: RoleCost, student: RoleCost) -> int:
    """Host bytes of the copies a layout makes of each role's resident state beyond the
    first: the teacher's weights over its `dp`, the student's weights and optimizer state
    over its `dp` (`tp`, `ep` and `fsdp` split them)."""
    n = layout.devices() if layout.placement == Placement.COLOCATED else None
    nt, ns = (n, n) if n else layout.sizes()
    dt, ds = layout.teacher[0], layout.student[0]
    return teacher.resident * nt * (dt - 1) // dt + student.resident * ns * (ds - 1) // ds


def colocated_bytes(teacher: RoleCost, student: RoleCost) -> int:
    """A device holding both roles: both roles' resident bytes and the larger temporaries."""
    return teacher.resident + student.resident + max(teacher.temp, student.temp)


def choose(rows: list[Row], given: Layout, limit: int | None, host_limit: int | None) -> Row:
    """The row `auto` picks (see the module's docstring): deterministic for a table."""
    fits = [
        r
        for r in rows
        if (limit is None or r.bytes_per_device <= limit)
        and (host_limit is None or r.host_bytes <= host_limit)
    ]
    if not fits:
        smallest = min(rows, key=lambda r: r.host_bytes if host_limit else r.bytes_per_device)
        raise DistillError(
            f"mesh.placement: auto found no layout that fits the memory; the smallest is "
            f"{smallest.layout.label()} at {_gib(smallest.bytes_per_device)} per device"
        )
    if host_limit is not None:  # CPU: no layout that copies a model into the one RAM
        cheap = [r for r in fits if r.replicated <= REPLICA_SHARE * host_limit]
        fits = cheap or [r for r in fits if r.replicated == min(x.replicated for x in fits)]
    best = min(r.seconds for r in fits)
    ties = [r for r in fits if r.seconds <= best * (1 + MARGIN)]
    for r in ties:
        if r.layout == given:
            return r
    key = (lambda r: r.host_bytes) if host_limit is not None else (lambda r: r.bytes_per_device)
    return min(ties, key=key)  # min keeps the first of equals: the table's order


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_table(rows: list[Row], chosen: Row, tokens_per_step: int, cpu: bool) -> str:
    host = "  host total" if cpu else ""
    lines = [
        f"mesh.placement auto: {len(rows)} candidates (predicted tokens/s from measured or "
        f"compiled role times, memory/device{host})"
    ]
    for r in sorted(rows, key=lambda r: r.seconds):
        mark = "->" if r is chosen else "  "
        extra = f"  {_gib(r.host_bytes):>11}" if cpu else ""
        source = "measured" if r.measured else "compiled"
        lines.append(
            f" {mark} {r.layout.label():<58} {tokens_per_step / r.seconds:>12.0f} {source} "
            f"{_gib(r.bytes_per_device):>11}{extra}"
        )
    return "\n".join(lines)


def host_memory_bytes() -> int | None:
    """This host's available memory (bytes), where the OS reports it."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
