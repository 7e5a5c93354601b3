"""Gradient accumulation (`train.grad_accum`): one optimizer step's gradient from
microbatches run one after another, each device working on its own rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from distill.types import TeacherOutput
from student import routing, sharding


def accumulate(grad_fn, params, inputs, n: int, mesh, grad_shardings):
    """(gradient, metrics) of the whole batch `inputs` = (batch, teacher_out), from `n`
    microbatches run one after another by `jax.lax.scan`.

    Microbatch j takes rows j, j + n, j + 2n, ... of the batch: an equal share of every
    device's own rows, so nothing moves between devices. A dense teacher output in blocks
    (`distill.types.TeacherOutput`) gives microbatch j its block j, those same rows. Each
    microbatch's mean loss, gradient and metrics are weighted by its share of the batch's
    tokens and summed in float32 (the gradient accumulator laid out like the parameters),
    so the result is the one-shot step's: losses are token means (`distill.models.losses`). Counts
    (`routing.COUNTS`) are summed; an MoE student's `moe_aux_loss` is the microbatches'
    token-weighted mean."""
    rows = NamedSharding(mesh, sharding.pieces_spec(mesh))

    def split(x):  # [B, ...] -> [B / n, n, ...]: a free reshape, rows still split
        if x.shape[0] % (n * mesh.size):
            raise ValueError(
                f"{x.shape[0]} rows do not split into {n} microbatches x {mesh.size} devices"
            )
        return x.reshape(x.shape[0] // n, n, *x.shape[1:])

    def microbatch(j):  # [B / n, ...]: rows j, j + n, ..., sliced where each device is
        # (never a transposed copy of the inputs: a dense teacher's [B, S, V] is the largest)
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, 1, False), grouped)
        if blocks is not None:  # the teacher's output for these rows: block j
            pick = [lambda bs, i=i: bs[i] for i in range(n)]
            mb = (mb[0], TeacherOutput(jax.lax.switch(j, pick, blocks), None))
        return jax.lax.with_sharding_constraint(mb, rows)

    blocks = None
    if isinstance(getattr(inputs[1], "logprobs", None), tuple):
        blocks, inputs = inputs[1].logprobs, (inputs[0], None)
        if len(blocks) != n:
            raise ValueError(f"a dense teacher output in {len(blocks)} blocks, {n} microbatches")
    grouped = jax.tree.map(split, inputs)
    total = jnp.maximum(jnp.sum(inputs[0].mask.astype(jnp.float32)), 1.0)
    _, metric_shapes = jax.eval_shape(grad_fn, params, *microbatch(0))[0]

    def body(carry, j):
        grads_acc, metrics_acc = carry
        mb = microbatch(j)
        (_, metrics), grads = grad_fn(params, *mb)
        w = jnp.sum(mb[0].mask.astype(jnp.float32)) / total
        grads = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), grads_acc, grads)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        metrics = {
            k: metrics_acc[k] + (v if k in routing.COUNTS else w * v).astype(jnp.float32)
            for k, v in metrics.items()
        }
        return (grads, metrics), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    init = (
        jax.lax.with_sharding_constraint(zeros, grad_shardings),
        {k: jnp.zeros(v.shape, jnp.float32) for k, v in metric_shapes.items()},
    )
    (grads, metrics), _ = jax.lax.scan(body, init, jnp.arange(n))
    return grads, metrics
