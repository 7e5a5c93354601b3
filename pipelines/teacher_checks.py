"""Preflight checks that a run starts from the teacher it means: no weights are read.

- A teacher distill bootstrapped is reused only by a config that would make the same one
  (`teacher.provenance`), or retrained on purpose (`teacher.rebootstrap`), never over a
  teacher distill did not make.
- A distill teacher checkpoint has `teacher.model`'s shapes (Orbax metadata).
- A student checkpoint in `run.output_dir` goes on only with the teacher and tokenizer it
  was distilled with (`distill.identity`), unless `run.allow_teacher_change`.
- A teacher to bootstrap (no weights at `teacher.checkpoint`) fits this host's devices.
"""

from __future__ import annotations

import os

from distill.checkpoint import params_exist, read_meta
from distill.config import Config
from distill.data.corpus import Corpus
from distill.data.prepared import tokenizer_identity
from distill.errors import DistillError
from distill.identity import check_pinned, data_hash, run_identity
from distill.mesh import available_devices
from distill.models import counts
from distill.outputs import checkpoint_dir, teacher_path
from teacher import provenance


def uses_teacher(cfg: Config) -> bool:
    """Whether `distill run` needs the teacher's weights (and bootstraps them if missing)."""
    return cfg.teacher.source == "online" or cfg.student.init == "from_teacher"


def teacher_record(cfg: Config, corpus: Corpus) -> dict:
    """The provenance record of the teacher `cfg` bootstraps from `corpus`."""
    return provenance.record(cfg, data_hash(corpus), tokenizer_identity(corpus.tokenizer))


def check_teacher_weights(cfg: Config, corpus: Corpus) -> None:
    """The teacher at `teacher_path(cfg)`, if there: made as `cfg` would make it (when it
    has a provenance record and `teacher.pretrain_steps > 0`) and of `teacher.model`'s
    shape; with `teacher.rebootstrap`, one that distill bootstrapped (it is replaced)."""
    t, path = cfg.teacher, teacher_path(cfg)
    if t.rebootstrap and t.pretrain_steps == 0:
        raise DistillError(
            "teacher.rebootstrap: true, but teacher.pretrain_steps is 0; set how many steps "
            "to bootstrap the teacher for"
        )
    if not params_exist(path):
        return
    stored = None if t.is_hf() else provenance.read(path)
    if t.rebootstrap:
        if stored is None:
            raise DistillError(
                f"teacher.rebootstrap: {path} holds a teacher distill did not bootstrap (no "
                f"{provenance.FILE}), which is not overwritten; point teacher.checkpoint at a "
                "new directory to bootstrap a teacher there"
            )
        return
    if t.is_hf():
        return  # shapes checked from config.json by distill.models.hf.files.check_checkpoint
    if stored is not None and t.pretrain_steps > 0:
        provenance.check(stored, teacher_record(cfg, corpus), path)
    provenance.check_shapes(cfg, path)


def check_student_pin(cfg: Config) -> None:
    """The student checkpoint in `run.output_dir`, if any, was distilled with the teacher
    and tokenizer this run uses; a teacher this run would (re)bootstrap is another one."""
    stored = read_meta(checkpoint_dir(cfg))
    if not stored:
        return
    current, path = run_identity(cfg), teacher_path(cfg)
    if uses_teacher(cfg) and cfg.teacher.rebootstrap:
        current["teacher"] = {"path": path, "note": "bootstrapped again: teacher.rebootstrap"}
    elif uses_teacher(cfg) and current["teacher"] is None and cfg.teacher.pretrain_steps:
        current["teacher"] = {"path": path, "note": "no weights: a new teacher is bootstrapped"}
    check_pinned(
        cfg,
        stored,
        current,
        "set run.allow_teacher_change=true to go on with it anyway, or use another run.output_dir",
    )


# Bytes per parameter of a replicated CE training state: float32 weights, gradients and
# AdamW's two moments.
_TRAIN_BYTES_PER_PARAM = 16


def check_bootstrap_fits(cfg: Config) -> None:
    """One DistillError line when the teacher must be bootstrapped (no weights at
    `teacher_path`) but its replicated training state cannot fit a device (the host's
    memory for all simulated CPU devices together), instead of running out of memory."""
    if cfg.teacher.pretrain_steps == 0 or (
        params_exist(teacher_path(cfg)) and not cfg.teacher.rebootstrap
    ):
        return
    devices = available_devices(cfg.mesh.platform)
    need = counts.param_count(cfg.teacher.model) * _TRAIN_BYTES_PER_PARAM
    if devices[0].platform == "cpu":
        need, limit = need * len(devices), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if limit and need > limit:
        raise DistillError(
            f"teacher.checkpoint: no weights at {teacher_path(cfg)}, and bootstrapping this "
            f"{counts.param_count(cfg.teacher.model) / 1e9:.1f}B-parameter teacher "
            f"(teacher.pretrain_steps) needs {need / 2**30:.0f} GiB of training state where "
            f"{limit / 2**30:.0f} GiB exist; point teacher.checkpoint at its weights"
        )
