"""The one training loop: a teacher source feeds a student executor; hooks do the rest.

Every way of training is this loop. A **teacher source** (`pipelines.sources`: online on
the inference mesh, the offline cache, none for the CE bootstrap; `pipelines.ray.mode`: a
pool of Ray teacher actors) reads batches in data order and starts their teacher work; a
**student executor** (`pipelines.executors`: the jitted step on the training mesh;
`pipelines.ray.mode`: the Ray student actor) trains on them. Evaluation, checkpoints,
metric records, progress, status and stop requests are written here once.

Step n, in dispatch order:
  1. pop the oldest in-flight item and dispatch student step n on it (its teacher output
     was moved to the training mesh during step n-1);
  2. top the source up to `pipeline.prefetch` items in flight (Grain fetch, dispatch of
     the teacher's work), never past the last step's batch;
  3. move the next item's teacher output to the training mesh (the hop), which may wait
     for the teacher, so it comes after step 1: the training mesh is busy meanwhile;
  4. read step n-lag's metrics, long done: the loop never waits on the current step.

A checkpoint records the data state before the oldest in-flight item: where a resume
restarts, so nothing in flight is lost or trained on twice.

When `Hooks.check` gives a reason at a recorded step (a diverged run), the loop stops
there: no evaluation and no checkpoint of the state it has, the checkpoints already being
written completed, and the summary says `"completed": false` with the `"failure"`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import jax

from pipelines.progress import Progress

log = logging.getLogger("distill")


class Item(NamedTuple):
    """One batch on its way through the loop."""

    data_state: dict  # iterator state *before* this batch: where a resume restarts
    batch: Any  # Batch of host arrays (ray: an object ref to one)
    teacher_out: Any  # TeacherOutput (device, host, or an object ref); None: no teacher
    tag: Any = None  # the source's own bookkeeping (ray: the replica)


class StudentLost(Exception):
    """The student executor lost its state (a dead Ray actor); `restart` recovers it."""


class TeacherSource(Protocol):
    def start(self, data_state: dict | None) -> None:
        """Position the data at `data_state` (None: the beginning), nothing in flight."""

    def submit(self) -> None:
        """Read the next batch and start its teacher work."""

    def pop(self) -> Item:
        """The oldest in-flight item, once its teacher work can be handed on."""

    def peek(self) -> Item:
        """The oldest in-flight item, left in flight."""

    def in_flight(self) -> int: ...

    def resume_point(self) -> dict:
        """The data state of the oldest unconsumed batch."""

    def figures(self, steps: int, since: float, step: int) -> dict:
        """teacher_ms (mean per batch of the last `steps`) and teacher_busy (since `since`);
        figures of the logged steps themselves (step - steps, step] where a source has them
        (the on-policy share)."""

    def eval_logits(self, batches: list) -> Any:
        """Dense teacher logits of each eval batch (an iterable), or None: no evaluation."""

    def close(self) -> None: ...


class StudentExecutor(Protocol):
    hops: bool  # whether teacher outputs are moved to the training mesh by `hop`

    def start(self) -> tuple[int, dict | None]:
        """(step the state is at, data state of its next batch; None: the beginning)."""

    def hop(self, teacher_out: Any) -> Any: ...

    def step(self, step: int, batch: Any, teacher_out: Any) -> Any:
        """Dispatch one step; returns a handle on its metrics."""

    def read(self, handle: Any, wanted: bool) -> dict | None:
        """The step's metrics as host floats when `wanted` (else None, or read anyway)."""

    def figures(self, steps: int, since: float) -> dict:
        """student_ms, student_busy and bytes_per_token, as the source's `figures`."""

    def evaluate(self, batches: list, teacher_logits: Any, keep: bool) -> dict: ...

    def save(self, step: int, data_state: dict) -> None: ...

    def finish(self) -> None:
        """Wait for the checkpoints started; release what the executor holds."""

    def restart(self, err: BaseException) -> tuple[int, dict | None]:
        """After StudentLost: a new executor state from the latest checkpoint, as `start`."""


def sigterm_flag() -> threading.Event:
    """An event set by SIGTERM (pods are stopped that way): the loop saves and exits."""
    flag = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: flag.set())
    return flag


