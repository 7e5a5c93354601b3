"""Every cross-device collective of the parallel forward (tensor, expert and context
parallel), in one place.

Each function takes the mesh axis name, or None for the unsharded (single-device) path, in
which case it reduces to the plain computation. They are meant to run inside
`jax.shard_map` over the inference mesh, where a vocabulary-sized array holds only this
shard's `V / tp` columns (rows of the embedding), shard i owning ids [i*V/tp, (i+1)*V/tp).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distill.models import topk


class SequenceParallel(str):
    """A tensor-parallel axis name whose row-parallel sums leave each device 1/tp of the
    positions (Megatron's sequence parallelism): `psum` of a [B, S, D] activation is then a
    reduce-scatter over S, and `gather_positions` all-gathers a normed [B, S/tp, D] shard
    back to [B, S, D] before the next column-parallel matmul. The residual stream and the
    norms between the parallel matmuls hold S/tp positions a device; the bytes moved are
    those of the all-reduce it replaces (an all-reduce is a reduce-scatter then an
    all-gather). Used as the axis name itself, so the model's code is the same."""


def psum(x: jax.Array, axis: str | None) -> jax.Array:
    """Sum partial results of a row-parallel matmul over the tensor-parallel axis: with
    `SequenceParallel`, reduce-scattered over the positions (axis 1)."""
    if axis is None:
        return x
    if isinstance(axis, SequenceParallel):
        return jax.lax.psum_scatter(x, str(axis), scatter_dimension=1, tiled=True)
    return jax.lax.psum(x, axis)


def psum_whole(x: jax.Array, axis: str | None) -> jax.Array:
    """`psum` whose result is whole on every device even under `SequenceParallel` (a sum
    over features, not positions: OLMoE's query/key norm)."""
    return x if axis is None else jax.lax.psum(x, str(axis))


def gather_positions(x_bsd: jax.Array, axis: str | None) -> jax.Array:
    """Under `SequenceParallel`: every device's [B, S/tp, ...] positions gathered to
    [B, S, ...] (all-gather over the tensor-parallel axis), typed replicated over it as
    the whole-row activations of plain tp are; else `x_bsd` as it is."""
    if not isinstance(axis, SequenceParallel):
        return x_bsd
    return jax.lax.all_gather(x_bsd, str(axis), axis=1, tiled=True, to="invarying")


def _vocab_offset(local_vocab: int, axis: str | None) -> jax.Array | int:
    return 0 if axis is None else jax.lax.axis_index(axis) * local_vocab


def embed_lookup(embed_vd: jax.Array, tokens_bs: jax.Array, axis: str | None) -> jax.Array:
    """Vocab-parallel embedding: each shard looks up the ids it owns, zeros elsewhere, psum."""
    if axis is None:
        return embed_vd[tokens_bs]
    local_v = embed_vd.shape[0]
    local_ids = tokens_bs - _vocab_offset(local_v, axis)
    owned = (local_ids >= 0) & (local_ids < local_v)
    x = embed_vd[jnp.clip(local_ids, 0, local_v - 1)]
    return psum(jnp.where(owned[..., None], x, 0).astype(embed_vd.dtype), axis)


def mask_vocab(
    logits_bsv: jax.Array, vocab_limit: int | None, axis: str | None, fill: float = -jnp.inf
) -> jax.Array:
    """`fill` at global ids >= `vocab_limit` (a model vocabulary padded past its tokenizer's):
    each shard masks the part of its id range [offset, offset + V/tp) beyond the limit.
    The teacher uses -inf; a student masking its own logits under a gradient should use a
    large finite value (-1e30): the JSD's logaddexp(-inf, -inf) has a NaN gradient."""
    local_v = logits_bsv.shape[-1]
    if vocab_limit is None or (axis is None and vocab_limit >= local_v):
        return logits_bsv
    ids = _vocab_offset(local_v, axis) + jnp.arange(local_v)
    return jnp.where(ids < vocab_limit, logits_bsv, fill).astype(logits_bsv.dtype)


def logsumexp(logits_bsv: jax.Array, axis: str | None) -> jax.Array:
    """log sum exp [B, S, 1] over a vocabulary sharded on `axis` (global max and sum via
    collectives), in float32."""
    z = logits_bsv.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    if axis is not None:
        m = jax.lax.pmax(m, axis)
    s = jnp.sum(jnp.exp(z - m), axis=-1, keepdims=True)
    if axis is not None:
        s = jax.lax.psum(s, axis)
    return m + jnp.log(s)


def log_softmax(logits_bsv: jax.Array, axis: str | None) -> jax.Array:
    """log softmax over a vocabulary sharded on `axis`."""
    return logits_bsv.astype(jnp.float32) - logsumexp(logits_bsv, axis)


def take_ids(x_bsv: jax.Array, ids_bs: jax.Array, axis: str | None) -> jax.Array:
    """x [B, S] at each token's global vocabulary id `ids_bs` (a log-prob of the target),
    from a vocabulary sharded on `axis`: the shard owning the id gives it, the others zero,
    psum."""
    local_v = x_bsv.shape[-1]
    local = ids_bs - _vocab_offset(local_v, axis)
    owned = (local >= 0) & (local < local_v)
    picked = jnp.take_along_axis(x_bsv, jnp.clip(local, 0, local_v - 1)[..., None], axis=-1)
    picked = jnp.where(owned, picked[..., 0], 0.0)
    return picked if axis is None else jax.lax.psum(picked, axis)


def top_k(scores_bsv: jax.Array, k: int, axis: str | None) -> tuple[jax.Array, jax.Array]:
    """Vocab-parallel top-k: a local top-k per shard (`distill.models.topk.top_k`, never a
    sort of the shard's whole vocabulary), then an all-gather of k candidates per shard and
    a merge. Only `tp * k` values per token move, never the vocabulary. Equal to
    `jax.lax.top_k` of the whole vocabulary, ties included: the candidates arrive in shard
    order, each shard's in id order among equal values, so the merge's lowest position on
    a tie is the lowest id.

    Returns (values [B,S,k], global ids [B,S,k] int32), values descending.
    """
    local_v = scores_bsv.shape[-1]
    vals, idx = topk.top_k(scores_bsv, min(k, local_v))
    idx = idx + _vocab_offset(local_v, axis)
    if axis is None:
        return vals, idx
    vals, idx = gather_replicated(vals, axis), gather_replicated(idx, axis)  # [B, S, tp*k]
    vals, pos = topk.by_rows(lambda v: jax.lax.top_k(v, k), vals)
    return vals, jnp.take_along_axis(idx, pos, axis=-1)


def gather_replicated(x: jax.Array, axis: str) -> jax.Array:
    """Concatenate every shard's last axis, as a value known to be equal on all shards.

    Written as a psum of one-hot slots rather than `all_gather`, because psum's result is
    typed replicated (so `shard_map` can return it with out_specs P()); it moves tp times
    the data of an all-gather, which is nothing for the k candidates per token it serves.
    """
    n = jax.lax.axis_size(axis)
    mine = jnp.arange(n) == jax.lax.axis_index(axis)  # [tp]
    slots = jnp.where(mine[:, None], x[..., None, :], jnp.zeros((), x.dtype))  # [..., tp, k]
    return jax.lax.psum(slots, axis).reshape(*x.shape[:-1], n * x.shape[-1])


# -- the forward's output layout: whole rows per device -------------------------------------


def rows_of_replicated(x_b: jax.Array, axis: str) -> jax.Array:
    """This shard's 1/n of the rows (leading axis) of a value equal on every shard of
    `axis` (the merged top-k): a local slice, nothing moves. Shard i keeps block i."""
    n = x_b.shape[0] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x_b, jax.lax.axis_index(axis) * n, n, axis=0)


