"""Distillation across vocabularies: a teacher and a student with different tokenizers.

The teacher's dense log-probs (its own vocabulary Vt, at temperature T) arrive at the
student's positions through the alignment of `distill.data.cross.rows`: position j of the
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
A top-k teacher (`teacher.top_k`) is compared through `distill.models.cross.topk`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from distill.config import DistillLossConfig
from distill.data.byte_paths import BytePaths
from distill.data.token_bytes import FirstBytes, VocabMap
from distill.models.cross.topk import (
    allowed_after,
    bucket_sums,
    cross_topk_divergence,
    dense_from_topk,
    first_byte_keep,
    first_byte_topk_buckets,
    renormalised,
)
from distill.models.losses import PADDED_LOGIT, TAIL_FLOOR, _divergence, _token_ce
from distill.models.topk import sort_descending
from distill.models.vocab_loss import Tree, _chunked_sums
from distill.types import TeacherOutput

METHODS = ("mapped", "uld", "first_byte", "byte_path")


@dataclass(frozen=True)
class CrossSpec:
    """How a cross-tokenizer step compares vocabularies: `method` (`METHODS`), the tables
    of ``mapped``, ``first_byte`` and ``byte_path``, and `teacher_live`, the ids of the
    teacher's tokenizer (a top-k teacher with k >= it has no tail). Hashable: part of a
    compiled step's key."""

    method: str
    vmap: VocabMap | FirstBytes | BytePaths | None = None
    teacher_live: int | None = None


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


def _by_first_byte(
    l_bsv: jax.Array, bucket: np.ndarray, keep: np.ndarray, allowed: jax.Array | None = None
) -> jax.Array:
    """Log-probs [..., len(keep)] of the buckets `keep`: `bucket_sums` renormalised over
    `keep`, or over the `allowed` ones [..., len(keep)] bool (PADDED_LOGIT on the others)."""
    return renormalised(bucket_sums(l_bsv, bucket, keep), True if allowed is None else allowed)


