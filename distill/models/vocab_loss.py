"""The losses of `distill.models.losses`, computed from the student's final hidden states chunk by
chunk, so its [B, S, V] logits are never whole.

At V = 128k and S = 4,096 one float32 copy of a sequence's logits is 2.1 GB, and the whole-
logits loss keeps several live (logits, log-probs, their gradients). Here the sequence axis
is cut into chunks of `chunk` positions; for each chunk [B, chunk] the logits are computed
from `x @ head`, reduced to per-token sums, and dropped. The chunk body is rematerialised
(`jax.checkpoint` under `jax.lax.map`), so the backward pass recomputes one chunk's logits
at a time too: peak memory holds one chunk's [B, chunk, V] logits and a few temporaries,
plus the head's own gradient.

A chunk spans every row rather than a run of the flattened B * S tokens, so a batch split
over data-parallel devices stays split: each device works on its rows of every chunk, and
no chunk lives on one device. When S is not a multiple of `chunk` the last chunk is shifted
back to end at S instead of padded (positions it shares with the chunk before count zero
times), so the dense teacher is sliced in place and never copied.

The training losses (`kd_loss_chunked`, `ce_loss_chunked`) form their gradient in the same
pass (`_chunked_loss`): each chunk's logits are made once, and the loss's gradient with
respect to the hidden states and the head is taken right there (the chunk's VJP, pulled
back through the head matmul), so the backward pass neither recomputes the logits (a third
head matmul, 2 x V x D FLOPs a token) nor passes over them again; it only scales the
stored gradients by the loss's cotangent.

Results equal `distill.models.losses` on `mask_vocab(x @ head, vocab_limit, fill=PADDED_LOGIT)`
up to float reassociation: the same per-token formulas, summed per chunk, then divided by
max(sum(mask), 1). Logits are accumulated in float32 from `compute_dtype` operands (bfloat16
on accelerators) and never rounded through it; everything after is float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from distill.collectives import mask_vocab
from distill.config import DistillLossConfig
from distill.models.losses import PADDED_LOGIT, _kl, _token_ce, fit_vocab, kd_divergence
from distill.types import TeacherMix, TeacherOutput

# One chunk's float32 logits on one device, by default: a few such temporaries live at once.
CHUNK_BYTES = 256 * 2**20

Tree = dict[str, jax.Array]


def default_chunk(vocab_size: int, rows: int = 1, budget_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk such that one chunk's float32 logits [rows, chunk, V] fit in
    `budget_bytes`: budget // (rows * V * 4), rounded down to a power of two, at least 1.
    `rows`: the batch rows one device holds (global batch / dp)."""
    n = max(1, budget_bytes // (4 * vocab_size * max(rows, 1)))
    return 1 << (n.bit_length() - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _head_matmul(x_nd: jax.Array, head_dv: jax.Array, dt: jnp.dtype) -> jax.Array:
    # on the rows [N, D] (a free reshape): a dot with one contracting dimension, whose head
    # gradient XLA:CPU forms without copying the logits' gradient transposed
    x = x_nd.reshape(-1, x_nd.shape[-1]).astype(dt)
    z = jnp.dot(x, head_dv.astype(dt), preferred_element_type=jnp.float32)
    return z.reshape(*x_nd.shape[:-1], head_dv.shape[-1])


def _head_matmul_fwd(x_nd, head_dv, dt):
    return _head_matmul(x_nd, head_dv, dt), (x_nd, head_dv)


def _head_matmul_bwd(dt, res, g_nv):
    # The logits' float32 cotangent is rounded to `dt` so both backward matmuls run on `dt`
    # operands (autodiff of a preferred_element_type dot would multiply float32 by `dt`,
    # which upcasts to a float32 matmul); both accumulate in float32, and the head's
    # gradient is returned in float32 rather than rounded to `dt`.
    x_nd, head_dv = res
    g = g_nv.reshape(-1, g_nv.shape[-1]).astype(dt)
    x = x_nd.reshape(-1, x_nd.shape[-1]).astype(dt)
    f32 = jnp.float32
    dx = jnp.einsum("nv,dv->nd", g, head_dv.astype(dt), preferred_element_type=f32)
    dh = jnp.einsum("nd,nv->dv", x, g, preferred_element_type=f32)
    return dx.reshape(x_nd.shape).astype(x_nd.dtype), dh.astype(head_dv.dtype)


_head_matmul.defvjp(_head_matmul_fwd, _head_matmul_bwd)


def head_logits(
    x_nd: jax.Array, head_dv: jax.Array, *, vocab_limit: int | None, compute_dtype, softcap=None
) -> jax.Array:
    """float32 logits [..., V] = x @ head from `compute_dtype` operands, accumulated and
    returned in float32 (not rounded through bfloat16), soft-capped at `softcap` (the
    model's `final_softcap`), padded ids set to PADDED_LOGIT."""
    z = _head_matmul(x_nd, head_dv, jnp.dtype(compute_dtype))
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    return mask_vocab(z, vocab_limit, None, fill=PADDED_LOGIT)


def _chunked_sums(
    token_fn: Callable[[jax.Array, Tree], Tree],
    x_bsd: jax.Array,
    head_dv: jax.Array,
    per_token: Tree,
    dense: Tree,
    mask_bs: jax.Array,
    *,
    vocab_limit: int | None,
    chunk: int | None,
    compute_dtype,
    softcap: float | None = None,
    at: tuple[Tree, jax.Array] | None = None,
) -> Tree:
    """sum over tokens of mask * token_fn(logits, inputs)[key], for every key, chunk by chunk.

    `per_token`: [B, S, ...] inputs small enough to regroup into chunks (targets, top-k).
    `dense`: [B, S, V] inputs (a dense teacher), sliced per chunk in place.
    `at`: ([B, T, V] inputs, index [B, S]): each chunk's positions gathered from them at
    the index (a dense teacher on its own rows, at the student's aligned positions), never
    a whole [B, S, V] copy.
    `token_fn(logits_bcv, inputs)`: per-token float32 values [B, c] for one chunk.
    """
    b, s, _ = x_bsd.shape
    c = max(1, min(chunk or default_chunk(head_dv.shape[-1], b), s))
    pos, fresh, regroup = _chunk_layout(b, s, c)
    weight = jnp.where(fresh[:, None], regroup(mask_bs.astype(jnp.float32)), 0.0)
    gathered, index = at if at is not None else ({}, jnp.zeros_like(mask_bs, jnp.int32))
    xs = (regroup(x_bsd), jax.tree.map(regroup, per_token), weight, jnp.asarray(pos[:, 0]))
    xs = (*xs, regroup(index))

    # The backward pass recomputes this chunk's logits instead of keeping every chunk's.
    @functools.partial(jax.checkpoint, prevent_cse=False)  # no CSE to fear inside a map
    def chunk_sums(xs) -> Tree:
        x_bcd, inputs, w_bc, start_c, index_bc = xs
        sliced = {k: jax.lax.dynamic_slice_in_dim(a, start_c, c, axis=1) for k, a in dense.items()}
        sliced.update(
            {k: jnp.take_along_axis(a, index_bc[..., None], axis=1) for k, a in gathered.items()}
        )
        z_bcv = head_logits(
            x_bcd, head_dv, vocab_limit=vocab_limit, compute_dtype=compute_dtype, softcap=softcap
        )
        values = token_fn(z_bcv, {**inputs, **sliced})
        return {k: jnp.sum(jnp.where(w_bc > 0, v * w_bc, 0.0)) for k, v in values.items()}

    return {k: jnp.sum(v) for k, v in jax.lax.map(chunk_sums, xs).items()}


def _chunk_layout(b: int, s: int, c: int):
    """(positions [n, c] of each chunk, fresh [n, c]: not counted by an earlier chunk,
    regroup: [B, S, ...] -> [n, B, c, ...]) of S positions in chunks of c; the last chunk
    is shifted back to end at S."""
    n = -(-s // c)
    first = np.arange(n) * c  # where chunk i's own positions begin
    start = np.minimum(first, s - c)
    pos = start[:, None] + np.arange(c)
    fresh = pos >= first[:, None]

    def regroup(a_bs):
        a = a_bs.reshape(b, n, c, *a_bs.shape[2:]) if s % c == 0 else a_bs[:, pos]
        return jnp.moveaxis(a, 1, 0)

    return pos, fresh, regroup


def _chunked_loss(
    token_fn: Callable[[jax.Array, Tree], Tree],
    coef: Tree,
    x_bsd: jax.Array,
    head_dv: jax.Array,
    per_token: Tree,
    dense: Tree,
    mask_bs: jax.Array,
    **kw,
) -> tuple[jax.Array, Tree]:
    """(total, sums): `_chunked_sums`'s sums (float32 scalars, carrying no gradient) and
    total = sum over keys of coef[key] * sums[key] (`coef`: float32 scalars, not
    differentiated), whose gradient with respect to `x_bsd` and `head_dv` is formed chunk
    by chunk in the forward pass (module docstring). Keywords as `_chunked_sums`."""
    run = functools.partial(_loss_pass, token_fn, tuple(sorted(kw.items())))
    return _fused(run, x_bsd, head_dv, (coef, per_token, dense, mask_bs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(run, x_bsd, head_dv, rest):
    total, sums, _ = run(x_bsd, head_dv, rest, with_grads=False)
    return total, sums


def _fused_fwd(run, x_bsd, head_dv, rest):
    total, sums, grads = run(x_bsd, head_dv, rest, with_grads=True)
    return (total, sums), grads


def _fused_bwd(run, grads, cotangents):
    g = cotangents[0]  # the total's; the sums are metrics, not differentiated
    dx, dh = grads
    return (g * dx).astype(dx.dtype), g * dh, None  # None: the other inputs' are zero


_fused.defvjp(_fused_fwd, _fused_bwd)


def _loss_pass(token_fn, kw, x_bsd, head_dv, rest, *, with_grads: bool):
    """(total, sums, (d total / d x, d total / d head) or None): one pass over the
    chunks of `_chunked_loss`, a `jax.lax.scan` carrying the head's float32 gradient."""
    kw = dict(kw)
    coef, per_token, dense, mask_bs = rest
    b, s, _ = x_bsd.shape
    c = max(1, min(kw["chunk"] or default_chunk(head_dv.shape[-1], b), s))
    pos, fresh, regroup = _chunk_layout(b, s, c)
    weight = jnp.where(fresh[:, None], regroup(mask_bs.astype(jnp.float32)), 0.0)
    xs = (regroup(x_bsd), jax.tree.map(regroup, per_token), weight, jnp.asarray(pos[:, 0]))
    head_kw = {k: kw[k] for k in ("vocab_limit", "compute_dtype", "softcap")}

    def body(dh_acc, xs):
        x_bcd, inputs, w_bc, start_c = xs
        sliced = {k: jax.lax.dynamic_slice_in_dim(a, start_c, c, axis=1) for k, a in dense.items()}

        def value(x_bcd, head_dv):
            z_bcv = head_logits(x_bcd, head_dv, **head_kw)
            values = token_fn(z_bcv, {**inputs, **sliced})
            sums = {k: jnp.sum(jnp.where(w_bc > 0, v * w_bc, 0.0)) for k, v in values.items()}
            return sum(coef[k] * sums[k] for k in coef), sums

        if not with_grads:
            total, sums = value(x_bcd, head_dv)
            return dh_acc, (total, sums, None)
        total, pull, sums = jax.vjp(value, x_bcd, head_dv, has_aux=True)
        dx_bcd, dh = pull(jnp.ones_like(total))
        return dh_acc + dh, (total, sums, dx_bcd)

    dh0 = jnp.zeros(head_dv.shape, jnp.float32) if with_grads else None
    dh, (totals, sums, dx) = jax.lax.scan(body, dh0, xs)
    total, sums = jnp.sum(totals), {k: jnp.sum(v) for k, v in sums.items()}
    if not with_grads:
        return total, sums, None
    dx = jnp.moveaxis(dx, 0, 1)  # [B, n, c, D]
    if s % c == 0:
        dx_bsd = dx.reshape(x_bsd.shape)
    else:  # positions shared by the last two chunks carry gradient from one of them only
        dx_bsd = jnp.zeros(x_bsd.shape, dx.dtype).at[:, pos].add(dx)
    return total, sums, (dx_bsd, dh.astype(head_dv.dtype))


def _means(sums: Tree, mask_bs: jax.Array) -> tuple[Tree, jax.Array]:
    tokens = jnp.sum(mask_bs.astype(jnp.float32))
    return {k: v / jnp.maximum(tokens, 1.0) for k, v in sums.items()}, tokens


def kd_loss_chunked(
    x_bsd: jax.Array,
    head_dv: jax.Array,
    teacher: TeacherOutput | TeacherMix,
    targets_bs: jax.Array,
    mask_bs: jax.Array,
    cfg: DistillLossConfig,
    *,
    vocab_limit: int | None = None,
    chunk: int | None = None,
    compute_dtype=jnp.float32,
    softcap: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`distill.models.losses.kd_loss` of the logits x @ head [B, S, V], never whole.

    x_bsd: the student's final hidden states (after the final norm); head_dv: the LM head
    (the embedding transposed when tied). teacher: dense [B, S, V] log-probs (read one chunk
    at a time) or top-k [B, S, k]. vocab_limit: ids >= it are padding, never given
    probability (a top-k teacher with k >= vocab_limit is then the dense divergence over the
    live ids). chunk: positions per chunk (default `default_chunk(V, B)`; under data
    parallelism pass `default_chunk(V, B // dp)`). Same metrics as `kd_loss`.

    Several teachers (`distill.types.TeacherMix`): KD is the weighted sum of the divergence
    to each teacher, position by position (its weights [B, S, n]); with forward KL its
    gradient is that of the divergence to the mixture sum_i w_i p_i (the two differ by the
    mixture's Jensen gap, a constant of the teachers). "kd_loss_teachers" [n]: each
    teacher's divergence over the tokens it weighs.
    """
    mix = isinstance(teacher, TeacherMix)
    outputs = teacher.outputs if mix else (teacher,)
    per_token, dense = {"targets": targets_bs}, {}
    if mix:
        per_token["w"] = jax.lax.stop_gradient(teacher.weights.astype(jnp.float32))
    for i, out in enumerate(outputs):
        lp = jax.lax.stop_gradient(out.logprobs)
        if out.ids is None:
            dense[f"lp{i}"] = lp
        else:
            per_token.update({f"lp{i}": lp, f"ids{i}": out.ids})

    def token_fn(z_bcv: jax.Array, t: Tree) -> Tree:
        kds = [
            kd_divergence(z_bcv, TeacherOutput(t[f"lp{i}"], t.get(f"ids{i}")), cfg,
                          vocab_limit=vocab_limit)
            for i in range(len(outputs))
        ]  # fmt: skip
        values = {"kd": kds[0], "ce": _token_ce(z_bcv, t["targets"])}
        if mix:  # each teacher's divergence at its weight (0 where its weight is 0)
            w = t["w"]
            parts = [jnp.where(w[..., i] > 0, w[..., i] * kd, 0.0) for i, kd in enumerate(kds)]
            values["kd"] = sum(parts)
            values.update({f"kd{i}": p for i, p in enumerate(parts)})
            values.update({f"w{i}": w[..., i] for i in range(len(kds))})
        return values

    n = jnp.maximum(jnp.sum(mask_bs.astype(jnp.float32)), 1.0)
    coef = {"kd": cfg.alpha * cfg.temperature**2 / n, "ce": (1.0 - cfg.alpha) / n}
    total, sums = _chunked_loss(
        token_fn, coef, x_bsd, head_dv, per_token, dense, mask_bs,
        vocab_limit=vocab_limit, chunk=chunk, compute_dtype=compute_dtype, softcap=softcap,
    )  # fmt: skip
    means, tokens = _means(sums, mask_bs)
    kd, ce = means["kd"], means["ce"]
    loss = _with_gradient_of(cfg.alpha * cfg.temperature**2 * kd + (1.0 - cfg.alpha) * ce, total)
    metrics = {"loss": loss, "kd_loss": kd, "ce_loss": ce, "tokens": tokens}
    if mix:  # each teacher's divergence over the tokens it weighs, weighted by them
        metrics["kd_loss_teachers"] = jnp.stack(  # NaN: a teacher of no weight this step
            [
                jnp.where(
                    sums[f"w{i}"] > 0, sums[f"kd{i}"] / jnp.maximum(sums[f"w{i}"], 1e-9), jnp.nan
                )
                for i in range(len(outputs))
            ]
        )
    return loss, metrics


def _with_gradient_of(value: jax.Array, total: jax.Array) -> jax.Array:
    """`value` (the loss as the means give it, bit for bit as before) carrying the gradient
    of `total` (the same loss summed chunk by chunk: equal up to float reassociation)."""
    return value + (total - jax.lax.stop_gradient(total))


def ce_loss_chunked(
    x_bsd: jax.Array,
    head_dv: jax.Array,
    targets_bs: jax.Array,
    mask_bs: jax.Array,
    *,
    vocab_limit: int | None = None,
    chunk: int | None = None,
    compute_dtype=jnp.float32,
    softcap: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`distill.models.losses.ce_loss` of the logits x @ head, never whole (arguments as
    `kd_loss_chunked`). Metrics: loss, ce_loss, tokens."""
    n = jnp.maximum(jnp.sum(mask_bs.astype(jnp.float32)), 1.0)
    total, sums = _chunked_loss(
        lambda z_bcv, t: {"ce": _token_ce(z_bcv, t["targets"])}, {"ce": 1.0 / n},
        x_bsd, head_dv, {"targets": targets_bs}, {}, mask_bs,
        vocab_limit=vocab_limit, chunk=chunk, compute_dtype=compute_dtype, softcap=softcap,
    )  # fmt: skip
    means, tokens = _means(sums, mask_bs)
    loss = _with_gradient_of(means["ce"], total)
    return loss, {"loss": loss, "ce_loss": means["ce"], "tokens": tokens}


def eval_metrics_chunked(
    x_bsd: jax.Array,
    head_dv: jax.Array,
    teacher_logits_bsv: jax.Array,
    targets_bs: jax.Array,
    mask_bs: jax.Array,
    *,
    vocab_limit: int | None = None,
    chunk: int | None = None,
    compute_dtype=jnp.float32,
    softcap: float | None = None,
) -> dict[str, jax.Array]:
    """`distill.models.losses.eval_metrics` of the student logits x @ head against the teacher's
    raw logits [B, S, V] (read one chunk at a time), never whole. Same keys; with no teacher
    logits (None: a teacher behind a server), the student's loss alone."""

    def token_fn(s_bcv: jax.Array, t: Tree) -> Tree:
        if "teacher" not in t:
            return {"student_loss": _token_ce(s_bcv, t["targets"])}
        t_bcv = fit_vocab(t["teacher"].astype(jnp.float32), s_bcv.shape[-1])
        ls, lt = jax.nn.log_softmax(s_bcv, axis=-1), jax.nn.log_softmax(t_bcv, axis=-1)
        agree = jnp.argmax(s_bcv, axis=-1) == jnp.argmax(t_bcv, axis=-1)
        return {
            "teacher_loss": _token_ce(t_bcv, t["targets"]),
            "student_loss": _token_ce(s_bcv, t["targets"]),
            "kl": _kl(lt, ls),
            "top1_agreement": agree.astype(jnp.float32),
        }

    sums = _chunked_sums(
        token_fn,
        x_bsd,
        head_dv,
        {"targets": targets_bs},
        {} if teacher_logits_bsv is None else {"teacher": teacher_logits_bsv},
        mask_bs,
        vocab_limit=vocab_limit,
        chunk=chunk,
        compute_dtype=compute_dtype,
        softcap=softcap,
    )
    means, tokens = _means(sums, mask_bs)
    return {**means, "tokens": tokens}
