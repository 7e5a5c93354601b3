"""The student's context parallelism (`mesh.student.cp`, `student.context`) against one device.

Rows are packed (three documents, the middle one crossing chunk edges, trailing padding);
the training step on a dp x fsdp x cp mesh must give the single-device step's losses and
metrics, and after two AdamW steps its parameters, to 1e-5 (float32): a plain model with a
top-k teacher, and a Gemma-like one (sliding and full layers, soft-capped attention and
logits) with a dense teacher on cp = 2 x fsdp = 2 in two microbatches, one whose first
layer has no RoPE (SmolLM3's NoPE layers) on the ring, and a Gemma 4 one (layers of two
shapes, per-layer inputs, KV sharing) on cp = 2 x fsdp = 2. Also: the in-step
layout equals `to_cp_layout`, the weights are split over cp, the hand-off lands the
teacher's rows split by position, and what cp does not support is refused in one line.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distill import handoff
from distill.config import Config, DistillLossConfig, ModelConfig, OptimConfig
from distill.config.load import config_from_dict
from distill.errors import DistillError
from distill.mesh import CP, DP, FSDP, TP, check_context, student_mesh
from distill.models import model
from distill.models.kernels import ring
from distill.models.kernels.ring import balance, to_cp_layout
from distill.types import Batch, TeacherOutput
from pipelines.plan import ring_bytes_per_step
from student import optim, sharding, train

S, V = 32, 64
PLAIN = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
GEMMA = PLAIN.model_copy(
    update=dict(
        sliding_window=6, layer_types=("sliding", "full"), attn_softcap=5.0, final_softcap=10.0
    )
)
NOPE = PLAIN.model_copy(update=dict(rope_layers=(False, True)))  # SmolLM3's NoPE layers
# Gemma 4: full layers of their own shapes (keys as values), per-layer inputs, the last two
# layers sharing keys and values with a wide MLP
GEMMA4 = PLAIN.model_copy(
    update=dict(
        family="gemma4_text", n_layers=4, head_dim=8, sliding_window=6,
        layer_types=("sliding", "full") * 2, global_head_dim=16, global_kv_heads=1,
        attn_k_eq_v=True, qk_norm=True, v_norm=True, layer_scalar=True, post_norms=True,
        embed_scale=True, activation="gelu_tanh", query_scale=1.0, rope_proportional=True,
        partial_rotary_factor=0.25, rope_local_theta=100.0, per_layer_input=8,
        kv_shared_layers=2, wide_mlp=True, tie_embeddings=True,
    )
)  # fmt: skip
CONFIGS = {"plain": PLAIN, "gemma": GEMMA, "nope": NOPE, "gemma4": GEMMA4}
OPT = OptimConfig(lr=1e-2, warmup_steps=1)


def _batch(b: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (b, S)).astype(np.int32)
    targets = rng.integers(0, V, (b, S)).astype(np.int32)
    seg = np.zeros((b, S), np.int32)
    seg[:, :11], seg[:, 11:27], seg[:, 27:30] = 1, 2, 3  # then padding (0)
    pos = np.concatenate([np.arange(11), np.arange(16), np.arange(3), np.arange(2)])
    mask = (rng.random((b, S)) > 0.3).astype(np.float32) * (seg > 0)
    return Batch(tokens, targets, seg, np.tile(pos, (b, 1)).astype(np.int32), mask)


def _teacher(b: int, seed: int, dense: bool, blocks: int = 1) -> TeacherOutput:
    """Top-k, or dense log-probs; in `blocks` arrays (block j: rows j, j + n, ...) for
    `train.grad_accum` microbatches."""
    logits = np.random.default_rng(seed).normal(size=(b, S, V)).astype(np.float32) * 3
    logp = np.asarray(jax.nn.log_softmax(logits))
    if dense:
        return TeacherOutput(logp if blocks == 1 else tuple(logp[j::blocks] for j in range(blocks)))
    vals, ids = jax.lax.top_k(logp, 6)
    return TeacherOutput(np.asarray(vals), np.asarray(ids).astype(np.int32))


@functools.cache
def _run(name: str, dp: int, fsdp: int, cp: int, dense: bool, accum: int = 1, b: int = 4):
    """(final params on the host, per-step metrics) of two steps of CONFIGS[name] on a
    dp x fsdp x cp mesh, in `accum` microbatches (a dense teacher in as many blocks)."""
    cfg = CONFIGS[name]
    mesh = student_mesh(jax.devices()[: dp * fsdp * cp], dp, fsdp, cp)
    tx = optim.make_optimizer(OPT, 10)
    step = train.make_train_step(
        cfg,
        tx,
        mesh,
        loss_cfg=DistillLossConfig(temperature=2.0, alpha=0.7),
        lr_schedule=optim.schedule(OPT, 10),
        grad_accum=accum,
    )
    state = train.init_state(cfg, tx, 0, mesh, jax.device_get(model.init_params(cfg, 0)))
    history = []
    for i in range(2):
        state, metrics = step(state, _batch(b, i), _teacher(b, i + 1, dense, accum))
        history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return jax.device_get(state.params), history


@pytest.mark.parametrize(
    "cfg, dp, fsdp, cp, dense, accum, exchange",
    [
        ("plain", 1, 1, 2, False, 1, "ring"),
        ("gemma", 1, 2, 2, True, 2, "gather"),
        ("nope", 1, 1, 2, False, 1, "ring"),
        ("gemma4", 1, 2, 2, False, 1, "ring"),
    ],
    ids=[
        "plain-cp2-topk-ring",
        "gemma-fsdp2-cp2-dense-accum2-gather",
        "nope-cp2-topk-ring",
        "gemma4-fsdp2-cp2-topk-ring",
    ],  # fmt: skip
)
def test_the_step_matches_one_device(cfg, dp, fsdp, cp, dense, accum, exchange, monkeypatch):
    """Against the single device's one-shot step (the second case also in two microbatches,
    its dense teacher in two blocks). Rows this short take `auto`'s gather; the first case
    passes k/v around the ring instead."""
    if exchange == "ring":
        monkeypatch.setattr(ring, "GATHER_MAX_BYTES", 0)
    assert ring.choose_exchange((4, S // cp, 2, 8), np.float32, cp) == exchange
    ref_params, ref = _run(cfg, 1, 1, 1, dense)
    params, got = _run(cfg, dp, fsdp, cp, dense, accum)
    assert ref[0]["tokens"] > 0
    for a, b in zip(ref, got, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), k
    # Gemma 4's per-layer tables: a row of a token seen once or twice takes AdamW steps
    # normalised from small gradients, which the layouts' summation orders move by 1.5e-5
    atol = 3e-5 if cfg == "gemma4" else 1e-5
    for x, y in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(y, x, atol=atol, rtol=0)


def _step_temp_bytes(cp: int, s: int) -> int:
    """XLA's per-device temporaries of the compiled step, one row of `s` tokens, top-k."""
    mesh = student_mesh(jax.devices()[:cp], 1, 1, cp)
    tx = optim.make_optimizer(OPT, 10)
    step = train.make_train_step(
        PLAIN, tx, mesh, loss_cfg=DistillLossConfig(), lr_schedule=optim.schedule(OPT, 10)
    )
    split = train.batch_sharding(mesh)
    shape = lambda *dims, dt=np.int32: jax.ShapeDtypeStruct(dims, dt, sharding=split)  # noqa: E731
    i32 = shape(1, s)
    batch = Batch(i32, i32, i32, i32, shape(1, s, dt=np.float32))
    out = TeacherOutput(shape(1, s, 6, dt=np.float32), shape(1, s, 6))
    compiled = step.lower(train.abstract_state(PLAIN, tx, mesh), batch, out).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_steps_memory_falls_with_cp():
    """Compile-only, a 4,096-token row: a device's temporaries (activations, attention and
    loss workspaces) at cp = 2 at most 0.6x of one device's."""
    assert _step_temp_bytes(2, 4096) <= 0.6 * _step_temp_bytes(1, 4096)


