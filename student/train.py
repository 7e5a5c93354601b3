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
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill import losses, model
from distill.config import Config, DistillLossConfig, ModelConfig
from distill.mesh import DP
from distill.types import Batch, TeacherOutput
from student import optim


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict
    opt_state: optax.OptState


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, mesh) -> TrainState:
    """Initialise parameters and optimizer state directly in their replicated placement."""
    replicated = NamedSharding(mesh, P())

    def init():
        params = model.init_params(cfg, seed)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    return jax.jit(init, out_shardings=replicated)()


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
):
    """Compile the step once for this mesh. Returns step(state, batch, teacher_out)."""
    replicated = NamedSharding(mesh, P())
    split = batch_sharding(mesh)

    def loss_fn(params, batch: Batch, teacher_out: TeacherOutput | None):
        logits = model.apply(
            cfg, params, batch.tokens, batch.segment_ids, batch.positions, dtype=dtype
        )
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


def distill_step_for(cfg: Config, mesh):
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
    )
    return tx, step


def make_logits_fn(cfg: ModelConfig, mesh, dtype: str = "float32"):
    """Student logits on the training mesh, batch split over `dp` (evaluation)."""
    split = batch_sharding(mesh)

    def logits(params, batch: Batch):
        return model.apply(
            cfg, params, batch.tokens, batch.segment_ids, batch.positions, dtype=dtype
        )

    return jax.jit(logits, in_shardings=(NamedSharding(mesh, P()), split), out_shardings=split)
