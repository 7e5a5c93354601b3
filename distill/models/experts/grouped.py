"""The experts' grouped matmuls: each row of a routed batch through its own expert's SwiGLU,
exactly, at the cost of the rows' experts alone.

Kernels (`kernel()` picks one per platform, as attention picks its backend):

- `ragged_dot`: `jax.lax.ragged_dot` over the rows sorted by expert, three grouped matmuls.
  TPU lowers it natively (megablox's grouped matmul). On NVIDIA GPUs (and CPU) XLA rewrites
  every ragged_dot into a dense matmul over *all* experts with the other experts' rows
  masked: E times the work and an [E, rows, D] temporary (one layer of the 30B-A3B shape at
  4,096 tokens: 39.7 TFLOP for 0.31 TFLOP of active experts). So it runs on TPU only.
- `tiled`: pure XLA for every other platform. The rows are laid out by expert, each
  expert's group padded up to a multiple of a tile of `m` rows (`tile_rows`), and one
  `jax.lax.scan` over the tiles runs each tile through its expert's SwiGLU (gate and up
  from the expert's own weights, taken by dynamic index: no gathered weight array), the
  gate/up activations never wider than a tile. Its backward (`jax.custom_vjp`) is a second
  scan: each tile's input gradient, and its weight gradients added into the expert's slot
  of the gradient in place; forward 3, backward 6 matmuls of a tile (3x the forward).
  The padding is at most min(E, R) * (m - 1) rows for R rows, and `tile_rows` keeps it
  under 1/`PAD_SHARE` of R: at R = T * k = 32,768 and E = 128, m = 32 and at most 12% more
  rows than routed. Fewer rows per expert (small R / E) mean smaller tiles, down to m = 1.
- `mosaic_gpu`: on Hopper GPUs (compute capability 9.x), JAX's Pallas Mosaic GPU ragged-dot
  kernels over the rows sorted by expert, with their own backward
  (`distill.models.experts.mosaic`); bfloat16 or float16 widths that are multiples of 64
  (`mosaic.usable`), else the `tiled` kernel.

The capacity path (`teacher.moe_capacity_factor`) needs no grouping: its [E, C, D] slots
run as batched matmuls (`batched_swiglu`).

Every kernel takes the experts as `Experts` (with gpt-oss' biases, `ModelConfig.expert_bias`:
each row adds its own expert's, inside the `tiled` kernel's tiles, by a per-row gather of
[E, F] around the others' grouped matmuls) and the gated activation as `glu(gate, up)`
(SwiGLU, GeGLU, gpt-oss' clamped SwiGLU: `distill.models.moe.glu`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from distill.collectives import cotangent, vary, varying
from distill.models import attention
from distill.models.experts import mosaic
from distill.models.experts.weights import Experts, group_ids, row_bias

KERNELS = ("ragged_dot", "mosaic_gpu", "tiled")
MAX_TILE = 128  # rows per tile at most: enough for a GPU's tensor cores
PAD_SHARE = 8  # padding at most 1/8 of the routed rows


def kernel(platform: str | None = None) -> str:
    """The grouped-matmul kernel for `platform` (default: the one attention chooses for,
    `distill.models.attention.platform`): `ragged_dot` on TPU, `mosaic_gpu` on a Hopper
    GPU, `tiled` elsewhere."""
    platform = platform or attention.platform()
    if platform == "tpu":
        return "ragged_dot"
    return "mosaic_gpu" if platform == "gpu" and hopper() else "tiled"


def hopper() -> bool:
    """Whether this process's GPUs are Hoppers (compute capability 9.x), which the Mosaic
    kernels are written for; False where there is no GPU (a plan made on a laptop)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return False
    capability = [str(getattr(d, "compute_capability", "")) for d in gpus]
    return bool(gpus) and all(c.startswith("9") for c in capability)


def tile_rows(rows: int, n_experts: int) -> int:
    """The tile m of the `tiled` kernel for `rows` rows over `n_experts` experts: the
    largest power of two up to `MAX_TILE` whose worst padding, n_experts * (m - 1) rows,
    stays within rows / `PAD_SHARE`; 1 at least."""
    m = 1
    while 2 * m <= MAX_TILE and n_experts * (2 * m - 1) * PAD_SHARE <= rows:
        m *= 2
    return m


