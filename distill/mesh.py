"""Device discovery, the two meshes' placement, and CPU device simulation.

The inference mesh (axes `pp` x `dp` x `ep` x `cp` x `tp`; `pp` and `cp` only when
`mesh.teacher.pp` or `mesh.teacher.cp` > 1) holds the teacher; the training mesh (axes
`dp` x `fsdp`, and `cp` when `mesh.student.cp` > 1) holds the student.
`mesh.placement: split` (the default) keeps them disjoint: the teacher takes the first
`pp * dp * ep * cp * tp` devices and the student the next `dp * fsdp * cp`, and the two
work at once. `colocated` lays both from the first device on, so they share devices and
take turns (one GPU; a host where no split balances the roles); `auto` is resolved to one
of the two before the meshes are built (`pipelines.placement`). On a host without
accelerators, `simulate_cpu_devices` must run before JAX initialises so that the two-mesh
layout runs anywhere.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from enum import StrEnum

from distill.config import Config
from distill.errors import DistillError


class Placement(StrEnum):
    """Where the two meshes lie (`mesh.placement`, which the config holds as the YAML's
    string: a member equals its string, so the two compare as they are): `split`, on
    disjoint devices, the roles working at once; `colocated`, on the same devices, taking
    turns; `auto`, one of the two chosen from each role's cost before the meshes are built
    (`pipelines.placement`)."""

    SPLIT = "split"
    COLOCATED = "colocated"
    AUTO = "auto"


TP = "tp"  # the inference mesh's tensor-parallel axis
# The inference mesh's expert-parallel axis: a mixture of experts' experts split over it,
# its tokens (rows) split over it for attention (data-parallel there).
EP = "ep"
# The data-parallel axis of both meshes: batch rows split over it. One name serves both
# because the meshes are separate objects and a sharding names its own mesh.
DP = "dp"
# The inference mesh's pipeline axis, outermost: its stages each hold a run of the teacher's
# layers, activations passed stage to stage once per microbatch (`teacher.stages`).
PP = "pp"
FSDP = "fsdp"  # the training mesh's fully-sharded axis: parameters and optimizer state split
# Both meshes' context-parallel axis: each row's sequence split over it (load-balanced
# chunks, `distill.models.kernels.ring`). Only in a mesh whose cp is above 1.
CP = "cp"

_COUNT_FLAG = "--xla_force_host_platform_device_count"

log = logging.getLogger(__name__)


def colocated(cfg: Config) -> bool:
    """Whether both meshes lie on the same devices (`mesh.placement: colocated`)."""
    return cfg.mesh.placement == Placement.COLOCATED


def devices_needed(cfg: Config) -> int:
    """How many devices the config asks for: the teacher's and the student's (disjoint sets;
    the larger of the two when colocated; `auto` counts as the mesh axes given, split)."""
    explicit = (cfg.mesh.teacher.devices or []) + (cfg.mesh.student.devices or [])
    t, s = teacher_size(cfg), student_size(cfg)
    return max([max(t, s) if colocated(cfg) else t + s] + [d + 1 for d in explicit])


# `mesh.placement: auto` on a host without accelerators chooses among this many simulated
# CPU devices (or as many as the axes written need, if more): the quick start's 8.
AUTO_CPU_DEVICES = 8


def cpu_devices_to_simulate(cfg: Config) -> int:
    """How many CPU devices to simulate before JAX starts (only the CPU platform heeds it):
    the devices the config asks for, at least `AUTO_CPU_DEVICES` under `auto`."""
    need = devices_needed(cfg)
    return max(need, AUTO_CPU_DEVICES) if cfg.mesh.placement == Placement.AUTO else need


def teacher_shape(cfg: Config) -> dict[str, int]:
    """The inference mesh's axes and sizes: {dp: ..., ep: ..., tp: ...} (tp innermost, so
    each tensor-parallel group is a run of neighbouring devices; ep next, as the all-to-all
    of expert dispatch is the next busiest), with pipeline stages {pp: ..., dp: ...} first
    (outermost: its stages exchange one activation per microbatch, so across hosts the
    stages split first), and context parallelism {..., cp: ..., tp: ...} just outside tp
    (its ring passes key/value blocks every layer, fewer bytes than tp's all-reduces). A
    mesh without stages has no pp axis, one without context parallelism no cp axis."""
    t = cfg.mesh.teacher
    cp = {CP: t.cp} if t.cp > 1 else {}
    return ({PP: t.pp} if t.pp > 1 else {}) | {DP: t.dp, EP: t.ep} | cp | {TP: t.tp}


def teacher_size(cfg: Config) -> int:
    """Devices of the inference mesh: pp * dp * ep * cp * tp."""
    return math.prod(teacher_shape(cfg).values())


def _teacher_keys(cfg: Config, prefix: str = "mesh.teacher.") -> str:
    """The inference mesh's keys for messages, `mesh.teacher.dp=2 x mesh.teacher.tp=4`
    (dp only when it is not 1)."""
    keys = [f"{prefix}{a}={n}" for a, n in teacher_shape(cfg).items() if a == TP or n > 1]
    return " x ".join(keys)


def teacher_mesh(devices: list, dp: int, tp: int, ep: int = 1, pp: int = 1, cp: int = 1):
    """The inference mesh over `devices` (pp * dp * ep * cp * tp of them): axes (DP, EP,
    TP), with PP first when there are pipeline stages and CP before TP when `cp` > 1 (each
    row's sequence split over it: `teacher.forward`), laid out by `device_grid`."""
    from jax.sharding import Mesh

    sizes = {PP: pp, DP: dp, EP: ep, CP: cp, TP: tp}
    axes = tuple(a for a, n in sizes.items() if a not in (PP, CP) or n > 1)
    return Mesh(device_grid(devices, tuple(sizes[a] for a in axes)), axes)


def student_mesh(devices: list, dp: int, fsdp: int, cp: int = 1):
    """The training mesh over `devices` (dp * fsdp * cp of them): axes (DP, FSDP), and CP
    innermost when `cp` > 1 (the ring passes key/value blocks every layer, between
    neighbours), laid out by `device_grid`."""
    from jax.sharding import Mesh

    if cp == 1:
        return Mesh(device_grid(devices, (dp, fsdp)), (DP, FSDP))
    return Mesh(device_grid(devices, (dp, fsdp, cp)), (DP, FSDP, CP))


def device_grid(devices: list, shape: tuple[int, ...]):
    """`devices` as an array of `shape` (axes ordered outer to inner, the innermost the one
    that communicates most: tp, fsdp), laid out by topology.

    One process's devices, and the chips of one multi-host TPU slice (all joined by ICI),
    are laid out as one torus by `jax.experimental.mesh_utils`: tp = 16 over a v5e 4x4's
    four hosts is a ring of neighbouring chips rather than four host rings joined end to
    end (GPUs are laid out by id; CPU devices keep their order). GPU and CPU hosts, joined
    by a slower network, and several slices, are split by `granule_split`: the outer axes
    cross the network between hosts first, and each host's devices are laid out as one
    process's are. A process need not hold consecutive devices: the row hand-off between
    groups follows whichever rows each process's devices hold (`pipelines.ray.rows`).
    Where a layout fails, or a TPU subset of a host forms no box on the torus, the devices
    keep their order (process by process)."""
    import numpy as np
    from jax.experimental import mesh_utils

    processes = len({d.process_index for d in devices})
    try:
        if processes == 1 or _one_tpu_slice(devices):
            if devices[0].platform == "cpu":
                return np.array(devices).reshape(shape)
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        outer, inner = granule_split(shape, processes)
        return mesh_utils.create_hybrid_device_mesh(
            inner, outer, devices, process_is_granule=True, allow_split_physical_axes=True
        )
    except (ValueError, NotImplementedError, AssertionError) as e:
        log.warning("mesh %s: kept the devices' order (no topology layout: %s)", shape, e)
        ordered = sorted(devices, key=lambda d: d.process_index)  # stable: order kept within
        return np.array(ordered).reshape(shape)


def _one_tpu_slice(devices: list) -> bool:
    return all(d.platform == "tpu" for d in devices) and (
        len({getattr(d, "slice_index", 0) for d in devices}) == 1
    )


def granule_split(shape: tuple[int, ...], granules: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(across granules, within each) for a mesh of `shape` over `granules` equal groups of
    devices (hosts): the outer axes take as much of the split as they divide, so data
    parallelism crosses the slow network first and tensor or fully-sharded parallelism
    last. ValueError when the axes cannot split that way."""
    outer, left = [], granules
    for n in shape:
        k = math.gcd(n, left)
        outer.append(k)
        left //= k
    if left != 1:
        raise ValueError(f"{granules} hosts do not split the axes {shape}")
    return tuple(outer), tuple(n // k for n, k in zip(shape, outer, strict=True))


def student_shape(cfg: Config) -> dict[str, int]:
    """The training mesh's axes and sizes: {dp: ..., fsdp: ...}, and cp when above 1."""
    s = cfg.mesh.student
    return {DP: s.dp, FSDP: s.fsdp, **({CP: s.cp} if s.cp > 1 else {})}


def student_size(cfg: Config) -> int:
    """Devices of the training mesh: dp * fsdp * cp."""
    return math.prod(student_shape(cfg).values())


def student_row_shards(cfg: Config) -> int:
    """How many ways the training mesh splits a batch's rows: dp * fsdp (`cp` splits each
    row's sequence instead)."""
    return cfg.mesh.student.dp * cfg.mesh.student.fsdp


def _student_keys(cfg: Config, prefix: str = "mesh.student.") -> str:
    """The training mesh's keys for messages, `mesh.student.dp=2 x mesh.student.fsdp=4`
    (fsdp only when it is not 1)."""
    keys = [f"{prefix}{a}={n}" for a, n in student_shape(cfg).items() if a == DP or n > 1]
    return " x ".join(keys)


def _role_mesh(cfg: Config, role: str) -> tuple[int, str]:
    """(devices of the role's mesh, its keys for messages); role: teacher or student."""
    if role == "teacher":
        return teacher_size(cfg), _teacher_keys(cfg)
    return student_size(cfg), _student_keys(cfg)


def hosts(cfg: Config, role: str) -> int:
    """Processes of a role's group (`mesh.<role>.hosts`): one per host in pipeline.mode ray."""
    return getattr(cfg.mesh, role).hosts


def devices_per_host(cfg: Config, role: str) -> int:
    """Devices each process of a role's group owns: its mesh size / `mesh.<role>.hosts`."""
    return _role_mesh(cfg, role)[0] // hosts(cfg, role)


def check_hosts(cfg: Config) -> None:
    """`mesh.<role>.hosts`: 1 in local mode (one process); in ray mode a divisor of the
    role's mesh size, so that every process owns as many devices as the others."""
    for role in ("teacher", "student"):
        n = hosts(cfg, role)
        if n == 1:
            continue
        if cfg.pipeline.mode != "ray":
            raise DistillError(
                f"mesh.{role}.hosts: {n} processes need pipeline.mode ray (local mode is one "
                "process); set it to 1 or use pipeline.mode ray"
            )
        size, keys = _role_mesh(cfg, role)
        if size % n:
            raise DistillError(
                f"mesh.{role}.hosts: {n} does not divide the {size} devices of {keys}"
            )


def check_batch_split(cfg: Config) -> None:
    """Every device of the training mesh gets its own rows, `train.grad_accum` microbatches
    of them: the batch divides by dp x fsdp x grad_accum."""
    factors = {
        "mesh.student.dp": cfg.mesh.student.dp,
        "mesh.student.fsdp": cfg.mesh.student.fsdp,
        "train.grad_accum": cfg.train.grad_accum,
    }
    named = {k: n for k, n in factors.items() if k == "mesh.student.dp" or n > 1}
    need = math.prod(named.values())
    if cfg.train.batch_size % need:
        keys = " x ".join(f"{k}={n}" for k, n in named.items())
        total = f" = {need}" if len(named) > 1 else ""
        raise DistillError(
            f"train.batch_size: {cfg.train.batch_size} is not divisible by {keys}{total}"
        )


def check_context(cfg: Config) -> None:
    """`mesh.student.cp` or `mesh.teacher.cp` > 1: every row splits into 2 x cp equal
    chunks (`train.seq_len`), and the run uses only what each role's context parallelism
    is built for so far (under `mesh.placement: auto` every candidate keeps each role's cp)."""
    _check_role_context(cfg, "student", [
        ("distill.cross_tokenizer", cfg.cross_tokenizer() and cfg.distill.cross_tokenizer
         == "byte_path", "first_byte, mapped or uld"),
    ])  # fmt: skip
    _check_ray_context(cfg)
    _check_role_context(cfg, "teacher", [
        ("mesh.teacher.pp", cfg.mesh.teacher.pp > 1, "mesh.teacher.pp: 1 (no stages)"),
    ])  # fmt: skip


def _check_role_context(cfg: Config, role: str, own: list) -> None:
    """One role's cp (`mesh.<role>.cp`) against the row length, the refusals both roles
    share and the role's `own` ones (field, refused, what it needs)."""
    cp, seq = getattr(cfg.mesh, role).cp, cfg.train.seq_len
    if cp == 1:
        return
    model = cfg.teacher.model if role == "teacher" else cfg.student_model()
    if any(model.linear_layers()):
        raise DistillError(
            f"mesh.{role}.cp: {cp} with linear-attention layers ({role}.model.layer_types: "
            "Qwen3.5's Gated DeltaNet) is not supported: their recurrent state would have to "
            f"pass from each cp shard of a row to the next, which is not built; mesh.{role}.cp: 1"
        )
    if seq % (2 * cp):
        raise DistillError(
            f"train.seq_len: {seq} does not split into 2 x mesh.{role}.cp = {2 * cp} equal "
            "chunks (context parallelism); make it a multiple of that"
        )
    refused = [
        ("distill.on_policy.fraction", cfg.distill.on_policy.fraction > 0, "fraction: 0"),
        *own,
    ]
    for key, bad, needs in refused:
        if bad:
            raise DistillError(
                f"{key}: not supported with mesh.{role}.cp={cp} (context parallelism) yet; "
                f"needs {needs}, or mesh.{role}.cp: 1"
            )


def _check_ray_context(cfg: Config) -> None:
    """Ray mode: a row's `mesh.student.cp` devices are one process's (the group's hosts
    split the row shards, dp x fsdp, `distill.mesh.granule_split`), as the row hand-off,
    the sampler and the evaluation give each student process whole rows. The teacher's cp
    may cross its processes: its outputs leave by (rows, positions) blocks; in a colocated
    group of several processes they then reach the student's devices by JAX's reshard
    across processes, which needs both meshes on the same devices."""
    t, s = cfg.mesh.teacher, cfg.mesh.student
    if cfg.pipeline.mode != "ray":
        return
    if s.cp > 1 and (s.dp * s.fsdp) % s.hosts:
        raise DistillError(
            f"mesh.student.cp: {s.cp} would split rows across the student group's {s.hosts} "
            f"hosts (mesh.student.dp x fsdp = {s.dp * s.fsdp} row shards); in pipeline.mode ray "
            "a row's cp devices are one process's: make mesh.student.hosts divide dp x fsdp"
        )
    sizes = teacher_size(cfg), student_size(cfg)
    if t.cp > 1 and colocated(cfg) and s.hosts > 1 and sizes[0] != sizes[1]:
        raise DistillError(
            f"mesh.teacher.cp: {t.cp} in a colocated group of {s.hosts} processes needs the "
            f"teacher's and the student's meshes on the same devices ({sizes[0]} and "
            f"{sizes[1]}); make them equal, or mesh.placement: split"
        )


def check_teacher_split(cfg: Config) -> None:
    """Every dp group of the inference mesh gets its own rows, `teacher.microbatch` of
    them per forward (a microbatch as large as the group's rows is all of them)."""
    bsz, dp, micro = cfg.train.batch_size, cfg.mesh.teacher.dp, cfg.teacher.microbatch
    ep = cfg.mesh.teacher.ep  # attention is data-parallel over ep: its groups own rows too
    if bsz % (dp * ep):
        keys = f"mesh.teacher.dp={dp}" + (f" x mesh.teacher.ep={ep}" if ep > 1 else "")
        raise DistillError(f"train.batch_size: {bsz} is not divisible by {keys}")
    dp *= ep
    if micro is not None and micro < bsz // dp and (bsz // dp) % micro:
        raise DistillError(
            f"teacher.microbatch: {micro} does not divide the {bsz // dp} rows of each teacher "
            f"dp group (train.batch_size={bsz} / mesh.teacher.dp={dp})"
        )


def check_placement_mode(cfg: Config) -> None:
    """Ray mode: `colocated` is one group of processes holding both roles, so one teacher
    replica on the student's hosts; `auto` chooses from one process's devices (local mode)."""
    if cfg.pipeline.mode != "ray" or cfg.mesh.placement == Placement.SPLIT:
        return
    if cfg.mesh.placement == Placement.AUTO:
        raise DistillError(
            "mesh.placement: auto chooses from the devices of one process (pipeline.mode "
            "local); in pipeline.mode ray set split or colocated"
        )
    if cfg.teacher.replicas > 1:
        raise DistillError(
            f"teacher.replicas: {cfg.teacher.replicas} replicas need mesh.placement: split "
            "(colocated, one group of processes holds the teacher and the student)"
        )
    t, s = cfg.mesh.teacher.hosts, cfg.mesh.student.hosts
    if t != s:
        raise DistillError(
            f"mesh.teacher.hosts: {t} differs from mesh.student.hosts: {s}; colocated, "
            "both roles run in the same processes"
        )


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for `n` host (CPU) devices. Only effective before JAX initialises its
    backends; a device count already set in XLA_FLAGS (by a user or a test) wins. It only
    affects the CPU platform, so it is harmless on GPU and TPU hosts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()


def available_devices(platform: str = "auto") -> list:
    """The devices distill will use: accelerators if present (or as asked), else CPU.
    Attention then chooses its backend and tiles for their platform
    (`distill.models.attention.use_platform`), not for JAX's default backend."""
    import jax

    from distill.models import attention

    try:
        devices = jax.devices(jax.default_backend() if platform == "auto" else platform)
    except RuntimeError:
        raise DistillError(f"mesh.platform: no {platform} devices on this host") from None
    attention.use_platform(devices[0].platform)
    return devices


def check_fit(cfg: Config, n_devices: int, platform: str) -> None:
    """Raise DistillError if the meshes do not fit the devices (before any device work)."""
    need = devices_needed(cfg)
    if need > n_devices:
        hint = ""
        if platform == "cpu":
            hint = " (simulated CPU devices are fixed once JAX starts)"
        raise DistillError(
            f"mesh: teacher {_teacher_keys(cfg, '')} + student {_student_keys(cfg, '')} needs "
            f"{need} devices, but only {n_devices} {platform} devices exist{hint}"
        )
    for role in ("teacher", "student"):
        r = getattr(cfg.mesh, role)
        size, keys = _role_mesh(cfg, role)
        if r.devices is not None and len(r.devices) != size:
            raise DistillError(f"mesh.{role}.devices: {len(r.devices)} ids given but {keys}")
    t, s = _device_ids(cfg)
    if set(t) & set(s) and not colocated(cfg):
        raise DistillError(
            f"mesh: teacher and student devices overlap: {sorted(set(t) & set(s))}; "
            "set mesh.placement: colocated to share them"
        )


def _device_ids(cfg: Config) -> tuple[list[int], list[int]]:
    m, n = teacher_size(cfg), student_size(cfg)
    first = 0 if colocated(cfg) else m  # colocated: both from device 0
    t = cfg.mesh.teacher.devices or list(range(m))
    s = cfg.mesh.student.devices or list(range(first, first + n))
    return t, s


@dataclass(frozen=True)
class Meshes:
    teacher: object  # jax.sharding.Mesh, axes (DP, EP, TP); PP first with stages, CP before TP
    student: object  # jax.sharding.Mesh, axes (DP, FSDP) or (DP, FSDP, CP)
    platform: str

    def layout(self) -> dict:
        """A plain description for logs and the status API."""

        def role(mesh, axis):
            devs = list(mesh.devices.flat)
            return {
                "axis": axis,
                "shape": {str(a): int(n) for a, n in mesh.shape.items()},
                "devices": [{"id": int(d.id), "kind": str(d.device_kind)} for d in devs],
            }

        t, s = role(self.teacher, TP), role(self.student, DP)
        shared = {d["id"] for d in t["devices"]} & {d["id"] for d in s["devices"]}
        return {
            "platform": self.platform,
            "placement": str(Placement.COLOCATED if shared else Placement.SPLIT),
            "teacher": t,
            "student": s,
        }


def _dp_tp_ep(cfg: Config) -> tuple[int, int, int, int, int]:
    t = cfg.mesh.teacher
    return t.dp, t.tp, t.ep, t.pp, t.cp


def _dp_fsdp_cp(cfg: Config) -> tuple[int, int, int]:
    s = cfg.mesh.student
    return s.dp, s.fsdp, s.cp


def build_meshes(cfg: Config) -> Meshes:
    devices = available_devices(cfg.mesh.platform)
    platform = devices[0].platform
    check_fit(cfg, len(devices), platform)
    t, s = _device_ids(cfg)
    return Meshes(
        teacher=teacher_mesh([devices[i] for i in t], *_dp_tp_ep(cfg)),
        student=student_mesh([devices[i] for i in s], *_dp_fsdp_cp(cfg)),
        platform=platform,
    )


def role_mesh(cfg: Config, role: str):
    """One role's mesh alone, over the first of this host's devices (`distill bench
    --role`: a role measured on a host too small for both)."""
    devices = available_devices(cfg.mesh.platform)
    size, keys = _role_mesh(cfg, role)
    if size > len(devices):
        raise DistillError(
            f"mesh.{role}: {keys} needs {size} devices, but only {len(devices)} "
            f"{devices[0].platform} devices exist"
        )
    if role == "teacher":
        return teacher_mesh(devices[:size], *_dp_tp_ep(cfg))
    return student_mesh(devices[:size], *_dp_fsdp_cp(cfg))


def all_devices_mesh(cfg: Config, axis: str = DP):
    """One data-parallel mesh over every device both roles use (teacher bootstrap)."""
    import numpy as np
    from jax.sharding import Mesh

    devices = available_devices(cfg.mesh.platform)
    t, s = _device_ids(cfg)
    ids = list(dict.fromkeys(t + s))  # colocated meshes share their devices: each once
    return Mesh(np.array([devices[i] for i in ids]), (axis,))
