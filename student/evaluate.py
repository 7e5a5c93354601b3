"""Held-out metrics of the student against the teacher's dense logits, on the training mesh.

One implementation for every pipeline mode (the local loop, `distill eval`, the Ray student
actor): per eval batch `distill.models.losses.eval_metrics` of the student against the teacher's
dense logits (whole rows or position windows: `student.eval_programs`), combined as
token-weighted means, so the chunking of the held-out rows into batches does not change
the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import jax
import numpy as np

from distill.config import Config
from student import eval_programs, train


def token_weighted_means(per_batch: Iterable[dict[str, float]]) -> dict[str, float]:
    """Combine per-batch means (each with its "tokens" count) into means over all tokens."""
    sums: dict[str, float] = {}
    for m in per_batch:
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + (v if k == "tokens" else v * m["tokens"])
    tokens = max(sums.pop("tokens", 0.0), 1.0)
    return {k: v / tokens for k, v in sums.items()}


def _target_bytes(targets, mask, table: np.ndarray) -> float:
    targets = np.asarray(jax.device_get(targets))
    return float(np.sum(table[targets] * np.asarray(jax.device_get(mask))))


def bits_per_byte(per: list[dict], t_tokens: list, batches: list, student_b, teacher_b) -> dict:
    """Held-out bits per byte of the student and the teacher: summed NLL (nats) of the
    masked targets over ln 2 times the UTF-8 bytes those targets spell, each model in its
    own tokens, so models with different tokenizers compare on the same text."""
    s_nll = t_nll = s_bytes = t_bytes = 0.0
    for m, n, b in zip(per, t_tokens, batches, strict=True):
        s_nll += m["student_loss"] * m["tokens"]
        t_nll += m.get("teacher_loss", math.nan) * n  # none: a teacher behind a server
        sb = _target_bytes(b.targets, b.mask, student_b)
        s_bytes += sb
        own = b.teacher.rows if b.teacher is not None else None
        t_bytes += sb if own is None else _target_bytes(own.targets, own.mask, teacher_b)
    out = {
        "student_bpb": s_nll / (math.log(2) * max(s_bytes, 1.0)),
        "teacher_bpb": t_nll / (math.log(2) * max(t_bytes, 1.0)),
    }
    return {k: v for k, v in out.items() if not math.isnan(v)}


def combine(per: list[dict], batches: list, byte_lengths=None) -> dict:
    """The held-out metrics of `batches` from each batch's (`StudentEval.one`): token-weighted
    means, the teacher's loss over its own tokens when it has them, and with `byte_lengths`
    (see `StudentEval`) bits per byte."""
    cross = any("teacher_tokens" in m for m in per)
    t_tokens = [m.pop("teacher_tokens", m["tokens"]) for m in per]
    out = token_weighted_means(per)
    if cross:  # the teacher's loss is a mean over its own tokens
        nll = sum(m["teacher_loss"] * n for m, n in zip(per, t_tokens, strict=True))
        out["teacher_loss"] = nll / max(sum(t_tokens), 1.0)
    if byte_lengths is not None:
        out.update(bits_per_byte(per, t_tokens, batches, *byte_lengths))
    return out


class StudentEval:
    """evaluate(params, batches, teacher_logits, keep) on the training mesh `mesh`.

    `teacher_logits` is an iterable of each batch's dense teacher logits, wherever they
    are (host, another mesh); they are moved here one batch at a time. With `keep` (small
    logits) the moved pairs are kept for later evaluations: the teacher is frozen."""

    def __init__(self, cfg: Config, mesh, vocab_limit: int | None, byte_lengths=None):
        """`byte_lengths`: (student's, teacher's) [V] bytes each id spells
        (`distill.data.token_bytes.byte_lengths`), to report bits per byte; with a teacher
        tokenizer of its own (`Config.cross_tokenizer`) the batches carry the teacher's rows
        and the teacher's loss is taken on them."""
        programs = eval_programs
        make = programs.cross_eval_fn_for if cfg.cross_tokenizer() else programs.eval_fn_for
        self._metrics = make(cfg.student_model(), mesh, cfg.student.dtype, vocab_limit)
        self._bytes = byte_lengths
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
        return combine([self._host(params, *pair) for pair in pairs], batches, self._bytes)

    def one(self, params, batch, teacher_logits) -> dict:
        """One batch's metrics with its token count (`token_weighted_means` combines them);
        the arrays are host arrays or already on the training mesh."""
        return self._host(
            params, jax.device_put(batch, self._split), jax.device_put(teacher_logits, self._split)
        )

    def _host(self, params, batch, teacher_logits) -> dict:
        m = self._metrics(params, batch, teacher_logits)
        return {k: float(v) for k, v in jax.device_get(m).items()}