def vocab_to_rows(x_bsv: jax.Array, axis: str) -> jax.Array:
    """[B, S, V/n] vocabulary shards -> [B/n, S, V] whole rows: an all-to-all over `axis`.
    Shard i sends its vocabulary slice of row block j to shard j and keeps row block i;
    the slices arrive in shard order, which is vocabulary order."""
    return jax.lax.all_to_all(x_bsv, axis, split_axis=0, concat_axis=x_bsv.ndim - 1, tiled=True)


def gather_vocab(x_bsv: jax.Array, axis: str) -> jax.Array:
    """[B, S, V/n] vocabulary shards -> [B, S, V] on every shard of `axis` (when the rows
    do not split n ways): an all-gather, typed replicated."""
    return jax.lax.all_gather(x_bsv, axis, axis=x_bsv.ndim - 1, tiled=True, to="invarying")


# -- expert parallelism ---------------------------------------------------------------------


def all_to_all(x_n: jax.Array, axis: str | None) -> jax.Array:
    """Block j of the leading axis [n, ...] goes to shard j of `axis`; what arrives is
    stacked in sender order (expert dispatch and its return trip). With `axis` None, n is 1
    and nothing moves."""
    if axis is None:
        return x_n
    return jax.lax.all_to_all(x_n, axis, split_axis=0, concat_axis=0, tiled=True)


