"""What every pipeline mode evaluates on, and how per-batch metrics combine.

Evaluation compares dense teacher and student logits [rows, S, V] on the held-out split. For
a real vocabulary (128k ids) a whole training batch of them would not fit on a device
(64 x 2048 x 128k float32 is 67 GB), so the same held-out rows are evaluated in chunks of
`eval_rows` rows: the largest divisor of `train.batch_size` that is a multiple of the
student's row shards (dp x fsdp) and of the teacher's dp (each group runs its own rows),
and keeps each student device's share of a chunk's logits under `EVAL_DEVICE_BYTES` (at
least one row per device). Rows whose logits would reach 2^31 elements (32,768 tokens x
128,256 ids is 4.2e9 a row) are also made and compared in position windows
(`eval_windows`). Metrics are token-weighted means, so neither chunking changes them.
Nothing here touches a device: the Ray driver uses it too.
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


def eval_windows(cfg: Config, length: int | None = None) -> int:
    """How many position windows each eval chunk's dense logits are made and compared in:
    the fewest, w, that keep one window's logits [eval_rows, S / w, V] under MAX_ELEMENTS
    (`distill.limits`: 32-bit GPU indexing), so no array ending in the vocabulary reaches
    it at any row length. Window j holds positions j, j + w, j + 2w, ... of every row: a
    strided window is a local slice of any contiguous split of the positions (`cp`'s row
    order and its load-balanced chunks alike) when w divides each chunk, so S / w must
    split into 2 x cp for each role's cp. `length`: the teacher's row length where it has
    its own tokens (cross-tokenizer), else `train.seq_len`. 1 (one window, the whole rows)
    wherever the rows fit; raises DistillError when no w fits."""
    s, v, rows = length or cfg.train.seq_len, cfg.teacher.model.vocab_size, eval_rows(cfg)
    cp = math.lcm(cfg.mesh.teacher.cp, cfg.mesh.student.cp)
    split = 2 * cp if cp > 1 else 1
    for w in range(1, s + 1):
        if s % w == 0 and (s // w) % split == 0 and rows * (s // w) * v < MAX_ELEMENTS:
            return w
    raise DistillError(
        f"train.seq_len: {s} tokens x {v} teacher ids: evaluation's logits of {rows} rows do "
        f"not split into position windows under 2^31 elements (32-bit GPU indexing)"
        + (f" that also split into 2 x cp = {split} chunks" if split > 1 else "")
    )


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
            if logits is None:  # no teacher logits to compare with (a cache without them)
                return None
            if self._keep:
                logits = self._logits = list(logits)
        m = self._executor.evaluate(self._batches, logits, self._keep)
        return m if self._samples is None else {**m, **self._samples()}
