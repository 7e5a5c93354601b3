"""Pipeline-parallel teacher stages over the inference mesh's `pp` axis (`mesh.teacher.pp`).

Stage s holds layers [s*L/pp, (s+1)*L/pp) (the layer weights' leading axis is split over
`pp`: `teacher.sharding`; where pp does not divide the layers the stack is padded with zero
layers, which pass their input through: `stacked_layers`), with its slice of the per-layer
data (windows, RoPE tables, which layers are MoE: `distill.models.parts.layer_data`). A dp
group's rows run in m microbatches that stream through the stages over m + pp - 1 ticks:
at tick t stage s runs its layers on microbatch t - s (the first stage on that
microbatch's embeddings, the others on what the previous stage sent at the end of tick
t - 1), then sends its output on to the next stage with one point-to-point transfer
(`distill.collectives.to_next_stage`). Each stage idles pp - 1 of the ticks (in SPMD it
computes on a stale buffer then, its result never used): the bubble is
(pp - 1) / (m + pp - 1).

The last stage's outputs, the final hidden states of every row, are then spread over the
stages (a reduce-scatter over `pp`, `distill.collectives.from_last_stage`), so that every
stage runs the final norm, the LM head and the top-k on its own 1/pp of the rows: the head
is not left to one stage, and the outputs leave with whole rows split over every device of
the mesh as without stages (`teacher.sharding.OUT_ROWS_PP`). When the rows do not divide that
way every stage gets all of them (an all-reduce) and runs the head on all (replicated).

Everything runs inside the teacher's `jax.shard_map` (`teacher.forward.make_forward`).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from distill import collectives as cc
from distill.config import Config
from distill.errors import DistillError
from distill.mesh import PP, TP
from distill.models import model, parts
from distill.types import Batch

log = logging.getLogger("distill")


def stacked_layers(n_layers: int, pp: int) -> int:
    """Layers the teacher's stack holds over `pp` stages: `n_layers` rounded up to a
    multiple of pp, so every stage holds as many (DeepSeek-V3's 61 over pp=2: 31 each). The
    layers past n_layers are zeros, and a block of zeros passes its input through exactly
    (x + 0: its attention and feed-forward outputs are projections by zero weights)."""
    return -(-n_layers // pp) * pp


def pad_layers(params: dict, cfg, pp: int) -> dict:
    """`params` as stages hold them (pp > 1): every part in the one-shape stack
    (`distill.models.parts.to_union`: every stage runs the same program) padded with zero
    layers to `stacked_layers` (a no-op when pp divides the layers); unchanged at pp = 1."""
    if pp == 1:
        return params
    params = parts.to_union(cfg, params)
    extra = stacked_layers(cfg.n_layers, pp) - cfg.n_layers
    if not extra:
        return params
    pad = lambda a: jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    return dict(params, layers=jax.tree.map(pad, params["layers"]))


def stage_data(cfg, stage: jax.Array, pp: int) -> dict | None:
    """`parts.layer_data` of stage `stage`'s layers (None when layers are alike); the zero
    layers that pad the stack (`stacked_layers`) take the last layer's, run dense where
    dense and MoE mix."""
    data = parts.layer_data(cfg, union=True)
    n = stacked_layers(cfg.n_layers, pp) // pp
    extra = n * pp - cfg.n_layers

    def pad(key, a):
        if not extra:
            return a
        tail = jnp.zeros_like(a[-1:]) if key == "moe" else a[-1:]
        return jnp.concatenate([a, jnp.repeat(tail, extra, axis=0)])

    data = None if data is None else {k: pad(k, a) for k, a in data.items()}
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, stage * n, n, axis=0), data)


def _vary(x, axes) -> jax.Array:
    """`x` typed as varying over `axes` (those it does not vary over already): a loop's
    carry must keep the type its body gives it."""
    missing = tuple(a for a in axes if a not in _varying(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varying(x) -> frozenset:
    """The mesh axes `x` varies over inside `jax.shard_map`."""
    return jax.typeof(x).manual_axis_type.varying


def hidden(
    cfg, params, batch: Batch, size: int, *, dtype: str, split: bool, moe_opts=None,
    with_stats: bool = False,
):  # fmt: skip
    """(final normed hidden states [r, S, D] of this stage's rows, the LM head [D, V/tp],
    the expert stats summed over layers and microbatches or None), the dp group's `rows`
    run in microbatches of `size` through the stages. `split`: r = rows / pp, stage i's
    block i of the rows; else r = rows on every stage."""
    module = model._module(cfg, params, union=True)
    pp, stage = jax.lax.axis_size(PP), jax.lax.axis_index(PP)
    rows, seq = batch.tokens.shape
    m = rows // size

    def micro(a):
        return a.reshape(m, size, *a.shape[1:])

    tokens, segments, positions = map(micro, (batch.tokens, batch.segment_ids, batch.positions))
    dt = jnp.dtype(dtype)
    backend = module.backend(cfg.attention, dt, seq)
    data = stage_data(cfg, stage, pp)
    local = stacked_layers(cfg.n_layers, pp) // pp  # this stage's layers
    axes = (PP, *_varying(batch.tokens))  # what a stage's activations vary over

    def tick(received, t):
        module = model._module(cfg, params, union=True)  # made in the loop's trace (NNX's rule)
        j = jnp.clip(t - stage, 0, m - 1)  # this stage's microbatch (stale when idle)
        x = jax.lax.cond(
            stage == 0,
            lambda: _vary(module.embed_tokens(tokens[j], TP, dt), axes),
            lambda: received,
        )
        y, stats = module.blocks(
            x, segments[j], positions[j], data, tp_axis=TP, backend=backend, moe_opts=moe_opts
        )
        if with_stats:  # an idle tick's routing is not the batch's, nor a padding layer's
            busy = (t >= stage) & (t - stage < m)
            real = stage * local + jnp.arange(local) < cfg.n_layers
            stats = jax.tree.map(
                lambda n: jnp.where(busy, jnp.sum(n * _per_layer(real, n), axis=0), 0), stats
            )
        return cc.to_next_stage(y, PP), (y, stats if with_stats else None)

    first = _vary(jnp.zeros((size, seq, cfg.d_model), dt), axes)
    _, (ys, stats) = jax.lax.scan(tick, first, jnp.arange(m + pp - 1))
    # the last stage finishes microbatch i at tick i + pp - 1
    x = cc.from_last_stage(ys[pp - 1 :].reshape(rows, seq, -1), PP, split)
    if with_stats:
        stats = jax.tree.map(lambda n: jnp.sum(n, axis=0), stats)
    return module.final(x), module.head(), stats


def _per_layer(mask_l: jax.Array, n_l: jax.Array) -> jax.Array:
    """`mask_l` [L] shaped to broadcast against per-layer stats `n_l` [L, ...]."""
    return mask_l.reshape(-1, *(1,) * (n_l.ndim - 1)).astype(n_l.dtype)


def bubble(pp: int, microbatches: int) -> float:
    """The fraction of a stage's ticks spent idle: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


def stage_bytes(cfg: Config, microbatches: int, dtype_bytes: int) -> int:
    """Bytes of activations a step sends between stages, over every dp group: each of the
    m microbatches [rows/m, S, D] crosses each of the pp - 1 stage boundaries once (the
    schedule's idle ticks send stale buffers too: pp - 1 more per boundary)."""
    t = cfg.mesh.teacher
    rows = cfg.train.batch_size // (t.dp * t.ep)
    per = rows // microbatches * cfg.train.seq_len * cfg.teacher.model.d_model * dtype_bytes
    return per * (t.pp - 1) * microbatches * t.dp * t.ep


def check_stages(cfg: Config, warn: bool = True) -> None:
    """`mesh.teacher.pp` against the model and the features built for it, before any device
    work: the layers divide into the stages (in ray mode the stages are the processes of a
    teacher group, `mesh.teacher.hosts`; under `mesh.placement: auto` every candidate keeps
    them).
    `warn`: log a warning when one microbatch leaves the stages nothing to overlap, or a
    stage spans several hosts."""
    pp = cfg.mesh.teacher.pp
    if pp == 1:
        return
    layers = cfg.teacher.model.n_layers
    gemma4 = {  # each layer reads the tokens and input embeddings; the last layers take
        # their keys and values from earlier ones, in another stage
        "per_layer_input": "per-layer input embeddings",
        "kv_shared_layers": "keys and values shared across layers",
    }
    for key, what in gemma4.items():
        if getattr(cfg.teacher.model, key):
            raise DistillError(
                f"mesh.teacher.pp: {pp} stages with {what} (teacher.model.{key}: Gemma 4's) "
                "is not supported; mesh.teacher.pp: 1"
            )
    per = stacked_layers(layers, pp) // pp
    if (pp - 1) * per >= layers:
        raise DistillError(
            f"mesh.teacher.pp: {pp} stages of {per} layers leave the last stage none of "
            f"teacher.model.n_layers={layers}; use fewer stages"
        )
    if warn and layers % pp:
        log.info(
            "mesh.teacher.pp=%d over %d layers: %d a stage, the last stage's last %d "
            "zero layers that pass their input through", pp, layers,
            stacked_layers(layers, pp) // pp, stacked_layers(layers, pp) - layers,
        )  # fmt: skip
    t = cfg.mesh.teacher
    if warn and t.hosts > pp:  # ray mode: stages are outermost, so a stage spans hosts
        log.warning(
            "mesh.teacher.hosts=%d with mesh.teacher.pp=%d: each stage spans %d hosts, so its "
            "tp (and dp, ep) collectives cross them; hosts = pp keeps each stage in one host",
            t.hosts, pp, t.hosts // pp,
        )  # fmt: skip
    rows = cfg.train.batch_size // (t.dp * t.ep)
    if warn and (cfg.teacher.microbatch is None or cfg.teacher.microbatch >= rows):
        log.warning(
            "mesh.teacher.pp=%d with one teacher microbatch: the stages run one after "
            "another (bubble %.0f%%); set teacher.microbatch below %d rows to overlap them",
            pp, 100 * bubble(pp, 1), rows,
        )  # fmt: skip


def stage_layers(cfg: Config) -> int:
    """Layers each stage holds (with the zero layers that pad the stack: `stacked_layers`)."""
    return stacked_layers(cfg.teacher.model.n_layers, cfg.mesh.teacher.pp) // cfg.mesh.teacher.pp
