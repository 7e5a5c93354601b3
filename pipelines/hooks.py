"""What the loop does besides training, one hook each, with its own cadence.

A hook overrides the events it needs (see `Hook`); the caller composes the list a loop runs
(`pipelines.local.distill_hooks`; the teacher bootstrap takes fewer), and each event calls
the hooks in list order. A hook gets the loop (`pipelines.loop.Loop`) first: its spec,
source, executor and store, and `stop`/`fail`/`phase`/`note`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from pipelines.progress import Progress

if TYPE_CHECKING:
    from pipelines.loop import Loop

log = logging.getLogger("distill")


class Hook:
    """Every event a hook may handle; each is a no-op here.

    on_start(loop, step)             a pass begins with the state at `step` (0: fresh)
    before_step(loop, step)          before student step `step` is dispatched
    after_dispatch(loop, step, h)    after it, the source topped up and the next hop staged;
                                     `h` is the handle on its metrics
    on_metrics(loop, step, m, rec)   a logged step's metrics (host floats, `train.metrics_lag`
                                     steps late) and its record
    end_of_step(loop, step)          the step's work dispatched and its lagged metrics read
    on_end(loop, step)               after the last step's metrics, before the executor
                                     finishes (waits for its checkpoints)
    after_finish(loop, step)         after the executor finished
    close(loop)                      always, last (also when the pass raises)
    note(text) -> bool               show a line to the user; True: shown
    summary() -> dict                keys this hook adds to the run's summary
    """

    def on_start(self, loop: Loop, step: int) -> None: ...
    def before_step(self, loop: Loop, step: int) -> None: ...
    def after_dispatch(self, loop: Loop, step: int, handle: Any) -> None: ...
    def on_metrics(self, loop: Loop, step: int, metrics: dict, record: dict) -> None: ...
    def end_of_step(self, loop: Loop, step: int) -> None: ...
    def on_end(self, loop: Loop, step: int) -> None: ...
    def after_finish(self, loop: Loop, step: int) -> None: ...
    def close(self, loop: Loop) -> None: ...

    def note(self, text: str) -> bool:
        return False

    def summary(self) -> dict:
        return {}


class Every(Hook):
    """`fn(loop, step)` every `every` steps, at `event` ("end_of_step" or
    "after_dispatch"), as levanter's `add_hook(fn, every=n)`. Tests inject faults so."""

    def __init__(self, fn: Callable[[Loop, int], None], every: int = 1, event="end_of_step"):
        if event not in ("end_of_step", "after_dispatch"):
            raise ValueError(f"event: {event!r} is not end_of_step or after_dispatch")
        self.fn, self.every, self.event = fn, every, event

    def after_dispatch(self, loop: Loop, step: int, handle: Any) -> None:
        if self.event == "after_dispatch" and step % self.every == 0:
            self.fn(loop, step)

    def end_of_step(self, loop: Loop, step: int) -> None:
        if self.event == "end_of_step" and step % self.every == 0:
            self.fn(loop, step)


class Records(Hook):
    """Each logged step's record into the store (metrics.jsonl, the dashboard, sinks)."""

    def on_metrics(self, loop: Loop, step: int, metrics: dict, record: dict) -> None:
        loop.store.log(record)


class ProgressBar(Hook):
    """A progress bar on a terminal, log lines otherwise; evaluation notes go through it."""

    def __init__(self, name: str):
        self.name, self.bar = name, None

    def on_start(self, loop: Loop, step: int) -> None:
        self.bar = Progress(loop.spec.steps, step, self.name)

    def on_metrics(self, loop: Loop, step: int, metrics: dict, record: dict) -> None:
        self.bar.update(step, record)

    def note(self, text: str) -> bool:
        if self.bar is None:
            return False
        self.bar.note(text)
        return True

    def close(self, loop: Loop) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Report(Hook):
    """`fn(step, record)` for each logged step (the bootstrap's log lines)."""

    def __init__(self, fn: Callable[[int, dict], None]):
        self.fn = fn

    def on_metrics(self, loop: Loop, step: int, metrics: dict, record: dict) -> None:
        self.fn(step, record)


