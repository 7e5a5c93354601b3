"""Where a run's metrics go besides the store: TensorBoard event files and Weights & Biases.

`MetricsStore` hands each training record to every sink's ``record(rec)``, each eval record
to ``eval(rec)``, and calls ``close()`` when the run ends; `metric_sinks` builds the sinks a
config asks for. Those calls come from the training loop's thread, so a sink only queues
the record: a daemon thread per sink writes what is queued every few seconds and at close,
and a failure there is logged once and never ends the run. A process killed without
closing loses what was queued since the last write.

Every numeric field of a record but its step and time is a scalar named ``FAMILY/FIELD``:
``train/*`` (distillation records), ``bootstrap/*`` (the teacher bootstrap), ``eval/*``.

TensorBoard (``run.tensorboard``, on by default; the ``tensorboard`` package's own event
writer, no TensorFlow): ``<run.output_dir>/tensorboard/distill/`` holds ``train/*`` and
``eval/*``, ``tensorboard/bootstrap/`` the ``bootstrap/*`` scalars; two TensorBoard runs,
since the two count steps separately. Each process writes its own event file, so a resumed
run adds one, which starts with a session start at the lowest step of its first write:
TensorBoard then drops the earlier files' events from that step on (the steps the resumed
run repeats), as the store's own history does. On a ``gs://`` output_dir the event files
are written to a local temporary directory and copied into the bucket
(`distill.storage.upload_dir`) at most every `UPLOAD_S` seconds and at close.

Weights & Biases (``wandb.enabled``; ``pip install 'distill[wandb]'``, imported only then):
the same scalars, each family plotted against its own step metric (``train/step``,
``eval/step``, ``bootstrap/step``).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from distill import storage
from distill.config import Config
from distill.errors import DistillError
from distill.observability.metrics import redact

log = logging.getLogger("distill")

FLUSH_S = 5.0  # a sink writes what it queued at most this long ago (and at close)
UPLOAD_S = 30.0  # event files are copied to a bucket at most this often (and at close)
FAMILIES = ("train", "bootstrap", "eval")
_NOT_SCALARS = frozenset({"step", "time", "seq"})


class Sink(Protocol):
    """What `MetricsStore` feeds: called from the loop's thread, so never blocking."""

    def record(self, rec: Mapping[str, Any]) -> None: ...

    def eval(self, rec: Mapping[str, Any]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


class Point(NamedTuple):
    """One record as scalars: ``values`` maps ``family/field`` to a float."""

    family: str
    step: int
    values: dict[str, float]
    time: float


def to_point(rec: Mapping[str, Any], *, is_eval: bool = False) -> Point:
    """A store record as scalars (see the module docstring for the names)."""
    phase = "bootstrap" if rec.get("phase") == "bootstrap" else "train"
    family = "eval" if is_eval else phase
    values = {
        f"{family}/{k}": float(v)
        for k, v in rec.items()
        if k not in _NOT_SCALARS and isinstance(v, int | float) and not isinstance(v, bool)
    }
    stamp = rec.get("time")
    return Point(family, int(rec.get("step") or 0), values, float(stamp or time.time()))


class _Queued:
    """A sink that writes on its own daemon thread: `_write(points)` every `interval_s`
    seconds when there is something new, then `_finish(failed)` at close."""

    def __init__(self, name: str, interval_s: float) -> None:
        self.name = name
        self._queue: deque[tuple[Mapping[str, Any], bool]] = deque()  # appends are atomic
        self._interval = interval_s
        self._closing = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._loop, name=f"distill-{name}", daemon=True)
        self._thread.start()

    def record(self, rec: Mapping[str, Any]) -> None:
        if not self._closing.is_set():
            self._queue.append((rec, False))

    def eval(self, rec: Mapping[str, Any]) -> None:
        if not self._closing.is_set():
            self._queue.append((rec, True))

    def close(self, failed: bool = False) -> None:
        """Write the rest and release what the sink holds (`failed`: the run ended in an
        error); later calls do nothing."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join()
        self._drain()
        self._guard(self._finish, failed)

    def _loop(self) -> None:
        while not self._closing.wait(self._interval):
            self._drain()

    def _drain(self) -> None:
        points = []
        while self._queue:
            rec, is_eval = self._queue.popleft()
            point = to_point(rec, is_eval=is_eval)
            if point.values:
                points.append(point)
        if points:
            self._guard(self._write, points)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 (metrics going astray must not end the run)
            if not self._warned:
                log.warning(
                    "%s: %s: %s; its metrics may be incomplete", self.name, type(e).__name__, e
                )
            self._warned = True

    def _write(self, points: list[Point]) -> None:
        raise NotImplementedError

    def _finish(self, failed: bool) -> None:
        """Flush and close what the sink writes to."""


class TensorBoardSink(_Queued):
    """Event files under ``logdir`` (local or ``gs://``); see the module docstring."""

    def __init__(self, logdir: str, interval_s: float = FLUSH_S) -> None:
        self.logdir = str(logdir).rstrip("/")
        self._remote = storage.is_remote(self.logdir)
        self._local = tempfile.mkdtemp(prefix="distill-tb-") if self._remote else self.logdir
        self._writers: dict[str, Any] = {}  # TensorBoard run name -> EventFileWriter
        self._uploaded_at = -math.inf
        super().__init__("tensorboard", interval_s)

    def _write(self, points: list[Point]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        for run in {_tb_run(p.family) for p in points}:
            if run not in self._writers:
                self._open(run, min(p.step for p in points if _tb_run(p.family) == run))
        for p in points:
            values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in p.values.items()]
            event = event_pb2.Event(
                wall_time=p.time, step=p.step, summary=summary_pb2.Summary(value=values)
            )
            self._writers[_tb_run(p.family)].add_event(event)
        for writer in self._writers.values():
            writer.flush()
        if self._remote and time.monotonic() - self._uploaded_at >= UPLOAD_S:
            self._upload()

    def _open(self, run: str, first_step: int) -> None:
        """A new event file for this process, starting with the session start that hides
        earlier processes' events from ``first_step`` on."""
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        writer = EventFileWriter(os.path.join(self._local, run), max_queue_size=100)
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        writer.add_event(event_pb2.Event(wall_time=time.time(), step=first_step, session_log=start))
        self._writers[run] = writer

    def _upload(self) -> None:
        self._uploaded_at = time.monotonic()
        storage.upload_dir(self._local, self.logdir)

    def _finish(self, failed: bool) -> None:
        for writer in self._writers.values():
            writer.close()
        if self._remote:
            try:
                if self._writers:
                    self._upload()
            finally:
                shutil.rmtree(self._local, ignore_errors=True)


def _tb_run(family: str) -> str:
    return "bootstrap" if family == "bootstrap" else "distill"


class WandbSink(_Queued):
    """Logs to a started W&B run (see `start_wandb`), each family against its own step."""

    def __init__(self, run: Any, interval_s: float = 1.0) -> None:
        self.run = run
        for family in FAMILIES:
            run.define_metric(f"{family}/step")
            run.define_metric(f"{family}/*", step_metric=f"{family}/step")
        super().__init__("wandb", interval_s)

    def _write(self, points: list[Point]) -> None:
        for p in points:
            self.run.log({**p.values, f"{p.family}/step": p.step})

    def _finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a failed run shows as failed in W&B


def start_wandb(cfg: Config) -> WandbSink:
    """A W&B run for ``cfg`` (its config, secrets redacted); DistillError if wandb is not
    installed or the run cannot start (no API key online, an unknown entity, ...)."""
    try:
        import wandb
    except ImportError:
        raise DistillError(
            "wandb.enabled: W&B logging needs the wandb package: pip install 'distill[wandb]'"
        ) from None
    w, out = cfg.wandb, cfg.run.output_dir
    local_dir = None if storage.is_remote(out) else out
    if local_dir is not None:
        os.makedirs(local_dir, exist_ok=True)
    try:
        run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or cfg.run.name,
            group=w.group,
            tags=w.tags or None,
            mode=w.mode,
            id=w.id,
            resume="allow" if w.id else None,
            dir=local_dir,
            config=redact(cfg.model_dump(mode="json")),
        )
    except Exception as e:  # noqa: BLE001 (wandb's errors have no common base)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DistillError(f"wandb: cannot start the W&B run: {first}") from None
    return WandbSink(run)


def metric_sinks(cfg: Config) -> list[Sink]:
    """The sinks ``cfg`` asks for: W&B (``wandb.enabled``) and TensorBoard
    (``run.tensorboard``, under ``<run.output_dir>/tensorboard``)."""
    sinks: list[Sink] = []
    if cfg.wandb.enabled:
        sinks.append(start_wandb(cfg))  # first: it is the one that can fail
    if cfg.run.tensorboard:
        sinks.append(TensorBoardSink(f"{cfg.run.output_dir.rstrip('/')}/tensorboard"))
    return sinks
