"""The student's state at the start of a run, the same in every pipeline mode, and the
run's student checkpointer, whose checkpoints pin the teacher and tokenizer they were
distilled with (`distill.identity`)."""

from __future__ import annotations

from collections.abc import Callable

from distill.checkpoint import Checkpointer
from distill.config import Config
from distill.identity import check_pinned, run_identity
from distill.outputs import checkpoint_dir
from student import train


def run_checkpointer(cfg: Config) -> Checkpointer:
    """The run's student checkpoints: `checkpoint_dir(cfg)`, the last
    `train.keep_checkpoints` kept, each saved with `run_identity(cfg)`. Make it once the
    teacher is in place (after a bootstrap), so that the identity is that teacher's."""
    return Checkpointer(
        checkpoint_dir(cfg), keep=cfg.train.keep_checkpoints, meta=run_identity(cfg)
    )


def start_student(
    cfg: Config, tx, mesh, ckpt: Checkpointer, init_params: Callable[[], dict | None]
) -> tuple[train.TrainState, dict | None, int]:
    """(state on `mesh`, data-iterator state, step): the latest checkpoint of `ckpt`, or,
    with none, a fresh state at step 0 with no data state, from `init_params()` (host
    parameters, e.g. the teacher's layers; None: random). `init_params` is called only
    when there is no checkpoint to resume. A checkpoint distilled with another teacher or
    tokenizer is refused (one DistillError line) unless `run.allow_teacher_change`."""
    scfg = cfg.student_model()
    if ckpt.latest_step() is not None:
        restored, data_state, step = ckpt.restore(train.saved(train.abstract_state(scfg, tx, mesh)))
        current = ckpt.meta if ckpt.meta is not None else run_identity(cfg)
        how = "set run.allow_teacher_change=true to go on with it anyway"
        check_pinned(cfg, ckpt.stored_meta(step), current, how)  # of the step restored
        return train.resumed(restored, mesh), data_state, step
    return train.init_state(scfg, tx, cfg.run.seed, mesh, init_params()), None, 0


def latest_params(cfg: Config, mesh) -> tuple[dict, int]:
    """(the student's parameters of the run's latest checkpoint, placed on `mesh` as
    training places them, its step); one DistillError line when there is none."""
    from distill.checkpoint import has_checkpoint
    from distill.errors import DistillError
    from student import optim

    where = checkpoint_dir(cfg)
    if not has_checkpoint(where):
        raise DistillError(f"run.output_dir: no student checkpoint in {where}")
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    ckpt = Checkpointer(where)
    try:
        abstract = train.saved(train.abstract_state(cfg.student_model(), tx, mesh))
        state, _, step = ckpt.restore(abstract)
    finally:
        ckpt.close()
    return state.params, step