def first_byte_buckets(
    lp_bsw: jax.Array, lq_bsv: jax.Array, fb: FirstBytes, inputs: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Both distributions as next-byte distributions: each token's probability summed into
    the bucket of its first byte (`FirstBytes`), over the buckets both vocabularies reach,
    each side renormalised over them. Exact for a byte-level teacher (its distribution is
    the next byte's), and consistent with the student's targets: the student's next token
    starts with the byte the teacher predicts. With `fb.follows` and the student's input
    tokens `inputs` [...], both sides are renormalised over the buckets that can follow
    each input token: the teacher conditioned on the student's token boundary."""
    keep = first_byte_keep(fb)
    allowed = allowed_after(fb, keep, inputs)
    return (
        _by_first_byte(lp_bsw, fb.teacher, keep, allowed),
        _by_first_byte(lq_bsv, fb.student, keep, allowed),
    )


def byte_path_buckets(
    lq_nv: jax.Array,
    lp_ndb: jax.Array,
    targets_n: jax.Array,
    deep_ok_n: jax.Array,
    bp: BytePaths,
    seen_ndb: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Teacher and student log-probs [n, D, 257] of the next byte after each of the first
    d = 1..D bytes of the target token, and which depths count [n, D] (`byte_path_divergence`).

    lq_nv: the student's log-probs; lp_ndb: the teacher's log-probs of each byte at its
    positions d = 1..D after the aligned one; deep_ok_n: whether the position after the
    whole target exists (the next student position is aligned). Buckets: the 256 bytes
    some student token goes on with, then "ends here" (the token that is exactly the
    prefix). The student's mass on them is its probability of the tokens under each child
    node (and of the prefix's token), over that of the tokens under the prefix; the
    teacher's is its probability of each child byte, its other mass in "ends here". Both
    are renormalised over the buckets the student has.

    `seen_ndb` [n, D, 256] (a top-k teacher): which bytes its top-k hold at each position.
    A child byte outside them joins "ends here" on both sides (the student's mass on it; the
    teacher's mass outside its top-k is already there), so the tail is never read as zero."""
    q = jnp.exp(lq_nv)
    under = jax.ops.segment_sum(
        q.T[jnp.asarray(bp.pair_id)], jnp.asarray(bp.pair_node), num_segments=len(bp.ends)
    ).T  # [n, N]: the probability of the tokens under each node
    path = jnp.asarray(bp.path)[targets_n][:, 1:]  # [n, D] node after d bytes
    length = jnp.sum(path >= 0, axis=-1, keepdims=True)  # bytes followed, up to D
    depth = jnp.arange(1, bp.depth + 1)
    counts = (path >= 0) & ((depth < length) | deep_ok_n[:, None])  # the last: its successor
    node = jnp.maximum(path, 0)
    kids = jnp.asarray(bp.child)[node]  # [n, D, 256]
    ends = jnp.asarray(bp.ends)[node]  # [n, D]
    q_kids = jnp.take_along_axis(under[:, None, :], jnp.maximum(kids, 0).reshape(len(q), -1)
                                 [:, None, :], axis=-1).reshape(kids.shape)  # fmt: skip
    q_ends = jnp.take_along_axis(q, jnp.maximum(ends, 0), axis=-1)
    seen = kids >= 0 if seen_ndb is None else (kids >= 0) & seen_ndb
    if seen_ndb is None:
        rest, rest_ok = q_ends, ends >= 0
    else:
        unseen = (kids >= 0) & ~seen
        rest = jnp.where(ends >= 0, q_ends, 0.0) + jnp.sum(jnp.where(unseen, q_kids, 0.0), -1)
        rest_ok = (ends >= 0) | jnp.any(unseen, axis=-1)
    valid = jnp.concatenate([seen, rest_ok[..., None]], axis=-1)
    q_all = jnp.concatenate([jnp.where(seen, q_kids, 0.0), rest[..., None]], axis=-1)
    p_bytes = jnp.exp(lp_ndb)
    p_kids = jnp.where(seen, p_bytes, 0.0)
    p_rest = jnp.maximum(1.0 - jnp.sum(p_kids, axis=-1, keepdims=True), 0.0)
    p_all = jnp.concatenate([p_kids, p_rest], axis=-1)
    return renormalised(p_all, valid), renormalised(q_all, valid), counts


def byte_path_divergence(
    lp_v: jax.Array,
    lq_v: jax.Array,
    lp_ndb: jax.Array,
    targets_n: jax.Array,
    deep_ok_n: jax.Array,
    cfg: DistillLossConfig,
    bp: BytePaths,
    inputs_n: jax.Array | None = None,
) -> jax.Array:
    """[n] the first-byte divergence (depth 0) plus, along the target token's bytes, the
    divergence of the next-byte distributions after each of its first d bytes (the chain
    rule of the divergence between distributions over byte strings, read along the observed
    path). lp_v [n, Vt] the teacher at the aligned position, lq_v [n, Vs] the student;
    inputs_n [n] the student's input tokens (`first_byte_buckets`)."""
    first = _divergence(*first_byte_buckets(lp_v, lq_v, bp.first, inputs_n), cfg)
    return first + deeper_bytes_divergence(lq_v, lp_ndb, targets_n, deep_ok_n, cfg, bp)


def deeper_bytes_divergence(lq_v, lp_ndb, targets_n, deep_ok_n, cfg, bp, seen_ndb=None):
    """[n] the byte path's divergences after the first byte, summed over the depths that
    count (`byte_path_buckets`)."""
    lp, lq, counts = byte_path_buckets(lq_v, lp_ndb, targets_n, deep_ok_n, bp, seen_ndb)
    deeper = jnp.where(counts, _divergence(lp, lq, cfg), 0.0)
    return jnp.sum(deeper, axis=-1)


def uld_distance(lp_bsw: jax.Array, lq_bsv: jax.Array) -> jax.Array:
    """[...] sum |sort(p) - sort(q)|: both distributions sorted in decreasing order, the
    shorter vocabulary padded with zero probabilities."""
    p = sort_descending(jnp.exp(lp_bsw))
    q = sort_descending(jnp.exp(lq_bsv))
    n = max(p.shape[-1], q.shape[-1])
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n - a.shape[-1])])  # noqa: E731
    return jnp.sum(jnp.abs(pad(p) - pad(q)), axis=-1)


def cross_divergence(
    student_logits: jax.Array,
    teacher_lp: jax.Array,
    cfg: DistillLossConfig,
    vmap: VocabMap | None,
    method: str,
    inputs: jax.Array | None = None,
) -> jax.Array:
    """Per-token divergence [...] between the teacher's log-probs [..., Vt] (at T) and the
    student's logits [..., Vs] / T, by `method` (`METHODS`; ``mapped`` needs `vmap`;
    ``first_byte`` reads the student's input tokens `inputs` [...], see
    `first_byte_buckets`)."""
    zt = student_logits.astype(jnp.float32) / cfg.temperature
    lq = zt - jax.nn.logsumexp(zt, axis=-1, keepdims=True)
    lp = jax.lax.stop_gradient(teacher_lp.astype(jnp.float32))
    if method == "uld":
        return uld_distance(lp, lq)
    if method == "first_byte":
        return _divergence(*first_byte_buckets(lp, lq, vmap, inputs), cfg)
    if method != "mapped":
        raise ValueError(f"cross-tokenizer method {method!r}, expected one of {METHODS}")
    lp, lq = mapped_buckets(lp, lq, vmap)
    return _divergence(lp, lq, cfg)


def at_student_positions(teacher_lp_btw: jax.Array, align_bs: jax.Array) -> jax.Array:
    """[B, S, ...] the teacher's values [B, T, ...] (log-probs, top-k ids) at each student
    position's aligned teacher position (position 0's where unmatched: the loss leaves
    those out)."""
    idx = jnp.maximum(align_bs, 0).astype(jnp.int32)[..., None]
    return jnp.take_along_axis(teacher_lp_btw, idx, axis=1)


def byte_path_inputs(
    teacher_lp_btw: jax.Array, align_bs: jax.Array, bp: BytePaths, topk: bool = False
) -> dict:
    """The byte-path loss's per-position inputs: "path" [B, S, D, 256], the teacher's
    log-probs of each byte at the D positions after the aligned one (its positions inside
    the target token's span, for a byte-level teacher), and "deep_ok" [B, S], whether the
    position after the whole target is aligned (then the last depth has its teacher).
    `topk`: `teacher_lp_btw` holds a top-k teacher's log-probs at their ids, -inf elsewhere
    (`dense_from_topk`); "seen" [B, S, D, 256] says which bytes its top-k hold."""
    b, s = align_bs.shape
    ids = jnp.asarray(np.maximum(bp.teacher_byte, 0))
    lpb = jnp.where(jnp.asarray(bp.teacher_byte >= 0), teacher_lp_btw[..., ids], PADDED_LOGIT)
    idx = jnp.maximum(align_bs, 0)[..., None] + jnp.arange(1, bp.depth + 1)
    idx = jnp.minimum(idx, teacher_lp_btw.shape[1] - 1).reshape(b, s * bp.depth, 1)
    path = jnp.take_along_axis(lpb, idx, axis=1).reshape(b, s, bp.depth, 256)
    deep_ok = jnp.concatenate([align_bs[:, 1:] >= 0, jnp.zeros((b, 1), bool)], axis=1)
    out = {"path": path, "deep_ok": deep_ok}
    if topk:
        out["seen"] = path > -jnp.inf
        out["path"] = jnp.maximum(path, PADDED_LOGIT)  # exp is still 0; no -inf downstream
    return out


def _byte_path_tokens(z_bcv: jax.Array, t: Tree, cfg: DistillLossConfig, bp: BytePaths):
    """`byte_path_divergence` [B, c] of one chunk's student logits and inputs; from a top-k
    teacher ("ids" and "seen" in `t`), its first byte by `first_byte_topk_buckets`."""
    zt = z_bcv.astype(jnp.float32) / cfg.temperature
    lq = zt - jax.nn.logsumexp(zt, axis=-1, keepdims=True)
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    lp = flat(t["lp"].astype(jnp.float32))
    inputs = flat(t["inputs"]) if "inputs" in t else None
    if "ids" in t:
        buckets = first_byte_topk_buckets(flat(lq), lp, flat(t["ids"]), bp.first, inputs)
    else:
        buckets = first_byte_buckets(lp, flat(lq), bp.first, inputs)
    first = _divergence(*buckets, cfg)
    seen = flat(t["seen"]) if "seen" in t else None
    deeper = deeper_bytes_divergence(
        flat(lq), flat(t["path"]), flat(t["targets"]), flat(t["deep_ok"]), cfg, bp, seen
    )
    return (first + deeper).reshape(z_bcv.shape[:2])


def _teacher_vocab(vmap: VocabMap | FirstBytes | BytePaths | None) -> int | None:
    """The teacher model's vocabulary size, from the method's tables (None for ``uld``)."""
    if isinstance(vmap, VocabMap):
        return len(vmap.student_of)
    if isinstance(vmap, BytePaths):
        return len(vmap.first.teacher)
    return None if vmap is None else len(vmap.teacher)


def _teacher_inputs(teacher: TeacherOutput, align_bs, method, vmap, teacher_live):
    """(per-token inputs, dense inputs on the teacher's rows (gathered at the aligned
    positions a chunk at a time), whether the divergence reads a top-k teacher, and
    whether its top-k hold every live teacher id) of `cross_kd_loss_chunked`. A top-k
    holding every id is scattered back into the dense teacher (``uld`` excepted), so that
    it gives the dense loss; ``byte_path`` reads the deeper bytes from that scatter."""
    lp = jax.lax.stop_gradient(teacher.logprobs)
    vocab = _teacher_vocab(vmap)
    whole = teacher.ids is not None and teacher.ids.shape[-1] >= (teacher_live or vocab or 0)
    if teacher.ids is None or (whole and method != "uld"):
        if teacher.ids is not None:
            lp = dense_from_topk(lp, teacher.ids, vocab)
        per_token = byte_path_inputs(lp, align_bs, vmap) if method == "byte_path" else {}
        return per_token, {"lp": lp}, False, whole
    per_token = {
        "lp": at_student_positions(lp, align_bs),
        "ids": at_student_positions(teacher.ids.astype(jnp.int32), align_bs),
    }
    if method == "byte_path":
        per_token.update(byte_path_inputs(dense_from_topk(lp, teacher.ids, vocab), align_bs,
                                          vmap, topk=True))  # fmt: skip
    return per_token, {}, True, whole


def ce_weight(cfg: DistillLossConfig) -> float:
    """The cross-entropy's weight across vocabularies (`distill.cross_ce`): 1, or 1 - alpha
    as with one vocabulary. The divergence compares the two distributions only through a
    coarse-graining (first bytes, the tokens both vocabularies spell, sorted masses), so a
    CE weighed down by alpha leaves the rest of the student's distribution untaught: under
    the quick start's teacher at alpha 0.9 the student stalled at the teacher's bits per
    byte (docs/benchmarks/2026-11-27-alpha-gate.md)."""
    return 1.0 if cfg.cross_ce == "full" else 1.0 - cfg.alpha


def cross_kd_loss_chunked(
    x_bsd: jax.Array,
    head_dv: jax.Array,
    teacher: TeacherOutput,
    align_bs: jax.Array,
    targets_bs: jax.Array,
    mask_bs: jax.Array,
    cfg: DistillLossConfig,
    *,
    vmap: VocabMap | FirstBytes | BytePaths | None,
    method: str,
    teacher_live: int | None = None,
    vocab_limit: int | None = None,
    chunk: int | None = None,
    compute_dtype=jnp.float32,
    softcap: float | None = None,
    inputs_bs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """loss = alpha * T^2 * KD + w * CE with KD across vocabularies (w: `ce_weight`), from
    the student's hidden states a chunk of positions at a time (`distill.models.vocab_loss`).

    teacher: on its own rows, dense log-probs [B, T, Vt] or top-k [B, T, k] with its ids
    (`cross_topk_divergence`; k >= `teacher_live`, every id of its tokenizer, is the dense
    loss); align_bs [B, S] int32: the teacher position of each student position, -1
    unmatched; inputs_bs [B, S]: the student's input tokens, which ``first_byte`` and
    ``byte_path`` condition the teacher's next byte on (`first_byte_buckets`). KD is the
    mean over masked, aligned positions; CE the mean over masked ones. Metrics as
    `kd_loss` plus "aligned_fraction" (aligned share of the masked positions)."""
    per_token, at, topk, whole = _teacher_inputs(teacher, align_bs, method, vmap, teacher_live)
    aligned = (align_bs >= 0).astype(jnp.float32)
    per_token.update(targets=targets_bs, aligned=aligned)
    if inputs_bs is not None:
        per_token["inputs"] = inputs_bs

    def token_fn(z_bcv: jax.Array, t: Tree) -> Tree:
        if method == "byte_path":
            kd = _byte_path_tokens(z_bcv, t, cfg, vmap)
        elif topk:
            kd = cross_topk_divergence(
                z_bcv, t["lp"], t["ids"], cfg, vmap, method, whole, t.get("inputs")
            )
        else:
            kd = cross_divergence(z_bcv, t["lp"], cfg, vmap, method, t.get("inputs"))
        return {
            "kd": jnp.where(t["aligned"] > 0, kd, 0.0),
            "ce": _token_ce(z_bcv, t["targets"]),
            "aligned": t["aligned"],
        }

    sums = _chunked_sums(
        token_fn,
        x_bsd,
        head_dv,
        per_token,
        {},
        mask_bs,
        vocab_limit=vocab_limit,
        chunk=chunk,
        compute_dtype=compute_dtype,
        softcap=softcap,
        at=(at, jnp.maximum(align_bs, 0).astype(jnp.int32)),
    )
    tokens = jnp.sum(mask_bs.astype(jnp.float32))
    kd = sums["kd"] / jnp.maximum(sums["aligned"], 1.0)
    ce = sums["ce"] / jnp.maximum(tokens, 1.0)
    loss = cfg.alpha * cfg.temperature**2 * kd + ce_weight(cfg) * ce
    return loss, {
        "loss": loss,
        "kd_loss": kd,
        "ce_loss": ce,
        "tokens": tokens,
        "aligned_fraction": sums["aligned"] / jnp.maximum(tokens, 1.0),
    }
