"""The teacher forward on the inference mesh, under `jax.shard_map` with explicit collectives.

The teacher never takes a gradient. It returns what the loss needs and nothing more:
log-probabilities at the distillation temperature, either dense (sharded over the
vocabulary) or the top-k values and ids (merged vocab-parallel, replicated), so that only
k numbers per token cross to the training mesh.
"""

from __future__ import annotations

from typing import Literal

import jax
from jax.sharding import PartitionSpec as P

from distill import collectives as cc
from distill import model
from distill.config import ModelConfig
from distill.mesh import TP
from distill.types import Batch, TeacherOutput
from teacher.sharding import param_specs

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
):
    """jit(shard_map(forward)) with signature (sharded_params, batch) -> output.

    `vocab_limit`: the tokenizer's vocabulary size when the model's is padded past it; the
    logits of ids >= vocab_limit are -inf in every mode (each vocab shard masks its own
    range), so log-probs and top-k put no mass on ids the tokenizer never produces.

    mode "dense": TeacherOutput(log softmax(z/T) [B,S,V] sharded over vocab, None)
    mode "topk":  TeacherOutput(top-k of log softmax(z/T) [B,S,k], ids [B,S,k]), replicated
    mode "logits": raw logits z [B,S,V] sharded over vocab (evaluation)
    """
    if mode == "topk" and not top_k:
        raise ValueError("mode='topk' needs top_k")

    def forward(params, batch: Batch):
        logits = model.apply(
            cfg, params, batch.tokens, batch.segment_ids, batch.positions, tp_axis=TP, dtype=dtype
        )  # [B, S, V/tp]
        if vocab_limit is not None and vocab_limit < cfg.vocab_size:
            logits = cc.mask_vocab(logits, vocab_limit, TP)
        if mode == "logits":
            return logits
        z = logits / temperature
        if mode == "dense":
            return TeacherOutput(cc.log_softmax(z, TP), None)
        # log-probs are logits minus one per-token constant: the top-k of the logits are
        # theirs, so only k log-probs are formed, never the [B, S, V/tp] array
        values, ids = cc.top_k(z, top_k, TP)
        return TeacherOutput(values - cc.logsumexp(z, TP), ids)

    vocab_sharded = P(None, None, TP)
    out_specs = {
        "logits": vocab_sharded,
        "dense": TeacherOutput(vocab_sharded, None),
        "topk": TeacherOutput(P(), P()),
    }[mode]
    sharded = jax.shard_map(
        forward, mesh=mesh, in_specs=(param_specs(cfg), P()), out_specs=out_specs
    )
    return jax.jit(sharded)
