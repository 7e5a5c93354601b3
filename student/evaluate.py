"""Held-out metrics of the student against the teacher's dense logits, on the training mesh.

One implementation for every pipeline mode (the local loop, `distill eval`, the Ray student
actor): per eval batch `distill.models.losses.eval_metrics` of the student against the teacher's
dense logits (the student's formed a chunk of positions at a time), combined as
token-weighted means, so the chunking of the held-out rows into batches does not change
the result.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax

from distill.config import Config
from student import train


def token_weighted_means(per_batch: Iterable[dict[str, float]]) -> dict[str, float]:
    """Combine per-batch means (each with its "tokens" count) into means over all tokens."""
    sums: dict[str, float] = {}
    for m in per_batch:
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + (v if k == "tokens" else v * m["tokens"])
    tokens = max(sums.pop("tokens", 0.0), 1.0)
    return {k: v / tokens for k, v in sums.items()}


class StudentEval:
    """evaluate(params, batches, teacher_logits, keep) on the training mesh `mesh`.

    `teacher_logits` is an iterable of each batch's dense teacher logits, wherever they
    are (host, another mesh); they are moved here one batch at a time. With `keep` (small
    logits) the moved pairs are kept for later evaluations: the teacher is frozen."""

    def __init__(self, cfg: Config, mesh, vocab_limit: int | None):
        self._metrics = train.eval_fn_for(
            cfg.student_model(), mesh, cfg.student.dtype, vocab_limit=vocab_limit
        )
        self._split = train.batch_sharding(mesh)
        self._kept: list | None = None

    def _pairs(self, batches: list, teacher_logits: Iterable, keep: bool):
        if self._kept is not None:
            yield from self._kept
            return
        kept = []
        for b, t in zip(batches, teacher_logits, strict=True):
            pair = (jax.device_put(b, self._split), jax.device_put(t, self._split))
            if keep:
                kept.append(pair)
            yield pair
        if keep:
            self._kept = kept

    def __call__(self, params, batches: list, teacher_logits: Iterable, keep: bool) -> dict:
        pairs = self._pairs(batches, teacher_logits, keep)
        return token_weighted_means(self._host(params, *pair) for pair in pairs)

    def one(self, params, batch, teacher_logits) -> dict:
        """One batch's metrics with its token count (`token_weighted_means` combines them);
        the arrays are host arrays or already on the training mesh."""
        return self._host(
            params, jax.device_put(batch, self._split), jax.device_put(teacher_logits, self._split)
        )

    def _host(self, params, batch, teacher_logits) -> dict:
        m = self._metrics(params, batch, teacher_logits)
        return {k: float(v) for k, v in jax.device_get(m).items()}
