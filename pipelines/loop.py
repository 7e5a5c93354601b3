"""The one training loop: a teacher source feeds a student executor; hooks do the rest.

Every way of training is this loop. A **teacher source** (`pipelines.sources`: online on
the inference mesh over `teacher.online`, the offline cache, none for the CE bootstrap;
`pipelines.ray.mode`: a pool of Ray teacher actors) reads batches in data order and starts
their teacher work; a **student executor** (`student.executor`: the jitted step on the
training mesh; `pipelines.ray.mode`: the Ray student group) trains on them. Everything
else (evaluation, checkpoints, metric records, progress, status, stop requests, profiling,
fault injection in tests) is a hook (`pipelines.hooks`) with its own cadence, composed by
the caller.

Step n, in dispatch order:
  1. pop the oldest in-flight item and dispatch student step n on it (its teacher output
     was moved to the training mesh during step n-1);
  2. top the source up to `prefetch` items in flight (Grain fetch, dispatch of the
     teacher's work), never past the last step's batch;
  3. move the next item's teacher output to the training mesh (the hop), which may wait
     for the teacher, so it comes after step 1: the training mesh is busy meanwhile (a
     source may remake that item before it is popped, as the on-policy source does when
     the `distill.alpha_gate` changes: its output is then moved at step n+1);
  4. hooks' `after_dispatch`;
  5. read step n-lag's metrics, long done, on the log cadence: the loop never waits on the
     current step; hooks' `on_metrics` get them;
  6. hooks' `end_of_step` (evaluation, checkpoints, stop requests, status, in list order).

A checkpoint records the data state before the oldest in-flight item: where a resume
restarts, so nothing in flight is lost or trained on twice.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

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
        """The oldest in-flight item, once its teacher work can be handed on: the object
        `peek` gave, unless the source remade the item since (the loop, which moved the
        peeked item's output ahead, tells the two apart by identity and moves a remade
        one's again)."""

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

    def save(self, step: int, data_state: dict) -> bool | None:
        """Start writing a checkpoint; False when none is written (a non-finite state)."""

    def finish(self) -> None:
        """Wait for the checkpoints started; release what the executor holds."""

    def restart(self, err: BaseException) -> tuple[int, dict | None]:
        """After StudentLost: a new executor state from the latest checkpoint, as `start`."""


class Store(Protocol):
    """What the loop and its hooks tell the run's metrics store (`MetricsStore`)."""

    def set_phase(self, phase: str, total_steps: int | None = None) -> None: ...

    def log(self, record: dict) -> None: ...

    def log_eval(self, record: dict) -> None: ...

    def set_checkpoint(self, step: int, at: float) -> None: ...

    def take_checkpoint_request(self) -> bool: ...

    def stop_requested(self) -> bool: ...

    def update(self, **fields: Any) -> None: ...


Record = Callable[[int, dict, dict], dict]  # (step, metrics, figures) -> the record logged


@dataclass(frozen=True)
class LoopSpec:
    """What the loop itself needs: how far it goes, how much is in flight, when it reads."""

    steps: int  # the last step
    prefetch: int  # teacher outputs in flight at most
    metrics_lag: int  # step n reads step n-lag's metrics
    log_every: int  # steps between metric reads (and records)
    tokens_per_step: int
    phase: str = "distill"  # the store's phase and the records' "phase"

    @classmethod
    def of(cls, cfg, steps: int | None = None, phase: str = "distill") -> LoopSpec:
        """The spec of a run's config; `steps` overrides `train.steps` (the bootstrap)."""
        t = cfg.train
        return cls(
            steps=t.steps if steps is None else steps,
            prefetch=cfg.pipeline.prefetch,
            metrics_lag=t.metrics_lag,
            log_every=t.log_every,
            tokens_per_step=t.batch_size * t.seq_len,
            phase=phase,
        )


class Loop:
    """`run()` trains from the executor's start to `spec.steps` and returns the summary.

    `hooks` run in list order at each event (see `pipelines.hooks.Hook`); `record` names a
    step's metrics and figures for the hooks that log them; `store` may be None."""

    def __init__(
        self,
        spec: LoopSpec,
        source: TeacherSource,
        executor: StudentExecutor,
        hooks: Sequence[Any] = (),
        *,
        record: Record,
        store: Store | None = None,
    ):
        self.spec, self.source, self.executor = spec, source, executor
        self.hooks, self.record, self.store = list(hooks), record, store
        self.pending: deque[tuple[int, Any]] = deque()  # (step, metrics handle), in order
        self.stopping: str | None = None  # why the pass stops before its last step
        self.failure: str | None = None  # why the run failed (no final eval or checkpoint)
        self.bytes_per_token: float | None = None

    # -- what hooks call ------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """End the pass after this step's hooks, as a stop request does (the final
        checkpoint is still written)."""
        self.stopping = self.stopping or reason

    def fail(self, reason: str) -> None:
        """End the pass now (a hook's `on_metrics`: no more metrics read, no `end_of_step`)
        with no final evaluation or checkpoint, once the checkpoints being written are
        complete; the summary says `completed: false` and `failure: reason`."""
        self.failure = self.failure or reason
        self.stop(reason)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The store shows `name` while the block runs, then the loop's phase again."""
        self._set_phase(name)
        try:
            yield
        finally:
            self._set_phase(self.spec.phase)

    def note(self, text: str) -> None:
        """A line for the user: through a hook that shows progress, else the log."""
        if not any(getattr(h, "note", None) and h.note(text) for h in self.hooks):
            log.info("%s", text)

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> dict:
        t_start = time.perf_counter()
        start, data_state = first = self.executor.start()
        while True:
            try:
                summary = self._run(start, data_state)
                break
            except StudentLost as e:
                start, data_state = self.executor.restart(e.__cause__ or e)
        summary.update(
            wall_time_s=time.perf_counter() - t_start,
            tokens=(summary["steps"] - first[0]) * self.spec.tokens_per_step,
        )
        return summary

    def _run(self, start: int, data_state: dict | None) -> dict:
        spec, source, executor = self.spec, self.source, self.executor
        source.start(data_state)
        if start:
            log.info("resuming from checkpoint step %d", start)
        self._set_phase(spec.phase, spec.steps)
        self.pending.clear()
        self.stopping = self.failure = None
        self._last_log = (time.perf_counter(), start)
        try:
            self._emit("on_start", start)
            for _ in range(min(spec.prefetch, spec.steps - start)):
                source.submit()
            staged = None
            step = start
            for step in range(start + 1, spec.steps + 1):
                item = source.pop()
                if staged is None or staged[0] is not item:  # none, or the source remade it
                    t_out = executor.hop(item.teacher_out)
                else:
                    t_out = staged[1]
                self._emit("before_step", step)
                handle = executor.step(step, item.batch, t_out)  # (1)
                self.pending.append((step, handle))
                staged = None
                if step < spec.steps:
                    while source.in_flight() < min(spec.prefetch, spec.steps - step):  # (2)
                        source.submit()
                    if executor.hops:
                        head = source.peek()
                        staged = (head, executor.hop(head.teacher_out))  # (3)
                self._emit("after_dispatch", step, handle)  # (4)
                self._read_metrics(step)  # (5)
                if self.failure:  # nothing more of this state: no evaluation, no checkpoint
                    break
                self._emit("end_of_step", step)  # (6)
                if self.stopping:
                    break
            if self.stopping and step == spec.steps and not self.failure:
                self.stopping = None  # a stop asked for at the last step: the run is complete
            self._read_metrics(step, drain=True)
            self._emit("on_end", step)
            executor.finish()
            self._emit("after_finish", step)
        finally:
            self._emit("close")
        summary = {
            "steps": step,
            "completed": self.stopping is None,
            "final_eval": None,
            "bytes_per_token": self.bytes_per_token,
        }
        for hook in self.hooks:
            summary.update(getattr(hook, "summary", dict)())
        summary["failure"] = self.failure
        return summary

    def _emit(self, event: str, *args) -> None:
        for hook in self.hooks:
            fn = getattr(hook, event, None)
            if fn is not None:
                fn(self, *args)

    def _read_metrics(self, step: int, drain: bool = False) -> None:
        """Read the pending steps' metrics up to `spec.metrics_lag` behind `step` (all of
        them when draining); a step on the log cadence (or the last) goes to the hooks."""
        spec = self.spec
        while not self.failure and len(self.pending) > (0 if drain else spec.metrics_lag):
            done, handle = self.pending.popleft()
            wanted = done % spec.log_every == 0 or done == spec.steps
            m = self.executor.read(handle, wanted)
            if not wanted:
                continue
            now = time.perf_counter()
            last_t, last_step = self._last_log
            n = max(done - last_step, 1)
            figures = {
                "tokens_per_s": (done - last_step) * spec.tokens_per_step / max(now - last_t, 1e-9),
                **self.source.figures(n, last_t, done),
                **self.executor.figures(n, last_t),
                "in_flight": self.source.in_flight(),
            }
            self.bytes_per_token = figures.get("bytes_per_token")
            self._emit("on_metrics", done, m, self.record(done, m, figures))
            self._last_log = (now, done)

    def _set_phase(self, phase: str, total_steps: int | None = None) -> None:
        if self.store is not None:
            self.store.set_phase(phase, total_steps=total_steps)
