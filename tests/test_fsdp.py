"""The training mesh `dp` x `fsdp` and gradient accumulation compute the plain data-parallel
step: the same losses, gradients and parameters; the state takes 1/fsdp of each device;
checkpoints move between layouts."""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from distill.checkpoint import Checkpointer
from distill.config import DistillLossConfig, ModelConfig, OptimConfig
from distill.mesh import DP, FSDP, student_mesh
from distill.models import model
from distill.types import Batch, TeacherOutput
from student import optim, sharding, train

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
OPT = OptimConfig(lr=1e-2, warmup_steps=1)


def _mesh(dp, fsdp, cp=1):
    if cp > 1:  # the context-parallel training mesh (distill.mesh.student_mesh)
        return student_mesh(jax.devices()[: dp * fsdp * cp], dp, fsdp, cp)
    return Mesh(np.array(jax.devices()[: dp * fsdp]).reshape(dp, fsdp), (DP, FSDP))


def _batch(b, s=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, (b, s)).astype(np.int32)
    targets = rng.integers(0, 64, (b, s)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[:, s // 2 :] = 2
    pos = np.concatenate([np.arange(s // 2)] * 2)[None].repeat(b, 0).astype(np.int32)
    mask = (rng.random((b, s)) > 0.3).astype(np.float32)
    mask[0] = 0.0  # a row without tokens: microbatches weigh unequal token counts
    return Batch(tokens, targets, seg, pos, mask)


def _teacher(b, s=16, seed=1):
    logits = np.random.default_rng(seed).normal(size=(b, s, 64)).astype(np.float32) * 3
    vals, ids = jax.lax.top_k(jax.nn.log_softmax(logits), 6)
    return TeacherOutput(np.asarray(vals), np.asarray(ids).astype(np.int32))


def _optimizer(name):
    # sgd: the update is -lr * gradient, so equal parameters after a step mean equal gradients
    return optim.make_optimizer(OPT, 10) if name == "adamw" else optax.sgd(0.1)


@functools.cache
def _params():
    return jax.device_get(model.init_params(CFG, 0))  # host arrays, initialised once


@functools.cache
def _run(dp, fsdp, grad_accum=1, b=8, opt="adamw", steps=2):
    """(final state, per-step metrics) of `steps` steps on a dp x fsdp mesh (cached: runs are
    shared between tests; nothing donates the returned state)."""
    mesh, tx = _mesh(dp, fsdp), _optimizer(opt)
    step = train.make_train_step(
        CFG,
        tx,
        mesh,
        loss_cfg=DistillLossConfig(temperature=2.0, alpha=0.7),
        lr_schedule=optim.schedule(OPT, 10),
        grad_accum=grad_accum,
    )
    state = train.init_state(CFG, tx, 0, mesh, _params())
    history = []
    for i in range(steps):
        state, metrics = step(state, _batch(b, seed=i), _teacher(b, seed=i + 1))
        history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return state, history


def _assert_same(run_a, run_b, atol=5e-6):
    (sa, ha), (sb, hb) = run_a, run_b
    for a, b in zip(ha, hb, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=2e-5, abs=2e-6), k
    for x, y in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-4)


def test_the_table_splits_each_weight_on_its_largest_divisible_dimension():
    specs = sharding.param_specs(CFG.model_copy(update={"vocab_size": 60}), 4)
    layers = specs["layers"]
    assert specs["embed"] == P(FSDP, None)  # [V=60, D]: V
    assert specs["lm_head"] == P(None, FSDP)  # [D, V]
    assert layers["w_gate"] == P(None, None, FSDP)  # [L, D, F=48]: F
    assert layers["w_down"] == P(None, FSDP, None)  # [L, F, D]: F
    assert layers["wk"] == P(None, FSDP, None)  # [L, D=32, KV*hd=16]
    assert layers["attn_norm"] == specs["final_norm"] == P()
    # 8 does not divide V=60: the embedding falls back to D; nothing splits the layer axis
    assert sharding.param_specs(CFG.model_copy(update={"vocab_size": 60}), 8)["embed"] == (
        P(None, FSDP)
    )
    assert sharding.param_specs(CFG, 64)["layers"]["wq"] == P()


@pytest.mark.parametrize("dp,fsdp", [(2, 4), (1, 8)])
def test_fsdp_step_matches_data_parallel(dp, fsdp):
    _assert_same(_run(8, 1), _run(dp, fsdp))
    state = _run(dp, fsdp)[0]
    wq = state.params["layers"]["wq"]
    assert wq.sharding.spec == P(None, None, FSDP)
    assert wq.addressable_shards[0].data.shape == (2, 32, 32 // fsdp)
    assert state.opt_state[1][0].mu["layers"]["wq"].sharding == wq.sharding  # Adam's moments


@pytest.mark.parametrize("grad_accum", [2, 4])
def test_gradient_accumulation_is_the_one_shot_step(grad_accum):
    """Losses, metrics (grad_norm) and, through SGD, the gradients themselves; mask row 0 is
    all padding, so the microbatches hold unequal token counts."""
    one_shot = _run(2, 2, b=16, opt="sgd")
    _assert_same(one_shot, _run(2, 2, grad_accum=grad_accum, b=16, opt="sgd"), atol=1e-6)


def _state_bytes(state) -> int:
    leaves = jax.tree.leaves((state.params, state.opt_state))
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def test_fsdp_holds_a_quarter_of_the_state_per_device():
    whole, quarter = _state_bytes(_run(8, 1)[0]), _state_bytes(_run(2, 4)[0])
    assert whole / 4 <= quarter < whole / 4 * 1.05  # norms and step counts are replicated
    tx = _optimizer("adamw")
    specs, shapes = train.state_specs(CFG, tx, 4), train.state_shapes(CFG, tx)
    planned = sum(  # `distill plan`'s figure, from shapes and the table alone
        sharding.bytes_per_device(getattr(shapes, k), getattr(specs, k), {DP: 2, FSDP: 4})
        for k in ("params", "opt_state")
    )
    assert planned == quarter


@pytest.mark.parametrize("src,dst", [((8, 1), (2, 4)), ((2, 4), (8, 1)), ((8, 1), (1, 2, 4))])
def test_checkpoint_restores_onto_another_layout(tmp_path, src, dst):
    state = _run(*src)[0]
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(2, state, {"pos": 2})
    target = train.abstract_state(CFG, _optimizer("adamw"), _mesh(*dst))
    restored, data, step = ckpt.restore(target)
    ckpt.close()
    assert step == 2 and data == {"pos": 2}
    for a, b, t in zip(
        jax.tree.leaves(state), jax.tree.leaves(restored), jax.tree.leaves(target), strict=True
    ):
        assert b.sharding == t.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_eval_chunks_give_every_device_of_both_axes_a_row():
    from distill.config.load import config_from_dict
    from distill.handoff import eval_rows
    from tests.conftest import tiny_config

    tree = tiny_config("corpus", "out", train={"batch_size": 64, "seq_len": 2048})
    tree["mesh"]["student"].update(dp=2, fsdp=4)
    tree["teacher"]["model"]["vocab_size"] = 128256
    assert eval_rows(config_from_dict(tree)) == 8  # 1 GB of logits per row: one per device


def test_fsdp_gathers_weights_never_activations(capfd):
    """ZeRO-3 as designed: every device keeps its own rows; what moves is weights (gathered
    where used) and gradients (reduced), never activations: float tensors with the sequence
    axis (S = 24). With fewer KV heads (2) than fsdp devices (4), XLA's SPMD partitioner
    reports no "Involuntary full rematerialization" (an array gathered whole to change its
    layout) compiling the step either."""
    import re

    mesh, tx, s = _mesh(2, 4), _optimizer("adamw"), 24
    step = train.make_train_step(
        CFG, tx, mesh, loss_cfg=DistillLossConfig(), lr_schedule=optim.schedule(OPT, 10)
    )
    state = train.init_state(CFG, tx, 0, mesh, _params())
    capfd.readouterr()
    hlo = step.lower(state, _batch(8, s), _teacher(8, s)).compile().as_text()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    moved = re.findall(r"= (.+?) (?:all-gather|all-to-all|collective-permute)(?:-start)?\(", hlo)
    assert moved
    activations = rf"(f32|bf16)\[[^\]]*\b{s}\b[^\]]*\]"
    assert not [m for m in moved if re.search(activations, m)], moved


@pytest.mark.parametrize("grad_accum", [2, 4])
def test_a_dense_teacher_in_blocks_is_the_one_shot_step(grad_accum):
    """A dense teacher output handed over in one block per microbatch (block j: rows j,
    j + n, ...; `distill.handoff.dense_blocks`) trains as the whole [B, S, V] array in one
    shot: the same metrics and, through SGD, gradients."""
    mesh, tx = _mesh(2, 2), optax.sgd(0.1)
    logits = np.random.default_rng(3).normal(size=(16, 16, 64)).astype(np.float32) * 3
    dense = TeacherOutput(np.asarray(jax.nn.log_softmax(logits)))
    blocks = TeacherOutput(tuple(dense.logprobs[j::grad_accum] for j in range(grad_accum)))
    runs = []
    for n, out in ((1, dense), (grad_accum, blocks)):
        step = train.make_train_step(
            CFG, tx, mesh, loss_cfg=DistillLossConfig(temperature=2.0, alpha=0.7),
            lr_schedule=optim.schedule(OPT, 10), grad_accum=n,
        )  # fmt: skip
        state, metrics = step(train.init_state(CFG, tx, 0, mesh, _params()), _batch(16), out)
        runs.append((state, [{k: float(v) for k, v in jax.device_get(metrics).items()}]))
    _assert_same(*runs, atol=1e-6)
