"""The student on the training mesh: a pure train step compiled once.

`(state, batch, teacher_out) -> (state, metrics)` with explicit shardings from the
student's one table (`student.sharding`): the batch and the teacher output split over
`dp` x `fsdp` (every device its own rows), the parameters and optimizer state split over
`fsdp` and replicated over `dp`. XLA's partitioner turns the gradient of the global-batch
loss into per-device gradients, all-gathering each weight where it is used and
reduce-scattering its gradient (ZeRO-3; with `fsdp` = 1, an all-reduce mean over `dp`):
the same numbers as one device on the whole batch. With `grad_accum` > 1 each device's
rows run as that many microbatches under `jax.lax.scan`, their token-weighted gradients
summed in float32 before the one optimizer update. The state buffers are donated. A step
whose loss or gradient norm is not finite leaves the parameters and the optimizer state as
they were (`Skips`: the loop stops a run whose skipped steps run too long).
`teacher_out=None` trains on hard labels only (the teacher bootstrap, and the CE
baseline); the same step serves online and offline distillation, since it only sees a
`TeacherOutput`, wherever it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill import programs
from distill.config import Config, DistillLossConfig, ModelConfig, OptimConfig
from distill.models import model, vocab_loss
from distill.models.cross import losses as cross_losses
from distill.models.cross.losses import CrossSpec
from distill.types import Batch, Continuations, TeacherOutput
from student import optim, routing, sharding
from student.accumulate import accumulate
from student.context import Context
from student.remat import concrete as concrete_remat

# What a skipped step found not finite: bits of `Skips.kinds`.
LOSS, GRAD_NORM = 1, 2


class Skips(NamedTuple):
    """Steps skipped for a non-finite loss or gradient norm, counted on device from step to
    step (int32 scalars, replicated), so that the loop, which reads only some steps' metrics
    and never the current one's, still sees a run of skipped steps that ended between two
    of its reads. Not checkpointed: no checkpoint is written within a run of skips
    (`unsaved_reason`), so a resumed run starts with none in progress and counts afresh."""

    run: jax.Array  # consecutive skipped steps up to this one (0 after a step that updated)
    longest: jax.Array  # the longest such run since the state was made or restored
    kinds: jax.Array  # LOSS | GRAD_NORM: what any skipped step found not finite


class Saved(NamedTuple):
    """What a checkpoint holds of a TrainState: everything but its `Skips` (the fields'
    names are the checkpoint's keys)."""

    step: jax.Array
    params: dict
    opt_state: optax.OptState


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer updates made (skipped steps not counted)
    params: dict
    opt_state: optax.OptState
    skips: Skips


def no_skips() -> Skips:
    """The counters of a state that has skipped no step."""
    return Skips(*(jnp.zeros((), jnp.int32) for _ in Skips._fields))


def _each_skip(value) -> Skips:
    """`value` (a shape, spec or sharding) for every counter of a Skips."""
    return Skips(*(value for _ in Skips._fields))


def saved(state: TrainState) -> Saved:
    """The part of `state` a checkpoint holds; `abstract_state(...)` through it is the
    target to restore a checkpoint onto, and `resumed` makes the restored part whole."""
    return Saved(state.step, state.params, state.opt_state)


def unsaved_reason(state: TrainState) -> str | None:
    """Why `state` is not worth a checkpoint, or None. Within a run of skipped steps its
    weights are the ones from before the run, already saved or savable then; a checkpoint
    now would only push an older one out of retention (`train.keep_checkpoints`), which may
    be the last good one when the update before the run already spoilt the weights (a
    learning rate far too high). One scalar read: a save waits for the state anyway."""
    run = int(state.skips.run)
    return f"the last {run} steps were skipped (non-finite)" if run else None


def resumed(restored: Saved, mesh) -> TrainState:
    """A TrainState from a restored checkpoint, on `mesh`, with no steps skipped yet."""
    return TrainState(*restored, programs.cached(_no_skips_program, mesh)())


def _no_skips_program(mesh):
    return jax.jit(no_skips, out_shardings=_each_skip(NamedSharding(mesh, P())))


def init_state(
    cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, mesh, params: dict | None = None
) -> TrainState:
    """Initialise parameters (or take `params` of `cfg`'s shapes, e.g. from the teacher:
    arrays already in their placement, as `teacher.weights.student_init_params` makes them
    given `param_shardings`, or host arrays) and the optimizer state directly in their
    placement on `mesh` (`state_shardings`): no device ever holds more than its share."""
    if params is not None:
        expected = model.abstract_params(cfg)
        placed = param_shardings(cfg, mesh)
        params = jax.device_put(jax.tree.map(_given_param, expected, params), placed)
    return programs.cached(_init_program, cfg, tx, seed, mesh, params is None)(params)


def _init_program(cfg: ModelConfig, tx, seed: int, mesh, fresh: bool):
    def init(params):
        params = model.init_params(cfg, seed) if fresh else params
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), no_skips())

    # given parameters become the state's own (donated): never two copies on a device
    donate = () if fresh else (0,)
    return jax.jit(init, out_shardings=state_shardings(cfg, tx, mesh), donate_argnums=donate)


