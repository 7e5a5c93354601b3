"""The teacher forward on the inference mesh, under `jax.shard_map` with explicit collectives.

The teacher never takes a gradient. It returns what the loss needs and nothing more:
log-probabilities at the distillation temperature, either dense or the top-k values and
ids (merged vocab-parallel), so that only k numbers per token cross to the training mesh.

Layout (`teacher.sharding`): each `dp` group of the inference mesh runs its own rows of the
batch, tensor-parallel over its `tp` devices, `microbatch` rows at a time. The outputs leave
batch-major, whole rows split over every device of the mesh: the merged top-k (equal on a
group's `tp` devices) is sliced, each device keeping its block of rows; dense log-probs and
logits (vocabulary-sharded) go through one all-to-all over `tp`. Each device then holds
B / (dp * tp) whole rows, and the hop to a student whose batch is split over as many devices
is one buffer copy per device (`distill.handoff`; for other splits the hop assembles each
student shard from whole row blocks, still device to device).

With pipeline stages (a `pp` axis: `mesh.teacher.pp`) the group's microbatches stream
through the stages' layers (`teacher.stages`), and each stage then forms the outputs of
its 1/pp of the rows as above: the rows leave split over pp as well.

With context parallelism (a `cp` axis: `mesh.teacher.cp`) the batch comes in with each
row's positions split over cp in row order; each device lays its slice out as the two
load-balanced chunks ring attention wants (`ring.balance`, two `ppermute`s of the
int32 fields), runs the layers on them with attention over the cp ring, forms its positions'
outputs, and sends them back to row order (`ring.unbalance`). The outputs leave
split over cp by position (`P(rows, cp)`), as a student of the same cp takes them: no row
is ever whole on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp

from distill import collectives as cc
from distill import programs
from distill.config import Config, ModelConfig
from distill.mesh import CP, DP, EP, PP, TP
from distill.models import model, moe
from distill.models.kernels import ring
from distill.models.vocab_loss import default_chunk
from distill.types import Batch, TeacherOutput
from teacher import stages
from teacher.sharding import OUT_ROWS_DP, batch_spec, out_spec, param_specs

Mode = Literal["dense", "topk", "logits", "target_logprobs"]


def make_forward(
    cfg: ModelConfig,
    mesh,
    *,
    mode: Mode = "dense",
    temperature: float = 1.0,
    top_k: int | None = None,
    dtype: str = "float32",
    vocab_limit: int | None = None,
    microbatch: int | None = None,
    capacity_factor: float | None = None,
    expert_load: bool = False,
    sequence_parallel: bool = True,
    windows: int = 1,
):
    """jit(shard_map(forward)) with signature (sharded_params, batch) -> output, on `mesh`
    (axes `dp` x `ep` x `tp`, with `pp` first for pipeline stages and `cp` before `tp` for
    context parallelism: `distill.mesh.teacher_mesh`). The batch's rows must divide by `dp`
    x `ep`, its positions (with `cp`) by 2 x cp (`teacher.sharding.batch_spec`).

    `vocab_limit`: the tokenizer's vocabulary size when the model's is padded past it; the
    logits of ids >= vocab_limit are -inf in every mode (each vocab shard masks its own
    range), so log-probs and top-k put no mass on ids the tokenizer never produces.

    `microbatch`: rows per forward in each dp group (at most: the largest divisor of the
    group's rows not above it); None: all of them at once. `capacity_factor`: a mixture of
    experts' per-expert capacity (`distill.models.moe`); None: dropless.
    `sequence_parallel`: norms and residuals on 1/tp of the positions (`_tensor_axis`).

    `expert_load` (a mixture of experts only): return (output, `moe.ExpertLoad`), the
    batch's routing counts summed over layers, microbatches and the axes that split rows
    (`dp`, `ep`; not `tp`, whose devices route the same tokens), replicated.

    mode "dense": TeacherOutput(log softmax(z/T) [B,S,V], None)
    mode "topk":  TeacherOutput(top-k of log softmax(z/T) [B,S,k], ids [B,S,k])
    mode "logits": raw logits z [B,S,V] (eval), or `windows` (`distill.handoff.eval_windows`)
    mode "target_logprobs": log softmax(z/T) [B,S] at each batch target (`distill score`,
        on-policy scoring): formed a chunk of positions at a time, never the [B,S,V] ones
    each with its rows split over the whole mesh (`teacher.sharding.out_spec`).
    """
    if mode == "topk" and not top_k:
        raise ValueError("mode='topk' needs top_k")
    if expert_load and not cfg.n_experts:
        raise ValueError("expert_load needs a mixture of experts")
    if windows > 1 and mode != "logits":
        raise ValueError("windows are for mode='logits', the only [B,S,V] one but 'dense'")

    moe_opts = {"ep_axis": EP, "capacity_factor": capacity_factor} if cfg.n_experts else None
    n_stages = mesh.shape.get(PP, 1)
    context, attend = _context(mesh)
    stage_kw = {"dtype": dtype, "moe_opts": moe_opts, "with_stats": expert_load}

    def outputs(params, batch: Batch):
        """What `mode` returns for some rows: top-k and target log-probs replicated over
        `tp`, else vocabulary-sharded [b, S, V/tp]; the logits formed a chunk of positions at
        a time."""
        tp = _tensor_axis(mesh, batch.tokens.shape[1], sequence_parallel)
        x, head, *stats = model.apply_hidden(
            cfg, params, batch.tokens, batch.segment_ids, batch.positions, tp_axis=tp,
            dtype=dtype, moe_opts=moe_opts, with_stats=expert_load, attend=attend,
        )  # fmt: skip  # [b, S, D] ([b, S/tp, D] under SP), [D, V/tp], (ExpertLoad [L, E], [L])
        x = cc.gather_positions(x, tp)
        out = rows_outputs(x, batch.targets, head)
        if not expert_load:
            return out
        return out, jax.tree.map(lambda n: jnp.sum(n, axis=0), stats[0])  # over layers

    heads = partial(head_outputs, cfg, mode, temperature, top_k, vocab_limit)
    rows_outputs = partial(_rows_outputs, heads, windows)

    def forward(params, batch: Batch, *, split_rows: bool):
        if context:  # each device's two load-balanced chunks of its rows
            batch = jax.tree.map(lambda x: ring.balance(x, CP), batch)
        if n_stages > 1:
            out = _staged(cfg, params, batch, rows_outputs, microbatch, split_rows, **stage_kw)
        else:
            out = in_microbatches(lambda b: outputs(params, b), batch, microbatch, expert_load)
        if expert_load:
            out, load = out
        out = _leave(out, mode, split_rows, context)
        if not expert_load:
            return out
        # each stage its layers' load; each cp device its positions' routing
        rows_axes = (DP, EP) + ((PP,) if n_stages > 1 else ()) + ((CP,) if context else ())
        return out, jax.tree.map(lambda n: cc.psum(n, rows_axes), load)

    def run(params, batch: Batch):
        spec = out_spec(batch.tokens.shape[0], mesh)
        out_specs = _mode_specs(mode, spec, windows)
        if expert_load:
            out_specs = (out_specs, moe.ExpertLoad(jax.P(), jax.P()))
        sharded = jax.shard_map(
            lambda p, b: forward(p, b, split_rows=spec[0] != OUT_ROWS_DP[0]),
            mesh=mesh,
            in_specs=(param_specs(cfg, n_stages), batch_spec(mesh)),
            out_specs=out_specs,
        )
        return sharded(params, batch)

    return jax.jit(run)


def _rows_outputs(out: Callable, windows: int, x, targets, head):
    """`out`'s outputs (`head_outputs` of a mode) of hidden states x [b, S, D] a chunk of
    positions at a time, in `windows` strided windows of the positions when above 1 (each
    device's, in its layout: the load-balanced chunks under cp hold whole runs of w
    positions)."""
    chunk = default_chunk(head.shape[-1], x.shape[0])
    if windows == 1:
        return by_positions(lambda c: out(*c, head), (x, targets), chunk)
    return tuple(
        by_positions(lambda c: out(*c, head), (x[:, j::windows], targets[:, j::windows]), chunk)
        for j in range(windows)
    )


def _context(mesh) -> tuple[bool, Callable | None]:
    """(whether `mesh` splits rows over `cp`, attention over its ring or None). Each device
    then holds its rows' two load-balanced chunks (`ring.balance`, the student's
    layout): RoPE from their true positions, attention by `ring_attention` (key/value
    blocks around the ring, or gathered, as for the student), windows, soft-caps and packed
    segments as on one device; everything else is per position."""
    context = CP in mesh.shape
    if context and PP in mesh.shape:
        raise ValueError("a teacher mesh with both pp and cp axes is not supported")
    return context, partial(ring.ring_attention, axis=CP) if context else None


def _tensor_axis(mesh, positions: int, sequence_parallel: bool) -> str:
    """The tensor-parallel axis the model runs on: `SequenceParallel(TP)` when asked and the
    `positions` of a device's rows divide over `tp` (> 1), without stages; else `TP`. Under
    it, between the column- and row-parallel matmuls, the residual stream and the norms
    hold 1/tp of the positions a device: each row-parallel sum is a reduce-scatter over
    the positions, each column-parallel matmul's input an all-gather of them (the same
    bytes as the all-reduce they replace), and the final hidden states are gathered once
    for the vocabulary-parallel head. The outputs equal plain tp's to float32 rounding."""
    tp = mesh.shape[TP]
    if sequence_parallel and tp > 1 and positions % tp == 0 and PP not in mesh.shape:
        return cc.SequenceParallel(TP)
    return TP


