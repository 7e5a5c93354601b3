"""How long each mesh is busy, measured without ever blocking the training loop.

The loop hands each dispatched result (a teacher output, a student step's metrics) to a
watcher thread per mesh, which waits for it to be ready and records when. A result's busy
time is ready(n) - max(ready(n-1), dispatched(n)): the time that mesh spent on it. The
loop reads these figures later; they are never on its critical path.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque


class ReadyWatcher:
    def __init__(self, name: str, window: int = 64):
        self.name = name
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._busy: deque[tuple[float, float]] = deque(maxlen=window)  # (ready_time, busy_s)
        self._last_ready = 0.0
        self._thread = threading.Thread(target=self._run, name=f"ready-{name}", daemon=True)
        self._thread.start()

    def watch(self, value) -> None:
        """Call right after dispatching `value` (any pytree of jax arrays)."""
        self._q.put((time.perf_counter(), value))

    def _run(self) -> None:
        import jax

        while True:
            item = self._q.get()
            if item is None:
                return
            dispatched, value = item
            try:
                jax.block_until_ready(value)
            except Exception:  # a deleted or failed buffer: nothing to time
                continue
            ready = time.perf_counter()
            with self._lock:
                self._busy.append((ready, ready - max(self._last_ready, dispatched)))
                self._last_ready = ready

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
        self._q.put(None)