def n_tiles(rows: int, n_experts: int, m: int) -> int:
    """Tiles that hold any routing of `rows` rows to `n_experts` experts, each expert's
    group padded to a multiple of m: sum_e ceil(c_e / m) <= (rows + min(E, rows)(m - 1)) / m."""
    return max(1, (rows + min(n_experts, rows) * (m - 1)) // m)


def expert_rows(x_nd, src_r, expert_r, w: Experts, glu, kernel_name: str):
    """Row r of the result [R, D]: expert `expert_r[r]`'s gated MLP (`glu(gate, up)`) of
    x[src_r[r]], zeros where expert_r[r] == E (an empty or dropped row)."""
    n_experts = w.n
    on_hopper = kernel_name == "mosaic_gpu" and mosaic.usable(
        x_nd.shape[-1], w.gate.shape[-1], x_nd.dtype
    )
    if kernel_name == "ragged_dot" or on_hopper:  # the rows sorted by expert, as runs
        order = jnp.argsort(expert_r, stable=True)  # rows of no expert last
        sizes = jnp.bincount(expert_r, length=n_experts + 1)[:n_experts].astype(jnp.int32)
        swiglu = mosaic.grouped_swiglu(glu) if on_hopper else partial(ragged_swiglu, glu=glu)
        y = swiglu(x_nd[src_r[order]], sizes, w)
        return jnp.zeros_like(y).at[order].set(y)
    if kernel_name not in KERNELS:
        raise ValueError(f"unknown MoE kernel {kernel_name!r}; expected one of {KERNELS}")
    x, src, pos, tile_e = _tiled_input(x_nd, src_r, expert_r, n_experts)
    y = tiled_swiglu(glu)(x, tile_e, w).reshape(src.shape[0], -1)
    return y.at[pos].get(mode="fill", fill_value=0)


def _tiled_input(x_nd, src_r, expert_r, n_experts: int):
    """The tiled kernel's input: (x [tiles, m, D], each tile row's source row in x_nd
    [tiles * m] (N where empty), each row's place in the tiles [R], each tile's expert)."""
    rows = expert_r.shape[0]
    m = tile_rows(rows, n_experts)
    tiles = n_tiles(rows, n_experts, m)
    pos, tile_e = _tile_layout(expert_r, n_experts, m, tiles)
    src = jnp.full((tiles * m,), x_nd.shape[0], jnp.int32).at[pos].set(src_r, mode="drop")
    return x_nd.at[src].get(mode="fill", fill_value=0).reshape(tiles, m, -1), src, pos, tile_e


def _tile_layout(expert_r, n_experts: int, m: int, tiles: int):
    """(each row's place in the tiled layout [R], past its end for rows of no expert; each
    tile's expert [tiles], E for the tiles left over): experts in order, each group
    starting on a tile boundary."""
    rows = expert_r.shape[0]
    counts = jnp.bincount(expert_r, length=n_experts + 1)[:n_experts]
    padded = (counts + m - 1) // m * m
    end = jnp.cumsum(padded)
    order = jnp.argsort(expert_r, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(rows, dtype=order.dtype))
    first = jnp.cumsum(counts) - counts  # each expert's first row in sorted order
    e = jnp.minimum(expert_r, n_experts - 1)
    pos = jnp.where(expert_r < n_experts, end[e] - padded[e] + rank - first[e], tiles * m)
    starts = jnp.arange(tiles, dtype=end.dtype) * m
    tile_e = jnp.searchsorted(end, starts, side="right")  # E: a tile past the routed rows
    return pos.astype(jnp.int32), tile_e.astype(jnp.int32)


def ragged_swiglu(x_md, sizes_e, w: Experts, glu):
    """Each expert's gated MLP on its contiguous run of rows of x [M, D] (`sizes_e` rows per
    expert, the rest of the rows unused, zeros) with `jax.lax.ragged_dot`; the biases by
    each row's expert."""
    dt = x_md.dtype
    e_m = group_ids(sizes_e, x_md.shape[0]) if w.b_gate is not None else None
    gate = jax.lax.ragged_dot(x_md, w.gate.astype(dt), sizes_e) + row_bias(w.b_gate, e_m, dt)
    up = jax.lax.ragged_dot(x_md, w.up.astype(dt), sizes_e) + row_bias(w.b_up, e_m, dt)
    y = jax.lax.ragged_dot(glu(gate, up), w.down.astype(dt), sizes_e)
    return y + row_bias(w.b_down, e_m, dt)


def _take(w, e, dt):
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False).astype(dt)