def _leave(out, mode: Mode, split_rows: bool, context: bool):
    """The outputs as they leave the mesh: with `cp`, back in row order (each device its
    S/cp positions: `ring.unbalance`); then top-k and target log-probs sliced to
    this `tp` device's rows (`split_rows`) or kept, vocabulary shards sent to their rows'
    devices (all-to-all) or gathered."""
    if context:
        out = jax.tree.map(lambda x: ring.unbalance(x, CP), out)
    if mode in ("topk", "target_logprobs"):
        layout = cc.rows_of_replicated if split_rows else lambda x, _: x
    else:
        layout = cc.vocab_to_rows if split_rows else cc.gather_vocab
    return jax.tree.map(lambda x: layout(x, TP), out)


def head_outputs(cfg: ModelConfig, mode: Mode, temperature, top_k, vocab_limit, x, targets, head):
    """`make_forward`'s outputs of `mode` from hidden states x [b, c, D] and this shard's
    LM head [D, V/tp]: top-k and target log-probs replicated over `tp`, else
    vocabulary-sharded [b, c, V/tp]."""
    logits = model.logits(x, head, cfg.final_softcap)  # [b, c, V/tp], float32
    if vocab_limit is not None and vocab_limit < cfg.vocab_size:
        logits = cc.mask_vocab(logits, vocab_limit, TP)
    if mode == "logits":
        return logits
    z = logits / temperature
    if mode == "dense":
        return TeacherOutput(cc.log_softmax(z, TP), None)
    if mode == "target_logprobs":  # [b, c], replicated over tp
        return cc.take_ids(z, targets, TP) - cc.logsumexp(z, TP)[..., 0]
    # log-probs are logits minus one per-token constant: the top-k of the logits are
    # theirs, so only k log-probs are formed, never the [b, S, V/tp] array
    values, ids = cc.top_k(z, top_k, TP)
    return TeacherOutput(values - cc.logsumexp(z, TP), ids)


