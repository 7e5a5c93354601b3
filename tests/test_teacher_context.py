"""The teacher's context parallelism (`mesh.teacher.cp`, `teacher.forward`) against cp = 1.

Rows are packed (three documents, the middle one crossing chunk edges, trailing padding:
`tests.test_context_parallel._batch`); the forward on a dp x ep x cp x tp mesh must give
the cp = 1 mesh's outputs to 1e-6 (float32), top-k and dense, for a plain family and a
windowed, soft-capped one (Gemma 3-like: sliding and full layers, a local RoPE base), one
with layers without RoPE (SmolLM3's NoPE), and a mixture of experts over ep; the outputs
leave split over cp by position in row order; the hand-off lands them on a student with
the same cp one buffer per device (no row whole anywhere) and on one with another cp by
pieces; a `distill run` with cp = 2 in both roles
gives the cp = 1 run's losses; `distill plan` shows the teacher's compiled temporaries
falling with cp. (What teacher cp does not support is refused in one line:
`tests.test_context_parallel`.)
"""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distill import handoff
from distill.config import Config
from distill.config.load import config_from_dict
from distill.mesh import CP, student_mesh, teacher_mesh
from distill.models import model
from distill.models.kernels import ring
from pipelines import plan
from pipelines.commands.cli import main
from pipelines.plan import memory as plan_memory
from student import train
from teacher.forward import make_forward
from teacher.sharding import batch_sharding, shard_params
from tests.conftest import read_evals, train_by_step, write_config
from tests.test_context_parallel import S, _batch
from tests.test_teacher_stages import FAMILIES


def _outputs(family, batch, dp, tp, cp, ep=1, **kw):
    cfg = FAMILIES[family]
    mesh = teacher_mesh(jax.devices()[: dp * ep * cp * tp], dp, tp, ep, 1, cp)
    params = shard_params(model.init_params(cfg, 1), cfg, mesh)
    return make_forward(cfg, mesh, **kw)(params, jax.device_put(batch, batch_sharding(mesh)))


CASES = [  # family, (dp, ep, cp, tp), mode, exchange; against (dp, ep, 1, tp)
    ("dense", (1, 1, 2, 1), "topk", "ring"),
    ("windowed", (1, 1, 2, 2), "topk", "auto"),
    ("windowed", (1, 1, 4, 1), "dense", "ring"),
    ("moe", (1, 2, 2, 1), "topk", "auto"),
    ("nope", (1, 1, 2, 2), "topk", "ring"),  # SmolLM3's NoPE layers
    *[
        pytest.param(*case, marks=pytest.mark.slow)
        for case in [
            ("dense", (1, 1, 4, 1), "dense", "auto"),
            ("dense", (2, 1, 2, 2), "dense", "auto"),
            ("windowed", (1, 1, 2, 1), "dense", "auto"),
            ("windowed", (1, 1, 4, 2), "topk", "ring"),
            ("windowed", (1, 1, 2, 2), "target_logprobs", "auto"),
            ("moe", (1, 1, 2, 2), "dense", "ring"),
        ]
    ],
]