def _given_param(expected: jax.ShapeDtypeStruct, given) -> jax.Array | np.ndarray:
    """A given parameter in float32: a placed array as it is (a device_put to its own
    sharding is no copy), a host one converted."""
    if isinstance(given, jax.Array):
        given = given if given.dtype == jnp.float32 else given.astype(jnp.float32)
    else:
        given = np.asarray(given, np.float32)
    if given.shape != tuple(expected.shape):
        raise ValueError(f"initial parameter of shape {given.shape}, expected {expected.shape}")
    return given


def param_shardings(cfg: ModelConfig, mesh) -> dict:
    """NamedShardings of the student's parameters on `mesh` (those of `state_shardings`),
    where its starting weights are read straight into."""
    shards, axis = sharding.weight_shards(dict(mesh.shape)), sharding.weight_axes(mesh.axis_names)
    return sharding.named(mesh, sharding.param_specs(cfg, shards, axis))


def state_shapes(cfg: ModelConfig, tx: optax.GradientTransformation) -> TrainState:
    """Shapes and dtypes of a TrainState, without allocating it."""
    params = model.abstract_params(cfg)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return TrainState(scalar, params, jax.eval_shape(tx.init, params), _each_skip(scalar))


def state_specs(
    cfg: ModelConfig, tx: optax.GradientTransformation, fsdp: int, axis=sharding.FSDP
) -> TrainState:
    """PartitionSpecs of a TrainState for an `fsdp`-way split over the mesh axis or axes
    `axis` (`sharding.weight_axes`): the parameters by the student's table, the optimizer
    state like the parameters it tracks, the counters replicated."""
    shapes = state_shapes(cfg, tx)
    params = sharding.param_specs(cfg, fsdp, axis)
    opt = sharding.like_params(shapes.opt_state, shapes.params, params)
    return TrainState(P(), params, opt, _each_skip(P()))


def state_shardings(cfg: ModelConfig, tx: optax.GradientTransformation, mesh) -> TrainState:
    """NamedShardings of a TrainState on `mesh` (`state_specs` for the mesh's `fsdp`, and
    `cp`: `sharding.weight_axes`)."""
    shards, axis = sharding.weight_shards(dict(mesh.shape)), sharding.weight_axes(mesh.axis_names)
    return sharding.named(mesh, state_specs(cfg, tx, shards, axis))


def abstract_state(cfg: ModelConfig, tx: optax.GradientTransformation, mesh) -> TrainState:
    """Shapes, dtypes and target shardings of a TrainState, for restoring onto `mesh`
    (whatever layout the checkpoint was written from)."""
    return jax.tree.map(
        lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
        state_shapes(cfg, tx),
        state_shardings(cfg, tx, mesh),
    )


def batch_sharding(mesh) -> NamedSharding:
    """Leading (batch) axis split over every device of the training mesh (`dp` x `fsdp`, or
    a 1-D `dp` mesh), and with a `cp` axis the sequence axis over it
    (`sharding.batch_spec`); used for batches and teacher outputs alike."""
    return NamedSharding(mesh, sharding.batch_spec(mesh))


