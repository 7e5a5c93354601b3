"""Device discovery, the two-mesh split, and CPU device simulation.

The inference mesh (axis `tp`) holds the teacher; the training mesh (axis `dp`) holds the
student. They are disjoint: by default the teacher takes the first `tp` devices and the
student the next `dp`. On a host without accelerators, `simulate_cpu_devices` must run
before JAX initialises so that the two-mesh layout runs anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from distill.config import Config
from distill.errors import DistillError

TP = "tp"  # the inference mesh's tensor-parallel axis
DP = "dp"  # the training mesh's data-parallel axis

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def devices_needed(cfg: Config) -> int:
    """How many devices the config asks for (disjoint teacher and student sets)."""
    explicit = (cfg.mesh.teacher.devices or []) + (cfg.mesh.student.devices or [])
    return max([cfg.mesh.teacher.tp + cfg.mesh.student.dp] + [d + 1 for d in explicit])


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for `n` host (CPU) devices. Only effective before JAX initialises its
    backends; a device count already set in XLA_FLAGS (by a user or a test) wins. It only
    affects the CPU platform, so it is harmless on GPU and TPU hosts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()


def available_devices(platform: str = "auto") -> list:
    """The devices distill will use: accelerators if present (or as asked), else CPU."""
    import jax

    if platform == "auto":
        backend = jax.default_backend()
        return jax.devices(backend)
    try:
        return jax.devices(platform)
    except RuntimeError:
        raise DistillError(f"mesh.platform: no {platform} devices on this host") from None


def check_fit(cfg: Config, n_devices: int, platform: str) -> None:
    """Raise DistillError if the meshes do not fit the devices (before any device work)."""
    need = devices_needed(cfg)
    if need > n_devices:
        hint = ""
        if platform == "cpu":
            hint = " (simulated CPU devices are fixed once JAX starts)"
        raise DistillError(
            f"mesh: teacher tp={cfg.mesh.teacher.tp} + student dp={cfg.mesh.student.dp} needs "
            f"{need} devices, but only {n_devices} {platform} devices exist{hint}"
        )
    for role in ("teacher", "student"):
        r = getattr(cfg.mesh, role)
        size = r.tp if role == "teacher" else r.dp
        if r.devices is not None and len(r.devices) != size:
            axis = "tp" if role == "teacher" else "dp"
            raise DistillError(
                f"mesh.{role}.devices: {len(r.devices)} ids given but mesh.{role}.{axis}={size}"
            )
    t, s = _device_ids(cfg)
    if set(t) & set(s):
        raise DistillError(f"mesh: teacher and student devices overlap: {sorted(set(t) & set(s))}")


def _device_ids(cfg: Config) -> tuple[list[int], list[int]]:
    tp, dp = cfg.mesh.teacher.tp, cfg.mesh.student.dp
    t = cfg.mesh.teacher.devices or list(range(tp))
    s = cfg.mesh.student.devices or list(range(tp, tp + dp))
    return t, s


@dataclass(frozen=True)
class Meshes:
    teacher: object  # jax.sharding.Mesh, axis TP
    student: object  # jax.sharding.Mesh, axis DP
    platform: str

    def layout(self) -> dict:
        """A plain description for logs and the status API."""

        def role(mesh, axis):
            devs = list(mesh.devices.flat)
            return {
                "axis": axis,
                "shape": {axis: len(devs)},
                "devices": [{"id": int(d.id), "kind": str(d.device_kind)} for d in devs],
            }

        return {
            "platform": self.platform,
            "teacher": role(self.teacher, TP),
            "student": role(self.student, DP),
        }


def build_meshes(cfg: Config) -> Meshes:
    import numpy as np
    from jax.sharding import Mesh

    devices = available_devices(cfg.mesh.platform)
    platform = devices[0].platform
    check_fit(cfg, len(devices), platform)
    t, s = _device_ids(cfg)
    return Meshes(
        teacher=Mesh(np.array([devices[i] for i in t]), (TP,)),
        student=Mesh(np.array([devices[i] for i in s]), (DP,)),
        platform=platform,
    )


def all_devices_mesh(cfg: Config, axis: str = DP):
    """One data-parallel mesh over every device both roles use (teacher bootstrap)."""
    import numpy as np
    from jax.sharding import Mesh

    devices = available_devices(cfg.mesh.platform)
    t, s = _device_ids(cfg)
    return Mesh(np.array([devices[i] for i in t + s]), (axis,))