@pytest.mark.parametrize("family, axes, mode, exchange", CASES)
def test_cp_gives_the_outputs_of_one_device_per_row(family, axes, mode, exchange, monkeypatch):
    """cp = 2 and 4 (with tp, dp or ep beside it) against the same mesh without cp; key/value
    blocks around the ring (`ring`) or gathered (`auto` picks gather for rows this short)."""
    if exchange == "ring":
        monkeypatch.setattr(ring, "GATHER_MAX_BYTES", 0)
    dp, ep, cp, tp = axes
    kw = {"mode": mode, "top_k": 5 if mode == "topk" else None, "microbatch": 2}
    if FAMILIES[family].n_experts and mode == "topk":
        kw["expert_load"] = True
    batch = _batch(4, 0)
    want = _outputs(family, batch, dp, tp, 1, ep, **kw)
    got = _outputs(family, batch, dp, tp, cp, ep, **kw)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=0)
    out = jax.tree.leaves(got)[0]
    assert out.sharding.spec[1] == CP  # split by position, each device S / cp of them
    assert {s.data.shape[1] for s in out.addressable_shards} == {S // cp}
    if kw.get("expert_load"):
        assert int(got[1].tokens.sum()) == 4 * S * 2 * 3  # tokens x k x MoE layers


@pytest.mark.parametrize("cp", [2, 4])
def test_unbalance_inverts_balance(cp):
    """Each device's two chunks back to its slice of the rows in row order."""
    mesh = Mesh(np.array(jax.devices()[:cp]), (CP,))
    x = np.arange(2 * 8 * cp * 3).reshape(2, 8 * cp, 3)
    spec = P(None, CP)
    run = jax.shard_map(
        lambda a: ring.unbalance(ring.balance(a, CP), CP),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )
    np.testing.assert_array_equal(np.asarray(jax.jit(run)(x)), x)


@pytest.mark.parametrize(
    "student_axes, one_copy", [((2, 1, 2), True), ((1, 1, 4), False), ((1, 2, 1), False)]
)
def test_the_hand_off_places_position_blocks(student_axes, one_copy, monkeypatch):
    """A teacher output on tp = 2 x cp = 2 (rows over tp, positions over cp) onto a student
    of dp = 2 x cp = 2 (the same blocks: one buffer copy per device, nothing assembled), of
    cp = 4 (each student device a piece of one teacher block) and of fsdp = 2 without cp
    (each student device's whole rows assembled from the two position blocks)."""
    devices = jax.devices()
    t_mesh = teacher_mesh(devices[:4], 1, 2, 1, 1, 2)
    x = np.arange(4 * S * 3.0).reshape(4, S, 3)
    out = jax.device_put(x, NamedSharding(t_mesh, P("tp", CP)))
    dst = train.batch_sharding(student_mesh(devices[4 : 4 + np.prod(student_axes)], *student_axes))
    assembled = []
    monkeypatch.setattr(handoff, "_assemble", _spy(handoff._assemble, assembled))
    moved = handoff.hop(out, dst)
    assert moved.sharding == dst
    np.testing.assert_array_equal(np.asarray(moved), x)
    assert (not assembled) == one_copy
    sizes = {s.data.shape for s in moved.addressable_shards}
    dp, fsdp, cp = student_axes
    assert sizes == {(4 // (dp * fsdp), S // cp, 3)}


def _spy(fn, calls: list):
    def wrapped(*args, **kw):
        calls.append(args[2])
        return fn(*args, **kw)

    return wrapped


@pytest.mark.parametrize("placement", ["split", pytest.param("colocated", marks=pytest.mark.slow)])
def test_a_run_with_cp_in_both_roles_gives_the_runs_losses(tiny_run, tmp_path, placement):
    """The tiny run again with its teacher on tp = 2 x cp = 2 and its student on dp = 2 x
    cp = 2 (8 devices, the outputs hopping block for block; or colocated on the same 4,
    whose blocks lie on other devices of the two meshes): the same losses and
    evaluations."""
    tree = json.loads(json.dumps(tiny_run.tree))
    out = tmp_path / "out"
    tree["run"]["output_dir"] = str(out)
    tree["mesh"]["teacher"]["cp"] = 2
    tree["mesh"]["student"]["cp"] = 2
    tree["mesh"]["placement"] = placement
    tree["teacher"].update(checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0)
    assert main(["run", write_config(tmp_path, tree)]) == 0
    runs = [train_by_step(o) for o in (tiny_run.out, out)]
    assert sorted(runs[0]) == sorted(runs[1]) == [2, 4, 6]
    losses = [[r[s][k] for s in (2, 4, 6) for k in ("loss", "kd_loss", "ce_loss")] for r in runs]
    np.testing.assert_allclose(losses[1], losses[0], atol=1e-6, rtol=0)
    evals = [[r["student_loss"] for r in read_evals(o)] for o in (tiny_run.out, out)]
    assert len(evals[0]) == 3
    np.testing.assert_allclose(evals[1], evals[0], atol=1e-6, rtol=0)


# the tiny run's teacher (`tests.conftest.tiny_config`)
TINY_TEACHER = dict(vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)


def _plan_config(cp: int) -> Config:
    cfg = config_from_dict(
        {
            "data": {"source": "x"},
            "teacher": {"model": TINY_TEACHER, "top_k": 8},
            "mesh": {"teacher": {"cp": cp}},
            "train": {"seq_len": 8192, "batch_size": 2},
        }
    )
    cfg.resolve_dtypes("cpu")
    return cfg


def test_the_plan_shows_the_teachers_memory_falling_with_cp():
    """Compile-only (`distill plan`'s figures), two rows of 8,192 tokens: a device's
    forward temporaries at cp = 2 at most 0.6x, at cp = 4 at most 0.35x cp = 1's; the ring's
    bytes: k, v and segment ids of a device's tokens, cp - 1 times a layer."""
    temps = {}
    for cp in (1, 2, 4):
        cfg = _plan_config(cp)
        mesh = teacher_mesh(jax.devices()[:cp], 1, 1, 1, 1, cp)
        figures, _ = plan_memory.teacher_memory(cfg, mesh, None)
        temps[cp] = figures["forward_temp_bytes_per_device"]
    assert temps[2] <= 0.6 * temps[1] and temps[4] <= 0.35 * temps[1], temps
    cfg = _plan_config(2)
    m = cfg.teacher.model
    assert "ring_bytes_per_step" not in plan.teacher_figures(_plan_config(1))
    tokens = 2 * 8192 // 2
    kv = tokens * (2 * m.n_kv_heads * m.hd * 4 + 4)  # float32 on CPU
    assert plan.teacher_figures(cfg)["ring_bytes_per_step"] == m.n_layers * kv