def _staged(cfg, params, batch: Batch, rows_outputs, microbatch, split: bool, **kw):
    """`rows_outputs` (hidden states, targets, head -> outputs) of a dp group's rows run
    through the `pp` stages (`teacher.stages.hidden`; `kw`: its dtype, moe_opts,
    with_stats): this stage's 1/pp of the rows with `split`, else all of them; with the
    expert load summed over layers and microbatches when `with_stats`."""
    size = microbatch_rows(batch.tokens.shape[0], microbatch)
    x, head, load = stages.hidden(cfg, params, batch, size, split=split, **kw)
    targets = cc.rows_of_replicated(batch.targets, PP) if split else batch.targets
    out = in_microbatches(lambda xt: rows_outputs(*xt, head), (x, targets), microbatch)
    return (out, load) if kw.get("with_stats") else out


def _mode_specs(mode: Mode, spec, windows: int = 1):
    """The output specs of `mode`, each array's rows laid out by `spec` (logits in
    `windows` arrays when above 1)."""
    if mode in ("dense", "topk"):
        return TeacherOutput(spec, spec if mode == "topk" else None)
    return spec if windows == 1 else (spec,) * windows  # logits, target log-probs


def by_positions(fn: Callable, xs, chunk: int):
    """fn over runs of `chunk` positions of `xs` (an array or a tree of them, each
    [b, S, ...]: the hidden states x [b, S, D], the targets), each output leaf [b, chunk,
    ...] written into its place in [b, S, ...]: one chunk's logits live at a time
    (`distill.models.vocab_loss.default_chunk` sizes them), never the [b, S, V/tp] ones. The
    last chunk is shifted back to end at S, so it rewrites a few positions with equal
    values rather than padding."""
    s = jax.tree.leaves(xs)[0].shape[1]
    if chunk >= s:
        return fn(xs)
    first = fn(jax.tree.map(lambda x: x[:, :chunk], xs))

    def place(out, piece, start):
        return jax.tree.map(
            lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, start, axis=1), out, piece
        )

    def whole(p):  # zeros [b, S, ...] varying over the mesh axes as `p` does (shard_map)
        return jnp.broadcast_to(jnp.zeros_like(p[:, :1]), (p.shape[0], s, *p.shape[2:]))

    def body(i, out):
        start = jnp.minimum(i * chunk, s - chunk)
        piece = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1), xs)
        return place(out, fn(piece), start)

    out = place(jax.tree.map(whole, first), first, 0)
    return jax.lax.fori_loop(1, -(-s // chunk), body, out)


def in_microbatches(fn: Callable, batch, microbatch: int | None, summed: bool = False):
    """fn over the rows of `batch` (a Batch, or any tree of [rows, ...] arrays) `microbatch`
    at a time (`jax.lax.map`: one compiled body, peak memory of one microbatch), the outputs
    concatenated along the rows.
    `summed`: fn returns (rows' output, counts), and the counts are summed instead."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    size = microbatch_rows(rows, microbatch)
    if size == rows:
        return fn(batch)
    n = rows // size
    out = jax.lax.map(fn, jax.tree.map(lambda x: x.reshape(n, size, *x.shape[1:]), batch))
    if summed:
        out, counts = out
        return in_rows(out, rows), jax.tree.map(lambda c: jnp.sum(c, axis=0), counts)
    return in_rows(out, rows)


def microbatch_rows(rows: int, microbatch: int | None) -> int:
    """Rows per forward of a dp group's `rows`: the largest divisor not above `microbatch`
    (None: all of them)."""
    if microbatch is None:
        return rows
    return max(d for d in range(1, microbatch + 1) if rows % d == 0)


def in_rows(out, rows: int):
    """Microbatch outputs [n, b, ...] as [n * b, ...] = [rows, ...]."""
    return jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), out)


def forward_for(cfg: ModelConfig, mesh, **kw):
    """`make_forward(cfg, mesh, **kw)`, built once per process for equal arguments
    (`distill.programs`): a second run of the same shapes reuses the compiled forward."""
    return programs.cached(make_forward, cfg, mesh, **kw)


def make_output_forward(cfg: Config, mesh, vocab_limit: int | None, expert_load: bool = False):
    """The run's training-time teacher output (top-k with `teacher.top_k`, else dense
    log-probs), at `distill.temperature`, in `teacher.microbatch` rows at a time.
    `expert_load`: with a mixture of experts' routing counts (`make_forward`)."""
    k = cfg.teacher.top_k
    return forward_for(
        cfg.teacher.model,
        mesh,
        mode="topk" if k else "dense",
        temperature=cfg.distill.temperature,
        top_k=k,
        dtype=cfg.teacher.dtype,
        vocab_limit=vocab_limit,
        microbatch=cfg.teacher.microbatch,
        capacity_factor=cfg.teacher.moe_capacity_factor,
        expert_load=expert_load,
    )
