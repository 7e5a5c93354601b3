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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax

from distill import collectives as cc
from distill import model
from distill.config import Config, ModelConfig
from distill.mesh import TP
from distill.types import Batch, TeacherOutput
from teacher.sharding import BATCH_BS, OUT_ROWS, out_spec, param_specs

Mode = Literal["dense", "topk", "logits"]


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
):
    """jit(shard_map(forward)) with signature (sharded_params, batch) -> output, on `mesh`
    (axes `dp` x `tp`: `distill.mesh.teacher_mesh`). The batch's rows must divide by `dp`.

    `vocab_limit`: the tokenizer's vocabulary size when the model's is padded past it; the
    logits of ids >= vocab_limit are -inf in every mode (each vocab shard masks its own
    range), so log-probs and top-k put no mass on ids the tokenizer never produces.

    `microbatch`: rows per forward in each dp group (at most: the largest divisor of the
    group's rows not above it); None: all of them at once.

    mode "dense": TeacherOutput(log softmax(z/T) [B,S,V], None)
    mode "topk":  TeacherOutput(top-k of log softmax(z/T) [B,S,k], ids [B,S,k])
    mode "logits": raw logits z [B,S,V] (evaluation)
    each with its rows split over the whole mesh (`teacher.sharding.out_spec`).
    """
    if mode == "topk" and not top_k:
        raise ValueError("mode='topk' needs top_k")

    def outputs(params, batch: Batch):
        """What `mode` returns for some rows: top-k replicated over `tp`, else
        vocabulary-sharded [b, S, V/tp]."""
        logits = model.apply(
            cfg, params, batch.tokens, batch.segment_ids, batch.positions, tp_axis=TP, dtype=dtype
        )  # [b, S, V/tp]
        if vocab_limit is not None and vocab_limit < cfg.vocab_size:
            logits = cc.mask_vocab(logits, vocab_limit, TP)
        if mode == "logits":
            return logits
        z = logits / temperature
        if mode == "dense":
            return TeacherOutput(cc.log_softmax(z, TP), None)
        # log-probs are logits minus one per-token constant: the top-k of the logits are
        # theirs, so only k log-probs are formed, never the [b, S, V/tp] array
        values, ids = cc.top_k(z, top_k, TP)
        return TeacherOutput(values - cc.logsumexp(z, TP), ids)

    def forward(params, batch: Batch, *, split_rows: bool):
        out = in_microbatches(lambda b: outputs(params, b), batch, microbatch)
        if mode == "topk":
            layout = cc.rows_of_replicated if split_rows else lambda x, _: x
        else:
            layout = cc.vocab_to_rows if split_rows else cc.gather_vocab
        return jax.tree.map(lambda x: layout(x, TP), out)

    def run(params, batch: Batch):
        spec = out_spec(batch.tokens.shape[0], mesh)
        out_specs = {
            "logits": spec,
            "dense": TeacherOutput(spec, None),
            "topk": TeacherOutput(spec, spec),
        }[mode]
        sharded = jax.shard_map(
            lambda p, b: forward(p, b, split_rows=spec == OUT_ROWS),
            mesh=mesh,
            in_specs=(param_specs(cfg), BATCH_BS),
            out_specs=out_specs,
        )
        return sharded(params, batch)

    return jax.jit(run)


def in_microbatches(fn: Callable, batch: Batch, microbatch: int | None):
    """fn over the rows of `batch` `microbatch` at a time (`jax.lax.map`: one compiled
    body, peak memory of one microbatch), the outputs concatenated along the rows."""
    rows = batch.tokens.shape[0]
    size = rows if microbatch is None else max(d for d in range(1, microbatch + 1) if rows % d == 0)
    if size == rows:
        return fn(batch)
    n = rows // size
    out = jax.lax.map(fn, jax.tree.map(lambda x: x.reshape(n, size, *x.shape[1:]), batch))
    return jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), out)


def make_output_forward(cfg: Config, mesh, vocab_limit: int | None):
    """The run's training-time teacher output (top-k with `teacher.top_k`, else dense
    log-probs), at `distill.temperature`, in `teacher.microbatch` rows at a time."""
    k = cfg.teacher.top_k
    return make_forward(
        cfg.teacher.model,
        mesh,
        mode="topk" if k else "dense",
        temperature=cfg.distill.temperature,
        top_k=k,
        dtype=cfg.teacher.dtype,
        vocab_limit=vocab_limit,
        microbatch=cfg.teacher.microbatch,
    )
