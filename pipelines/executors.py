"""The student executor of one process: the jitted step on the training mesh.

`LocalExecutor` owns the train state, its compiled step, its checkpoints and the student
side of evaluation (`pipelines.loop.StudentExecutor`). The same class runs the teacher
bootstrap (a cross-entropy step, no teacher output, no checkpoints). The Ray student actor
is the other executor (`pipelines.ray.mode`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from distill import handoff
from distill.checkpoint import Checkpointer
from pipelines.timing import ReadyWatcher
from student import routing, train
from student.alpha import AlphaSteps
from student.evaluate import StudentEval
from student.generate import ParamHistory

log = logging.getLogger("distill")


class LocalExecutor:
    """step(step, batch, teacher_out) dispatches `step_fn` on `mesh` with the state donated.

    `start_fn()` gives (state, data state, step) as `student.state.start_student` does;
    `step_fn(state, batch, teacher_out)` (or `(state, batch)` when `with_teacher` is False)
    returns (state, metrics)."""

    hops = True

    def __init__(
        self,
        mesh: Mesh,
        start_fn: Callable,
        step_fn: Callable,
        *,
        with_teacher: bool = True,
        ckpt: Checkpointer | None = None,
        evaluator: StudentEval | None = None,
        tokens_per_step: int = 1,
        history: ParamHistory | None = None,
    ):
        self._split = train.batch_sharding(mesh)
        self._start_fn, self._step_fn, self._with_teacher = start_fn, step_fn, with_teacher
        self._ckpt, self._evaluator = ckpt, evaluator
        self._tokens = tokens_per_step
        self.history = history  # the recent parameters, for on-policy generation
        self._watch = ReadyWatcher("student", devices=mesh.devices.flat)
        self.state = None
        self._bytes_per_token: float | None = None

    @property
    def alpha(self) -> float | None:
        """The `distill.alpha` the next steps train with; None: a step without one."""
        return self._step_fn.alpha if isinstance(self._step_fn, AlphaSteps) else None

    def set_alpha(self, alpha: float) -> None:
        """Train the next steps with `alpha` (a step of `student.alpha.AlphaSteps`)."""
        self._step_fn.set(alpha)

    def start(self) -> tuple[int, dict | None]:
        self.state, data_state, start = self._start_fn()
        if self.alpha is not None:  # the weight the checkpoint's run was training with
            self._step_fn.restore(self._ckpt.stored_notes(start) if start else None)
        if self.history is not None:
            self.history.start(start, self.state.params, self._ckpt)
        return start, data_state

    def restart(self, err: BaseException):
        raise err  # one process: nothing to recover from

    def hop(self, teacher_out):
        """The teacher output onto the training mesh's batch sharding: device to device
        (`distill.handoff`), never through the host, so it never waits for the teacher."""
        return None if teacher_out is None else handoff.hop(teacher_out, self._split)

    def step(self, step: int, batch, teacher_out):
        args = (teacher_out,) if self._with_teacher else ()
        self.state, metrics = self._step_fn(self.state, jax.device_put(batch, self._split), *args)
        self._watch.watch(metrics)
        if self.history is not None:
            self.history.record(step, self.state.params)
        if self._bytes_per_token is None and teacher_out is not None:
            nbytes = sum(x.nbytes for x in jax.tree.leaves(teacher_out))
            self._bytes_per_token = nbytes / self._tokens
        return metrics

    def read(self, metrics, wanted: bool) -> dict | None:
        if not wanted:  # never synchronise on a step whose metrics are not recorded
            return None
        return routing.host_metrics(metrics)

    def figures(self, steps: int, since: float) -> dict:
        return {
            "student_ms": self._watch.recent_ms(steps),
            "student_busy": self._watch.busy_fraction(since),
            "bytes_per_token": self._bytes_per_token,
        }

    def evaluate(self, batches: list, teacher_logits, keep: bool) -> dict:
        moved = (self.hop(t) for t in teacher_logits)  # one batch at a time, as consumed
        return self._evaluator(self.state.params, batches, moved, keep)

    def save(self, step: int, data_state: dict) -> bool:
        """Start writing a checkpoint; False when none is written (`train.unsaved_reason`,
        or a non-finite state)."""
        if (why := train.unsaved_reason(self.state)) is not None:
            log.warning("checkpoint step %d not written: %s", step, why)
            return False
        extra = None if self.history is None else self.history.extra(step)
        notes = None if self.alpha is None else self._step_fn.note()
        return self._ckpt.save(
            step, train.saved(self.state), data_state, force=True, extra=extra, notes=notes
        )

    def finish(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
        self.close()

    def close(self) -> None:
        """Stop timing (idempotent): also where the run ended by an error, before `finish`."""
        self._watch.close()
