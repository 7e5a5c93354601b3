"""`distill plan`: the device split, sizes and FLOPs, computed from shapes alone."""

from __future__ import annotations

import math

import jax

from distill import hf, model
from distill.config import Config
from distill.mesh import Meshes
from student import optim


def plan(cfg: Config, meshes: Meshes) -> dict:
    tcfg, scfg = cfg.teacher.model, cfg.student_model()
    tp, dp, seq = cfg.mesh.teacher.tp, cfg.mesh.student.dp, cfg.train.seq_len
    t_params, s_params = model.param_count(tcfg), model.param_count(scfg)
    # as loaded: a Hugging Face teacher keeps its stored dtypes, distill's own are float32
    # (teacher.dtype is the compute dtype; weights are cast where they are used)
    if cfg.teacher.is_hf():
        t_weights = hf.weight_bytes(cfg.teacher.checkpoint, tcfg)
    else:
        t_weights = t_params * 4
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    opt_shapes = jax.eval_shape(tx.init, model.abstract_params(scfg))
    opt_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(opt_shapes))
    k = cfg.teacher.top_k
    cross = (k * 8) if k else tcfg.vocab_size * 4  # float32 values (+ int32 ids) per token
    return {
        "layout": meshes.layout(),
        "teacher": {
            "params": t_params,
            "weight_bytes_per_device": t_weights // tp,
            "forward_flops_per_token": model.flops_per_token(tcfg, seq),
        },
        "student": {
            "params": s_params,
            "weight_bytes_per_device": s_params * 4,
            "optimizer_bytes_per_device": opt_bytes,
            "train_flops_per_token": 3 * model.flops_per_token(scfg, seq),
        },
        "tokens_per_step": cfg.train.batch_size * seq,
        "per_device_batch": cfg.train.batch_size // dp,
        "teacher_output": f"top-{k}" if k else "dense",
        "bytes_per_token_between_meshes": cross,
    }


def format_plan(p: dict) -> str:
    lay, t, s = p["layout"], p["teacher"], p["student"]
    ids = lambda role: ",".join(str(d["id"]) for d in lay[role]["devices"])  # noqa: E731
    mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    return "\n".join(
        [
            f"devices ({lay['platform']}): teacher tp={len(lay['teacher']['devices'])} on "
            f"[{ids('teacher')}]  |  student dp={len(lay['student']['devices'])} on "
            f"[{ids('student')}]",
            f"teacher: {t['params'] / 1e6:.2f}M params, {mb(t['weight_bytes_per_device'])} "
            f"weights/device, {t['forward_flops_per_token'] / 1e6:.1f} MFLOP/token forward",
            f"student: {s['params'] / 1e6:.2f}M params, "
            f"{mb(s['weight_bytes_per_device'])} weights + "
            f"{mb(s['optimizer_bytes_per_device'])} optimizer/device, "
            f"{s['train_flops_per_token'] / 1e6:.1f} MFLOP/token train step",
            f"batch: {p['tokens_per_step']} tokens/step, {p['per_device_batch']} rows/device; "
            f"teacher output {p['teacher_output']}, {p['bytes_per_token_between_meshes']} B/token "
            "between meshes",
        ]
    )