@dataclass
class Hooks:
    """What varies between the loop's uses besides its source and executor."""

    phase: str = "distill"  # the store's phase and the records' "phase"
    record: Callable[[int, dict, dict], dict] | None = None  # (step, metrics, figures)
    evaluate: Callable[[int], dict | None] | None = None  # held-out metrics at a step
    checkpoints: bool = True  # periodic and final checkpoints, on stop requests too
    progress: bool = True  # a progress bar or log lines; False: log lines via `report`
    report: Callable[[int, dict], None] | None = None
    profile: str | None = None  # where `train.profile` writes its trace; None: no trace
    after_dispatch: list[Callable[[int], None]] = field(default_factory=list)
    end_of_step: list[Callable[[int, int], None]] = field(default_factory=list)
    # (step, metrics) of each recorded step -> why the run must stop (`pipelines.divergence`)
    check: Callable[[int, dict], str | None] | None = None


class Loop:
    """`run()` trains from the executor's start to `steps` (default `train.steps`) and
    returns the summary; `store` (a MetricsStore) may be None."""

    def __init__(
        self,
        cfg,
        source: TeacherSource,
        executor: StudentExecutor,
        store,
        hooks: Hooks,
        steps: int | None = None,
    ):
        self.cfg, self.source, self.executor, self.store = cfg, source, executor, store
        self.hooks = hooks
        self.steps = cfg.train.steps if steps is None else steps
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        self.sigterm = sigterm_flag()

    def run(self) -> dict:
        t_start = time.perf_counter()
        start, data_state = first = self.executor.start()
        while True:
            try:
                summary = self._run(start, data_state)
                break
            except StudentLost as e:
                start, data_state = self.executor.restart(e.__cause__ or e)
        return {
            **summary,
            "wall_time_s": time.perf_counter() - t_start,
            "tokens": (summary["steps"] - first[0]) * self.tokens_per_step,
        }

    # -- one pass from a start point --------------------------------------------------------

    def _run(self, start: int, data_state: dict | None) -> dict:
        cfg, source, executor, hooks = self.cfg, self.source, self.executor, self.hooks
        steps, prefetch = self.steps, cfg.pipeline.prefetch
        source.start(data_state)
        if start:
            log.info("resuming from checkpoint step %d", start)
        self._set_phase(hooks.phase, steps)
        progress = Progress(steps, start, cfg.run.name) if hooks.progress else None
        state = _PassState(start, progress)
        try:
            if start == 0:
                state.last_eval = self._evaluate(0, progress)
            for _ in range(min(prefetch, steps - start)):
                source.submit()
            staged = None
            step = start
            for step in range(start + 1, steps + 1):
                item = source.pop()
                t_out = executor.hop(item.teacher_out) if staged is None else staged
                self._profile(step, None)
                handle = executor.step(step, item.batch, t_out)  # (1)
                state.pending.append((step, handle))
                self._profile(step, handle)
                staged = None
                if step < steps:
                    while source.in_flight() < min(prefetch, steps - step):  # (2)
                        source.submit()
                    if executor.hops:
                        staged = executor.hop(source.peek().teacher_out)  # (3)
                for fn in hooks.after_dispatch:
                    fn(step)
                self._read_metrics(state)  # (4)
                if state.failure is not None:  # no evaluation, no checkpoint of this state
                    break
                if step % cfg.train.eval_every == 0 and step != steps:
                    state.last_eval = self._evaluate(step, progress)
                if hooks.checkpoints and (
                    step % cfg.train.checkpoint_every == 0 or self._checkpoint_requested()
                ):
                    self._save(step, state)
                if self._stop_requested():
                    log.info("stop requested: saving a checkpoint at step %d and exiting", step)
                    state.stopped_early = step != steps
                    break
                for fn in hooks.end_of_step:
                    fn(step, len(state.pending))
            if state.failure is None:
                self._read_metrics(state, drain=True)
            failed = state.failure is not None
            if not (state.stopped_early or failed):
                state.last_eval = self._evaluate(step, progress)
            if hooks.checkpoints and state.last_saved != step and not failed:
                self._save(step, state)
            executor.finish()  # the checkpoints being written, complete on disk
            for fn in hooks.end_of_step:
                fn(step, 0)
        finally:
            if progress is not None:
                progress.close()
        return {
            "steps": step,
            "completed": not state.stopped_early and state.failure is None,
            "failure": state.failure,
            "final_eval": state.last_eval,
            "bytes_per_token": state.bytes_per_token,
        }

    # -- the hooks ------------------------------------------------------------------------

    def _read_metrics(self, state: _PassState, drain: bool = False) -> None:
        cfg, hooks = self.cfg, self.hooks
        while state.failure is None and len(state.pending) > (
            0 if drain else cfg.train.metrics_lag
        ):
            step, handle = state.pending.popleft()
            wanted = step % cfg.train.log_every == 0 or step == self.steps
            m = self.executor.read(handle, wanted)
            if not wanted:
                continue
            now = time.perf_counter()
            n = max(step - state.last_log_step, 1)
            figures = {
                "tokens_per_s": (step - state.last_log_step)
                * self.tokens_per_step
                / max(now - state.last_log_t, 1e-9),
                **self.source.figures(n, state.last_log_t, step),
                **self.executor.figures(n, state.last_log_t),
                "in_flight": self.source.in_flight(),
            }
            state.bytes_per_token = figures.get("bytes_per_token")
            record = hooks.record(step, m, figures)
            if self.store is not None:
                self.store.log(record)
            if state.progress is not None:
                state.progress.update(step, record)
            if hooks.report is not None:
                hooks.report(step, record)
            state.last_log_t, state.last_log_step = now, step
            if hooks.check is not None:
                state.failure = hooks.check(step, m)

    def _evaluate(self, step: int, progress: Progress | None) -> dict | None:
        if self.hooks.evaluate is None:
            return None
        self._set_phase("eval")
        m = self.hooks.evaluate(step)
        if m is not None:
            m = {"step": step, **m}
            self.store.log_eval(m)
            note = (
                f"eval step {step}: student {m['student_loss']:.4f} "
                f"teacher {m['teacher_loss']:.4f} kl {m['kl']:.4f} top1 {m['top1_agreement']:.3f}"
            )
            if "sample_teacher_nll" in m:
                note += f" sample nll {m['sample_teacher_nll']:.4f} len {m['sample_len']:.1f}"
            progress.note(note) if progress is not None else log.info("%s", note)
        self._set_phase(self.hooks.phase)
        return m

    def _save(self, step: int, state: _PassState) -> None:
        self._set_phase("checkpoint")
        written = self.executor.save(step, self.source.resume_point())
        if self.store is not None and written is not False:
            self.store.set_checkpoint(step, time.time())
        self._set_phase(self.hooks.phase)
        state.last_saved = step

    def _profile(self, step: int, handle: Any) -> None:
        """`train.profile: [first, n]`: a jax.profiler trace from before step `first` is
        dispatched until step first+n-1 has finished (the one place the loop waits)."""
        if self.hooks.profile is None or self.cfg.train.profile is None:
            return
        first, n = self.cfg.train.profile
        if handle is None and step == first:
            jax.profiler.start_trace(self.hooks.profile)
        elif handle is not None and step == first + n - 1:
            self.executor.read(handle, True)
            jax.profiler.stop_trace()
            log.info("profile: steps %d..%d traced to %s", first, step, self.hooks.profile)

    def _set_phase(self, phase: str, total_steps: int | None = None) -> None:
        if self.store is not None:
            self.store.set_phase(phase, total_steps=total_steps)

    def _checkpoint_requested(self) -> bool:
        return self.store is not None and self.store.take_checkpoint_request()

    def _stop_requested(self) -> bool:
        return self.sigterm.is_set() or (self.store is not None and self.store.stop_requested())


class _PassState:
    """The loop's bookkeeping during one pass."""

    def __init__(self, start: int, progress: Progress | None):
        self.pending: deque[tuple[int, Any]] = deque()  # (step, metrics handle), in order
        self.progress = progress
        self.last_eval: dict | None = None
        self.last_log_t, self.last_log_step = time.perf_counter(), start
        self.last_saved = start
        self.stopped_early = False
        self.failure: str | None = None  # why the run must stop (`Hooks.check`)
        self.bytes_per_token: float | None = None
