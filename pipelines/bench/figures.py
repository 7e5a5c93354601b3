"""The bench's derived figures: tokens/s, MFU (the model's FLOPs over the device's peak)
and, for the student step, HFU (the FLOPs the device does, its `train.remat` recompute
included)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distill.config import Config
from distill.models import counts
from student.remat import concrete as concrete_remat
from student.remat import train_flops_per_token


def matmul_flops_per_s(mesh, n: int = 1024, repeats: int = 5) -> float:
    """Peak throughput of an [d*n, n] x [n, n] float32 matmul, rows split over the d devices
    of the training mesh."""
    d = mesh.size
    rows = NamedSharding(mesh, P(mesh.axis_names))  # split over every device of the mesh
    a = jax.device_put(jnp.ones((d * n, n), jnp.float32), rows)
    b = jax.device_put(jnp.ones((n, n), jnp.float32), NamedSharding(mesh, P()))
    mm = jax.jit(lambda a, b: a @ b)
    for _ in range(2):
        jax.block_until_ready(mm(a, b))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(mm(a, b))
        times.append(time.perf_counter() - t)
    ms = 1e3 * min(times)  # the peak this machine reaches: a conservative MFU denominator
    return 2.0 * d * n * n * n / (ms / 1e3)


# Dense bfloat16 peak FLOP/s per device by device kind (vendor figures: H100/H200 SXM,
# A100, TPU v4, v5e ("TPU v5 lite"), v5p, v6e ("TPU v6 lite")).
BF16_PEAK = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}


def peak_flops_per_s(mesh) -> float:
    """The MFU denominator of a mesh: its devices' bfloat16 peak on a known accelerator;
    elsewhere (CPU) the float32 matmul rate measured on the same devices."""
    devs = list(mesh.devices.flat)
    for name, peak in BF16_PEAK.items():
        if name in devs[0].device_kind:
            return peak * len(devs)
    return matmul_flops_per_s(Mesh(np.array(devs), ("d",)))


def teacher_figures(res: dict, cfg: Config, mesh) -> dict:
    """The teacher's configured output time, tokens/s and MFU (forward FLOPs) on `mesh`."""
    tokens = cfg.train.batch_size * cfg.train.seq_len
    ms = res["teacher_topk_ms"] if cfg.teacher.top_k else res["teacher_dense_ms"]
    peak = peak_flops_per_s(mesh)
    flops = counts.flops_per_token(cfg.teacher.model, cfg.train.seq_len) * tokens
    return {
        "teacher_ms": ms,
        "teacher_tokens_per_s": tokens / (ms / 1e3),
        "teacher_peak_flops_per_s": peak,
        "teacher_mfu": flops / (ms / 1e3) / peak,
        "topk_over_plain_teacher": res["teacher_topk_ms"] / res["teacher_plain_ms"],
    }


def student_figures(res: dict, cfg: Config, mesh) -> dict:
    """The student step's time with the configured teacher output, tokens/s, MFU (the
    model's FLOPs: 3 x forward) and HFU (the FLOPs the device does, recompute of the
    step's `train.remat` policy included: `student.remat.train_flops_per_token`) on `mesh`."""
    tokens = cfg.train.batch_size * cfg.train.seq_len
    ms = res["student_kd_topk_ms"] if cfg.teacher.top_k else res["student_kd_dense_ms"]
    peak = peak_flops_per_s(mesh)
    scfg, seq = cfg.student_model(), cfg.train.seq_len
    flops = 3 * counts.flops_per_token(scfg, seq) * tokens
    policy = concrete_remat(cfg.train.remat, mesh.devices.flat[0].platform)
    hardware = train_flops_per_token(scfg, seq, policy) * tokens
    return {
        "student_ms": ms,
        "student_tokens_per_s": tokens / (ms / 1e3),
        "matmul_flops_per_s": peak,
        "mfu": flops / (ms / 1e3) / peak,
        "hfu": hardware / (ms / 1e3) / peak,
        "student_remat": policy,
        **{
            f"kd_over_ce_{kind}": res[f"student_kd_{kind}_ms"] / res["student_ce_ms"]
            for kind in ("dense", "topk")
            if f"student_kd_{kind}_ms" in res
        },
        **(
            {"cross_over_one_vocab": res["student_kd_dense_ms"] / res["student_kd_one_vocab_ms"]}
            if "student_kd_one_vocab_ms" in res
            else {}
        ),
    }
