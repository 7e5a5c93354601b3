"""The compiled evaluation programs on the training mesh: held-out metrics of the student
against the teacher's dense logits.

The teacher's logits of an eval chunk come whole ([B, S, V]) or, where those would reach
2^31 elements, as a tuple of w strided position windows ([B, S/w, V], window j positions
j, j + w, ... of every row: `distill.handoff.eval_windows`). The student's hidden
states are formed once per chunk; each window's metrics read the same positions of them
(the student's logits a chunk of positions at a time, never whole) and the windows combine
as token-weighted means: the metrics of the whole rows. With a `cp` axis the rows run as
the step's load-balanced pieces (`student.context`); the hidden states then go back to
each device's slice of the positions in row order, where the teacher's logits already are
(moving D-wide hidden states, never the vocabulary-wide logits): a strided window of a
slice is the slice of the window, as each holds whole runs of w positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distill import programs
from distill.config import ModelConfig
from distill.models import model, vocab_loss
from distill.types import Batch
from student import routing
from student.context import Context
from student.train import batch_sharding, head_loss_kw, pieces_sharding


def eval_fn_for(cfg: ModelConfig, mesh, dtype: str = "float32", vocab_limit: int | None = None):
    """`make_eval_fn`, built once per process for equal arguments (`distill.programs`)."""
    return programs.cached(make_eval_fn, cfg, mesh, dtype, vocab_limit)


def windows_of(teacher_logits) -> tuple:
    """The teacher's eval logits as a tuple of position windows (one: the whole rows)."""
    return teacher_logits if isinstance(teacher_logits, tuple) else (teacher_logits,)


def window(x, j: int, w: int):
    """Positions j, j + w, ... of every row of x [B, S, ...] (x itself when w is 1)."""
    return x if w == 1 else x[:, j::w]


def weighted(parts: list[dict]) -> dict:
    """Per-window means, each with its "tokens", as means over all their tokens."""
    if len(parts) == 1:
        return parts[0]
    tokens = sum(m["tokens"] for m in parts)
    out = {
        k: sum(m[k] * m["tokens"] for m in parts) / jnp.maximum(tokens, 1.0)
        for k in parts[0]
        if k != "tokens"
    }
    return {**out, "tokens": tokens}


def make_eval_fn(cfg: ModelConfig, mesh, dtype: str = "float32", vocab_limit: int | None = None):
    """metrics(params, batch, teacher_logits) on the training mesh, batch split over its
    devices: `losses.eval_metrics` of the student against the teacher's dense logits (whole
    or in windows: the module docstring), the student's computed a chunk of positions at a
    time (never a whole [B, S, V]). With a `cp` axis, on each device's pieces of the rows,
    as the step (`student.context`)."""
    split = batch_sharding(mesh)
    context, pieces = Context.of(mesh), pieces_sharding(mesh)
    attend = None if context is None else context.attend
    routed = routing.Routing(cfg, mesh)

    def metrics(params, batch: Batch, teacher_logits):
        windows = windows_of(teacher_logits)
        rows_in = batch if context is None else context.pieces(batch)
        x, head = model.apply_hidden(
            cfg, params, rows_in.tokens, rows_in.segment_ids, rows_in.positions, dtype=dtype,
            rows=pieces, moe_opts=routed.opts(rows_in), attend=attend,
        )  # fmt: skip
        if context is not None:  # the hidden states to the logits' layout, not the reverse
            x, batch, windows = context.unbalance(x), *context.slices((batch, windows))
        kw = head_loss_kw(cfg, mesh, x, batch.tokens.shape[0], vocab_limit)
        w = len(windows)

        def one(j: int, t):
            targets, mask = window(batch.targets, j, w), window(batch.mask, j, w)
            return vocab_loss.eval_metrics_chunked(window(x, j, w), head, t, targets, mask, **kw)

        parts = [one(j, t) for j, t in enumerate(windows)]
        return weighted(parts)

    return jax.jit(metrics, in_shardings=(None, split, split))


def cross_eval_fn_for(cfg: ModelConfig, mesh, dtype: str, vocab_limit: int | None):
    """`make_cross_eval_fn`, built once per process for equal arguments."""
    return programs.cached(make_cross_eval_fn, cfg, mesh, dtype, vocab_limit)


def make_cross_eval_fn(cfg: ModelConfig, mesh, dtype: str, vocab_limit: int | None):
    """metrics(params, batch, teacher_logits) of a cross-tokenizer batch: the student's loss
    in its own tokens; the teacher's on its own rows, from its dense logits [B, T, Vt]
    (whole or in windows), with its own token count ("teacher_tokens"); the share of
    student tokens aligned. The two losses are in different tokens: only their bits per
    byte compare. With a `cp` axis the student runs on its pieces of the rows
    (`student.context`); the teacher's rows, its logits and the alignment are read in row
    order, split by position."""
    split = batch_sharding(mesh)
    context, pieces = Context.of(mesh), pieces_sharding(mesh)
    attend = None if context is None else context.attend
    routed = routing.Routing(cfg, mesh)

    def metrics(params, batch: Batch, teacher_logits):
        own = batch if context is None else context.pieces(batch._replace(teacher=None))
        x, head = model.apply_hidden(
            cfg, params, own.tokens, own.segment_ids, own.positions, dtype=dtype,
            rows=pieces, moe_opts=routed.opts(own), attend=attend,
        )  # fmt: skip
        kw = head_loss_kw(cfg, mesh, x, own.tokens.shape[0], vocab_limit)
        _, m = vocab_loss.ce_loss_chunked(x, head, own.targets, own.mask, **kw)
        t = batch.teacher.rows
        windows = windows_of(teacher_logits)
        nll = sum(
            _masked_nll(z, window(t.targets, j, len(windows)), window(t.mask, j, len(windows)))
            for j, z in enumerate(windows)
        )
        t_tokens = jnp.sum(t.mask)
        aligned = (batch.teacher.align >= 0) & (batch.mask > 0)
        return {
            "student_loss": m["ce_loss"],
            "teacher_loss": nll / jnp.maximum(t_tokens, 1),
            "aligned_fraction": jnp.sum(aligned) / jnp.maximum(m["tokens"], 1.0),
            "tokens": m["tokens"],
            "teacher_tokens": t_tokens,
        }

    return jax.jit(metrics, in_shardings=(None, split, split))


def _masked_nll(logits, targets, mask):
    """The summed NLL of the masked targets under logits [B, T, V]."""
    zt = logits.astype(jnp.float32)  # a reduction: no second [B, T, V] array
    picked = jnp.take_along_axis(zt, targets[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(zt, axis=-1) - picked
    return jnp.sum(jnp.where(mask > 0, nll, 0.0))