class Evaluate(Hook):
    """Held-out metrics (`evaluate(step)`, or None) at the start of a fresh run, every
    `every` steps and at the end of a pass that was not stopped early."""

    def __init__(self, evaluate: Callable[[int], dict | None], every: int):
        self.evaluate, self.every = evaluate, every
        self.last: dict | None = None

    def on_start(self, loop: Loop, step: int) -> None:
        self.last = None
        if step == 0:
            self._run(loop, 0)

    def end_of_step(self, loop: Loop, step: int) -> None:
        if step % self.every == 0 and step != loop.spec.steps:
            self._run(loop, step)

    def on_end(self, loop: Loop, step: int) -> None:
        if not loop.stopping:
            self._run(loop, step)

    def summary(self) -> dict:
        return {"final_eval": self.last}

    def _run(self, loop: Loop, step: int) -> None:
        with loop.phase("eval"):
            m = self.evaluate(step)
        if m is None:
            return
        self.last = m = {"step": step, **m}
        loop.store.log_eval(m)
        note = f"eval step {step}: student {m['student_loss']:.4f}"
        if "teacher_loss" in m:  # none from a teacher behind a server
            note += f" teacher {m['teacher_loss']:.4f}"
        if "kl" in m:  # one vocabulary: the two distributions compare token by token
            note += f" kl {m['kl']:.4f} top1 {m['top1_agreement']:.3f}"
        if "teacher_bpb" in m:
            note += f" bits/byte {m['student_bpb']:.4f} vs {m['teacher_bpb']:.4f}"
        elif "student_bpb" in m:
            note += f" bits/byte {m['student_bpb']:.4f}"
        if "aligned_fraction" in m:
            note += f" aligned {m['aligned_fraction']:.3f}"
        if "sample_teacher_nll" in m:
            note += f" sample nll {m['sample_teacher_nll']:.4f} len {m['sample_len']:.1f}"
        loop.note(note)


class Checkpoints(Hook):
    """The student's state every `every` steps and when the dashboard asks, and at the end
    of a pass (a stop request's too); never after a failure. A checkpoint records where
    the data resumes: before the oldest batch still in flight."""

    def __init__(self, every: int):
        self.every = every
        self.last_saved = 0

    def on_start(self, loop: Loop, step: int) -> None:
        self.last_saved = step

    def end_of_step(self, loop: Loop, step: int) -> None:
        requested = loop.store is not None and loop.store.take_checkpoint_request()
        if step % self.every == 0 or requested:
            self._save(loop, step)

    def on_end(self, loop: Loop, step: int) -> None:
        if self.last_saved != step and not loop.failure:
            self._save(loop, step)

    def _save(self, loop: Loop, step: int) -> None:
        """`executor.save` returns False when it wrote nothing (a non-finite state, or
        steps being skipped): the store then records no checkpoint."""
        with loop.phase("checkpoint"):
            written = loop.executor.save(step, loop.source.resume_point())
            if loop.store is not None and written is not False:
                loop.store.set_checkpoint(step, time.time())
        self.last_saved = step


class StopRequests(Hook):
    """Stop (saving a checkpoint) on SIGTERM, as pods are stopped, or the dashboard's
    stop request."""

    def __init__(self):
        self.sigterm = threading.Event()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.sigterm.set())

    def end_of_step(self, loop: Loop, step: int) -> None:
        if self.sigterm.is_set() or (loop.store is not None and loop.store.stop_requested()):
            log.info("stop requested: saving a checkpoint at step %d and exiting", step)
            loop.stop("stop requested")


class Status(Hook):
    """`update(step, queued)` after every step and once the executor finished (queued 0):
    what /api/status shows besides the records."""

    def __init__(self, update: Callable[[int, int], None]):
        self.update = update

    def end_of_step(self, loop: Loop, step: int) -> None:
        self.update(step, len(loop.pending))

    def after_finish(self, loop: Loop, step: int) -> None:
        self.update(step, 0)


class Profile(Hook):
    """`train.profile: [first, n]`: a jax.profiler trace to `path` from before step
    `first` is dispatched until step first+n-1 has finished (the one place a loop waits)."""

    def __init__(self, first: int, n: int, path: str):
        self.first, self.last, self.path = first, first + n - 1, path

    def before_step(self, loop: Loop, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.path)

    def after_dispatch(self, loop: Loop, step: int, handle: Any) -> None:
        if step == self.last:
            loop.executor.read(handle, True)
            jax.profiler.stop_trace()
            log.info("profile: steps %d..%d traced to %s", self.first, step, self.path)


class ReleaseHostMemory(Hook):
    """On CPU devices: give the system the pages the heap keeps from one-off work
    (`distill.allocator.release_freed_memory`): at the start (the teacher loaded, the
    student placed, the first evaluation done), after the first step (its programs
    compiled) and after each evaluation (every `every` steps), never between other steps,
    whose temporaries stay kept for reuse."""

    def __init__(self, every: int):
        self.every, self.first = every, 1

    def on_start(self, loop: Loop, step: int) -> None:
        self.first = step + 1
        self._release()

    def end_of_step(self, loop: Loop, step: int) -> None:
        if step == self.first or step % self.every == 0:
            self._release()

    def _release(self) -> None:
        from distill.allocator import release_freed_memory

        release_freed_memory()
