"""Host memory of a run on CPU devices: every simulated device lives in the same RAM.

On an accelerator each device has its own memory, and `plan_memory.check_fits` compares a
role's compiled peak with one device's. On CPU the devices are slices of one process's
memory, so what a layout costs is the sum over its devices: the teacher's peak times its
`dp x ep x tp` devices plus the student's peak times its `dp x fsdp`. A data-parallel
replica (`dp`) copies its role's weights (and the student's optimizer state) once more
in the same RAM without adding a core; `tp` and `fsdp` split them. The machine's
available memory (`MemAvailable`) bounds that sum, with `HOST_RESERVE` left for the
process itself (the Python and XLA runtimes, the corpus, reading the checkpoint).

`distill plan` reports the sum beside the memory available (`host_memory` in its JSON);
`distill run` and `distill eval`, which load both models here, refuse a layout whose sum
exceeds it before loading anything, in one line naming the one-device-per-role layout and
its sum where that fits. (`distill validate` and `plan` check a layout for any machine: a
GPU host's, planned on a laptop, is theirs to describe, not to refuse.) Compiling both programs
costs time, so they check only where the resident weights and optimizer state alone
(`plan`'s figures, no compile) reach `CHECK_FROM` of the memory available: tiny configs
skip it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from distill.config import Config
from distill.errors import DistillError
from distill.mesh import Meshes, build_meshes

log = logging.getLogger(__name__)

# The process beyond its devices' programs: 1.2 GiB measured for a 0.5B teacher and its
# pruned student (docs/benchmarks/2026-11-27-host-memory.md), with some margin.
HOST_RESERVE = 3 * 2**29
CHECK_FROM = 0.1  # compile and sum the programs from this share of the available memory
ONE_EACH = ("teacher.dp", "teacher.tp", "student.dp", "student.fsdp")  # the fallback layout


def available_bytes() -> int | None:
    """The memory this machine can give the run now: Linux's `MemAvailable`, or less where
    the process's cgroup (a container's memory limit, cgroup v2) leaves less; None where it
    is not known (then nothing is checked)."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limit = _cgroup_room()
    return limit if free is None else free if limit is None else min(free, limit)


def _cgroup_room(
    proc: Path = Path("/proc/self/cgroup"), fs: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """memory.max - memory.current of this process's cgroup (v2); None without a limit."""
    try:
        rel = proc.read_text().strip().split("::")[-1]
        root = fs / rel.lstrip("/")
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def device_counts(meshes: Meshes, cfg: Config | None = None) -> dict[str, int]:
    """Each role's devices; none for a teacher that is not loaded (`teacher.source: cache`:
    its mesh is reserved, nothing is placed on it)."""
    cached = cfg is not None and cfg.teacher.source == "cache"
    return {"teacher": 0 if cached else meshes.teacher.devices.size,
            "student": meshes.student.devices.size}  # fmt: skip


def host_figures(
    meshes: Meshes, mem: dict, available: int | None, cfg: Config | None = None
) -> dict:
    """The sum over devices of each role's compiled peak (`plan_memory.memory`'s `mem`),
    the reserve, and the memory available (`host_memory` of the plan's JSON). Colocated
    meshes share their devices: each device counts once, with both roles' bytes
    (`pipelines.placement.colocated_memory`). `cfg`: a cache run's teacher counts nothing."""
    n, shared = device_counts(meshes, cfg), None
    if "colocated" in mem:
        shared = len({d.id for m in (meshes.teacher, meshes.student) for d in m.devices.flat})
        needed = mem["colocated"]["peak_bytes_per_device"] * shared + HOST_RESERVE
    else:
        peak = {role: mem[role]["peak_bytes_per_device"] for role in n}
        needed = sum(peak[role] * n[role] for role in n) + HOST_RESERVE
    return {
        "devices": n,
        "colocated_devices": shared,
        "needed_bytes": needed,
        "reserve_bytes": HOST_RESERVE,
        "available_bytes": available,
        "fits": None if available is None else needed <= available,
    }


def _devices(h: dict) -> str:
    """`4 teacher + 4 student devices`, or `4 colocated devices` (each holding both roles)."""
    if h.get("colocated_devices"):
        return f"{h['colocated_devices']} colocated devices"
    return f"{h['devices']['teacher']} teacher + {h['devices']['student']} student devices"


def format_host(h: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    where = "n/a" if h["available_bytes"] is None else gib(h["available_bytes"])
    verdict = {None: "", True: ": fits", False: ": does not fit"}[h["fits"]]
    return (
        f"host memory (CPU devices share it): {_devices(h)} and {gib(h['reserve_bytes'])} for "
        f"the process need {gib(h['needed_bytes'])} in all; {where} available{verdict}"
    )


def resident_bytes(cfg: Config, meshes: Meshes) -> int:
    """The weights and optimizer state over every device (`pipelines.plan`'s figures, from
    shapes, no compile): a lower bound of what the run holds."""
    from pipelines.plan import plan

    p, n = plan(cfg, meshes), device_counts(meshes, cfg)
    s = p["student"]
    student = s["weight_bytes_per_device"] + s["optimizer_bytes_per_device"]
    return p["teacher"]["weight_bytes_per_device"] * n["teacher"] + student * n["student"]


def one_device_per_role(cfg: Config) -> Config:
    """`cfg` with one device per role: nothing replicated, nothing split."""
    out = cfg.model_copy(deep=True)
    out.mesh.teacher.dp = out.mesh.teacher.tp = out.mesh.teacher.ep = 1
    out.mesh.student.dp = out.mesh.student.fsdp = 1
    out.mesh.teacher.devices = out.mesh.student.devices = None
    return out


def check_host_fits(cfg: Config, meshes: Meshes, memory, available: int | None = None) -> None:
    """On CPU devices: one DistillError line when the sum over devices of both programs'
    compiled peaks exceeds the memory available. `memory(cfg, meshes)` gives
    `plan_memory.memory`'s figures (called only where the resident state is large enough
    to matter, and once more for the layout the refusal names)."""
    if meshes.platform != "cpu":
        return
    available = available_bytes() if available is None else available
    if available is None or resident_bytes(cfg, meshes) < CHECK_FROM * available:
        return
    h = host_figures(meshes, memory(cfg, meshes), available, cfg)
    if h["fits"]:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    way = _layout_that_fits(cfg, memory, available)
    raise DistillError(
        f"host memory: the {_devices(h)} of this run are CPU devices sharing one RAM, and "
        f"they need {gib(h['needed_bytes'])} in all, over the {gib(available)} available; {way}"
    )


def _layout_that_fits(cfg: Config, memory, available: int) -> str:
    """The refusal's way out: one device per role if that fits (with its sum), else what
    lowers the programs' memory."""
    lower = "lower train.batch_size, train.seq_len or teacher.microbatch, or set train.remat"
    small = one_device_per_role(cfg)
    if small.mesh == cfg.mesh:
        return lower
    try:
        meshes = build_meshes(small)
        h = host_figures(meshes, memory(small, meshes), available, small)
    except DistillError:
        return lower
    layout = " ".join(f"--set mesh.{k}=1" for k in ONE_EACH)
    if h["fits"]:
        return f"one device per role fits ({h['needed_bytes'] / 2**30:.1f} GiB): {layout}"
    return f"even one device per role needs {h['needed_bytes'] / 2**30:.1f} GiB: {lower}"
