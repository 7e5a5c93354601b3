"""The run's metrics store: what the training loop reports, kept as plain Python data.

One writer (the training loop thread) and many readers (HTTP handlers, Prometheus scrapes).
Everything is converted to plain JSON-safe Python values on the way in, so readers never
touch device arrays and never wait on the accelerator; one lock guards all state and is
held only for dictionary work.

The store also appends every record to ``{output_dir}/metrics.jsonl`` (one JSON object per
line, flushed per line, append mode so a resumed run continues the file; on a ``gs://``
bucket, which cannot append, the file is rewritten whole every few seconds and at close:
see `distill.storage`). Three kinds of line share the file:

- training records: ``{"step", "loss", "kd_loss", "ce_loss", "lr", ..., "phase", "time"}``
  where ``phase`` is ``"bootstrap"`` (teacher pretraining) or ``"distill"``;
- eval records: ``{"step", "teacher_loss", "student_loss", "kl", "top1_agreement",
  "eval": true, "time"}``;
- events: ``{"event": "start" | "phase" | "mesh" | "checkpoint" | "alpha_gate" | "failed" | "done",
  "step", "time", ...}``, so that ``distill dashboard`` can rebuild the phase, mesh layout
  and last checkpoint of a run from the file alone (``distill.observability.metrics_log.Follower``).
  Readers of training records skip lines with an ``"event"`` or ``"eval"`` key.

History is kept per series (bootstrap, distill, eval), each strictly increasing in step: a
record whose step is not past the series' last step (a run resumed from an earlier
checkpoint) replaces the records from that step on, so a resumed run's history stays
continuous. Stored records carry a ``seq`` number in arrival order; a poller asks for
records after the last ``seq`` it saw (steps alone cannot be a cursor: bootstrap and
distill both count from 1, and metrics lag lets an eval record overtake training records).
``epoch`` counts rewinds, which remove records, so a poller knows to start over.
"""

from __future__ import annotations

import bisect
import copy
import threading
import time
from typing import Any

import yaml
from etils import epath

from distill import storage
from distill.errors import DistillError
from distill.observability.metrics_log import PHASES, SERIES, Follower, dumps, redact, to_plain

_ETA_WINDOW = 20  # records used for the steps-per-second estimate


