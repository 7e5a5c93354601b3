"""The student on the training mesh: a pure train step compiled once.

`(state, batch, teacher_out) -> (state, metrics)` with explicit shardings: the batch and
the teacher output are split over `dp`, the parameters and optimizer state replicated, so
XLA's partitioner turns the gradient of the global-batch loss into a per-device gradient
plus an all-reduce mean over `dp` — the same numbers as one device on the whole batch. The
state buffers are donated. `teacher_out=None` trains on hard labels only (the teacher
bootstrap, and the CE baseline); the same step serves online and offline distillation,
since it only sees a `TeacherOutput`, wherever it came from.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill import losses, model
from distill.collectives import mask_vocab
from distill.config import Config, DistillLossConfig, ModelConfig
from distill.mesh import DP
from distill.types import Batch, TeacherOutput
from student import optim


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict
    opt_state: optax.OptState


def init_state(
    cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, mesh, params: dict | None = None
) -> TrainState:
    """Initialise parameters (or take `params`, host arrays of `cfg`'s shapes, e.g. from the
    teacher) and the optimizer state directly in their replicated placement."""
    replicated = NamedSharding(mesh, P())

    def init(params):
        params = model.init_params(cfg, seed) if params is None else params
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    if params is not None:
        expected = jax.eval_shape(lambda: model.init_params(cfg, 0))
        params = jax.device_put(jax.tree.map(_host_param, expected, params), replicated)
    return jax.jit(init, out_shardings=replicated)(params)


def _host_param(expected: jax.ShapeDtypeStruct, given) -> np.ndarray:
    given = np.asarray(given, np.float32)
    if given.shape != tuple(expected.shape):
        raise ValueError(f"initial parameter of shape {given.shape}, expected {expected.shape}")
    return given


def abstract_state(cfg: ModelConfig, tx: optax.GradientTransformation, mesh) -> TrainState:
    """Shapes, dtypes and target shardings of a TrainState, for restoring onto `mesh`."""
    replicated = NamedSharding(mesh, P())
    shapes = jax.eval_shape(
        lambda: TrainState(
            jnp.zeros((), jnp.int32),
            model.init_params(cfg, 0),
            tx.init(model.init_params(cfg, 0)),
        )
    )
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), shapes
    )


def batch_sharding(mesh) -> NamedSharding:
    """Leading (batch) axis split over `dp`; used for batches and teacher outputs alike."""
    return NamedSharding(mesh, P(DP))


def make_train_step(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh,
    *,
    loss_cfg: DistillLossConfig | None,
    lr_schedule: optax.Schedule,
    dtype: str = "float32",
    with_teacher: bool = True,
    vocab_limit: int | None = None,
):
    """Compile the step once for this mesh. Returns step(state, batch, teacher_out).

    `vocab_limit` (`distill.tokenizers.vocab_limit`): logits of padded ids >= it are masked
    to a large finite negative, which the losses treat as zero probability."""
    replicated = NamedSharding(mesh, P())
    split = batch_sharding(mesh)

    def loss_fn(params, batch: Batch, teacher_out: TeacherOutput | None):
        logits = student_logits(cfg, params, batch, dtype, vocab_limit)
        if teacher_out is None:
            return losses.ce_loss(logits, batch.targets, batch.mask)
        return losses.kd_loss(logits, teacher_out, batch.targets, batch.mask, loss_cfg)

    def step(state: TrainState, batch: Batch, teacher_out: TeacherOutput | None):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(state.params, batch, teacher_out)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, lr=lr_schedule(state.step), grad_norm=optax.tree.norm(grads))
        return TrainState(state.step + 1, params, opt_state), metrics

    if with_teacher:
        fn = step
        in_shardings = (replicated, split, split)
    else:
        fn = lambda state, batch: step(state, batch, None)  # noqa: E731
        in_shardings = (replicated, split)
    return jax.jit(
        fn, in_shardings=in_shardings, out_shardings=(replicated, replicated), donate_argnums=0
    )


def distill_step_for(cfg: Config, mesh, vocab_limit: int | None = None):
    """The run's optimizer and compiled distillation step, as every pipeline mode builds
    them from the config: (tx, step(state, batch, teacher_out))."""
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    step = make_train_step(
        cfg.student_model(),
        tx,
        mesh,
        loss_cfg=cfg.distill,
        lr_schedule=optim.schedule(cfg.optim, cfg.train.steps),
        dtype=cfg.student.dtype,
        vocab_limit=vocab_limit,
    )
    return tx, step


# A padded id's logit: finite, so no gradient meets logaddexp(-inf, -inf) (the JSD), yet so
# low that its probability is exactly 0 in float32.
PADDED_LOGIT = -1e30


def student_logits(
    cfg: ModelConfig, params, batch: Batch, dtype: str, vocab_limit: int | None
) -> jax.Array:
    logits = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions, dtype=dtype)
    return mask_vocab(logits, vocab_limit, None, fill=PADDED_LOGIT)  # float32 logits


def make_logits_fn(cfg: ModelConfig, mesh, dtype: str = "float32", vocab_limit: int | None = None):
    """Student logits on the training mesh, batch split over `dp` (evaluation)."""
    split = batch_sharding(mesh)

    def logits(params, batch: Batch):
        return student_logits(cfg, params, batch, dtype, vocab_limit)

    return jax.jit(logits, in_shardings=(NamedSharding(mesh, P()), split), out_shardings=split)
