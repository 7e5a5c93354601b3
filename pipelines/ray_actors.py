"""The actors of `pipeline.mode: ray`: one teacher per replica and one student, each owning
its devices.

An actor process gets its devices from Ray before it imports JAX: GPUs (or TPU chips) as
Ray resources, which Ray makes the only visible ones, or on a host without accelerators its
own simulated CPU devices through `XLA_FLAGS` in the actor's runtime environment
(`device_options`). Each actor builds a mesh over all of its local devices. JAX is imported
only inside the actors' methods, never by importing this module.

Actors get the config as a plain tree and validate it themselves. What crosses between
actors is host numpy: a `Batch` and a `TeacherOutput` (top-k, or dense for small
vocabularies). The jitted functions are the local mode's own (`teacher.forward.make_forward`,
`student.train.make_train_step`), so both modes compute the same numbers.
"""

from __future__ import annotations

import os
import re
import time

import ray

from distill.config_file import config_from_dict
from distill.errors import DistillError
from distill.mesh import DP, TP, student_shape, teacher_shape
from distill.tokenizers import build_tokenizer, vocab_limit

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def device_options(n_devices: int, platform: str) -> tuple[dict, dict]:
    """(placement-group bundle, actor options) giving an actor `n_devices` of `platform`.

    gpu/tpu: Ray resources, so the actor lands on a node that has them and sees only its
    own (JAX picks its platform itself, whatever the driver's environment pins). cpu: one
    CPU slot, and `n_devices` simulated host devices set in the actor's environment before
    its JAX starts (the driver's other XLA flags are kept)."""
    auto = {"runtime_env": {"env_vars": {"JAX_PLATFORMS": ""}}}
    if platform == "gpu":
        return {"CPU": 1, "GPU": n_devices}, {"num_cpus": 1, "num_gpus": n_devices, **auto}
    if platform == "tpu":
        opts = {"num_cpus": 1, "resources": {"TPU": n_devices}, **auto}
        return {"CPU": 1, "TPU": n_devices}, opts
    flags = re.sub(_COUNT_FLAG + r"=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    env = {"XLA_FLAGS": " ".join([*flags, f"{_COUNT_FLAG}={n_devices}"]), "JAX_PLATFORMS": "cpu"}
    return {"CPU": 1}, {"num_cpus": 1, "runtime_env": {"env_vars": env}}


def _local_mesh(shape: dict[str, int], field: str):
    """A mesh of `shape` ({axis: size}, in order) over this process's first devices."""
    import math

    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices, n = jax.devices(), math.prod(shape.values())
    if len(devices) < n:
        raise DistillError(
            f"{field}: the actor needs {n} devices but sees {len(devices)} "
            f"{devices[0].platform} devices"
        )
    return Mesh(np.array(devices[:n]).reshape(*shape.values()), tuple(shape))


def _info(mesh, axis: str) -> dict:
    """Where this actor runs and which devices it owns (status API, mesh layout)."""
    devs = list(mesh.devices.flat)
    return {
        "node": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "platform": devs[0].platform,
        "layout": {
            "axis": axis,
            "shape": {str(a): int(n) for a, n in mesh.shape.items()},
            "devices": [{"id": int(d.id), "kind": str(d.device_kind)} for d in devs],
        },
    }


@ray.remote
class TeacherActor:
    """The inference mesh (axes `dp` x `tp`, as in local mode) and the frozen teacher on it."""

    def __init__(self, cfg_tree: dict):
        import jax

        from pipelines.sources import OnlineTeacher

        cfg = config_from_dict(cfg_tree)
        cfg.resolve_dtypes(jax.devices()[0].platform)
        self._mesh = _local_mesh(teacher_shape(cfg), "mesh.teacher.dp x tp")
        self._teacher = OnlineTeacher(cfg, self._mesh, build_tokenizer(cfg.data))
        self._jax = jax

    def info(self) -> dict:
        return _info(self._mesh, TP)

    def _timed(self, fn, batch):
        """(fn's output for `batch` as host arrays, busy milliseconds)."""
        t0 = time.perf_counter()
        out = self._jax.device_get(fn(batch))
        return out, 1e3 * (time.perf_counter() - t0)

    @ray.method(num_returns=2)
    def forward(self, batch):
        """(TeacherOutput of host arrays [B, S, k or V], busy milliseconds)."""
        return self._timed(self._teacher.output, batch)

    @ray.method(num_returns=2)
    def eval_logits(self, batch):
        """(dense teacher logits [B, S, V] of an eval batch, busy milliseconds)."""
        return self._timed(self._teacher.logits, batch)


@ray.remote
class StudentActor:
    """The training mesh (axes `dp` x `fsdp`): train state, train step, evaluation,
    checkpoints.

    On construction it restores the latest checkpoint of `run.output_dir` if there is one,
    so a recreated student resumes where the last checkpoint left off; `resume_point` says
    where, and the driver rewinds its data iterator to match."""

    def __init__(self, cfg_tree: dict):
        import jax

        from student import train
        from student.evaluate import StudentEval
        from student.state import run_checkpointer, start_student
        from teacher.weights import student_init_params

        cfg = config_from_dict(cfg_tree)
        cfg.resolve_dtypes(jax.devices()[0].platform)
        scfg = cfg.student_model()
        limit = vocab_limit(build_tokenizer(cfg.data), scfg.vocab_size)
        self._jax = jax
        self._mesh = _local_mesh(student_shape(cfg), "mesh.student.dp x fsdp")
        self._split = train.batch_sharding(self._mesh)
        tx, self._step_fn = train.distill_step_for(cfg, self._mesh, vocab_limit=limit)
        self._ckpt = run_checkpointer(cfg)
        self._state, self._data_state, self._start = start_student(
            cfg, tx, self._mesh, self._ckpt, lambda: student_init_params(cfg)
        )
        self._next = self._start + 1
        self._tokens = cfg.train.batch_size * cfg.train.seq_len
        self._eval = StudentEval(cfg, self._mesh, limit)

    def info(self) -> dict:
        return _info(self._mesh, DP)

    def resume_point(self) -> tuple[int, dict | None]:
        """(the step the state is at, the data state of its next batch; None: from the start)."""
        return self._start, self._data_state

    def step(self, step_no: int, batch, teacher_out) -> dict:
        """Train on step `step_no`'s batch; metrics as host floats. Steps must come in order:
        a step whose predecessor never ran (its teacher output was lost) is refused."""
        if step_no != self._next:
            raise RuntimeError(f"student step {step_no} out of order: expected {self._next}")
        jax, t0 = self._jax, time.perf_counter()
        t_out = jax.device_put(teacher_out, self._split)
        self._state, metrics = self._step_fn(self._state, jax.device_put(batch, self._split), t_out)
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self._next += 1
        m["student_ms"] = 1e3 * (time.perf_counter() - t0)
        m["bytes_per_token"] = sum(x.nbytes for x in jax.tree.leaves(teacher_out)) / self._tokens
        return m

    def evaluate(self, batches: list, teacher_logits: list, keep: bool) -> dict:
        """Held-out teacher vs student metrics, by the local mode's own `StudentEval`.
        `batches` and `teacher_logits` are lists of object refs, one per eval batch (nested
        in lists, so Ray leaves them unresolved); they are fetched one at a time."""
        return self._eval(
            self._state.params,
            (ray.get(b) for b in batches),
            (ray.get(t) for t in teacher_logits),
            keep,
        )

    def save(self, step: int, data_state: dict) -> None:
        """Start an asynchronous checkpoint of the state after `step`."""
        self._ckpt.save(step, self._state, data_state, force=True)

    def wait_for_checkpoints(self) -> int | None:
        """Block until every started checkpoint is written; the latest step on disk."""
        self._ckpt.wait()
        return self._ckpt.latest_step()

    def close(self) -> None:
        self._ckpt.close()
