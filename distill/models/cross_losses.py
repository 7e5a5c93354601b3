"""Distillation across vocabularies: a teacher and a student with different tokenizers.

The teacher's dense log-probs (its own vocabulary Vt, at temperature T) arrive at the
student's positions through the alignment of `distill.data.cross_rows`: position j of the
student reads the teacher's position whose text prefix ends at the same character. Two ways
to compare the two next-token distributions (`distill.cross_tokenizer`):

- ``mapped``: over the student's vocabulary plus one tail bucket. A teacher token spelling
  exactly the bytes of a student token (`distill.data.token_bytes.VocabMap`) is that student
  token's bucket; every other teacher token's mass, and the student's mass on tokens no
  teacher token spells, fall into the tail, as the top-k tail of `distill.models.losses`
  does (a student with no unmapped token has no tail: the teacher is conditioned on the
  mapped tokens, see `mapped_buckets`). With one tokenizer on both sides the map is the
  identity, there is no tail, and the divergence is `kd_divergence`'s to the bit.
- ``first_byte``: both distributions marginalised onto the next byte (each token's
  probability into the bucket of its first byte); exact for a byte-level teacher, whose
  distribution is the next byte's, where ``mapped`` would push a BPE student's mass onto
  its single-byte tokens (the teacher's mass on longer tokens is nil).
- ``uld``: the Universal Logit Distillation loss (Boizard et al., 2024; TRL's GOLD): the
  L1 (Wasserstein-1 on sorted supports) distance between the two distributions sorted in
  decreasing order, the shorter padded with zeros. It needs no shared tokens at all, at
  the price of ignoring which token carries which probability.

Positions without a teacher match count in the cross-entropy, not in the divergence; the
divergence is a mean over the aligned positions, and "aligned_fraction" reports their share.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from distill.config import DistillLossConfig
from distill.data.token_bytes import FirstBytes, VocabMap
from distill.models.losses import PADDED_LOGIT, TAIL_FLOOR, _divergence, _token_ce
from distill.models.vocab_loss import Tree, _chunked_sums

METHODS = ("mapped", "uld", "first_byte")


@dataclass(frozen=True)
class CrossSpec:
    """How a cross-tokenizer step compares vocabularies: `method` (`METHODS`) and, for
    ``mapped``, the teacher-to-student map. Hashable: part of a compiled step's key."""

    method: str
    vmap: VocabMap | FirstBytes | None = None


def mapped_buckets(
    lp_bsw: jax.Array, lq_bsv: jax.Array, vmap: VocabMap
) -> tuple[jax.Array, jax.Array]:
    """Teacher and student log-probs over the student's mapped ids and, when the student has
    unmapped ids, a tail bucket. lp [..., Vt] teacher, lq [..., Vs] student.

    The map is one to one, so a student bucket's teacher log-prob is one gathered value:
    exact, not a log of a sum. Which side has unmapped mass is known from the map:
    - neither (one tokenizer): the student's vocabulary as is, today's divergence exactly;
    - the student (ids no teacher token spells): a tail bucket holding the student's mass
      there and the teacher's unmapped mass, floored at TAIL_FLOOR as the top-k tail is;
    - only the teacher (a student whose every id is mapped, e.g. bytes under a BPE
      teacher): the student cannot put mass on the teacher's other tokens, so the teacher
      is conditioned on the mapped ones (renormalised over them) instead of a tail.
    Buckets with no mass hold PADDED_LOGIT (probability exactly 0 in float32), and an empty
    tail is never formed (no logsumexp of nothing, no NaN gradient).
    """
    teacher_of = np.asarray(vmap.teacher_of)
    mapped = teacher_of >= 0
    idx = jnp.broadcast_to(jnp.asarray(np.maximum(teacher_of, 0)), lq_bsv.shape)
    lp = jnp.take_along_axis(lp_bsw, idx, axis=-1)
    teacher_tail = not (np.asarray(vmap.student_of) >= 0).all()
    if mapped.all():
        if teacher_tail:  # the teacher conditioned on the student's tokens
            lp = lp - jax.nn.logsumexp(lp, axis=-1, keepdims=True)
        return lp, lq_bsv
    lp = jnp.where(mapped, lp, PADDED_LOGIT)
    lq = jnp.where(mapped, lq_bsv, PADDED_LOGIT)
    if teacher_tail:
        unmapped = jnp.asarray(np.asarray(vmap.student_of) < 0)
        p_tail = jnp.exp(jax.nn.logsumexp(jnp.where(unmapped, lp_bsw, -jnp.inf), axis=-1))
    else:
        p_tail = jnp.zeros(lq.shape[:-1], jnp.float32)
    lp_tail = jnp.log(jnp.maximum(p_tail, TAIL_FLOOR))
    lq_tail = jax.nn.logsumexp(jnp.where(mapped, -jnp.inf, lq_bsv), axis=-1)
    return (
        jnp.concatenate([lp, lp_tail[..., None]], axis=-1),
        jnp.concatenate([lq, lq_tail[..., None]], axis=-1),
    )


def _by_first_byte(l_bsv: jax.Array, bucket: np.ndarray, keep: np.ndarray) -> jax.Array:
    """Log-probs [..., len(keep)] of the buckets `keep`: the probabilities [..., V] of
    `exp(l)` summed by bucket (ids of bucket -1 dropped), renormalised over `keep`."""
    seg = np.where(bucket >= 0, bucket, FirstBytes.size)
    p = jnp.exp(l_bsv).reshape(-1, l_bsv.shape[-1]).T  # [V, N]: segments on the leading axis
    summed = jax.ops.segment_sum(p, jnp.asarray(seg), num_segments=FirstBytes.size + 1)
    kept = summed[jnp.asarray(keep)].T.reshape(*l_bsv.shape[:-1], len(keep))
    kept = kept / jnp.maximum(jnp.sum(kept, axis=-1, keepdims=True), 1e-30)
    return jnp.log(jnp.maximum(kept, 1e-30))