def _add_at(acc, e, v):
    """acc[e] += v, in place in a loop's carry."""
    cur = jax.lax.dynamic_index_in_dim(acc, e, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(acc, cur + v.astype(acc.dtype), e, 0)


def _vma(*trees) -> frozenset:
    """The mesh axes any leaf of `trees` varies over."""
    return frozenset().union(*(varying(a) for a in jax.tree.leaves(trees)))


def _tile_scan(tile, x, tile_e, w: Experts):
    """`tile(x_t, e, w)` over the tiles of x [tiles, m, D] (`jax.lax.scan`), zeros for a
    tile of expert E (past the routed rows: `jax.lax.cond` skips its matmuls)."""
    vma = _vma(x, tile_e, w)
    out = jax.eval_shape(tile, x[0], tile_e[0], w)
    skip = jax.tree.map(lambda o: vary(jnp.zeros(o.shape, o.dtype), vma), out)

    def body(_, xe):
        used = xe[1] < w.n
        return None, jax.lax.cond(used, lambda: tile(*xe, w), lambda: skip)

    return jax.lax.scan(body, None, (x, tile_e))[1]


def _bias(b, e, dt):
    return 0 if b is None else _take(b, e, dt)


def _gate_up(x, e, w: Experts):
    dt = x.dtype
    g = x @ _take(w.gate, e, dt) + _bias(w.b_gate, e, dt)
    return g, x @ _take(w.up, e, dt) + _bias(w.b_up, e, dt)


def _tiles_grads(glu, x, tile_e, w: Experts, g, u, dy, acc: Experts):
    """The tiled backward: (dx [tiles, m, D], acc + the weights' gradients), from each
    tile's input x, gate and up activations g, u and output cotangent dy; `acc` float32
    like the weights, each tile's gradients added into its expert's slot in place (a
    padding row's cotangent is zero: it adds nothing to the biases' either)."""

    def step(acc, xs):
        x_t, e, g_t, u_t, dy_t = xs
        a, glu_vjp = jax.vjp(glu, g_t, u_t)
        dg, du = glu_vjp(dy_t @ _take(w.down, e, dy_t.dtype).T)
        grads = Experts(x_t.T @ dg, x_t.T @ du, a.T @ dy_t)
        if w.b_gate is not None:
            grads = grads._replace(b_gate=dg.sum(0), b_up=du.sum(0), b_down=dy_t.sum(0))
        acc = jax.tree.map(lambda a, v: _add_at(a, e, v), acc, grads)
        dx = dg @ _take(w.gate, e, dg.dtype).T + du @ _take(w.up, e, du.dtype).T
        return acc, dx

    none = vary(jnp.zeros(x.shape[1:], x.dtype), _vma(x, tile_e, dy, w))

    def body(acc, xs):
        used = xs[1] < w.n
        return jax.lax.cond(used, lambda: step(acc, xs), lambda: (acc, none))

    acc, dx = jax.lax.scan(body, acc, (x, tile_e, g, u, dy))
    return dx, acc


def _zeros(w: Experts, vma) -> Experts:
    """float32 zeros like each weight, varying over `vma`: a gradient accumulator."""
    return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, jnp.float32), vma), w)


def tiled_swiglu(glu):
    """f(x [tiles, m, D], tile_e [tiles], w: Experts) -> [tiles, m, D]: each tile through
    its expert's gated MLP (`glu(gate, up)`), with the tiled backward. A tile of expert E
    (past the routed rows) is skipped (`jax.lax.cond`): zeros, no matmul."""

    def tile(x, e, w):
        g, u = _gate_up(x, e, w)
        return glu(g, u) @ _take(w.down, e, x.dtype) + _bias(w.b_down, e, x.dtype), (g, u)

    @jax.custom_vjp
    def f(x, tile_e, w):
        return _tile_scan(tile, x, tile_e, w)[0]  # (g, u) unused, dropped

    def fwd(x, tile_e, w):
        y, gu = _tile_scan(tile, x, tile_e, w)
        return y, (x, tile_e, w, gu)

    def bwd(res, dy):
        x, tile_e, w, (g, u) = res
        dx, grads = _tiles_grads(glu, x, tile_e, w, g, u, dy, _zeros(w, _vma(x, tile_e, dy, w)))
        return dx, None, jax.tree.map(cotangent, grads, w)

    f.defvjp(fwd, bwd)
    return f


def expert_rows_grads(x_nd, src_r, expert_r, w: Experts, dy_rd, acc: Experts, glu, kernel_name):
    """The transpose of `expert_rows` at its output cotangent dy [R, D]: (dx [N, D], acc +
    the weights' gradients), `acc` float32 like the weights and varying as the rows do: no
    sum over mesh axes here. The tiled kernel recomputes gate and up (not down) and adds
    each tile's gradients into `acc` in place (an accumulator over calls, such as the
    dispatch's rounds, holds one copy of the gradients)."""
    if kernel_name != "tiled":
        fn = lambda x, w: expert_rows(x, src_r, expert_r, w, glu, kernel_name)  # noqa: E731
        dx, dw = jax.vjp(fn, x_nd, w)[1](dy_rd)
        return dx, jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, dw)
    x, src, pos, tile_e = _tiled_input(x_nd, src_r, expert_r, w.n)
    dy = jnp.zeros((src.shape[0], dy_rd.shape[1]), dy_rd.dtype).at[pos].set(dy_rd, mode="drop")
    g, u = _tile_scan(_gate_up, x, tile_e, w)
    dx, acc = _tiles_grads(glu, x, tile_e, w, g, u, dy.reshape(x.shape), acc)
    dx = jnp.zeros_like(x_nd).at[src].add(dx.reshape(src.shape[0], -1), mode="drop")
    return dx, acc


def batched_swiglu(x_ecd, w: Experts, glu):
    """Each expert's gated MLP on its own slots [E, C, D] -> [E, C, D]: batched matmuls."""
    dt = x_ecd.dtype

    def bias(b):  # [E, F] -> [E, 1, F], one per expert's slots
        return 0 if b is None else b.astype(dt)[:, None, :]

    g = jnp.einsum("ecd,edf->ecf", x_ecd, w.gate.astype(dt)) + bias(w.b_gate)
    u = jnp.einsum("ecd,edf->ecf", x_ecd, w.up.astype(dt)) + bias(w.b_up)
    return jnp.einsum("ecf,efd->ecd", glu(g, u), w.down.astype(dt)) + bias(w.b_down)
