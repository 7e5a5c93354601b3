"""The flash-style XLA attention kernels behind `distill.models.attention`: `blockwise` (an
online softmax over key blocks, any platform) and `prefix` (each query block against its
whole causal prefix, short rows on CPU). Both save the logsumexp and recompute scores in a
`jax.custom_vjp` backward, so nothing of size S x S is kept for the gradient.

Scores are float32 `Scores(scale, softcap)` of q.k: scaled, then capped at
cap * tanh(s / cap) when `softcap` is set, whose derivative the backward applies. A
`window` (None, or an int32 scalar that may vary per layer under the layer scan) keeps the
keys with q_idx - window < k_idx; blockwise never visits key blocks wholly before it.

The block-major kernel is public for context parallelism (`distill.models.kernels.ring`):
`flash_state` / `flash_update` / `flash_result` run one online softmax over key spans cut
from other parts of the row (each at a position `offset`), and `flash_backward` takes the
whole output's logsumexp, so each span's share of the gradient comes from one call.

Attention sinks (gpt-oss): an optional learned logit per query head, `sinks` [KV, G] in the
kernels' head layout (`sink_heads`), joins every query's softmax denominator and adds no
value: p_j = exp(s_j) / (exp(sink) + sum_t exp(s_t)). The online softmax starts from it
(running max the sink, normaliser 1), so it counts once per query however many key spans
follow, and the logsumexp the backward reads includes it; its own gradient is
d sink = -sum over queries of p_sink * (dO . O), p_sink = exp(sink - logsumexp).
Values may be narrower or wider than queries and keys (DeepSeek-V3's MLA: v [.., hd_v]);
outputs have v's width.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from distill.collectives import cotangent

# Finite, so an all-masked block gives exp(0) (then zeroed) rather than exp(-inf + inf) = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Scores:
    """Float32 attention scores from q.k products: scaled, then soft-capped if `softcap`."""

    scale: float
    softcap: float | None = None

    def __call__(self, dots):
        s = dots * self.scale
        return s if self.softcap is None else self.softcap * jnp.tanh(s / self.softcap)

    def backward(self, dots, ds):
        """The cotangent of the q.k products from the scores' cotangent `ds`."""
        if self.softcap is None:
            return ds * self.scale
        t = jnp.tanh(dots * self.scale / self.softcap)
        return ds * (self.scale * (1.0 - t * t))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def sink_heads(sinks_h, n_kv: int):
    """Per-head sink logits [H] -> float32 [KV, G] (query head h = kv * G + g, as
    `query_blocks` groups them); None stays None."""
    return None if sinks_h is None else sinks_h.astype(jnp.float32).reshape(n_kv, -1)


def sink_grad(sinks_kg, lse, delta, axes):
    """d sink [KV, G] = -sum of p_sink * (dO . O) over the query `axes` of `lse` / `delta`
    (p_sink = exp(sink - lse)); summed over the mesh axes the queries vary over and the sinks
    do not (`collectives.cotangent`). None without sinks."""
    if sinks_kg is None:
        return None
    d = -jnp.sum(jnp.exp(sinks_kg[:, :, None] - lse) * delta, axis=axes)
    return cotangent(d, sinks_kg)


def window_mask(q_pos, k_pos, window):
    """Causal, and inside the window when there is one."""
    mask = q_pos >= k_pos
    return mask if window is None else mask & (q_pos - k_pos < window)


# --- blockwise ---------------------------------------------------------------------------


def blockwise(q, k, v, seg, scores: Scores, window, block_q: int, block_kv: int, sinks=None):
    """Pad S to whole blocks, lay the arrays out block-major, run the flash kernel. `sinks`:
    float32 [H] sink logits, or None."""
    if block_q < 1 or block_kv < 1:
        raise ValueError(f"block sizes must be positive, got {block_q}, {block_kv}")
    b, s, h, d = q.shape
    n_kv = k.shape[2]
    bq, bk = min(block_q, s), min(block_kv, s)
    sp = round_up(s, math.lcm(bq, bk))
    # Padding sits after every real token, so causality alone keeps it out of real rows;
    # padded rows attend to themselves (finite) and are sliced off.
    pad = [(0, 0), (0, sp - s), (0, 0), (0, 0)]
    q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    seg = jnp.pad(seg, [(0, 0), (0, sp - s)])
    qb, seg_q = query_blocks(q, n_kv, bq), seg_blocks(seg, bq)
    kb, vb, seg_k = kv_blocks(k, bk), kv_blocks(v, bk), seg_blocks(seg, bk)
    ob = _flash(qb, kb, vb, seg_q, seg_k, window, sink_heads(sinks, n_kv), scores)
    return from_query_blocks(ob)[:, :s]


