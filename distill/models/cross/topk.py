"""Cross-tokenizer divergences from a top-k teacher: its k largest log-probs at a position,
in its own vocabulary, and the mass outside them (the tail, 1 - sum(exp(top-k))), as the
one-vocabulary top-k (`distill.models.losses`) sends them. Each method of
`distill.models.cross.losses` coarse-grains both distributions onto buckets the top-k
determine, plus one tail bucket:

- ``mapped``: the student ids the top-k teacher ids spell, then the tail (the teacher's mass
  outside its mapped top-k; the student's on every other id). One tokenizer on both sides
  gives the one-vocabulary top-k loss bit for bit.
- ``first_byte``: the first bytes the top-k ids start with, then the tail (the teacher's
  mass outside its top-k; the student's on the other first bytes).
- ``byte_path`` (`cross_losses.byte_path_buckets` with `seen_ndb`): depth 0 as
  ``first_byte``; deeper, the child bytes in the top-k, the rest with "ends here".
- ``uld``: both sorted distributions, the ranks past k in one bucket.

A top-k that holds every id of the teacher's tokenizer has no tail: the loss scatters it
back (`dense_from_topk`) and is the dense loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distill.config import DistillLossConfig
from distill.data.token_bytes import FirstBytes, VocabMap
from distill.models.losses import PADDED_LOGIT, TAIL_FLOOR, _divergence
from distill.models.topk import sort_descending


def bucket_sums(l_bsv: jax.Array, bucket: np.ndarray, keep: np.ndarray) -> jax.Array:
    """Probabilities [..., len(keep)]: those [..., V] of `exp(l)` summed by bucket, of the
    buckets `keep` (ids of bucket -1 dropped)."""
    seg = np.where(bucket >= 0, bucket, FirstBytes.size)
    p = jnp.exp(l_bsv).reshape(-1, l_bsv.shape[-1]).T  # [V, N]: segments on the leading axis
    summed = jax.ops.segment_sum(p, jnp.asarray(seg), num_segments=FirstBytes.size + 1)
    return summed[jnp.asarray(keep)].T.reshape(*l_bsv.shape[:-1], len(keep))


def first_byte_keep(fb: FirstBytes) -> np.ndarray:
    """The first-byte buckets both vocabularies reach."""
    return np.intersect1d(fb.teacher[fb.teacher >= 0], fb.student[fb.student >= 0])


def renormalised(p: jax.Array, valid: jax.Array | bool) -> jax.Array:
    """log of `p` over the `valid` buckets (True: all), renormalised over them; PADDED_LOGIT
    elsewhere."""
    p = jnp.where(valid, p, 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.where(valid, jnp.log(jnp.maximum(p, 1e-30)), PADDED_LOGIT)


def teacher_tail(lp_k: jax.Array) -> jax.Array:
    """[...] the teacher's mass outside its top-k log-probs [..., k], floored at 0."""
    return jnp.maximum(-jnp.expm1(jax.nn.logsumexp(lp_k, axis=-1)), 0.0)


def dense_from_topk(lp_k: jax.Array, ids_k: jax.Array, vocab: int) -> jax.Array:
    """[..., vocab] log-probs holding the top-k at their ids and -inf elsewhere (the dense
    teacher's value for its masked ids): the dense teacher when the top-k hold every id."""
    full = jnp.full((*lp_k.shape[:-1], vocab), -jnp.inf, jnp.float32)
    idx = ids_k.astype(jnp.int32)
    return jnp.put_along_axis(full, idx, lp_k.astype(jnp.float32), axis=-1, inplace=False)


def mapped_topk_buckets(
    zt: jax.Array, lse: jax.Array, lp_k: jax.Array, ids_k: jax.Array, vmap: VocabMap
) -> tuple[jax.Array, jax.Array]:
    """Teacher and student log-probs over k + 1 buckets: the student ids the top-k teacher
    ids spell (an unmapped one's bucket holds nothing: PADDED_LOGIT on both sides), then the
    tail. The teacher's tail is its mass outside its mapped top-k (outside its top-k, and on
    top-k ids no student token spells), floored at TAIL_FLOOR; the student's its mass on
    every other id, a logsumexp (exact). zt [..., Vs] the student's logits / T, lse their
    logsumexp. With one tokenizer these are `losses._topk_buckets`' buckets, bit for bit."""
    s_ids = jnp.asarray(vmap.student_of)[ids_k]
    mapped = s_ids >= 0
    lq_k = jnp.take_along_axis(zt - lse[..., None], jnp.maximum(s_ids, 0), axis=-1)
    at = jnp.where(mapped, s_ids, zt.shape[-1])  # an unmapped id: past the end, dropped
    in_topk = jnp.put_along_axis(
        jnp.zeros(zt.shape, bool), at, True, axis=-1, inplace=False, mode="drop"
    )
    lq_tail = jax.nn.logsumexp(jnp.where(in_topk, -jnp.inf, zt), axis=-1) - lse
    p_tail = -jnp.expm1(jax.nn.logsumexp(jnp.where(mapped, lp_k, -jnp.inf), axis=-1))
    lp_tail = jnp.log(jnp.maximum(p_tail, TAIL_FLOOR))
    lp = jnp.concatenate([jnp.where(mapped, lp_k, PADDED_LOGIT), lp_tail[..., None]], axis=-1)
    lq = jnp.concatenate([jnp.where(mapped, lq_k, PADDED_LOGIT), lq_tail[..., None]], axis=-1)
    return lp, lq


