"""Several teachers for one student (`teachers:`): one source per teacher (online on the
inference mesh, or behind an endpoint), all read in the same data order, and a source over
them whose items carry their outputs together (`distill.types.TeacherMix`).

With records routed (`data.teacher_field`) each position's weight is 1 for its row's
teacher and 0 for the others; a teacher works only on batches holding rows of its own (every
batch under `data.teacher_batches: mixed`, its own batches under `grouped`), the others'
outputs then zeros of no weight. Without routing the divergence is to all of them at their
weights. Evaluation compares the student with their combination, as one teacher (routed:
each row's own; mixed: the weighted mixture), where every teacher is local.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from distill.config import Config
from distill.handoff import eval_windows
from distill.types import Batch, TeacherMix, TeacherOutput
from pipelines.loop import Item
from teacher.online import OnlineTeacher


def mix_weights(cfg: Config, batch: Batch) -> np.ndarray:
    """[B, S, n] float32: each position's weight of each teacher (summing to 1): one-hot of
    the batch's route with records routed, else the teachers' normalised weights."""
    n = len(cfg.teachers)
    if batch.route is not None:
        return np.eye(n, dtype=np.float32)[np.asarray(batch.route)]
    w = np.asarray(cfg.teacher_weights(), np.float32)
    return np.broadcast_to(w, (*np.shape(batch.tokens), n)).copy()


class MultiSource:
    """The teachers' sources in step: item n of each is batch n (the same corpus iterated
    with the same seed), and the item handed on is the first source's batch with every
    teacher's output (`TeacherMix`); none while the alpha gate keeps the teacher off."""

    student_eval = True  # a teacher behind a server: the student's held-out figures alone

    def __init__(self, cfg: Config, sources: list):
        self._cfg, self.sources = cfg, sources
        self._names = [t.name for t in cfg.teachers]
        self._made: tuple | None = None  # (the sources' items, the item made of them)
        self._empty: dict[int, TeacherOutput] = {}  # each teacher's output of no weight
        if cfg.data.teacher_field is not None:  # each teacher works on batches with its rows
            for i, s in enumerate(sources):
                s.wants = lambda batch, i=i: bool(np.any(np.asarray(batch.route) == i))

    def start(self, data_state: dict | None) -> None:
        for s in self.sources:
            s.start(data_state)
        self._made = None

    def submit(self) -> None:
        for s in self.sources:
            s.submit()

    def peek(self) -> Item:
        return self._combined(tuple(s.peek() for s in self.sources))

    def pop(self) -> Item:
        return self._combined(tuple(s.pop() for s in self.sources))

    def _combined(self, items: tuple) -> Item:
        """One item of the sources' items: the same object for the same items (the loop
        tells a peeked item from a remade one by identity)."""
        if self._made is not None and all(
            a is b for a, b in zip(self._made[0], items, strict=True)
        ):
            return self._made[1]
        head = items[0]
        outs = tuple(i.teacher_out for i in items)
        out = None
        if any(o is not None for o in outs):  # none: the alpha gate keeps the teachers off
            shape = np.shape(head.batch.tokens)
            outs = tuple(self._no_weight(i, shape) if o is None else o for i, o in enumerate(outs))
            out = TeacherMix(outs, mix_weights(self._cfg, head.batch))
        # the route stays on the host: the outputs' weights carry it to the student's step
        item = head._replace(batch=head.batch._replace(route=None), teacher_out=out, tag=None)
        self._made = (items, item)
        return item

    def _no_weight(self, i: int, shape: tuple) -> TeacherOutput:
        """Teacher i's output for a batch without its rows (its weight 0 everywhere): zeros
        of its top-k's shapes, made once."""
        if i not in self._empty:
            k = self._cfg.teachers[i].top_k
            self._empty[i] = TeacherOutput(
                np.zeros((*shape, k), np.float32), np.zeros((*shape, k), np.int32)
            )
        return self._empty[i]

    def in_flight(self) -> int:
        return self.sources[0].in_flight()

    def resume_point(self) -> dict:
        return self.sources[0].resume_point()

    def gate(self, open_: bool) -> bool:
        for s in self.sources:
            s.gate(open_)
        return False

    def figures(self, steps: int, since: float, step: int = 0) -> dict:
        """teacher_ms: the teachers' summed; teacher_busy: the busiest's (they share the
        inference mesh); each teacher's teacher_ms by name."""
        each = [s.figures(steps, since, step) for s in self.sources]
        busy = [f["teacher_busy"] for f in each if f.get("teacher_busy") is not None]
        return {
            "teacher_ms": sum(f["teacher_ms"] for f in each),
            "teacher_busy": max(busy) if busy else None,
            "teacher_ms_by_teacher": {
                n: f["teacher_ms"] for n, f in zip(self._names, each, strict=True)
            },
        }

    def eval_logits(self, batches: list):
        """The teachers' held-out logits as one teacher's, each eval chunk's (as
        `teacher.online.OnlineTeacher.eval_logits`): with records routed each row's own
        teacher's log-probs, else the log of their weighted mixture sum_i w_i p_i. None (the
        student's figures alone) where a teacher is behind a server (no dense logits), the
        teachers' vocabularies differ, or the logits come in position windows."""
        teachers = [getattr(s, "teacher", None) for s in self.sources]
        if not all(isinstance(t, OnlineTeacher) for t in teachers):
            return None
        vocab = {one.teacher.model.vocab_size for one in self._cfg.each_teacher()}
        seq = np.shape(batches[0].tokens)[1] if batches else self._cfg.train.seq_len
        if len(vocab) > 1 or any(eval_windows(one, seq) > 1 for one in self._cfg.each_teacher()):
            return None
        weights = None if self._cfg.data.teacher_field else self._cfg.teacher_weights()
        return (
            _one_teacher(b.route, tuple(t.logits(b) for t in teachers), weights=weights)
            for b in batches
        )

    def close(self) -> None:
        for s in self.sources:
            s.close()


@partial(jax.jit, static_argnames=("weights",))
def _one_teacher(route, logits: tuple, weights: tuple | None):
    """Several teachers' logits [B, S, V] as one teacher's log-probs: each position's
    routed teacher's (`route` [B, S]), or the log of the mixture at `weights`."""
    lps = [jax.nn.log_softmax(z.astype(jnp.float32), axis=-1) for z in logits]
    if weights is None:
        out = lps[0]
        for i, lp in enumerate(lps[1:], start=1):
            out = jnp.where((route == i)[..., None], lp, out)
        return out
    logw = jnp.log(jnp.asarray(weights, jnp.float32))
    return jax.nn.logsumexp(jnp.stack(lps) + logw[:, None, None, None], axis=0)
