"""The data-parallel student step equals a single-device step on the same global batch."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from distill.config import DistillLossConfig, ModelConfig, OptimConfig
from distill.types import Batch, TeacherOutput
from student import optim, train

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)


def _batch(b=8, s=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, (b, s)).astype(np.int32)
    targets = rng.integers(0, 64, (b, s)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[:, s // 2 :] = 2
    pos = np.concatenate([np.arange(s // 2)] * 2)[None].repeat(b, 0).astype(np.int32)
    mask = (rng.random((b, s)) > 0.2).astype(np.float32)
    return Batch(tokens, targets, seg, pos, mask)


def _teacher(kind, b=8, s=16, seed=1):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, s, 64)).astype(np.float32) * 3
    lp = np.asarray(jax.nn.log_softmax(logits))
    if kind == "dense":
        return TeacherOutput(lp, None)
    vals, ids = jax.lax.top_k(lp, 6)
    return TeacherOutput(np.asarray(vals), np.asarray(ids).astype(np.int32))


def _run(dp, teacher, steps=3, layer_loop="auto"):
    mesh = Mesh(np.array(jax.devices()[:dp]), ("dp",))
    tx = optim.make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 10)
    step = train.make_train_step(
        CFG,
        tx,
        mesh,
        loss_cfg=DistillLossConfig(temperature=2.0, alpha=0.7),
        lr_schedule=optim.schedule(OptimConfig(lr=1e-2, warmup_steps=1), 10),
        with_teacher=teacher is not None,
        layer_loop=layer_loop,
    )
    state = train.init_state(CFG, tx, 0, mesh)
    history = []
    for _ in range(steps):
        args = (_batch(seed=0),) + ((teacher,) if teacher is not None else ())
        state, metrics = step(state, *args)
        history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return jax.device_get(state.params), history


@pytest.mark.parametrize("kind", ["dense", "topk", None])
def test_dp_step_matches_single_device(kind):
    teacher = _teacher(kind) if kind else None
    p1, h1 = _run(1, teacher)
    p4, h4 = _run(4, teacher)
    for a, b in zip(h1, h4, strict=True):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=2e-5, abs=2e-6), k
    # Adam divides by sqrt(v): float reassociation in near-zero gradients shows at lr scale
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)
    assert h1[-1]["loss"] < h1[0]["loss"]


def test_unrolled_layers_step_like_the_scan():
    """`train.layer_loop`: the same steps whether the layers are one scanned block or
    unrolled (auto's choice for this 2-layer model on CPU devices)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    assert train.unrolls("auto", CFG, mesh) and not train.unrolls("scan", CFG, mesh)
    deep = CFG.model_copy(update={"n_layers": train.UNROLL_MAX_LAYERS + 1})
    assert not train.unrolls("auto", deep, mesh) and train.unrolls("unroll", deep, mesh)
    teacher = _teacher("topk")
    p_scan, h_scan = _run(2, teacher, layer_loop="scan")
    p_unroll, h_unroll = _run(2, teacher, layer_loop="unroll")
    for a, b in zip(h_scan, h_unroll, strict=True):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=2e-5, abs=2e-6), k
    for x, y in zip(jax.tree.leaves(p_scan), jax.tree.leaves(p_unroll), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)


def test_no_weight_decay_on_norms():
    params = {
        "layers": {"attn_norm": np.ones((2, 4)), "wq": np.ones((2, 4, 4))},
        "final_norm": np.ones(4),
        "embed": np.ones((8, 4)),
    }
    mask = optim.decay_mask(params)
    assert mask == {"layers": {"attn_norm": False, "wq": True}, "final_norm": False, "embed": True}


def test_schedule_warmup_then_cosine():
    sched = optim.schedule(OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1), 100)
    assert float(sched(0)) == 0.0
    assert float(sched(10)) == pytest.approx(1.0)
    assert float(sched(100)) == pytest.approx(0.1)
    assert float(sched(55)) == pytest.approx(0.55, abs=0.01)