def test_the_weights_are_split_over_fsdp_and_cp():
    """ZeRO-3 spans a row's cp devices too: each holds 1/(fsdp x cp) of the state."""
    tx = optim.make_optimizer(OPT, 10)
    placed = train.state_shardings(PLAIN, tx, student_mesh(jax.devices()[:4], 1, 2, 2))
    assert placed.params["layers"]["wq"].spec == P(None, None, (FSDP, CP))
    assert placed.opt_state[1][0].mu["layers"]["wq"].spec == P(None, None, (FSDP, CP))
    shapes, specs = train.state_shapes(PLAIN, tx), jax.tree.map(lambda x: x.spec, placed)
    split = sharding.bytes_per_device(shapes.params, specs.params, {DP: 1, FSDP: 2, CP: 2})
    whole = sharding.bytes_per_device(shapes.params, jax.tree.map(lambda _: P(), specs.params), {})
    assert whole / 4 <= split < whole / 3  # a quarter of all but the norms
    # starting weights (from a teacher) are read straight into the state's layout
    assert train.param_shardings(PLAIN, student_mesh(jax.devices()[:4], 1, 2, 2)) == placed.params


@pytest.mark.parametrize("cp", [2, 4])
def test_the_step_lays_rows_out_as_ring_attention_expects(cp):
    """Row order split over cp -> each device's two chunks (two ppermutes): the same array
    as `to_cp_layout` on the host, split evenly."""
    mesh = Mesh(np.array(jax.devices()[:cp]), (CP,))
    x = np.arange(2 * 8 * cp * 3).reshape(2, 8 * cp, 3)
    run = jax.shard_map(
        functools.partial(balance, axis=CP), mesh=mesh, in_specs=P(None, CP), out_specs=P(None, CP)
    )
    np.testing.assert_array_equal(np.asarray(jax.jit(run)(x)), to_cp_layout(x, cp))