def allowed_after(fb: FirstBytes, keep: np.ndarray, inputs: jax.Array | None) -> jax.Array | None:
    """[..., len(keep)] bool: the first-byte buckets that can follow each student input token
    (`inputs` [...] ids, `FirstBytes.follows`); every bucket for a token never seen followed.
    None without the table or the inputs (no condition)."""
    if fb.follows is None or inputs is None:
        return None
    table = fb.follows[:, keep]
    table = table | ~table.any(axis=-1, keepdims=True)
    return jnp.asarray(table)[inputs]


def first_byte_topk_buckets(
    lq_bsv: jax.Array,
    lp_k: jax.Array,
    ids_k: jax.Array,
    fb: FirstBytes,
    inputs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`first_byte_buckets` from a top-k teacher: over the first bytes both vocabularies
    reach that some top-k id starts with ("seen"), plus a tail bucket. The teacher's seen
    buckets hold its top-k mass summed by first byte, its tail its mass outside the top-k
    (floored at TAIL_FLOOR); the student's tail holds its mass on the unseen bytes. The
    teacher's tokens outside its top-k are taken to start with unseen bytes: exact for a
    byte-level teacher (its tail is the other bytes), for a BPE teacher an approximation
    (a tail token starting with a seen byte is counted in the tail, not in its byte). With
    the student's input tokens `inputs` (`allowed_after`), the buckets that cannot follow
    the input token are left out on both sides, as the dense loss does; the teacher's tail
    keeps all its mass outside the top-k (which bytes it holds is not known)."""
    keep = first_byte_keep(fb)
    n = len(keep)
    place = np.full(FirstBytes.size + 1, n, np.int32)  # bucket -> index in keep; n: dropped
    place[keep] = np.arange(n)
    t_place = jnp.asarray(place[np.where(fb.teacher >= 0, fb.teacher, FirstBytes.size)])[ids_k]
    lead, k = lp_k.shape[:-1], lp_k.shape[-1]
    rows = jnp.arange(int(np.prod(lead)))[:, None]
    flat = t_place.reshape(-1, k)
    p_seen = jnp.zeros((len(rows), n + 1)).at[rows, flat].add(jnp.exp(lp_k).reshape(-1, k))
    seen = jnp.zeros((len(rows), n + 1), bool).at[rows, flat].set(True)
    p_seen, seen = p_seen[:, :n].reshape(*lead, n), seen[:, :n].reshape(*lead, n)
    q = bucket_sums(lq_bsv, fb.student, keep)
    allowed = allowed_after(fb, keep, inputs)
    if allowed is not None:
        seen, q = seen & allowed, jnp.where(allowed, q, 0.0)
    p_tail = jnp.maximum(teacher_tail(lp_k), TAIL_FLOOR)
    q_tail = jnp.sum(jnp.where(seen, 0.0, q), axis=-1)
    valid = jnp.concatenate([seen, jnp.ones((*lead, 1), bool)], axis=-1)
    p_all = jnp.concatenate([jnp.where(seen, p_seen, 0.0), p_tail[..., None]], axis=-1)
    q_all = jnp.concatenate([jnp.where(seen, q, 0.0), q_tail[..., None]], axis=-1)
    return renormalised(p_all, valid), renormalised(q_all, valid)


def uld_topk_distance(lp_k: jax.Array, lq_bsv: jax.Array, tail_empty: bool = False) -> jax.Array:
    """[...] ULD from a top-k teacher: both distributions sorted in decreasing order and
    coarse-grained past rank k, sum_i<k |p_(i) - q_(i)| + |p_tail - q_tail|, each tail the
    mass past rank k. `tail_empty`: the top-k hold every teacher id (p_tail is 0, not the
    rounding of 1 - sum)."""
    k = lp_k.shape[-1]
    p = sort_descending(jnp.exp(lp_k))
    p_tail = jnp.zeros(p.shape[:-1], jnp.float32) if tail_empty else teacher_tail(lp_k)
    q = sort_descending(jnp.exp(lq_bsv))
    q = jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, max(k - q.shape[-1], 0))])
    q_tail = jnp.sum(q[..., k:], axis=-1)
    return jnp.sum(jnp.abs(p - q[..., :k]), axis=-1) + jnp.abs(p_tail - q_tail)


def cross_topk_divergence(
    student_logits: jax.Array,
    lp_k: jax.Array,
    ids_k: jax.Array,
    cfg: DistillLossConfig,
    vmap: VocabMap | FirstBytes | None,
    method: str,
    tail_empty: bool = False,
    inputs: jax.Array | None = None,
) -> jax.Array:
    """Per-token divergence [...] between a top-k teacher (log-probs lp_k and its own ids
    ids_k [..., k], at T) and the student's logits [..., Vs] / T, by `method`: ``mapped``,
    ``first_byte`` (conditioned on the student's input tokens `inputs`, when given) or
    ``uld`` (the module docstring)."""
    zt = student_logits.astype(jnp.float32) / cfg.temperature
    lse = jax.nn.logsumexp(zt, axis=-1)
    lp_k = jax.lax.stop_gradient(lp_k.astype(jnp.float32))
    ids_k = ids_k.astype(jnp.int32)
    if method == "uld":
        return uld_topk_distance(lp_k, zt - lse[..., None], tail_empty)
    if method == "first_byte":
        buckets = first_byte_topk_buckets(zt - lse[..., None], lp_k, ids_k, vmap, inputs)
        return _divergence(*buckets, cfg)
    if method != "mapped":
        raise ValueError(f"cross-tokenizer top-k method {method!r}: mapped, first_byte or uld")
    return _divergence(*mapped_topk_buckets(zt, lse, lp_k, ids_k, vmap), cfg)
