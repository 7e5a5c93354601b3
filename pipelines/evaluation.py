"""What every pipeline mode evaluates on, and how per-batch metrics combine.

Evaluation compares dense teacher and student logits [rows, S, V] on the held-out split. For
a real vocabulary (128k ids) a whole training batch of them would not fit on a device
(64 x 2048 x 128k float32 is 67 GB), so the same held-out rows are evaluated in chunks of
`distill.handoff.eval_rows` rows (each student device's share under `EVAL_DEVICE_BYTES`),
and rows whose logits would reach 2^31 elements (32,768 tokens x 128,256 ids is 4.2e9 a
row) are made and compared in position windows (`distill.handoff.eval_windows`). Metrics
are token-weighted means, so neither chunking changes them. Nothing here touches a device:
the Ray driver uses it too.
"""

from __future__ import annotations

from distill.config import Config
from distill.data.corpus import Corpus
from distill.handoff import eval_rows, eval_windows
from distill.types import Batch

# The frozen teacher's eval logits are computed once and kept when they are this small.
EVAL_CACHE_BYTES = 256 * 2**20


def check_eval_rows(cfg: Config) -> None:
    """Refuse a layout whose evaluation logits do not split into windows (`eval_windows`)."""
    eval_windows(cfg)


def eval_batches(cfg: Config, corpus: Corpus) -> list[Batch]:
    """The held-out rows every evaluation uses (`data.eval_batches` training batches of
    them, the same rows in the same order in every mode), in chunks of `eval_rows`."""
    rows = eval_rows(cfg)
    return corpus.eval_batches(rows, cfg.data.eval_batches * cfg.train.batch_size // rows)


def eval_cache_fits(cfg: Config) -> bool:
    """Whether the teacher's dense eval logits are small enough to keep."""
    b, s, v = cfg.train.batch_size, cfg.train.seq_len, cfg.teacher.model.vocab_size
    return cfg.data.eval_batches * b * s * v * 4 <= EVAL_CACHE_BYTES


class Evaluation:
    """The loop's evaluation hook: the teacher's dense eval logits from the source (kept
    when small: the teacher is frozen) against the student's, on the executor."""

    def __init__(self, cfg: Config, batches: list, source, executor, samples=None):
        """`samples()`: more metrics of the student's own samples (`pipelines.on_policy`
        .SampleScore on the current parameters), or None."""
        self._batches, self._source, self._executor = batches, source, executor
        self._samples = samples
        self._keep = eval_cache_fits(cfg)
        self._logits = None

    def __call__(self, step: int) -> dict | None:
        logits = self._logits
        if logits is None:
            logits = self._source.eval_logits(self._batches)
            if logits is None and getattr(self._source, "student_eval", False):
                logits = [None] * len(self._batches)  # the student's own figures alone
            if logits is None:  # no teacher logits to compare with (a cache without them)
                return None
            if self._keep:
                logits = self._logits = list(logits)
        m = self._executor.evaluate(self._batches, logits, self._keep)
        return m if self._samples is None else {**m, **self._samples()}
