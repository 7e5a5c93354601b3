"""``metrics.jsonl`` read back: the follower behind ``distill dashboard OUTPUT_DIR``.

A ``Follower`` replays a run directory's ``metrics.jsonl`` (and ``summary.json``) into a
``metrics.MetricsStore``, incrementally, so a dashboard follows a run going on in another
process, on local disk or in a bucket; the store uses the same follower to pick up its own
history when a run resumes. The line format is described in ``metrics``; the vocabulary both
sides share (phases, series, JSON-safe values and strict JSON, redaction) lives here so
that imports run one way: ``metrics`` imports this module, never the reverse. Every JSON
distill writes (records, summaries, manifests, command output) is made by `dumps`."""

from __future__ import annotations

import copy
import json
import math
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from etils import epath

from distill import storage

PHASES = ("starting", "bootstrap", "distill", "eval", "checkpoint", "done", "failed")
SERIES = ("bootstrap", "distill", "eval")
# A key is secret when one of its words (split at "_", "-" and ".") is one of these:
# `server.token`, `api_key`, `access_token`; not `data.tokenizer`, a path worth seeing.
_SECRET_WORDS = frozenset({"token", "secret", "password", "key", "apikey", "passwd"})
_REDACTED = "***"
_REMOTE_POLL_S = 2.0  # a follower of a bucket's metrics.jsonl looks this often at most


def redact(tree: Any) -> Any:
    """A deep copy of a config tree with string values of secret-looking keys replaced."""
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            secret = not _SECRET_WORDS.isdisjoint(re.split(r"[_.\-]", str(k).lower()))
            out[str(k)] = _REDACTED if secret and isinstance(v, str) else redact(v)
        return out
    if isinstance(tree, list | tuple):
        return [redact(v) for v in tree]
    return copy.deepcopy(tree)


