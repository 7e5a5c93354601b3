"""What every pipeline mode evaluates on, and how per-batch metrics combine.

Evaluation compares dense teacher and student logits [rows, S, V] on the held-out split. For
a real vocabulary (128k ids) a whole training batch of them would not fit on a device
(64 x 2048 x 128k float32 is 67 GB), so the same held-out rows are evaluated in chunks of
`eval_rows` rows: the largest divisor of `train.batch_size` that is a multiple of the
student's row shards (dp x fsdp) and of the teacher's dp (each group runs its own rows),
and keeps each student device's share of a chunk's logits under `EVAL_DEVICE_BYTES` (at
least one row per device). Metrics are token-weighted means, so the chunking does not
change them. Nothing here touches a device: the Ray driver uses it too.
"""

from __future__ import annotations

import math

from distill.config import Config
from distill.data.corpus import Corpus
from distill.errors import DistillError
from distill.limits import MAX_ELEMENTS
from distill.mesh import student_row_shards
from distill.types import Batch

# The frozen teacher's eval logits are computed once and kept when they are this small.
EVAL_CACHE_BYTES = 256 * 2**20
# A chunk's dense float32 logits, per student device (teacher and student logits, and the
# log-softmax temporaries of the metrics, each of about this size).
EVAL_DEVICE_BYTES = 256 * 2**20


def eval_rows(cfg: Config) -> int:
    """Rows per evaluation chunk (see the module docstring)."""
    bsz, n = cfg.train.batch_size, student_row_shards(cfg)
    step = math.lcm(n, cfg.mesh.teacher.dp)  # both divide bsz, so their lcm does
    row_bytes = cfg.train.seq_len * cfg.teacher.model.vocab_size * 4
    divisors = [r for r in range(step, bsz + 1, step) if bsz % r == 0]
    return max((r for r in divisors if r // n * row_bytes <= EVAL_DEVICE_BYTES), default=step)


def check_eval_rows(cfg: Config) -> None:
    """Refuse a row too long for evaluation's dense logits: a chunk holds at least one row
    per device, and one row's [S, V] reaching MAX_ELEMENTS (`distill.limits`: 32-bit GPU
    indexing) would be an array past it."""
    s, v = cfg.train.seq_len, cfg.teacher.model.vocab_size
    if s * v >= MAX_ELEMENTS:
        raise DistillError(
            f"train.seq_len: {s} tokens x {v} teacher ids = {s * v:,} elements, not under "
            f"2^31 (32-bit GPU indexing): evaluation compares the dense logits of whole rows; "
            f"at most {(MAX_ELEMENTS - 1) // v} tokens a row fit"
        )


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
            if logits is None:  # no teacher logits to compare with (a cache without them)
                return None
            if self._keep:
                logits = self._logits = list(logits)
        m = self._executor.evaluate(self._batches, logits, self._keep)
        return m if self._samples is None else {**m, **self._samples()}
