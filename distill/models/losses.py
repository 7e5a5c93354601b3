"""Distillation and cross-entropy losses: pure float32 JAX functions returning (loss, metrics).

Shapes: logits [B, S, V], targets [B, S] int32, mask [B, S] float (1 = count this token).
Every loss is a masked mean over tokens, dividing by max(sum(mask), 1) so an all-padding
batch gives 0, not NaN. Positions with mask 0 are excluded with `jnp.where`, so whatever
the padding holds (even inf) never reaches the result.

Divergences are computed on log-probabilities over "buckets" (the vocabulary, or the
top-k ids plus a tail) with the convention 0 * log 0 = 0, written with `jnp.where` on both
the value and its argument so neither the loss nor its gradient produces NaN when a
probability underflows to zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distill.collectives import mask_vocab
from distill.config import DistillLossConfig
from distill.types import TeacherOutput

# A padded vocabulary id's student logit: finite, so no gradient meets logaddexp(-inf, -inf)
# (the JSD), yet so low that its probability is exactly 0 in float32.
PADDED_LOGIT = -1e30

# Teacher tail masses below float32 resolution of the top-k sum (1 - sum(exp(top-k)) is
# only known to about this precision) are raised to it, so its log stays finite.
TAIL_FLOOR = float(jnp.finfo(jnp.float32).eps)


def fit_vocab(x_bsv: jax.Array, v: int, fill: float = -jnp.inf) -> jax.Array:
    """Teacher log-probs or logits [B, S, V_teacher] at the student's vocabulary width `v`:
    the vocabularies differ only in padding past the tokenizer's ids (masked in both), so
    the teacher's extra padded ids are dropped, or the student's extra ones given `fill`
    (the teacher's masked value)."""
    have = x_bsv.shape[-1]
    if have > v:
        return x_bsv[..., :v]
    if have < v:
        pad = [(0, 0)] * (x_bsv.ndim - 1) + [(0, v - have)]
        return jnp.pad(x_bsv, pad, constant_values=fill)
    return x_bsv


def _masked_mean(x_bs: jax.Array, mask_bs: jax.Array) -> jax.Array:
    mask_bs = mask_bs.astype(jnp.float32)
    total = jnp.sum(jnp.where(mask_bs > 0, x_bs * mask_bs, 0.0))
    return total / jnp.maximum(jnp.sum(mask_bs), 1.0)


def _token_ce(logits_bsv: jax.Array, targets_bs: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per token, [B, S], float32."""
    z = logits_bsv.astype(jnp.float32)
    picked = jnp.take_along_axis(z, targets_bs[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jax.nn.logsumexp(z, axis=-1) - picked


def _kl(la: jax.Array, lb: jax.Array) -> jax.Array:
    """KL(a || b) = sum a * (log a - log b) over the last axis, from log-probs; 0 log 0 = 0."""
    a = jnp.exp(la)
    live = a > 0
    diff = jnp.where(live, la - lb, 0.0)  # safe argument: no inf - inf, no 0 * inf
    return jnp.sum(jnp.where(live, a * diff, 0.0), axis=-1)


def _divergence(lp: jax.Array, lq: jax.Array, cfg: DistillLossConfig) -> jax.Array:
    """Per-token divergence between teacher log-probs `lp` and student log-probs `lq`."""
    if cfg.loss == "forward_kl":
        return _kl(lp, lq)
    if cfg.loss == "reverse_kl":
        return _kl(lq, lp)
    beta = cfg.beta  # generalized JSD: m = beta * p + (1 - beta) * q
    lm = jnp.logaddexp(jnp.log(beta) + lp, jnp.log1p(-beta) + lq)
    return beta * _kl(lp, lm) + (1.0 - beta) * _kl(lq, lm)


def _topk_buckets(
    lq_bsv: jax.Array,
    zt_bsv: jax.Array,
    lse_bs: jax.Array,
    lp_bsk: jax.Array,
    ids_bsk: jax.Array,
    *,
    tail_is_padding: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Teacher and student log-probs over k + 1 buckets: the k teacher ids, then the tail.

    The teacher tail is log(1 - sum(exp(top-k))), floored at TAIL_FLOOR (it may round to
    zero or below when the top-k hold all the mass). The student tail is computed exactly as
    the logsumexp of its logits outside the top-k ids rather than as 1 - sum(q_k), which
    cancels catastrophically (and has exploding gradients) when the student is confident.
    `tail_is_padding`: the top-k already cover every live id, so the tail holds only padded
    ids and the teacher's tail is exactly zero (log = -inf), not floored: a floored teacher
    tail against the student's zero tail would add TAIL_FLOOR * 1e30.
    """
    lq_bsk = jnp.take_along_axis(lq_bsv, ids_bsk, axis=-1)
    in_topk = jnp.put_along_axis(
        jnp.zeros(zt_bsv.shape, bool), ids_bsk, True, axis=-1, inplace=False
    )
    lq_tail = jax.nn.logsumexp(jnp.where(in_topk, -jnp.inf, zt_bsv), axis=-1) - lse_bs
    if tail_is_padding:
        lp_tail = jnp.full(lq_tail.shape, -jnp.inf, jnp.float32)
    else:
        p_tail = -jnp.expm1(jax.nn.logsumexp(lp_bsk, axis=-1))
        lp_tail = jnp.log(jnp.maximum(p_tail, TAIL_FLOOR))
    lp = jnp.concatenate([lp_bsk, lp_tail[..., None]], axis=-1)
    lq = jnp.concatenate([lq_bsk, lq_tail[..., None]], axis=-1)
    return lp, lq


def kd_divergence(
    student_logits: jax.Array,
    teacher: TeacherOutput,
    cfg: DistillLossConfig,
    *,
    vocab_limit: int | None = None,
) -> jax.Array:
    """Per-token divergence D(p, q) [B, S] at temperature T, q = softmax(student_logits / T).

    How the top-k tail is treated: with a top-k teacher, the divergence is taken over k + 1
    buckets, the k teacher ids plus one tail bucket holding all remaining probability mass
    (p_tail = 1 - sum_k p_i for the teacher, q_tail = 1 - sum_k q_{id_i} for the student).
    This is a coarse-graining of the full distributions, so by the data-processing
    inequality it is a lower bound on the dense divergence, and it equals the dense value
    when the student matches the teacher's shape within the tail (q_j / q_tail = p_j /
    p_tail for every tail token). A teacher tail below float32 resolution (TAIL_FLOOR) is
    raised to it, so a teacher whose top-k hold all the mass gives no NaN or infinity.
    When k equals the vocabulary size there is no tail and the result is the dense one.

    `vocab_limit`: ids >= it are padding of the model's vocabulary (the tokenizer has fewer
    tokens); the student's logits there are set to PADDED_LOGIT (probability 0). A top-k
    teacher with k >= vocab_limit then holds every live id, its tail is exactly empty, and
    the result is the dense divergence over the live ids.
    """
    student_logits = mask_vocab(student_logits, vocab_limit, None, fill=PADDED_LOGIT)
    zt = student_logits.astype(jnp.float32) / cfg.temperature
    lse = jax.nn.logsumexp(zt, axis=-1)
    lq = zt - lse[..., None]
    lp = jax.lax.stop_gradient(teacher.logprobs.astype(jnp.float32))
    if teacher.ids is None:
        lp = fit_vocab(lp, zt.shape[-1])
    live = zt.shape[-1] if vocab_limit is None else min(vocab_limit, zt.shape[-1])
    if teacher.ids is not None and teacher.ids.shape[-1] < zt.shape[-1]:
        ids = teacher.ids.astype(jnp.int32)
        tail_is_padding = teacher.ids.shape[-1] >= live
        lp, lq = _topk_buckets(lq, zt, lse, lp, ids, tail_is_padding=tail_is_padding)
    elif teacher.ids is not None:  # k == V: a permutation of the dense vocabulary
        lq = jnp.take_along_axis(lq, teacher.ids.astype(jnp.int32), axis=-1)
    elif lp.shape != lq.shape:
        raise ValueError(f"dense teacher log-probs {lp.shape} vs student logits {lq.shape}")
    return _divergence(lp, lq, cfg)


def kd_loss(
    student_logits: jax.Array,
    teacher: TeacherOutput,
    targets: jax.Array,
    mask: jax.Array,
    cfg: DistillLossConfig,
    *,
    vocab_limit: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """loss = alpha * T^2 * KD + (1 - alpha) * CE, all float32 scalars.

    KD is the masked mean of `kd_divergence` (teacher at temperature T, student logits / T);
    the T^2 factor keeps its gradient scale independent of T (Hinton et al., 2015). CE is the
    masked mean of the student's cross-entropy on `targets` at temperature 1.
    Metrics: "loss", "kd_loss" (KD without the T^2 factor), "ce_loss", "tokens" (sum(mask)).
    `vocab_limit`: see `kd_divergence`; pass it whenever the model's vocabulary is padded.
    """
    student_logits = mask_vocab(student_logits, vocab_limit, None, fill=PADDED_LOGIT)
    kd = _masked_mean(kd_divergence(student_logits, teacher, cfg, vocab_limit=vocab_limit), mask)
    ce = _masked_mean(_token_ce(student_logits, targets), mask)
    loss = cfg.alpha * cfg.temperature**2 * kd + (1.0 - cfg.alpha) * ce
    tokens = jnp.sum(mask.astype(jnp.float32))
    return loss, {"loss": loss, "kd_loss": kd, "ce_loss": ce, "tokens": tokens}


def ce_loss(
    logits: jax.Array, targets: jax.Array, mask: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Plain next-token cross-entropy (the teacher bootstrap). Metrics: loss, ce_loss, tokens."""
    loss = _masked_mean(_token_ce(logits, targets), mask)
    tokens = jnp.sum(mask.astype(jnp.float32))
    return loss, {"loss": loss, "ce_loss": loss, "tokens": tokens}


def eval_metrics(
    student_logits: jax.Array, teacher_logits: jax.Array, targets: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """Held-out comparison of student and teacher from raw logits [B, S, V], at T = 1.

    All values are masked means over tokens, plus "tokens" (sum(mask)): to combine batches,
    weight each mean by its "tokens". teacher_loss / student_loss: cross-entropy on
    targets; kl: dense KL(teacher || student); top1_agreement: fraction of tokens whose
    argmaxes agree.
    """
    s = student_logits.astype(jnp.float32)
    t = fit_vocab(teacher_logits.astype(jnp.float32), s.shape[-1])
    kl = _kl(jax.nn.log_softmax(t, axis=-1), jax.nn.log_softmax(s, axis=-1))
    agree = (jnp.argmax(s, axis=-1) == jnp.argmax(t, axis=-1)).astype(jnp.float32)
    return {
        "teacher_loss": _masked_mean(_token_ce(t, targets), mask),
        "student_loss": _masked_mean(_token_ce(s, targets), mask),
        "kl": _masked_mean(kl, mask),
        "top1_agreement": _masked_mean(agree, mask),
        "tokens": jnp.sum(mask.astype(jnp.float32)),
    }
