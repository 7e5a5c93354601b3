"""How long each mesh is busy, measured without ever blocking the training loop.

The loop hands each dispatched result (a teacher output, a student step's metrics) to a
watcher, whose thread waits for it to be ready and records when. A result's busy time is
ready(n) - max(ready(n-1), dispatched(n)): the time its devices spent on it, n-1 being the
result dispatched before it onto the same devices. Watchers given the same devices (the
two roles of `mesh.placement: colocated`) share one waiting thread, which takes their
results in dispatch order, the order the devices run them: a teacher forward queued behind
a student step counts from that step's end, not from its own dispatch, so each role's time
is its own and the two busy fractions share the devices' time rather than each claiming
all of it. The loop reads these figures later; they are never on its critical path.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterable

_WAITERS: dict[frozenset, _Waiter] = {}  # by device ids: the waiter of watchers alive
_WAITERS_LOCK = threading.Lock()


class _Waiter:
    """One thread waiting for a set of devices' results in dispatch order."""

    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        self._last_ready = 0.0
        self.users = 0
        self._thread = threading.Thread(target=self._run, name=f"ready-{name}", daemon=True)
        self._thread.start()

    def put(self, watcher: ReadyWatcher, value) -> None:
        self._q.put((watcher, time.perf_counter(), value))

    def _run(self) -> None:
        import jax

        while True:
            item = self._q.get()
            if item is None:
                return
            watcher, dispatched, value = item
            try:
                jax.block_until_ready(value)
            except Exception:  # a deleted or failed buffer: nothing to time
                continue
            ready = time.perf_counter()
            watcher._record(ready, ready - max(self._last_ready, dispatched))
            self._last_ready = ready

    def stop(self) -> None:
        self._q.put(None)


class ReadyWatcher:
    def __init__(self, name: str, window: int = 64, devices: Iterable | None = None):
        """`devices` (jax devices, e.g. a mesh's `devices.flat`): share the waiting thread
        of the other watchers alive on exactly these devices; None: a thread of its own."""
        self.name = name
        self._lock = threading.Lock()
        self._busy: deque[tuple[float, float]] = deque(maxlen=window)  # (ready_time, busy_s)
        self._key = None if devices is None else frozenset(int(d.id) for d in devices)
        with _WAITERS_LOCK:
            waiter = _WAITERS.get(self._key) if self._key is not None else None
            if waiter is None:
                waiter = _Waiter(name)
                if self._key is not None:
                    _WAITERS[self._key] = waiter
            waiter.users += 1
        self._waiter = waiter

    def watch(self, value) -> None:
        """Call right after dispatching `value` (any pytree of jax arrays)."""
        if self._waiter is not None:  # closed: nothing more is timed
            self._waiter.put(self, value)

    def _record(self, ready: float, busy_s: float) -> None:
        with self._lock:
            self._busy.append((ready, busy_s))

    def recent_ms(self, n: int) -> float:
        """Mean busy milliseconds of the last `n` finished results."""
        with self._lock:
            last = list(self._busy)[-n:]
        return 1e3 * sum(b for _, b in last) / len(last) if last else 0.0

    def busy_fraction(self, since: float) -> float:
        """Fraction of wall time since `since` this mesh was busy."""
        now = time.perf_counter()
        with self._lock:
            busy = sum(b for t, b in self._busy if t >= since)
        return min(1.0, busy / max(now - since, 1e-9))

    def close(self) -> None:
        """Idempotent; the shared thread stops with its last watcher."""
        with _WAITERS_LOCK:
            waiter, self._waiter = self._waiter, None
            if waiter is None:
                return
            waiter.users -= 1
            if waiter.users == 0:
                if _WAITERS.get(self._key) is waiter:
                    del _WAITERS[self._key]
                waiter.stop()