def pieces_sharding(mesh) -> NamedSharding:
    """The rows of the step's forward: `batch_sharding`'s, or with a `cp` axis each
    device's pieces of the rows as rows of their own (`student.context`)."""
    return NamedSharding(mesh, sharding.pieces_spec(mesh))


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
    remat: str = "none",
    grad_accum: int = 1,
    layer_loop: str = "auto",
    cross: CrossSpec | None = None,
):
    """Compile the step once for this mesh. Returns step(state, batch, teacher_out).

    `vocab_limit` (`distill.data.tokenizers.vocab_limit`): logits of padded ids >= it are masked
    to a large finite negative, which the losses treat as zero probability. `grad_accum`:
    microbatches per step (it must divide each device's rows). `layer_loop`: see
    `unrolls`. `cross`: how to compare vocabularies when batches carry the teacher's own
    rows (`distill.models.cross.losses`)."""
    replicated = NamedSharding(mesh, P())
    split = batch_sharding(mesh)
    placed = state_shardings(cfg, tx, mesh)

    unroll = unrolls(layer_loop, cfg, mesh)
    loss_fn = make_loss_fn(
        cfg, loss_cfg, dtype, vocab_limit, remat, mesh, unroll=unroll, cross=cross
    )
    context = Context.of(mesh)

    def step(state: TrainState, batch: Batch, teacher_out: TeacherOutput | None):
        if context is not None:  # each device's pieces of the rows, laid out for the ring
            batch, teacher_out = context.pieces((batch, teacher_out))
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if grad_accum == 1:
            if isinstance(getattr(teacher_out, "logprobs", None), tuple):
                raise ValueError("a dense teacher output in blocks needs train.grad_accum > 1")
            (_, metrics), grads = grad_fn(state.params, batch, teacher_out)
        else:
            grads, metrics = accumulate(
                grad_fn, state.params, (batch, teacher_out), grad_accum, mesh, placed.params
            )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        metrics = dict(metrics, lr=lr_schedule(state.step), grad_norm=grad_norm)
        if teacher_out is not None:  # the divergence's weight this step was compiled with
            on_samples = isinstance(batch, Continuations)  # their loss: the divergence alone
            metrics["alpha"] = jnp.float32(1.0 if on_samples else loss_cfg.alpha)
        elif loss_cfg is not None:  # a distillation run's step without a teacher: CE alone
            metrics["alpha"] = jnp.float32(0.0)
        updated = TrainState(state.step + 1, params, opt_state, state.skips)
        state = _unless_nonfinite(updated, state, metrics["loss"], grad_norm)
        return state, {**metrics, **skip_metrics(state.skips)}

    if with_teacher:
        fn = step
        in_shardings = (placed, split, split)
    else:
        fn = lambda state, batch: step(state, batch, None)  # noqa: E731
        in_shardings = (placed, split)
    return jax.jit(
        fn, in_shardings=in_shardings, out_shardings=(placed, replicated), donate_argnums=0
    )


def _unless_nonfinite(
    updated: TrainState, state: TrainState, loss: jax.Array, grad_norm: jax.Array
) -> TrainState:
    """`updated` when the step's loss and gradient norm are finite; otherwise `state` as it
    was, the skip counted in its `Skips`.

    A skipped step advances neither the step counter nor the optimizer state, whose count
    drives the learning-rate schedule: the schedule follows the updates actually made, as
    optax's `apply_if_finite` and Megatron's skipped iterations do, so no warm-up step is
    lost to a bad batch and the lr a record shows is the one the optimizer used. An isolated
    skip shifts the rest of the schedule by one step; a run of them stops the run
    (`train.max_nonfinite_steps`).
    A select rather than a `lax.cond`: it fuses into the update's own elementwise work."""
    kinds = jnp.where(jnp.isfinite(loss), 0, LOSS) | jnp.where(
        jnp.isfinite(grad_norm), 0, GRAD_NORM
    )
    ok = kinds == 0
    run = jnp.where(ok, 0, state.skips.run + 1)
    skips = Skips(run, jnp.maximum(state.skips.longest, run), state.skips.kinds | kinds)
    kept = jax.tree.map(lambda new, old: jnp.where(ok, new, old), saved(updated), saved(state))
    return TrainState(*kept, skips)


def skip_metrics(skips: Skips) -> dict:
    """The step's `Skips` as metrics: `nonfinite_run`, `nonfinite_longest`, `nonfinite_kinds`
    (read by `pipelines.divergence.Divergence`)."""
    return {f"nonfinite_{k}": v for k, v in skips._asdict().items()}


# `train.layer_loop: auto` unrolls models up to this deep on CPU. There the scanned backward
# pass writes every layer's activations into stacked buffers and reads them back (dynamic
# slices and updates), which unrolling removes: the quick-start-shaped student step (2
# layers, 16 x 256 tokens) took 277 ms unrolled against 314 ms scanned. Deeper models keep
# the scan, whose compile time does not grow with depth.
UNROLL_MAX_LAYERS = 8


def unrolls(layer_loop: str, cfg: ModelConfig, mesh) -> bool:
    """Whether the training step unrolls the layers (`train.layer_loop`): `unroll`, or
    `auto` for a model of at most UNROLL_MAX_LAYERS layers on CPU devices."""
    if layer_loop != "auto":
        return layer_loop == "unroll"
    return mesh.devices.flat[0].platform == "cpu" and cfg.n_layers <= UNROLL_MAX_LAYERS


def distill_step_for(
    cfg: Config,
    mesh,
    vocab_limit: int | None = None,
    *,
    with_teacher: bool = True,
    cross: CrossSpec | None = None,
):
    """The run's optimizer and compiled distillation step, as every pipeline mode builds
    them from the config: (tx, step(state, batch, teacher_out)); without a teacher, the
    cross-entropy step(state, batch). `cross`: see `make_train_step`."""
    return step_for(
        cfg.student_model(),
        cfg.optim,
        cfg.train.steps,
        mesh,
        loss_cfg=cfg.distill,
        dtype=cfg.student.dtype,
        with_teacher=with_teacher,
        vocab_limit=vocab_limit,
        remat=concrete_remat(cfg.train.remat, mesh.devices.flat[0].platform),
        grad_accum=cfg.train.grad_accum,
        layer_loop=cfg.train.layer_loop,
        cross=cross,
    )


