"""Where the teacher's weights come from: a checkpoint, or a bootstrap run that makes one.

If `teacher.checkpoint` has no weights and `teacher.pretrain_steps > 0`, the teacher is
first trained with plain cross-entropy on the same data, data-parallel over every device
of both meshes, and saved at that path (default `<output_dir>/teacher`); a second run
reuses it. This makes the quick start meaningful with no downloads.

The student's starting state is made here too (`start_student`), since it may come from the
teacher's weights (`student.init: from_teacher`).
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distill import model
from distill.checkpoint import abstract_like, load_params, params_exist, save_params
from distill.config import Config
from distill.data import Corpus
from distill.mesh import DP, TP, all_devices_mesh
from student import optim, train
from teacher import sharding

log = logging.getLogger("distill")


def teacher_path(cfg: Config) -> str:
    return cfg.teacher.checkpoint or f"{cfg.run.output_dir.rstrip('/')}/teacher"


def load_teacher(cfg: Config, mesh) -> dict:
    """Read the teacher checkpoint straight into the TP layout of the inference mesh: each
    device reads only its own slices. A Hugging Face directory is read by `teacher.hf`."""
    mcfg = cfg.teacher.model
    if cfg.teacher.is_hf():
        from teacher.hf import load_hf_teacher

        return load_hf_teacher(cfg.teacher.checkpoint, mcfg, mesh)
    target = sharding.shardings(mcfg, mesh)
    expand = mcfg.n_kv_heads < mesh.shape[TP]
    if expand:  # stored with n_kv_heads KV heads: read those replicated, then repeat per shard
        rep = NamedSharding(mesh, P())
        target = dict(target, layers=dict(target["layers"], wk=rep, wv=rep))
    params = load_params(teacher_path(cfg), abstract_like(model.abstract_params(mcfg), target))
    return sharding.shard_params(params, mcfg, mesh) if expand else params


def student_init_params(cfg: Config) -> dict | None:
    """`student.init: from_teacher`: host float32 parameters of the student made of the
    teacher's embeddings, final norm, head and the layers `cfg.init_layers()`; None: random.

    A Hugging Face teacher is read tensor by tensor, only the tensors the student keeps; a
    distill checkpoint is read whole into host memory first."""
    if cfg.student.init != "from_teacher":
        return None
    layers, mcfg = cfg.init_layers(), cfg.teacher.model
    if cfg.teacher.is_hf():
        from teacher.hf import read_hf_layers

        return read_hf_layers(cfg.teacher.checkpoint, mcfg, layers)
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=host),
        model.abstract_params(mcfg),
    )
    params = jax.tree.map(
        lambda x: np.asarray(x, np.float32), load_params(teacher_path(cfg), abstract)
    )
    params["layers"] = {k: v[np.asarray(layers)] for k, v in params["layers"].items()}
    return params


def start_student(cfg: Config, tx, mesh, ckpt) -> tuple[train.TrainState, dict | None, int]:
    """The student's state at the start of a run, on `mesh`, in every pipeline mode: the
    latest checkpoint of `ckpt` with its data-iterator state and step, or, with none, a fresh
    state (random, or `student.init: from_teacher`) at step 0 with no data state."""
    scfg = cfg.student_model()
    if ckpt.latest_step():
        return ckpt.restore(train.abstract_state(scfg, tx, mesh))
    return train.init_state(scfg, tx, cfg.run.seed, mesh, student_init_params(cfg)), None, 0


def bootstrap_teacher(cfg: Config, corpus: Corpus, store=None, stop=lambda: False) -> None:
    """Train the teacher with cross-entropy and save it at `teacher_path(cfg)`."""
    steps, mcfg = cfg.teacher.pretrain_steps, cfg.teacher.model
    mesh = all_devices_mesh(cfg, DP)
    n = mesh.shape[DP]
    while cfg.train.batch_size % n:  # the largest device count that divides the batch
        n -= 1
    if n != mesh.shape[DP]:
        mesh = Mesh(np.array(list(mesh.devices.flat)[:n]), (DP,))
    ocfg = cfg.optim.model_copy(update={"lr": cfg.teacher.pretrain_lr})
    tx = optim.make_optimizer(ocfg, steps)
    state = train.init_state(mcfg, tx, cfg.run.seed + 1, mesh)
    step_fn = train.make_train_step(
        mcfg,
        tx,
        mesh,
        loss_cfg=None,
        lr_schedule=optim.schedule(ocfg, steps),
        dtype=cfg.teacher.dtype,
        with_teacher=False,
    )
    it = corpus.train_iterator(cfg.train.batch_size, seed=cfg.run.seed + 1)
    split = train.batch_sharding(mesh)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    log.info("bootstrap: training the teacher for %d steps on %d devices", steps, n)
    if store is not None:
        store.set_phase("bootstrap", total_steps=steps)
    pending, t0, t_window = [], time.perf_counter(), time.perf_counter()
    for step in range(1, steps + 1):
        state, metrics = step_fn(state, jax.device_put(next(it), split))
        pending.append((step, metrics))
        while len(pending) > (0 if step == steps or stop() else cfg.train.metrics_lag):
            s, m = pending.pop(0)
            if s % cfg.train.log_every == 0 or s == steps:
                m = {k: float(v) for k, v in jax.device_get(m).items()}
                now = time.perf_counter()
                rate = cfg.train.log_every * tokens_per_step / max(now - t_window, 1e-9)
                t_window = now
                log.info("bootstrap step %d/%d loss %.4f", s, steps, m["loss"])
                if store is not None:
                    store.log(
                        {
                            "step": s,
                            "phase": "bootstrap",
                            "loss": m["loss"],
                            "ce_loss": m["ce_loss"],
                            "lr": m["lr"],
                            "tokens_per_s": rate,
                        }
                    )
        if stop():
            break
    save_params(teacher_path(cfg), jax.device_get(state.params))
    log.info("bootstrap: teacher saved to %s (%.1fs)", teacher_path(cfg), time.perf_counter() - t0)


def ensure_teacher(cfg: Config, corpus: Corpus, store=None) -> None:
    if not params_exist(teacher_path(cfg)):
        bootstrap_teacher(cfg, corpus, store)