def query_blocks(q_bshd, n_kv: int, bq: int):
    """[B, S, H, d] -> [S/bq, B, KV, G, bq, d]: the kernel's block-major queries."""
    b, s, h, d = q_bshd.shape
    return q_bshd.reshape(b, s // bq, bq, n_kv, h // n_kv, d).transpose(1, 0, 3, 4, 2, 5)


def from_query_blocks(ob):
    """[nq, B, KV, G, bq, d] -> [B, nq * bq, KV * G, d], the inverse of `query_blocks`."""
    nq, b, n_kv, g, bq, d = ob.shape
    return ob.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, n_kv * g, d)


def kv_blocks(k_bskd, bk: int):
    """[B, S, KV, d] -> [S/bk, B, KV, bk, d]."""
    b, s, n_kv, d = k_bskd.shape
    return k_bskd.reshape(b, s // bk, bk, n_kv, d).transpose(1, 0, 3, 2, 4)


def from_kv_blocks(kb):
    """[nk, B, KV, bk, d] -> [B, nk * bk, KV, d], the inverse of `kv_blocks`."""
    nk, b, n_kv, bk, d = kb.shape
    return kb.transpose(1, 0, 3, 2, 4).reshape(b, nk * bk, n_kv, d)


def seg_blocks(seg_bs, block: int):
    """[B, S] -> [S/block, B, block]."""
    b, s = seg_bs.shape
    return seg_bs.reshape(b, s // block, block).transpose(1, 0, 2)


def _block_mask(i, j, seg_q_i, seg_k_j, window, bq: int, bk: int, offset=0):
    """[B, 1, 1, bq, bk]: causal, in the window and same segment, for query block i against
    key block j, the queries starting `offset` positions after the keys."""
    q_pos = offset + i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    same_doc = seg_q_i[:, :, None] == seg_k_j[:, None, :]
    return (same_doc & window_mask(q_pos, k_pos, window))[:, None, None]


def _key_span(i, window, bq: int, bk: int, nk: int, offset=0):
    """[first, stop) of the key blocks query block i sees, the queries starting `offset`
    positions after the keys: those before `first` are out of every query's window, those
    from `stop` after the last query (above the diagonal). Empty when none is visible."""
    stop = jnp.clip((offset + (i + 1) * bq - 1) // bk + 1, 0, nk)
    if window is None:
        return 0, stop
    return jnp.maximum(offset + i * bq - window + 1, 0) // bk, stop


def _query_span(j, window, bq: int, bk: int, nq: int, offset=0):
    """[first, stop) of the query blocks that see key block j: those before `first` lie
    above the diagonal, those from `stop` have j's keys out of their windows."""
    first = jnp.clip((j * bk - offset) // bq, 0, nq)
    if window is None:
        return first, nq
    return first, jnp.minimum(((j + 1) * bk + window - 2 - offset) // bq, nq - 1) + 1


def flash_forward(qb, kb, vb, seg_q, seg_k, window, sinks, scores: Scores):
    """Blocked output [nq, B, KV, G, bq, dv] (q's dtype) and its logsumexp [nq, B, KV, G, bq]
    (float32), from block-major q [nq, B, KV, G, bq, d], k [nk, B, KV, bk, d], v [nk, B, KV,
    bk, dv] and segment ids [nq, B, bq] / [nk, B, bk] of one span of a row; `sinks` [KV, G]
    or None."""
    return _flash_scan(qb, kb, vb, seg_q, seg_k, window, scores, 0, None, sinks)


def flash_state(qb, dv: int, sinks=None):
    """The online softmax's state before any key: running max, normaliser [nq, B, KV, G, bq]
    and unnormalised output [nq, B, KV, G, bq, dv], float32 (see `flash_update`). With
    `sinks` [KV, G] the state has seen each head's sink: max the sink, normaliser 1."""
    zeros = jnp.zeros_like(qb[..., 0], jnp.float32)  # varying over the mesh axes q does
    acc = jnp.broadcast_to(zeros[..., None], (*zeros.shape, dv))
    if sinks is None:
        return zeros + MASK_VALUE, zeros, acc
    return zeros + sinks[:, :, None], zeros + 1.0, acc


def flash_update(state, qb, kb, vb, seg_q, seg_k, window, scores: Scores, offset):
    """The online softmax `state` (`flash_state`) after the queries `qb` also attend to the
    keys `kb` / `vb` of another span of their row (context parallelism), whose first key
    lies `offset` (an int32 scalar) positions before the first query; negative: after it.
    Key blocks wholly after a query block's last query, or wholly before its window, are
    never visited. Threading one state through every span keeps one output-sized buffer
    live and orders the spans' work."""
    return _flash_scan(qb, kb, vb, seg_q, seg_k, window, scores, offset, state)


def flash_result(state, dtype):
    """(output in `dtype`, logsumexp float32) from an online softmax state; a query that saw
    no key gets 0 and `MASK_VALUE`."""
    m, denom, acc = state
    seen = denom > 0
    denom = jnp.where(seen, denom, 1.0)
    return (acc / denom[..., None]).astype(dtype), jnp.where(seen, m + jnp.log(denom), MASK_VALUE)


def _flash_scan(qb, kb, vb, seg_q, seg_k, window, scores: Scores, offset, state, sinks=None):
    """Per query block, the online softmax over the key blocks it sees. With `state` None
    each block starts afresh (from `sinks`, if any) and ends with (output, logsumexp); else
    it continues `state` and returns the new state."""
    nq, b, n_kv, g, bq, d = qb.shape
    nk, bk = kb.shape[0], kb.shape[3]

    def query_block(i, q_i, seg_q_i, init):
        def key_block(j, carry):
            m, denom, acc = carry
            dots = jnp.einsum("bkgqd,bksd->bkgqs", q_i, kb[j], preferred_element_type=jnp.float32)
            mask = _block_mask(i, j, seg_q_i, seg_k[j], window, bq, bk, offset)
            s = jnp.where(mask, scores(dots), MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum(
                "bkgqs,bksd->bkgqd", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32
            )
            return m_new, denom * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv

        first, stop = _key_span(i, window, bq, bk, nk, offset)
        return lax.fori_loop(first, stop, key_block, init)

    if state is None:

        def fresh(_, xs):
            i, q_i, seg_q_i = xs
            # carries made from q_i, so that under `shard_map` they vary over the same mesh
            # axes as q (a fresh constant would not, and fori_loop needs equal carry types)
            carry = query_block(i, q_i, seg_q_i, flash_state(q_i, vb.shape[-1], sinks))
            return None, flash_result(carry, qb.dtype)

        return lax.scan(fresh, None, (jnp.arange(nq), qb, seg_q))[1]

    def carried(i, state):  # updated in place: one state buffer, not an input and an output
        carry = query_block(i, qb[i], seg_q[i], jax.tree.map(lambda x: x[i], state))
        return jax.tree.map(lambda x, c: x.at[i].set(c), state, carry)

    return lax.fori_loop(0, nq, carried, state)


def saving_lse(forward, backward):
    """A `jax.custom_vjp` of `forward(qb, kb, vb, seg_q, seg_k, window, sinks, static) ->
    (out, lse)` returning out: it saves the inputs, out and lse, and differentiates with
    `backward(static, (qb, kb, vb, seg_q, seg_k, window, sinks, out, lse), d_out)`."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
    def attend(qb, kb, vb, seg_q, seg_k, window, sinks, static):
        return forward(qb, kb, vb, seg_q, seg_k, window, sinks, static)[0]

    def attend_fwd(*args):
        out, lse = forward(*args)
        return out, (*args[:7], out, lse)

    attend.defvjp(attend_fwd, backward)
    return attend


def _flash_bwd(scores: Scores, res, do_b):
    qb, kb, vb, seg_q, seg_k, window, sinks, ob, lse = res
    delta = jnp.sum(do_b.astype(jnp.float32) * ob.astype(jnp.float32), axis=-1)
    dq, dkb, dvb = flash_backward(qb, kb, vb, seg_q, seg_k, window, lse, delta, do_b, scores)
    dsinks = sink_grad(sinks, lse, delta, (0, 1, 4))  # [nq, B, KV, G, bq] -> [KV, G]
    return dq.astype(qb.dtype), dkb, dvb, None, None, None, dsinks


def flash_backward(
    qb, kb, vb, seg_q, seg_k, window, lse, delta, do_b, scores: Scores, offset=0, grads=None
):
    """FlashAttention-2 backward: per key block, visit the query blocks that see it, recompute
    p from the logsumexp `lse` [nq, B, KV, G, bq], accumulate dk/dv there and dq in place.

    `lse` and `delta` (sum of dO * O per query) are those of the whole output, so that a
    query span attending several key spans (context parallelism) gets each span's share of
    the gradient from this one call per span. Returns dq (float32) and dk, dv (k's and v's
    dtype), or with `grads` (float32 dq, dk, dv to add to, context parallelism) the float32
    sums. `offset` as in `flash_update`.
    """
    nq, _, _, _, bq, _ = qb.shape
    nk, bk = kb.shape[0], kb.shape[3]

    def key_block(j, k_j, v_j, seg_k_j, carry):
        def query_block(i, carry):
            dq, dk_j, dv_j = carry
            q_i, do_i = qb[i], do_b[i]
            dots = jnp.einsum("bkgqd,bksd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32)
            mask = _block_mask(i, j, seg_q[i], seg_k_j, window, bq, bk, offset)
            p = jnp.where(mask, jnp.exp(scores(dots) - lse[i][..., None]), 0.0)
            dv_j = dv_j + jnp.einsum(
                "bkgqs,bkgqd->bksd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bkgqd,bksd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = scores.backward(dots, p * (dp - delta[i][..., None])).astype(qb.dtype)
            dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds, k_j, preferred_element_type=jnp.float32)
            dk_j = dk_j + jnp.einsum(
                "bkgqs,bkgqd->bksd", ds, q_i, preferred_element_type=jnp.float32
            )
            return dq.at[i].add(dq_i), dk_j, dv_j

        first, stop = _query_span(j, window, bq, bk, nq, offset)
        return lax.fori_loop(first, stop, query_block, carry)

    if grads is None:

        def fresh(dq, xs):
            j, k_j, v_j, seg_k_j = xs
            # zeros varying like k_j, v_j under shard_map
            zeros = (jnp.zeros_like(k_j, jnp.float32), jnp.zeros_like(v_j, jnp.float32))
            dq, dk_j, dv_j = key_block(j, k_j, v_j, seg_k_j, (dq, *zeros))
            return dq, (dk_j.astype(kb.dtype), dv_j.astype(vb.dtype))

        dq0 = jnp.zeros_like(qb, jnp.float32)
        dq, (dkb, dvb) = lax.scan(fresh, dq0, (jnp.arange(nk), kb, vb, seg_k))
        return dq, dkb, dvb

    def carried(j, grads):  # dk, dv updated in place, not an input and an output
        dq, dk, dv = grads
        dq, dk_j, dv_j = key_block(j, kb[j], vb[j], seg_k[j], (dq, dk[j], dv[j]))
        return dq, dk.at[j].set(dk_j), dv.at[j].set(dv_j)

    return lax.fori_loop(0, nk, carried, grads)


_flash = saving_lse(flash_forward, _flash_bwd)


# --- prefix ------------------------------------------------------------------------------


def prefix(q, k, v, seg, scores: Scores, window, block: int, sinks=None):
    """Head-major copies [B, KV, G, S, d] and [B, KV, S, d], the blocks, and back. `sinks`:
    float32 [H] sink logits, or None."""
    if block < 1:
        raise ValueError(f"block size must be positive, got {block}")
    b, s, h, d = q.shape
    n_kv = k.shape[2]
    qh = q.reshape(b, s, n_kv, h // n_kv, d).transpose(0, 2, 3, 1, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    sinks = sink_heads(sinks, n_kv)
    o = _prefix_blocks(qh, kh, vh, seg, window, sinks, scores, min(block, s))
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s, h, v.shape[-1])


def _prefix_spans(s: int, block: int) -> list[tuple[int, int]]:
    """(start, end) of each query block; the last may be shorter."""
    return [(i, min(i + block, s)) for i in range(0, s, block)]


def _prefix_dots(qh, kh, seg, window, start: int, end: int):
    """q.k products [B, KV, G, end - start, end] of queries start:end against keys :end, and
    their mask (causal, in the window, same segment)."""
    dots = jnp.einsum(
        "bkgqd,bktd->bkgqt", qh[:, :, :, start:end], kh[:, :, :end],
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    q_pos = start + lax.broadcasted_iota(jnp.int32, (end - start, end), 0)
    k_pos = lax.broadcasted_iota(jnp.int32, (end - start, end), 1)
    same_doc = seg[:, start:end, None] == seg[:, None, :end]
    return dots, (same_doc & window_mask(q_pos, k_pos, window))[:, None, None]


def _prefix_forward(qh, kh, vh, seg, window, sinks, scores: Scores, block):
    """Output [B, KV, G, S, dv] and its logsumexp [B, KV, G, S] (float32), with `sinks`
    [KV, G] (or None) in each query's denominator."""
    outs, lses = [], []
    sink = None if sinks is None else sinks[:, :, None, None]  # [KV, G, 1, 1]
    for start, end in _prefix_spans(qh.shape[3], block):
        dots, mask = _prefix_dots(qh, kh, seg, window, start, end)
        s = jnp.where(mask, scores(dots), MASK_VALUE)
        m = s.max(axis=-1, keepdims=True)
        m = m if sink is None else jnp.maximum(m, sink)
        p = jnp.exp(s - m)  # masked entries underflow to 0: each row sees itself
        denom = p.sum(axis=-1, keepdims=True)
        denom = denom if sink is None else denom + jnp.exp(sink - m)
        pv = jnp.einsum(
            "bkgqt,bktd->bkgqd", p.astype(vh.dtype), vh[:, :, :end],
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        outs.append((pv / denom).astype(qh.dtype))
        lses.append((m + jnp.log(denom))[..., 0])
    return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _prefix_blocks(qh, kh, vh, seg, window, sinks, scores, block):
    return _prefix_forward(qh, kh, vh, seg, window, sinks, scores, block)[0]


def _prefix_fwd(qh, kh, vh, seg, window, sinks, scores, block):
    o, lse = _prefix_forward(qh, kh, vh, seg, window, sinks, scores, block)
    return o, (qh, kh, vh, seg, window, sinks, o, lse)


def _prefix_bwd(scores: Scores, block, res, do):
    """Per query block: p from the saved logsumexp, then dq for the block and its share of
    dk, dv for the keys it saw (added into the whole)."""
    qh, kh, vh, seg, window, sinks, o, lse = res
    s_len = qh.shape[3]
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    dqs, dk, dv = [], 0.0, 0.0
    for start, end in _prefix_spans(s_len, block):
        q_i, do_i = qh[:, :, :, start:end], do[:, :, :, start:end]
        dots, mask = _prefix_dots(qh, kh, seg, window, start, end)
        p = jnp.where(mask, jnp.exp(scores(dots) - lse[:, :, :, start:end, None]), 0.0)
        f32 = jnp.float32
        dv_i = jnp.einsum("bkgqt,bkgqd->bktd", p.astype(do.dtype), do_i, preferred_element_type=f32)
        dp = jnp.einsum("bkgqd,bktd->bkgqt", do_i, vh[:, :, :end], preferred_element_type=f32)
        ds = scores.backward(dots, p * (dp - delta[:, :, :, start:end, None])).astype(qh.dtype)
        dqs.append(jnp.einsum("bkgqt,bktd->bkgqd", ds, kh[:, :, :end], preferred_element_type=f32))
        dk_i = jnp.einsum("bkgqt,bkgqd->bktd", ds, q_i, preferred_element_type=f32)
        pad = [(0, 0), (0, 0), (0, s_len - end), (0, 0)]
        dk, dv = dk + jnp.pad(dk_i, pad), dv + jnp.pad(dv_i, pad)
    dq = jnp.concatenate(dqs, axis=3)
    dsinks = sink_grad(sinks, lse, delta, (0, 3))  # [B, KV, G, S] -> [KV, G]
    return dq.astype(qh.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype), None, None, dsinks


_prefix_blocks.defvjp(_prefix_fwd, _prefix_bwd)