def step_for(
    cfg: ModelConfig, optim_cfg: OptimConfig, steps: int, mesh, **kw
) -> tuple[optax.GradientTransformation, Callable]:
    """(tx, `make_train_step(cfg, tx, mesh, **kw)`) for the optimizer `optim_cfg` over
    `steps` steps: built once per process for equal arguments (`distill.programs`), so a
    second run of the same shapes reuses the compiled step."""
    return programs.cached(_step_for, cfg, optim_cfg, steps, mesh, **kw)


def _step_for(cfg: ModelConfig, optim_cfg: OptimConfig, steps: int, mesh, **kw):
    tx = optim.make_optimizer(optim_cfg, steps)
    lr = optim.schedule(optim_cfg, steps)
    return tx, make_train_step(cfg, tx, mesh, lr_schedule=lr, **kw)


def make_loss_fn(
    cfg: ModelConfig,
    loss_cfg: DistillLossConfig | None,
    dtype: str,
    vocab_limit: int | None,
    remat: str,
    mesh,
    *,
    unroll: bool = False,
    cross: CrossSpec | None = None,
):
    """loss_fn(params, batch, teacher_out) -> (loss, metrics): KD (or CE without a teacher
    output) from the model's final hidden states, the LM head applied a chunk of positions
    at a time (`distill.models.vocab_loss`), so the [B, S, V] logits are never whole. A chunk's
    logits stay under `vocab_loss.CHUNK_BYTES` for the rows one device of `mesh` holds.
    `unroll`: the layers unrolled (`unrolls`). A mixture-of-experts student's routing
    (`student.routing`) adds `distill.moe_aux_loss` times its load-balancing loss. On a
    mesh with a `cp` axis the batch and teacher output are the step's pieces of the rows
    (`student.context`), and attention runs over the ring."""
    split = pieces_sharding(mesh)
    attend = _attend(mesh)

    routed = routing.Routing(cfg, mesh, getattr(loss_cfg, "moe_aux_loss", 0.0))

    def loss_fn(params, batch: Batch, teacher_out: TeacherOutput | None):
        x, head, stats = model.apply_hidden(
            cfg, params, batch.tokens, batch.segment_ids, batch.positions, dtype=dtype,
            remat=remat, rows=split, unroll=unroll, moe_opts=routed.opts(batch), with_stats=True,
            attend=attend,
        )  # fmt: skip
        return routed.add(*losses(x, head, batch, teacher_out), stats, batch)

    def losses(x, head, batch: Batch, teacher_out: TeacherOutput | None):
        kw = head_loss_kw(cfg, mesh, x, batch.tokens.shape[0], vocab_limit)
        if teacher_out is None:
            return vocab_loss.ce_loss_chunked(x, head, batch.targets, batch.mask, **kw)
        cfg_here = loss_cfg
        if isinstance(batch, Continuations):  # the student's own samples: no CE on them
            cfg_here = loss_cfg.model_copy(update={"alpha": 1.0, "cross_ce": "one_minus_alpha"})
        if batch.teacher is not None:  # the teacher's own rows: compare across vocabularies
            return cross_losses.cross_kd_loss_chunked(
                x, head, teacher_out, batch.teacher.align, batch.targets, batch.mask, cfg_here,
                vmap=cross.vmap, method=cross.method, teacher_live=cross.teacher_live,
                inputs_bs=batch.tokens, **kw,
            )  # fmt: skip
        return vocab_loss.kd_loss_chunked(
            x, head, teacher_out, batch.targets, batch.mask, cfg_here, **kw
        )

    return loss_fn


def head_loss_kw(cfg: ModelConfig, mesh, x, rows: int, vocab_limit: int | None) -> dict:
    """The keyword arguments of `distill.models.vocab_loss`'s chunked losses over the head
    for hidden states `x` of `rows` rows split over `mesh` (the step's and evaluation's)."""
    per_device = max(rows // mesh.devices.size, 1)
    return {
        "vocab_limit": vocab_limit,
        "chunk": vocab_loss.default_chunk(cfg.vocab_size, per_device),
        "compute_dtype": x.dtype,
        "softcap": cfg.final_softcap,
    }


def _attend(mesh):
    """Attention over the mesh's `cp` ring (`student.context`); None (the model's own
    backend) without a cp axis."""
    context = Context.of(mesh)
    return None if context is None else context.attend
