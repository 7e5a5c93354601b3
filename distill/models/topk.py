"""An exact top-k that never sorts a whole vocabulary, and every sort or top-k over a
bounded number of elements a call.

**Top-k by chunk maxima** (`top_k`). For k > 16 XLA:GPU takes `jax.lax.top_k` by sorting
every row whole: at a 128,256-id vocabulary the teacher's top-64 cost a quarter of its
forward on an H200. The last axis is instead cut into chunks of `c` ids and each chunk's
maximum taken (one read of the row, no sort). The k largest values lie in the k chunks
with the largest maxima (ties to the lowest chunk): each of those chunks holds a value at
least as large as any value of a chunk left out, and on a tie an earlier, so lower, id. So
the top-k of those chunks' k * c values, gathered in id order, is the row's top-k: only
`V / c` maxima and `k * c` candidates a row are ever sorted.

The result equals `jax.lax.top_k`'s bit for bit (values and ids): its comparator is the
IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN), ties to the lowest id.
A float maximum orders values alike but for the sign of a zero and NaNs (it may propagate
one, of either sign, or drop it), so when a row holds a NaN (its chunk sums tell, read in
the same pass) or its k-th chunk maximum is a zero, that call takes `jax.lax.top_k` whole
instead (`jax.lax.cond`; logits without NaN whose k-th chunk maximum is not exactly 0
never do). Ids past the vocabulary in the last, partial chunk are never candidates: they
read as the least value of that order and sit after every real id. When k * c reaches the
vocabulary there is nothing to save and `jax.lax.top_k` runs.

**Bounded calls** (`by_rows`). XLA:GPU's sorts (CUB's segmented radix sort, behind every
top-k with k > 16) index with 32-bit offsets: a top-k over more than 16,744 rows of 128,256
ids overflowed. Every sort and top-k of the project runs through `by_rows`, which splits the
rows (the second-to-last axis) so that no call holds `distill.limits.MAX_ELEMENTS` (2^31)
elements or more; calls under it run as written, in one piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from distill import limits

# Ids per chunk of `top_k`: sqrt(V / k) balances the V / c maxima and the k * c candidates
# each row sorts (45 at 128,256 ids and k = 64, 63 at k = 32); on a 2-core CPU at
# [512, 128256] c = 32 and 64 measured alike, 128 slower (docs/benchmarks/2026-11-27-topk.md).
CHUNK = 64


def top_k(x: jax.Array, k: int, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """(values [..., k] descending, ids [..., k] int32) of the last axis: exactly
    `jax.lax.top_k(x, k)` (module docstring), never sorting a whole row, in calls of fewer
    than `distill.limits.MAX_ELEMENTS` elements."""
    return by_rows(lambda a: _top_k(a, k, chunk), x)


def _top_k(x: jax.Array, k: int, chunk: int) -> tuple[jax.Array, jax.Array]:
    if k * chunk >= x.shape[-1] or not jnp.issubdtype(x.dtype, jnp.floating):
        return _lax_top_k(x, k)
    chunks, exact = select_chunks(x, k, chunk)
    return jax.lax.cond(
        exact, lambda a, c: of_chunks(a, c, chunk), lambda a, _: _lax_top_k(a, k), x, chunks
    )


def select_chunks(x: jax.Array, k: int, chunk: int) -> tuple[jax.Array, jax.Array]:
    """(the k chunks of `chunk` ids with the largest maxima [..., k], ties to the lowest
    chunk; whether they hold the top-k for every row, a bool): not when a row holds a NaN
    or its k-th chunk maximum is a zero (module docstring)."""
    maxima, sums = by_chunk(x, chunk, (jnp.max, jnp.sum))  # [..., n] each, one read of x
    top_max, chunks = jax.lax.top_k(maxima, k)
    # A NaN makes its chunk's sum NaN (a maximum may drop it: XLA:CPU's does), and so does
    # +inf beside -inf, which merely takes the whole path. The k-th maximum is read as the
    # least of the k: a slice of top_k's values would keep XLA:CPU from rewriting its sort
    # as a partial sort.
    hard = jnp.any(jnp.isnan(sums)) | jnp.any(jnp.min(top_max, axis=-1) == 0)
    return chunks, ~hard


def _lax_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    values, ids = jax.lax.top_k(x, k)
    return values, ids.astype(jnp.int32)


def by_chunk(x: jax.Array, chunk: int, reductions: tuple[Callable, ...]) -> tuple[jax.Array, ...]:
    """Each reduction (`jnp.max`, `jnp.sum`, ...) of each run of `chunk` ids of the last
    axis: [..., ceil(V / chunk)] each (the last run shorter when `chunk` does not divide V).
    Reductions of one shape, so XLA can take them in one read of `x`."""
    v = x.shape[-1]
    full = v // chunk * chunk
    runs = x[..., :full].reshape(*x.shape[:-1], v // chunk, chunk)
    out = tuple(r(runs, axis=-1) for r in reductions)
    if full == v:
        return out
    tails = (r(x[..., full:], axis=-1, keepdims=True) for r in reductions)
    return tuple(jnp.concatenate([o, t], axis=-1) for o, t in zip(out, tails, strict=True))


def of_chunks(x: jax.Array, chunks: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """The top-k of the values of `chunks` [..., k] (chunk indices of `x`'s last axis):
    their k * chunk ids gathered in increasing order, so `jax.lax.top_k`'s lowest position
    on a tie is the lowest id; ids past V read as the least float (all bits set, -NaN)."""
    v, k = x.shape[-1], chunks.shape[-1]
    chunks = jnp.sort(chunks, axis=-1)
    ids = (chunks[..., None] * chunk + jnp.arange(chunk, dtype=chunks.dtype)).reshape(
        *chunks.shape[:-1], k * chunk
    )
    values = jnp.take_along_axis(x, jnp.minimum(ids, v - 1), axis=-1)
    if v % chunk:
        least = jax.lax.bitcast_convert_type(np.array(-1, _int_of(x.dtype)), x.dtype)
        values = jnp.where(ids < v, values, least)
    top, pos = jax.lax.top_k(values, k)
    return top, jnp.take_along_axis(ids, pos, axis=-1).astype(jnp.int32)


def _int_of(dtype) -> np.dtype:
    return np.dtype(f"int{8 * jnp.dtype(dtype).itemsize}")


def sort_descending(x: jax.Array) -> jax.Array:
    """The last axis sorted in decreasing order, in calls of fewer than
    `distill.limits.MAX_ELEMENTS` elements."""
    return by_rows(lambda a: -jnp.sort(-a, axis=-1), x)


def by_rows(fn: Callable, *xs: jax.Array, bound: int | None = None):
    """fn(*xs) with every call under `bound` elements per array (default
    `distill.limits.MAX_ELEMENTS`): arrays [..., R, V_i] (the same leading dims and rows R)
    are cut along R into blocks of equal size, fn runs on each (`jax.lax.map`: one
    compiled body) and its outputs [..., r, ...] are put back together along that axis.
    The last block is shifted back to end at R, so it recomputes a few rows rather than
    padding. One call when the arrays are under `bound` already; leading dims too large
    for one row each are folded into the rows first. A single row of `bound` elements or
    more cannot be split and runs whole (as do 1-D arrays)."""
    bound = limits.MAX_ELEMENTS if bound is None else bound
    widest = max(xs, key=lambda a: a.shape[-1])
    if widest.size < bound or widest.ndim < 2 or widest.shape[-1] >= bound:
        return fn(*xs)
    lead = widest.shape[:-2]
    if math.prod(lead) * widest.shape[-1] >= bound:
        rows = math.prod(widest.shape[:-1])
        out = by_rows(fn, *(a.reshape(rows, a.shape[-1]) for a in xs), bound=bound)
        return jax.tree.map(lambda o: o.reshape(*widest.shape[:-1], *o.shape[1:]), out)
    r, axis = widest.shape[-2], widest.ndim - 2
    block = (bound - 1) // (math.prod(lead) * widest.shape[-1])
    n = -(-r // block)
    starts = jnp.asarray(np.minimum(np.arange(n) * block, r - block), jnp.int32)
    outs = jax.lax.map(
        lambda s: fn(*(jax.lax.dynamic_slice_in_dim(a, s, block, axis=axis) for a in xs)), starts
    )

    def whole(o):  # [n, ..., block, ...] -> [..., r, ...]
        o = jnp.moveaxis(o, 0, axis)  # [..., n, block, ...]
        head = o[(slice(None),) * axis + (slice(0, n - 1),)]
        head = head.reshape(*head.shape[:axis], (n - 1) * block, *head.shape[axis + 2 :])
        tail = o[(slice(None),) * axis + (n - 1, slice(block - (r - (n - 1) * block), None))]
        return jnp.concatenate([head, tail], axis=axis)

    return jax.tree.map(whole, outs)
