"""The teacher bootstrap: a teacher trained with cross-entropy on the run's own data.

If `teacher.checkpoint` has no weights and `teacher.pretrain_steps > 0`, the teacher is
first trained with plain cross-entropy on the same data, data-parallel over every device
of both meshes, and saved at that path (default `<output_dir>/teacher`); a second run
reuses it. This makes the quick start meaningful with no downloads.
"""

from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np
from etils import epath
from jax.sharding import Mesh

from distill.checkpoint import params_exist, save_params
from distill.config import Config
from distill.data.corpus import Corpus
from distill.errors import DistillError, RunFailed
from distill.mesh import DP, all_devices_mesh
from distill.outputs import teacher_path
from pipelines import hooks as h
from pipelines.divergence import Divergence
from pipelines.loop import Loop, LoopSpec
from pipelines.memory_guard import HostMemoryGuard
from pipelines.sources import NoTeacher
from student import train
from student.executor import LocalExecutor

log = logging.getLogger("distill")


def _bootstrap_mesh(cfg: Config) -> Mesh:
    """Every device of both meshes, or the largest count of them that divides the batch."""
    mesh = all_devices_mesh(cfg, DP)
    n = mesh.shape[DP]
    while cfg.train.batch_size % n:
        n -= 1
    return mesh if n == mesh.shape[DP] else Mesh(np.array(list(mesh.devices.flat)[:n]), (DP,))


def _record(step: int, m: dict, figures: dict) -> dict:
    keys = ("loss", "ce_loss", "lr")
    return {"step": step, "phase": "bootstrap", **{k: m[k] for k in keys}} | {
        "tokens_per_s": figures["tokens_per_s"]
    }


def bootstrap_teacher(cfg: Config, corpus: Corpus, store=None, record: dict | None = None) -> None:
    """Train the teacher with cross-entropy and save it at `teacher_path(cfg)`: the one loop
    with no teacher source and a CE step, data-parallel over every device. The weights and
    the provenance `record` are written to a temporary directory first and then moved into
    place together, so a teacher without its record never appears."""
    steps, mcfg = cfg.teacher.pretrain_steps, cfg.teacher.model
    mesh = _bootstrap_mesh(cfg)
    ocfg = cfg.optim.model_copy(update={"lr": cfg.teacher.pretrain_lr})
    tx, step_fn = train.step_for(
        mcfg, ocfg, steps, mesh, loss_cfg=None, dtype=cfg.teacher.dtype, with_teacher=False
    )
    executor = LocalExecutor(
        mesh,
        lambda: (train.init_state(mcfg, tx, cfg.run.seed + 1, mesh), None, 0),
        step_fn,
        with_teacher=False,
    )
    source = NoTeacher(lambda: corpus.train_iterator(cfg.train.batch_size, seed=cfg.run.seed + 1))
    report = h.Report(
        lambda step, r: log.info("bootstrap step %d/%d loss %.4f", step, steps, r["loss"])
    )
    guard = Divergence(cfg.train.max_nonfinite_steps)
    memory = HostMemoryGuard(cfg.train.min_free_host_memory_gib)
    hooks = [*([h.Records()] if store is not None else []), report, guard, memory]
    hooks.append(h.StopRequests())
    log.info("bootstrap: training the teacher for %d steps on %d devices", steps, mesh.size)
    t0 = time.perf_counter()
    try:
        spec = LoopSpec.of(cfg, steps=steps, phase="bootstrap")
        summary = Loop(spec, source, executor, hooks, record=_record, store=store).run()
    finally:
        source.close()
    if summary["failure"] is not None:
        raise RunFailed(
            f"teacher bootstrap: {summary['failure']}; no teacher was saved at "
            f"{teacher_path(cfg)} (teacher.pretrain_lr is {cfg.teacher.pretrain_lr:g})"
        )
    if not summary["completed"]:
        raise DistillError(
            f"stopped during the teacher bootstrap at step {summary['steps']} of {steps}: "
            f"no teacher was saved at {teacher_path(cfg)}; rerun to bootstrap it"
        )
    _save(teacher_path(cfg), jax.device_get(executor.state.params), record)
    log.info("bootstrap: teacher saved to %s (%.1fs)", teacher_path(cfg), time.perf_counter() - t0)


def _save(path: str, params, record: dict | None) -> None:
    """Weights and provenance into `path.partial`, then renamed to `path` (an older teacher
    there, replaced on purpose by `teacher.rebootstrap`, is removed only after that)."""
    from teacher import provenance

    final = epath.Path(path if "://" in path else os.path.abspath(path))
    partial, old = final.parent / f"{final.name}.partial", final.parent / f"{final.name}.old"
    for stale in (partial, old):
        if stale.exists():
            stale.rmtree()
    save_params(str(partial), params)
    if record is not None:
        provenance.write(str(partial), record)
    if final.exists():
        final.rename(old)
    partial.rename(final)
    if old.exists():
        old.rmtree()


def ensure_teacher(cfg: Config, corpus: Corpus, store=None) -> None:
    """The teacher at `teacher_path(cfg)`: reused when there (checked as preflight checks
    it), else, or with `teacher.rebootstrap`, bootstrapped and saved with the provenance
    record of the settings that made it (`teacher.provenance`)."""
    from pipelines.teacher_checks import check_bootstrap_fits, check_teacher_weights, teacher_record

    check_teacher_weights(cfg, corpus)  # again: cache-teacher's preflight may skip it
    check_bootstrap_fits(cfg)
    if params_exist(teacher_path(cfg)) and not cfg.teacher.rebootstrap:
        return
    bootstrap_teacher(cfg, corpus, store, record=teacher_record(cfg, corpus))
