"""Concurrent requests gathered into one teacher forward.

A request is a list of rows (`pipelines.serve.scorer.Row`) and a future. One worker thread
takes the oldest request, then whatever else arrives within `wait_s` or until the batch's
rows are full, and runs them as one batch; a request larger than a batch runs over several.
The HTTP handlers wait on their futures, so the event loop keeps accepting meanwhile.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

log = logging.getLogger("distill")


@dataclass
class _Request:
    rows: list
    targets: bool  # whether the next tokens' log-probs are wanted (the JSON APIs)
    temperature: float  # of the top-k log-probs; a batch has one
    future: Future = field(default_factory=Future)
    results: list = field(default_factory=list)
    taken: int = 0  # rows handed to a batch so far


class Batcher:
    """`submit(rows, targets)` -> a future of the rows' `Scored` outputs, in order.

    Args:
      score: (rows, targets, temperature) -> one output per row, for at most `max_rows`
        rows.
      max_rows: rows per forward.
      wait_s: how long the first request of a batch waits for others to join it.
      on_batch: called with (rows, seconds) after each forward (the server's metrics).
    """

    def __init__(
        self, score: Callable, max_rows: int, wait_s: float, on_batch: Callable | None = None
    ):
        self._score, self.max_rows, self._wait = score, max_rows, wait_s
        self._on_batch = on_batch or (lambda rows, seconds: None)
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="distill-batcher", daemon=True)
        self._thread.start()

    def submit(self, rows: list, targets: bool = False, temperature: float = 1.0) -> Future:
        request = _Request(list(rows), targets, float(temperature))
        if not request.rows:
            request.future.set_result([])
        else:
            self._queue.put(request)
        return request.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10.0)

    def _run(self) -> None:
        carry: _Request | None = None  # a request with rows left over from the last batch
        while True:
            first = carry or self._queue.get()
            if first is None:
                return
            batch, carry = self._gather(first)
            self._forward(batch)

    def _gather(self, first: _Request) -> tuple[list[tuple[_Request, int, int]], _Request | None]:
        """[(request, first row, end row)] of one batch, and a request not wholly in it."""
        batch, room, deadline = [], self.max_rows, time.monotonic() + self._wait
        request = first
        while True:
            n = min(room, len(request.rows) - request.taken)
            batch.append((request, request.taken, request.taken + n))
            request.taken += n
            room -= n
            if request.taken < len(request.rows):
                return batch, request
            left = deadline - time.monotonic()
            if room == 0 or left <= 0:
                return batch, None
            try:
                request = self._queue.get(timeout=left)
            except queue.Empty:
                return batch, None
            if request is None:  # closing: this batch first
                self._queue.put(None)
                return batch, None
            if request.temperature != first.temperature:  # the next batch's
                return batch, request

    def _forward(self, batch: list[tuple[_Request, int, int]]) -> None:
        rows = [row for request, a, b in batch for row in request.rows[a:b]]
        targets = any(request.targets for request, _, _ in batch)
        t0 = time.perf_counter()
        try:
            out = self._score(rows, targets, batch[0][0].temperature)
        except Exception as e:  # the requests fail, the server goes on
            log.exception("teacher forward failed")
            for request, _, _ in batch:
                if not request.future.done():
                    request.future.set_exception(e)
            return
        self._on_batch(len(rows), time.perf_counter() - t0)
        at = 0
        for request, a, b in batch:
            request.results.extend(out[at : at + b - a])
            at += b - a
            if len(request.results) == len(request.rows) and not request.future.done():
                request.future.set_result(request.results)
