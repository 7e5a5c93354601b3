"""The student's running object: the executor on the training mesh, and its one assembly.

`LocalExecutor` owns the train state, its compiled step, its checkpoints and the student
side of evaluation (`pipelines.loop.StudentExecutor`); `student_executor` assembles it for a
run, once, for local mode (`pipelines.local`), `distill eval` and every process of the Ray
student group (`pipelines.ray.actors.StudentMember`) alike. The same class runs the teacher
bootstrap (a cross-entropy step, no teacher output, no checkpoints).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from distill import handoff
from distill.checkpoint import Checkpointer
from distill.config import Config
from distill.data.byte_paths import BytePaths
from distill.data.corpus import Corpus
from distill.data.token_bytes import FirstBytes, VocabMap, byte_lengths
from distill.data.tokenizers import vocab_limit
from distill.models.cross.losses import CrossSpec
from distill.observability.timing import ReadyWatcher
from student import routing, train
from student.alpha import AlphaSteps, alpha_steps_for
from student.evaluate import StudentEval
from student.generate import ParamHistory
from student.state import run_checkpointer, start_student

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

    def evaluate_one(self, batch, teacher_logits) -> dict:
        """One eval batch's metrics with its token count (`StudentEval.one`): the arrays
        host arrays or already on the training mesh (a Ray student process's rows)."""
        return self._evaluator.one(self.state.params, batch, teacher_logits)

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

    def wait_for_checkpoints(self) -> int | None:
        """Block until every started checkpoint is written; the latest step on disk."""
        self._ckpt.wait()
        return self._ckpt.latest_step()

    def finish(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
        self.close()

    def close(self) -> None:
        """Stop timing (idempotent): also where the run ended by an error, before `finish`."""
        self._watch.close()


def student_executor(
    cfg: Config, corpus: Corpus, mesh: Mesh, init_params: Callable
) -> LocalExecutor:
    """The run's student on the training mesh: its state (resumed, or initialised), its
    compiled distillation step, its checkpoints and its side of evaluation; for on-policy
    runs, the recent parameters it generates with. `init_params(cfg, shardings)`: the
    parameters a new state starts from, each made in its placement, or None for random
    (`teacher.weights.student_init_params`: pruned from the teacher, or pretrained; the
    caller wires it, since the student does not import the teacher)."""
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
    cross = cross_spec(cfg, corpus)
    tx, step_fn = alpha_steps_for(cfg, mesh, vocab_limit=limit, cross=cross)
    ckpt = run_checkpointer(cfg)
    placed = train.param_shardings(cfg.student_model(), mesh)  # its weights read straight there
    history = None
    if cfg.distill.on_policy.fraction > 0:
        abstract = train.abstract_state(cfg.student_model(), tx, mesh).params
        history = ParamHistory(cfg.pipeline.max_staleness, abstract)
    return LocalExecutor(
        mesh,
        lambda: start_student(cfg, tx, mesh, ckpt, lambda: init_params(cfg, placed)),
        step_fn,
        ckpt=ckpt,
        evaluator=StudentEval(cfg, mesh, limit, eval_byte_lengths(cfg, corpus)),
        tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
        history=history,
    )


def cross_spec(cfg: Config, corpus: Corpus) -> CrossSpec | None:
    """How the step compares the two vocabularies of a cross-tokenizer run, else None."""
    if corpus.teacher is None:
        return None
    vmap, method = None, cfg.distill.cross_tokenizer
    if method in ("mapped", "first_byte", "byte_path"):
        kind = {"mapped": VocabMap, "first_byte": FirstBytes, "byte_path": BytePaths}[method]
        vmap = kind.between(
            corpus.teacher, corpus.tokenizer, cfg.teacher.model.vocab_size,
            cfg.student_model().vocab_size,
        )  # fmt: skip
    if cfg.distill.cross_boundary and method in ("first_byte", "byte_path"):
        vmap = vmap.after_tokens(*corpus.train.successions())
    return CrossSpec(method, vmap, corpus.teacher.vocab_size)


def eval_byte_lengths(cfg: Config, corpus: Corpus) -> tuple:
    """(student's, teacher's) bytes per id, for held-out bits per byte."""
    student = byte_lengths(corpus.tokenizer, cfg.student_model().vocab_size)
    return student, byte_lengths(corpus.teacher_tokenizer, cfg.teacher.model.vocab_size)