class MetricsStore:
    """Thread-safe state of one run; see the module docstring for the file format."""

    def __init__(
        self,
        run_name: str,
        total_steps: int,
        config: dict,
        output_dir: str | None = None,
        stall_timeout_s: float = 300.0,
        sinks: list[Any] | tuple[Any, ...] = (),
    ) -> None:
        """``sinks`` (`tracking.Sink`: TensorBoard, W&B) get every training and eval record
        from `log` and `log_eval`, in the loop's thread, and are closed by `close`."""
        self._lock = threading.RLock()
        self._sinks = list(sinks)
        self.run_name = str(run_name)
        self.stall_timeout_s = float(stall_timeout_s)
        self._config = redact(to_plain(config or {}))
        self._run_total = int(total_steps)  # distill steps
        self._bootstrap_total = 0
        self._total = self._run_total  # of the current phase's counter
        self._phase = "starting"
        self._step = 0
        self._latest: dict[str, Any] = {}  # the latest training record
        self._gauges: dict[str, Any] = {}  # live values from update(), newer than _latest
        self._series: dict[str, list[dict]] = {s: [] for s in SERIES}
        self._steps: dict[str, list[int]] = {s: [] for s in SERIES}
        self._log: list[dict] = []  # every stored record in arrival order
        self._seqs: list[int] = []
        self._next_seq = 0
        self._epoch = 0
        self._mesh: dict | None = None
        self._checkpoint: dict | None = None
        self._gate: list[dict] = []  # `distill.alpha_gate`'s changes, oldest first
        self._eval: dict | None = None
        self._summary: dict | None = None
        self._failure: str | None = None
        self._started_at = time.time()
        self._ended_at: float | None = None  # set when the run is done or failed
        self._progress_at = time.monotonic()
        self._checkpoint_requested = False
        self._stop_requested = False
        self._file = None
        self._follow: Follower | None = None
        if output_dir is not None:
            storage.check(output_dir, "run.output_dir")
            root = epath.Path(output_dir)
            if storage.stat(root / "metrics.jsonl") is not None:
                self._load_previous(root)
            self._file = storage.open_log(root / "metrics.jsonl")  # lives with the store
            self._write({"event": "start", "run_name": self.run_name, "total_steps": self._total})

    # -- the loop's side ------------------------------------------------------------------

    def set_phase(self, phase: str, total_steps: int | None = None) -> None:
        """Enter ``phase``. ``bootstrap`` and ``distill`` count steps separately; ``total_steps``
        sets the total of the counter in use (the teacher pretrain steps for bootstrap)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        with self._lock:
            self._apply_phase(phase, total_steps)
            self._progress_at = time.monotonic()
            self._write({"event": "phase", "phase": phase, "total_steps": self._total})

    def set_mesh(self, layout: dict) -> None:
        with self._lock:
            self._mesh = to_plain(layout)
            self._write({"event": "mesh", "layout": self._mesh})

    def log(self, record: dict) -> None:
        """One training record (``step``, ``loss``, ``kd_loss``, ... see module docstring)."""
        rec = dict(record)
        rec.setdefault("time", time.time())
        with self._lock:
            rec.setdefault("step", self._step)
            rec.setdefault("phase", self._family())
            self._write(rec)
            self._apply_record(to_plain(rec))
            self._progress_at = time.monotonic()
            if self._sinks:
                plain = to_plain(rec, finite=False)  # a NaN loss is worth a sink's plot
                for sink in self._sinks:
                    sink.record(plain)

    def log_eval(self, record: dict) -> None:
        """``{"step", "teacher_loss", "student_loss", "kl", "top1_agreement"}``."""
        rec = {**record, "eval": True}
        rec.setdefault("time", time.time())
        with self._lock:
            rec.setdefault("step", self._step)
            self._write(rec)
            self._apply_eval(to_plain(rec))
            self._progress_at = time.monotonic()
            if self._sinks:
                plain = to_plain(rec, finite=False)
                for sink in self._sinks:
                    sink.eval(plain)

    def set_checkpoint(self, step: int, time: float) -> None:  # noqa: A002 (the contract's name)
        with self._lock:
            self._checkpoint = {"step": int(step), "time": float(time)}
            self._write({"event": "checkpoint", **self._checkpoint})

    def alpha_gate(self, step: int, alpha: float, reason: str) -> None:
        """`distill.alpha_gate` changed the divergence's weight to `alpha` from `step` on
        (0: the teacher is off): an event in metrics.jsonl and in the status."""
        with self._lock:
            event = {"step": int(step), "alpha": float(alpha), "reason": str(reason)}
            self._gate_event(event)
            self._write({"event": "alpha_gate", **event})

    def update(self, **gauges: Any) -> None:
        """Live gauges (``in_flight``, ``bytes_per_token``, ``teacher_busy``, ``step``,
        ``actors``, ``restarts``, ...); also a heartbeat. Not written to metrics.jsonl."""
        plain = to_plain(gauges)
        with self._lock:
            step = plain.pop("step", None)
            if step is not None:
                self._step = int(step)
            self._gauges.update(plain)
            self._progress_at = time.monotonic()

    def heartbeat(self) -> None:
        with self._lock:
            self._progress_at = time.monotonic()

    def fail(self, reason: str, summary: dict | None = None) -> None:
        """The run failed (`reason`, one line; /healthz answers 503 with it); `summary`:
        the summary of a run that stopped cleanly (a diverged one)."""
        with self._lock:
            self._phase, self._failure = "failed", str(reason)
            self._ended_at = time.time()
            line = {"event": "failed", "reason": self._failure}
            if summary is not None:
                self._summary = line["summary"] = redact(to_plain(summary))
            self._write(line)

    def finish(self, summary: dict) -> None:
        with self._lock:
            self._phase = "done"
            self._ended_at = time.time()
            self._summary = redact(to_plain(summary or {}))
            self._write({"event": "done", "summary": self._summary})

    def close(self) -> None:
        """Close metrics.jsonl, writing what a bucket has not got yet, then the sinks, told
        whether the run failed (the store stays readable)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            sinks, self._sinks = self._sinks, []
            failed = self._phase == "failed"
        for sink in sinks:  # outside the lock: a sink may upload files or finish a W&B run
            sink.close(failed=failed)

    # -- control: set by HTTP handlers, polled by the loop -----------------------------------

    def request_checkpoint(self) -> None:
        with self._lock:
            self._checkpoint_requested = True

    def request_stop(self) -> None:
        with self._lock:
            self._stop_requested = True

    def take_checkpoint_request(self) -> bool:
        """True once per request (the caller then saves), False until the next one."""
        with self._lock:
            requested, self._checkpoint_requested = self._checkpoint_requested, False
            return requested

    def stop_requested(self) -> bool:
        with self._lock:
            return self._stop_requested

    # -- the readers' side ----------------------------------------------------------------

    @property
    def config(self) -> dict:
        """The resolved config, secrets redacted."""
        self._refresh()
        with self._lock:
            return copy.deepcopy(self._config)

    def status(self) -> dict:
        self._refresh()
        with self._lock:
            ok, reason = self._health()
            latest = {**self._latest, **self._gauges}
            step, total = self._step, self._total
            return {
                "run_name": self.run_name,
                "phase": self._phase,
                "step": step,
                "total_steps": total,
                "progress": min(1.0, step / total) if total > 0 else None,
                "eta_s": self._eta(),
                "elapsed_s": (self._ended_at or time.time()) - self._started_at,
                **{k: latest.get(k) for k in _STATUS_FIGURES},
                "bottleneck": _bottleneck(latest),
                "mesh": copy.deepcopy(self._mesh),
                "last_checkpoint": copy.deepcopy(self._checkpoint),
                "alpha_gate": copy.deepcopy(self._gate),
                "latest_eval": copy.deepcopy(self._eval),
                "actors": copy.deepcopy(self._gauges.get("actors")),
                "restarts": self._gauges.get("restarts"),
                "summary": copy.deepcopy(self._summary),
                "failure": self._failure,
                "healthy": ok,
                "health_reason": reason,
                "epoch": self._epoch,
                "time": time.time(),
            }

    def history(self, since: int = -1) -> list[dict]:
        """Training and eval records with ``step > since``, in arrival order."""
        return self.history_page(since=since)["records"]

    def history_page(self, since: int = -1, after: int = -1) -> dict:
        """``{"epoch", "next", "records"}``: records with ``step > since`` and ``seq > after``;
        poll again with ``after=next``, and from scratch when ``epoch`` changed. The record
        dicts are never mutated once stored; callers must not mutate them either."""
        self._refresh()
        with self._lock:
            i = bisect.bisect_right(self._seqs, after)
            records = [r for r in self._log[i:] if r["step"] > since]
            return {"epoch": self._epoch, "next": self._next_seq - 1, "records": records}

    def health(self) -> tuple[bool, str]:
        """(ok, reason): not ok once failed, or when nothing progressed for the stall
        timeout while the run is not done."""
        self._refresh()
        with self._lock:
            return self._health()

    # -- rebuilding from a run directory ---------------------------------------------------

    @classmethod
    def from_run_dir(cls, output_dir: str) -> MetricsStore:
        """A read-only store rebuilt from ``metrics.jsonl`` (+ ``summary.json``,
        ``config.yaml``) that re-reads the file whenever it changes, so it also follows a
        run going on in another process; ``output_dir`` may be a ``gs://`` URI. Raises
        DistillError if the directory is missing."""
        storage.check(output_dir, "OUTPUT_DIR")
        root = epath.Path(output_dir)
        if not root.is_dir():
            raise DistillError(f"run directory not found: {root}")
        config: dict = {}
        try:
            loaded = yaml.safe_load((root / "config.yaml").read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except (OSError, yaml.YAMLError):
            pass

        def section(name: str) -> dict:
            value = config.get(name)
            return value if isinstance(value, dict) else {}

        store = cls(
            run_name=section("run").get("name") or _dir_name(root),
            total_steps=int(section("train").get("steps") or 0),
            config=config,
            stall_timeout_s=float(section("server").get("stall_timeout_s") or 300.0),
        )
        store._follow = Follower(root)
        store._refresh()
        return store

    def _load_previous(self, root: epath.Path) -> None:
        """A resumed run: start from the history already in metrics.jsonl, so the live
        dashboard shows one continuous run (the records it repeats will replace these)."""
        name, total = self.run_name, self._run_total
        follower = Follower(root)
        follower.sync(self)
        with self._lock:
            self.run_name, self._run_total = name, total
            self._phase, self._failure, self._summary = "starting", None, None
            self._apply_phase("starting", None)
            self._progress_at = time.monotonic()
            if follower.starts:
                self._gauges["restarts"] = follower.starts

    def _refresh(self) -> None:
        if self._follow is not None:
            self._follow.sync(self)

    # -- internals (called with the lock held) ---------------------------------------------

    def _write(self, line: dict) -> None:
        if self._file is None:
            return
        line.setdefault("step", self._step)
        line.setdefault("time", time.time())
        self._file.write(dumps(line) + "\n")
        self._file.flush()

    def _gate_event(self, event: dict) -> None:
        self._gate = [*self._gate, event][-_GATE_EVENTS:]

    def _family(self) -> str:
        """Which step counter is in use: the teacher bootstrap's or the distillation's."""
        return "bootstrap" if self._phase == "bootstrap" else "distill"

    def _apply_phase(self, phase: str, total_steps: int | None) -> None:
        family = phase if phase in ("bootstrap", "distill") else self._family()
        if family != self._family():
            steps = self._steps[family]
            self._step = steps[-1] if steps else 0
        if total_steps is not None:
            if family == "bootstrap":
                self._bootstrap_total = int(total_steps)
            else:
                self._run_total = int(total_steps)
        self._total = self._bootstrap_total if family == "bootstrap" else self._run_total
        self._phase = phase

    def _apply_record(self, rec: dict) -> None:
        series = "bootstrap" if rec.get("phase") == "bootstrap" else "distill"
        rec["phase"] = series
        self._insert(series, rec)
        if series == self._family():
            self._step = rec["step"]
        self._latest = rec
        for k in rec:
            self._gauges.pop(k, None)  # a fresher record supersedes an older gauge

    def _apply_eval(self, rec: dict) -> None:
        self._insert("eval", rec)
        self._eval = rec

    def _insert(self, series: str, rec: dict) -> None:
        rec["step"] = int(rec.get("step") or 0)
        steps, recs = self._steps[series], self._series[series]
        if steps and rec["step"] <= steps[-1]:  # a resumed run repeats steps: rewind
            i = bisect.bisect_left(steps, rec["step"])
            gone = {id(r) for r in recs[i:]}
            del steps[i:], recs[i:]
            self._log = [r for r in self._log if id(r) not in gone]
            self._seqs = [r["seq"] for r in self._log]
            self._epoch += 1
        rec["seq"] = self._next_seq
        self._next_seq += 1
        steps.append(rec["step"])
        recs.append(rec)
        self._log.append(rec)
        self._seqs.append(rec["seq"])

    def _health(self) -> tuple[bool, str]:
        if self._phase == "failed":
            return False, f"run failed: {self._failure}"
        if self._phase == "done":
            return True, "done"
        idle = time.monotonic() - self._progress_at
        if idle > self.stall_timeout_s:
            return False, (
                f"stalled: no progress for {idle:.0f}s in phase {self._phase} "
                f"(stall timeout {self.stall_timeout_s:g}s)"
            )
        return True, "ok"

    def _eta(self) -> float | None:
        if self._phase in ("done", "failed"):
            return 0.0 if self._phase == "done" else None
        recs = self._series[self._family()][-_ETA_WINDOW:]
        if len(recs) < 2 or self._total <= 0:
            return None
        dt = (recs[-1].get("time") or 0) - (recs[0].get("time") or 0)
        ds = recs[-1]["step"] - recs[0]["step"]
        if dt <= 0 or ds <= 0:
            return None
        return max(0.0, (self._total - self._step) * dt / ds)


def _dir_name(root: epath.Path) -> str:
    return root.name if storage.is_remote(root) else root.resolve().name


def _bottleneck(latest: dict) -> str | None:
    """The side that bounds throughput: the mesh (or actor role) busier per unit of time."""
    t, s = latest.get("teacher_busy"), latest.get("student_busy")
    if not isinstance(t, (int, float)) or not isinstance(s, (int, float)):
        return None
    return "teacher" if t > s else "student"


_GATE_EVENTS = 20  # the alpha gate's latest changes the status lists

_STATUS_FIGURES = (
    "loss",
    "kd_loss",
    "kd_loss_by_teacher",
    "ce_loss",
    "lr",
    "alpha",
    "teacher_off_steps",
    "tokens_per_s",
    "teacher_ms",
    "teacher_wait_s",
    "student_ms",
    "teacher_busy",
    "student_busy",
    "in_flight",
    "bytes_per_token",
    "on_policy",
    "generate_ms",
    "gen_tokens_per_s",
    "staleness",
    "expert_load",
    "expert_load_max_mean",
    "expert_dropped",
)