def to_plain(value: Any, *, finite: bool = True) -> Any:
    """JSON-safe plain Python: numpy/JAX scalars become int/float; with ``finite``,
    NaN and infinities become None (strict JSON, and what a browser's JSON.parse accepts)."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if (not finite or math.isfinite(value)) else None
    if isinstance(value, Mapping):
        return {str(k): to_plain(v, finite=finite) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v, finite=finite) for v in value]
    if hasattr(value, "model_dump"):  # a pydantic config section
        return to_plain(value.model_dump(mode="json"), finite=finite)
    if hasattr(value, "tolist"):  # numpy / JAX scalars and arrays
        return to_plain(value.tolist(), finite=finite)
    return str(value)


def dumps(value: Any, **kwargs: Any) -> str:
    """`value` as strict JSON (RFC 8259, what `jq` and browsers parse): through `to_plain`,
    so NaN and infinities are null; `json.dumps`'s keywords (`indent`, ...) pass through.
    Every JSON record distill writes is made here."""
    return json.dumps(to_plain(value), allow_nan=False, **kwargs)


class Follower:
    """Reads a run directory's ``metrics.jsonl`` into a store incrementally: the new complete
    lines on each sync, everything again if the file was replaced or truncated. On a bucket
    (where each sync costs requests) it looks at most every `_REMOTE_POLL_S` seconds.

    ``store`` is a ``metrics.MetricsStore``; the follower rebuilds its state in place,
    under the store's lock (the store calls ``sync`` before every read)."""

    def __init__(self, root: epath.Path) -> None:
        self.root = root
        self.path = root / "metrics.jsonl"
        self._lock = threading.Lock()
        self._offset = 0
        self._seen = False
        self._ident: int | None = None
        self.starts = 0
        self._phase_events = False
        self._summary_mtime: float | None = None
        self._poll_every = _REMOTE_POLL_S if storage.is_remote(root) else 0.0
        self._polled_at = -math.inf

    def sync(self, store) -> None:
        with self._lock:
            if time.monotonic() - self._polled_at < self._poll_every:
                return
            self._polled_at = time.monotonic()
            st = storage.stat(self.path)
            if st is not None:
                if self._seen and (st.ident != self._ident or st.size < self._offset):
                    self._reset(store)
                self._seen, self._ident = True, st.ident
                if st.size > self._offset:
                    self._read_new(store)
                with store._lock:  # progress as seen from here: the file's last change
                    store._progress_at = time.monotonic() - max(0.0, time.time() - st.mtime)
            self._sync_summary(store, st)

    def _reset(self, store) -> None:
        self._offset = self.starts = 0
        self._phase_events = False
        self._summary_mtime = None
        with store._lock:
            for s in SERIES:
                store._series[s].clear()
                store._steps[s].clear()
            store._log, store._seqs = [], []
            store._epoch += 1
            store._phase, store._step, store._latest, store._gauges = "starting", 0, {}, {}
            store._mesh = store._checkpoint = store._eval = store._failure = None

    def _read_new(self, store) -> None:
        data = storage.read(self.path, self._offset)
        end = data.rfind(b"\n") + 1  # the writer may be mid-line: leave the tail for later
        self._offset += end
        with store._lock:
            for raw in data[:end].splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and isinstance(line.get("step", 0), int):
                    self._apply(store, to_plain(line))

    def _apply(self, store, line: dict) -> None:
        event = line.get("event")
        if event is None:
            if "step" not in line:
                pass
            elif line.get("eval"):
                store._apply_eval(line)
            else:
                if not self._phase_events:  # a file without phase events: follow the records
                    store._phase = "bootstrap" if line.get("phase") == "bootstrap" else "distill"
                store._apply_record(line)
        elif event == "start":
            self.starts += 1
            if self.starts == 1 and isinstance(line.get("time"), float | int):
                store._started_at = float(line["time"])
            else:
                store._gauges["restarts"] = self.starts - 1
            store.run_name = str(line.get("run_name") or store.run_name)
            if line.get("total_steps"):
                store._run_total = int(line["total_steps"])
            store._failure, store._ended_at = None, None
            store._phase = "starting"
            store._apply_phase("starting", None)  # the distill counter and total again
        elif event == "phase" and line.get("phase") in PHASES:
            self._phase_events = True
            store._apply_phase(line["phase"], line.get("total_steps"))
        elif event == "mesh" and isinstance(line.get("layout"), dict):
            store._mesh = line["layout"]
        elif event == "checkpoint":
            store._checkpoint = {"step": int(line.get("step") or 0), "time": line.get("time")}
        elif event == "alpha_gate" and isinstance(line.get("alpha"), int | float):
            store._gate_event(
                {"step": line["step"], "alpha": line["alpha"], "reason": line.get("reason")}
            )
        elif event == "failed":
            self._phase_events = True
            store._phase, store._failure = "failed", str(line.get("reason"))
            store._ended_at = line.get("time")
            if isinstance(line.get("summary"), dict):
                store._summary = redact(line["summary"])
        elif event == "done":
            self._phase_events = True
            store._phase = "done"
            store._ended_at = line.get("time")
            if isinstance(line.get("summary"), dict):
                store._summary = redact(line["summary"])

    def _sync_summary(self, store, jsonl: storage.FileStat | None) -> None:
        """summary.json marks a finished run, unless metrics.jsonl grew well after it (the
        run was resumed)."""
        path = self.root / "summary.json"
        try:
            st = storage.stat(path)
            if st is None:
                return
            mtime = st.mtime
            if mtime != self._summary_mtime:
                summary = json.loads(storage.read(path).decode("utf-8"))
                self._summary_mtime = mtime
                if isinstance(summary, dict):
                    with store._lock:
                        store._summary = redact(to_plain(summary))
        except (OSError, ValueError):
            return
        resumed = jsonl is not None and jsonl.mtime > mtime + 1.0
        with store._lock:
            if store._summary is not None and store._phase != "failed" and not resumed:
                store._phase = "done"
