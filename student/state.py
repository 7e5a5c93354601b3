"""The student's state at the start of a run, the same in every pipeline mode."""

from __future__ import annotations

from collections.abc import Callable

from distill.checkpoint import Checkpointer
from distill.config import Config
from student import train


def start_student(
    cfg: Config, tx, mesh, ckpt: Checkpointer, init_params: Callable[[], dict | None]
) -> tuple[train.TrainState, dict | None, int]:
    """(state on `mesh`, data-iterator state, step): the latest checkpoint of `ckpt`, or,
    with none, a fresh state at step 0 with no data state, from `init_params()` (host
    parameters, e.g. the teacher's layers; None: random). `init_params` is called only
    when there is no checkpoint to resume."""
    scfg = cfg.student_model()
    if ckpt.latest_step():
        return ckpt.restore(train.abstract_state(scfg, tx, mesh))
    return train.init_state(scfg, tx, cfg.run.seed, mesh, init_params()), None, 0
