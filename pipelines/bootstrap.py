"""The teacher bootstrap: a teacher trained with cross-entropy on the run's own data.

If `teacher.checkpoint` has no weights and `teacher.pretrain_steps > 0`, the teacher is
first trained with plain cross-entropy on the same data, data-parallel over every device
of both meshes, and saved at that path (default `<output_dir>/teacher`); a second run
reuses it. This makes the quick start meaningful with no downloads.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np
from jax.sharding import Mesh

from distill.checkpoint import params_exist, save_params
from distill.config import Config
from distill.data import Corpus
from distill.mesh import DP, all_devices_mesh
from distill.outputs import teacher_path
from student import optim, train

log = logging.getLogger("distill")


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