@pytest.mark.parametrize("first", [4, 0], ids=["split", "colocated"])
def test_the_teacher_output_lands_split_by_position(first):
    """Rows on a dp=2 x tp=2 teacher mesh -> the dp=1 x fsdp=1 x cp=4 student's sharding,
    on other devices or the same ones: each student device gets its quarter of every row's
    positions, values unchanged."""
    devices = jax.devices()
    teacher = Mesh(np.array(devices[:4]).reshape(2, 2), (DP, TP))
    x = jax.device_put(np.arange(4 * S * 3.0).reshape(4, S, 3), NamedSharding(teacher, P(DP)))
    dst = train.batch_sharding(student_mesh(devices[first : first + 4], 1, 1, 4))
    moved = handoff.hop(x, dst)
    assert moved.sharding == dst
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(x))
    assert {s.data.shape for s in moved.addressable_shards} == {(4, S // 4, 3)}


def _config(role: str = "student", **mesh) -> Config:
    return config_from_dict(
        {
            "data": {"source": "x"},
            "mesh": {role: mesh},
            "train": {"seq_len": S, "batch_size": 4},
        }
    )


REFUSED = [  # (updates, the field named) for either role's cp (`mesh.teacher.cp` too)
    ({"train": {"seq_len": 36}}, "train.seq_len"),
    ({"distill": {"on_policy": {"fraction": 0.5}}}, "distill.on_policy.fraction"),
]


@pytest.mark.parametrize(
    "role, updates, key",
    [(role, *case) for role in ("student", "teacher") for case in REFUSED]
    + [("teacher", {"mesh": {"teacher": {"pp": 2}}}, "mesh.teacher.pp")],
)
def test_what_cp_does_not_support_is_refused_in_one_line(role, updates, key):
    tree = _config(role, cp=4).model_dump()
    for section, values in updates.items():
        for k, v in values.items():
            if isinstance(v, dict):
                tree[section][k].update(v)
            else:
                tree[section][k] = v
    with pytest.raises(DistillError, match=key) as err:
        check_context(Config.model_validate(tree))
    assert "\n" not in str(err.value) and f"mesh.{role}.cp" in str(err.value)
    tree["mesh"][role]["cp"] = 1  # the same run without context parallelism passes
    check_context(Config.model_validate(tree))


def test_ray_mode_keeps_a_students_row_in_one_process():
    """pipeline.mode ray: either role's cp passes; the student's only while the group's
    hosts split its row shards (a row's cp devices one process's), the teacher's across
    its processes too, colocated only with both meshes on the same devices."""
    tree = _config("student", cp=2).model_dump()
    tree["pipeline"]["mode"] = "ray"
    tree["mesh"]["teacher"].update(cp=2, hosts=2)
    tree["mesh"]["student"].update(dp=2, hosts=2)
    check_context(Config.model_validate(tree))
    tree["mesh"]["student"].update(dp=1)
    with pytest.raises(DistillError, match="mesh.student.cp: 2 would split rows across") as err:
        check_context(Config.model_validate(tree))
    assert "\n" not in str(err.value) and "mesh.student.hosts" in str(err.value)
    # colocated over several processes: the teacher's blocks reach the student's devices by
    # JAX's reshard across processes, which needs one set of devices for both meshes
    tree["mesh"].update(placement="colocated")
    tree["mesh"]["teacher"].update(tp=2)
    tree["mesh"]["student"].update(dp=2, cp=1)
    with pytest.raises(DistillError, match="mesh.teacher.cp: 2 in a colocated group of 2"):
        check_context(Config.model_validate(tree))
    tree["mesh"]["student"].update(cp=2)  # 4 devices each
    check_context(Config.model_validate(tree))


def test_validate_names_both_roles_cp_in_ray_mode(corpus_dir, tmp_path, capsys):
    """`distill validate` of a ray-mode config with cp in both roles: ok, its line naming
    each mesh's cp; a student row split over the group's hosts: one line naming the field."""
    from pipelines.commands.cli import main
    from tests.conftest import tiny_config, write_config

    mesh = {"teacher": {"tp": 2, "cp": 2}, "student": {"dp": 2, "cp": 2}}
    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"), mesh=mesh, pipeline={"mode": "ray"})
    path = write_config(tmp_path, tree)
    assert main(["validate", path]) == 0
    assert "teacher dp=1 x cp=2 x tp=2, student dp=2 x fsdp=1 x cp=2" in capsys.readouterr().out
    assert main(["validate", path, "--set", "mesh.student.hosts=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distill: error: mesh.student.cp: 2 would split rows") and "\n" not in err


def test_the_plan_counts_the_rings_bytes():
    """Per device and step: k, v and segment ids around the ring cp - 1 times forward and
    backward, float32 dk and dv cp times; a rematerialised forward passes them again."""
    cfg = _config(cp=2)
    m = cfg.student_model()
    tokens = 4 * S // 2  # all 4 rows, half of each row's positions
    kv, dkv = tokens * (2 * m.n_kv_heads * m.hd * 4 + 4), tokens * 2 * m.n_kv_heads * m.hd * 4
    assert ring_bytes_per_step(cfg) == m.n_layers * (2 * kv + 2 * dkv)
    cfg.train.remat = "block"
    assert ring_bytes_per_step(cfg) == m.n_layers * (3 * kv + 2 * dkv)
    assert ring_bytes_per_step(_config(cp=1)) == 0