def first_byte_buckets(
    lp_bsw: jax.Array, lq_bsv: jax.Array, fb: FirstBytes
) -> tuple[jax.Array, jax.Array]:
    """Both distributions as next-byte distributions: each token's probability summed into
    the bucket of its first byte (`FirstBytes`), over the buckets both vocabularies reach,
    each side renormalised over them. Exact for a byte-level teacher (its distribution is
    the next byte's), and consistent with the student's targets: the student's next token
    starts with the byte the teacher predicts."""
    keep = np.intersect1d(fb.teacher[fb.teacher >= 0], fb.student[fb.student >= 0])
    return _by_first_byte(lp_bsw, fb.teacher, keep), _by_first_byte(lq_bsv, fb.student, keep)


def uld_distance(lp_bsw: jax.Array, lq_bsv: jax.Array) -> jax.Array:
    """[...] sum |sort(p) - sort(q)|: both distributions sorted in decreasing order, the
    shorter vocabulary padded with zero probabilities."""
    p = -jnp.sort(-jnp.exp(lp_bsw), axis=-1)
    q = -jnp.sort(-jnp.exp(lq_bsv), axis=-1)
    n = max(p.shape[-1], q.shape[-1])
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n - a.shape[-1])])  # noqa: E731
    return jnp.sum(jnp.abs(pad(p) - pad(q)), axis=-1)


def cross_divergence(
    student_logits: jax.Array,
    teacher_lp: jax.Array,
    cfg: DistillLossConfig,
    vmap: VocabMap | None,
    method: str,
) -> jax.Array:
    """Per-token divergence [...] between the teacher's log-probs [..., Vt] (at T) and the
    student's logits [..., Vs] / T, by `method` (`METHODS`; ``mapped`` needs `vmap`)."""
    zt = student_logits.astype(jnp.float32) / cfg.temperature
    lq = zt - jax.nn.logsumexp(zt, axis=-1, keepdims=True)
    lp = jax.lax.stop_gradient(teacher_lp.astype(jnp.float32))
    if method == "uld":
        return uld_distance(lp, lq)
    if method == "first_byte":
        return _divergence(*first_byte_buckets(lp, lq, vmap), cfg)
    if method != "mapped":
        raise ValueError(f"cross-tokenizer method {method!r}, expected one of {METHODS}")
    lp, lq = mapped_buckets(lp, lq, vmap)
    return _divergence(lp, lq, cfg)


def at_student_positions(teacher_lp_btw: jax.Array, align_bs: jax.Array) -> jax.Array:
    """[B, S, Vt] the teacher's log-probs at each student position's aligned teacher
    position (position 0's where unmatched: the loss leaves those out)."""
    idx = jnp.maximum(align_bs, 0).astype(jnp.int32)[..., None]
    return jnp.take_along_axis(teacher_lp_btw, idx, axis=1)


def cross_kd_loss_chunked(
    x_bsd: jax.Array,
    head_dv: jax.Array,
    teacher_lp_btw: jax.Array,
    align_bs: jax.Array,
    targets_bs: jax.Array,
    mask_bs: jax.Array,
    cfg: DistillLossConfig,
    *,
    vmap: VocabMap | None,
    method: str,
    vocab_limit: int | None = None,
    chunk: int | None = None,
    compute_dtype=jnp.float32,
    softcap: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """loss = alpha * T^2 * KD + (1 - alpha) * CE with KD across vocabularies, from the
    student's hidden states a chunk of positions at a time (`distill.models.vocab_loss`).

    teacher_lp_btw: the teacher's dense log-probs [B, T, Vt] on its own rows; align_bs
    [B, S] int32: the teacher position of each student position, -1 unmatched. KD is the
    mean over masked, aligned positions; CE the mean over masked ones. Metrics as
    `kd_loss` plus "aligned_fraction" (aligned share of the masked positions)."""
    lp = at_student_positions(jax.lax.stop_gradient(teacher_lp_btw), align_bs)
    aligned = (align_bs >= 0).astype(jnp.float32)

    def token_fn(z_bcv: jax.Array, t: Tree) -> Tree:
        kd = cross_divergence(z_bcv, t["lp"], cfg, vmap, method)
        return {
            "kd": jnp.where(t["aligned"] > 0, kd, 0.0),
            "ce": _token_ce(z_bcv, t["targets"]),
            "aligned": t["aligned"],
        }

    sums = _chunked_sums(
        token_fn,
        x_bsd,
        head_dv,
        {"targets": targets_bs, "aligned": aligned},
        {"lp": lp},
        mask_bs,
        vocab_limit=vocab_limit,
        chunk=chunk,
        compute_dtype=compute_dtype,
        softcap=softcap,
    )
    tokens = jnp.sum(mask_bs.astype(jnp.float32))
    kd = sums["kd"] / jnp.maximum(sums["aligned"], 1.0)
    ce = sums["ce"] / jnp.maximum(tokens, 1.0)
    loss = cfg.alpha * cfg.temperature**2 * kd + (1.0 - cfg.alpha) * ce
    return loss, {
        "loss": loss,
        "kd_loss": kd,
        "ce_loss": ce,
        "tokens": tokens,
        "aligned_fraction": sums["aligned"] / jnp.maximum(tokens, 1.0),
    }
