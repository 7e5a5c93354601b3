"""The `mosaic_gpu` grouped-matmul kernel: each expert's SwiGLU on its run of rows through
JAX's Pallas Mosaic GPU ragged-dot kernels for Hopper GPUs
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` and `transposed_ragged_dot_mgpu`), which
multiply each row by its own expert's weights only (XLA's own `ragged_dot` on NVIDIA GPUs
multiplies every row by every expert: `distill.models.experts.grouped`).

Three grouped matmuls make the forward and its backward (`Ops`): `dot` (rows [M, K] by their
group's [K, N]), `dot_t` (by their group's [N, K], transposed) and `outer` (each group's
rows of a [R, M] and a [R, N]: the group's [M, N], a weight gradient). The SwiGLU's
forward is two `dot`s (gate, up) and one (down); its backward (`jax.custom_vjp`) three
`dot_t`s and three `outer`s. Experts' biases (gpt-oss) are not in the kernels: each row
adds its expert's outside them (a gather of [E, F] by the row's group), and their
gradients are the rows' cotangents summed per group (`segment_sum`). The kernels leave
the rows past the groups unwritten, so those rows (rows of no expert: dropped or empty)
are zeroed here. The same composition runs with
XLA's reference ops (`reference_ops`), which tests compare with plain autodiff on any
platform; the Mosaic kernels themselves run on a Hopper GPU only (tests marked `gpu`).

The kernels take bfloat16 or float16 operands whose contracting and output widths are
multiples of their 64-wide blocks (`usable`); `distill.models.experts.grouped` takes its `tiled`
kernel for any other shape or dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from distill.collectives import cotangent
from distill.models.experts.weights import group_ids, row_bias

BLOCK = 64  # the kernels' k (and m) block: widths must be multiples of it
DTYPES = (jnp.bfloat16, jnp.float16)


class Ops(NamedTuple):
    """The three grouped matmuls; `sizes` [G] rows per group, in row order."""

    dot: Callable  # (x [M, K], w [G, K, N], sizes) -> [M, N]
    dot_t: Callable  # (x [M, K], w [G, N, K], sizes) -> [M, N]
    outer: Callable  # (a [R, M], b [R, N], sizes) -> [G, M, N]


def usable(d_model: int, d_ff: int, dtype) -> bool:
    """Whether the Mosaic kernels take an expert SwiGLU of widths `d_model`, `d_ff` (this
    device's columns) in `dtype`."""
    return jnp.dtype(dtype) in map(jnp.dtype, DTYPES) and d_model % BLOCK == 0 == d_ff % BLOCK


def _block_n(n: int) -> int:
    return 128 if n % 128 == 0 else BLOCK


def mosaic_ops() -> Ops:
    """The Hopper kernels (imported here: only a GPU program traces them)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    common = {"block_k": BLOCK, "max_concurrent_steps": 4, "grid_block_n": 1}

    def dot(x, w, sizes, transpose_rhs=False):
        n = w.shape[1] if transpose_rhs else w.shape[2]
        return ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=sizes, block_m=BLOCK, block_n=_block_n(n),
            transpose_rhs=transpose_rhs, **common,
        )  # fmt: skip

    def outer(a, b, sizes):
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            a, b, group_sizes=sizes, block_m=BLOCK, block_n=_block_n(b.shape[1]), **common
        )

    return Ops(dot, lambda x, w, s: dot(x, w, s, transpose_rhs=True), outer)


def reference_ops() -> Ops:
    """The same three products by XLA's `ragged_dot` (exact on every platform; dense over
    every group on NVIDIA GPUs and CPU): the reference of the composition's tests."""

    def outer(a, b, sizes):
        numbers = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())),
            lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[],
        )
        return jax.lax.ragged_dot_general(a, b, sizes, numbers)

    return Ops(
        dot=lambda x, w, s: jax.lax.ragged_dot(x, w, s),
        dot_t=lambda x, w, s: jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), s),
        outer=outer,
    )


def _rows_of_groups(y, sizes):
    """y with the rows past the groups' (unwritten by the kernels) zeroed."""
    live = jnp.arange(y.shape[0]) < jnp.sum(sizes)
    return jnp.where(live[:, None], y, jnp.zeros((), y.dtype))


def grouped_swiglu(glu, ops: Ops | None = None):
    """f(x [M, D], sizes [E], w: `grouped.Experts`) -> [M, D]: expert e's gated MLP
    (`glu(gate, up)`, with its biases if any) of its run of `sizes[e]` rows of x, in expert
    order; zeros for the rows past them. Weights are cast to x's dtype; their gradients are
    summed over the mesh axes the rows vary over and they do not, as
    `grouped.tiled_swiglu`'s."""

    def forward(x, sizes, w):
        dt, n = x.dtype, x.shape[0]
        o = ops or mosaic_ops()
        e_m = group_ids(sizes, n) if w.b_gate is not None else None
        g = _rows_of_groups(o.dot(x, w.gate.astype(dt), sizes) + row_bias(w.b_gate, e_m, dt), sizes)
        u = _rows_of_groups(o.dot(x, w.up.astype(dt), sizes) + row_bias(w.b_up, e_m, dt), sizes)
        y = o.dot(glu(g, u), w.down.astype(dt), sizes) + row_bias(w.b_down, e_m, dt)
        return _rows_of_groups(y, sizes), (x, sizes, w, g, u)

    def backward(res, dy):
        x, sizes, w, g, u = res
        dt, o = x.dtype, ops or mosaic_ops()
        h, pull = jax.vjp(glu, g, u)
        dy = _rows_of_groups(dy.astype(dt), sizes)
        dh = _rows_of_groups(o.dot_t(dy, w.down.astype(dt), sizes), sizes)
        dg, du = pull(dh)
        dx = o.dot_t(dg, w.gate.astype(dt), sizes) + o.dot_t(du, w.up.astype(dt), sizes)
        grads = type(w)(o.outer(x, dg, sizes), o.outer(x, du, sizes), o.outer(h, dy, sizes))
        if w.b_gate is not None:  # each row's cotangent to its group's bias
            e_m, n = group_ids(sizes, x.shape[0]), w.gate.shape[0]
            sums = [jax.ops.segment_sum(c, e_m, num_segments=n) for c in (dg, du, dy)]
            grads = grads._replace(b_gate=sums[0], b_up=sums[1], b_down=sums[2])
        zero_sizes = np.zeros(sizes.shape, jax.dtypes.float0)
        return (_rows_of_groups(dx, sizes), zero_sizes, jax.tree.map(cotangent, grads, w))

    @jax.custom_vjp
    def f(x, sizes, w):
        return forward(x, sizes, w)[0]

    f.defvjp(forward, backward)
    return f