def ragged_all_to_all(x, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis: str):
    """`out` with the rows other shards of `axis` send here written in, each shard sending
    shard j the rows x[input_offsets[j]:][:send_sizes[j]], to land at output_offsets[j]
    there; recv_sizes[i]: rows that arrive from shard i (`jax.lax.ragged_all_to_all`: the
    expert dispatch sending only routed rows). XLA:CPU does not implement it."""
    return jax.lax.ragged_all_to_all(
        x, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis
    )


def axis_size(axis: str | None) -> int:
    """Shards along `axis`; 1 on the unsharded path."""
    return 1 if axis is None else jax.lax.axis_size(axis)


# -- context parallelism --------------------------------------------------------------------


def ring_shift(x, axis: str | None):
    """Each shard's `x` (any pytree) to the next shard of `axis`, the last to the first: one
    step of the ring. Shard i receives shard i - 1's. With `axis` None, nothing moves."""
    if axis is None:
        return x
    n = jax.lax.axis_size(axis)
    return permute(x, axis, [(i, (i + 1) % n) for i in range(n)])


def permute(x, axis: str | None, perm: list[tuple[int, int]]):
    """Each shard's `x` (any pytree) to another shard of `axis`: (source, destination) pairs
    of a permutation (`jax.lax.ppermute`). With `axis` None, nothing moves."""
    if axis is None:
        return x
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm), x)


def gather_shards(x, axis: str | None):
    """Every shard's `x` (any pytree), stacked on a new leading axis in shard order [n, ...]
    (an all-gather). With `axis` None, [1, ...]."""
    if axis is None:
        return jax.tree.map(lambda a: a[None], x)
    return jax.tree.map(lambda a: jax.lax.all_gather(a, axis), x)


def scatter_sum(x_n, axis: str | None):
    """The transpose of `gather_shards`: x [n, ...] summed over the shards of `axis`, shard
    i keeping entry i (a reduce-scatter). With `axis` None, x[0]."""
    if axis is None:
        return jax.tree.map(lambda a: a[0], x_n)
    return jax.tree.map(lambda a: jax.lax.psum_scatter(a, axis, scatter_dimension=0), x_n)


def varying(x) -> frozenset:
    """The mesh axes `x` varies over inside `jax.shard_map` (none outside)."""
    return jax.typeof(x).mat.varying


def vary(x, vma):
    """x varying over the mesh axes `vma` (inside `jax.shard_map`), as a loop carry that
    accumulates varying values must start."""
    return jax.lax.pcast(x, tuple(sorted(vma)), to="varying") if vma else x


def cotangent(grad, w):
    """A weight's gradient summed over the mesh axes its rows varied over and it does not
    (the transpose of using one weight on every device's rows), in its dtype."""
    extra = tuple(sorted(varying(grad) - varying(w)))
    return (jax.lax.psum(grad, extra) if extra else grad).astype(w.dtype)


# -- pipeline parallelism -------------------------------------------------------------------


def to_next_stage(x, axis: str):
    """Each stage's `x` (any pytree) to the next stage of `axis`: one point-to-point
    transfer per stage boundary (not a ring: the last stage sends nothing, the first
    receives zeros)."""
    n = jax.lax.axis_size(axis)
    perm = [(i, i + 1) for i in range(n - 1)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm), x)


def from_last_stage(x_b: jax.Array, axis: str, split: bool) -> jax.Array:
    """The last stage's x [B, ...] (the other stages' values ignored) on every stage of
    `axis`: with `split`, stage i keeps row block i of it [B/n, ...] (a reduce-scatter);
    else all of it (an all-reduce). Zeros added to one stage's value: exact."""
    last = jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1
    x_b = jnp.where(last, x_b, jnp.zeros((), x_b.dtype))
    if split:
        return jax.lax.psum_scatter(x_b, axis, scatter_dimension=0, tiled=True)
    return jax.lax.psum(x_b, axis)
