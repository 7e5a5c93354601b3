"""`train.remat: auto`: the least recompute whose compiled peak fits the device; and every
policy's loss and gradients equal `none`'s."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from distill.config import DistillLossConfig, ModelConfig
from distill.config.load import config_from_dict
from distill.mesh import role_mesh
from distill.models import model
from distill.types import Batch, TeacherOutput
from pipelines.plan import memory as plan_memory
from student import train
from student.remat import CANDIDATES, HEADROOM, choose, concrete, train_flops_per_token
from tests.conftest import tiny_config
from tests.test_student import CFG, _batch, _teacher

GIB = 2**30


def _peaks(table: dict, asked: list):
    def peak_of(policy):
        asked.append(policy)
        return table[policy]

    return peak_of


def test_auto_takes_the_least_recompute_that_fits_compiling_no_more_than_it_needs():
    table = {"none": 60 * GIB, "dots": 30 * GIB, "block": 20 * GIB}
    asked = []
    c = choose("auto", _peaks(table, asked), 80 * GIB)  # budget 72 GiB: none fits
    assert (c.policy, asked, c.budget) == ("none", ["none"], 72 * GIB)
    asked = []
    c = choose("auto", _peaks(table, asked), 40 * GIB)  # budget 36 GiB: dots, block untried
    assert (c.policy, asked) == ("dots", ["none", "dots"])
    assert c.peaks == {"none": 60 * GIB, "dots": 30 * GIB}
    assert "none 60.00 GiB, dots 30.00 GiB vs 36.00 GiB = 40.00 GiB less 10% headroom" in c.reason
    assert "the least recompute that fits" in c.reason
    asked = []
    c = choose("auto", _peaks(table, asked), 25 * GIB)
    assert (c.policy, asked) == ("block", list(CANDIDATES))
    # the headroom is the margin: a peak just over 90% of the device does not fit
    assert choose("auto", _peaks({**table, "none": 90 * GIB + 1}, []), 100 * GIB).policy == "dots"
    assert choose("auto", _peaks({**table, "none": 90 * GIB}, []), 100 * GIB).policy == "none"


def test_auto_when_nothing_fits_is_block_and_says_so():
    c = choose("auto", _peaks({"none": 9 * GIB, "dots": 8 * GIB, "block": 7 * GIB}, []), GIB)
    assert c.policy == "block" and c.reason.endswith("none fits")


def test_a_configured_policy_and_cpu_compile_nothing():
    def never(policy):
        raise AssertionError(f"compiled {policy}")

    assert choose("dots", never, 10 * GIB).policy == "dots"
    c = choose("auto", never, None)
    assert c.policy == "none" and "CPU" in c.reason and c.peaks == {}
    assert concrete("auto", "cpu") == "none" and concrete("block", "gpu") == "block"
    with pytest.raises(ValueError, match="must be resolved"):
        concrete("auto", "gpu")


def test_resolve_remat_compiles_the_candidates_on_a_given_device_size():
    """The plan's path, on CPU with a device size handed in: the candidates' compiled peaks
    fall with recompute, and auto takes the first that fits."""
    tree = tiny_config("unused", "unused", mesh={"teacher": {"tp": 1}, "student": {"dp": 1}})
    tree["student"]["model"].update(d_model=64, n_layers=2, d_ff=256)
    tree["train"].update(batch_size=4, seq_len=256, layer_loop="scan")
    cfg = config_from_dict(tree)
    cfg.resolve_dtypes("cpu")
    mesh = role_mesh(cfg, "student")
    _, all_three = plan_memory.resolve_remat(cfg.model_copy(deep=True), mesh, device_bytes=1)
    peaks = {p: f["peak_bytes_per_device"] for p, f in all_three.items()}
    assert list(peaks) == list(CANDIDATES) and peaks["none"] > peaks["dots"] > peaks["block"]
    device = int(peaks["dots"] / (1 - HEADROOM)) + 1  # none does not fit, dots just does
    choice, _ = plan_memory.resolve_remat(cfg, mesh, device_bytes=device)
    assert (choice.policy, cfg.train.remat) == ("dots", "dots")  # resolved in the config
    assert choice.peaks == {"none": peaks["none"], "dots": peaks["dots"]}
    again, _ = plan_memory.resolve_remat(cfg, mesh, device_bytes=device)  # now configured
    assert again.policy == "dots" and again.peaks == {}


@pytest.mark.parametrize("policy", ["dots", "block"])
def test_every_policy_gives_the_loss_and_gradients_of_none(policy):
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    loss_cfg = DistillLossConfig(temperature=2.0, alpha=0.7)
    params = model.init_params(CFG, 0)
    batch, teacher = _batch(), _teacher("topk")

    def grads(remat):
        loss_fn = train.make_loss_fn(CFG, loss_cfg, "float32", None, remat, mesh)
        return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, teacher)

    (loss, _), g = grads("none")
    (loss_p, _), g_p = grads(policy)
    np.testing.assert_allclose(loss_p, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_p, g)


@pytest.mark.parametrize("policy", CANDIDATES)
def test_the_recompute_model_is_xla_s_count_of_a_loop_free_step(policy):
    """XLA's cost analysis counts a loop's body once (the scanned layers, the loss's chunks:
    the 1B step's 2-layer compile reads the same FLOPs as its 4-layer one), so the bench's
    hardware FLOPs come from `train_flops_per_token`; here it is checked against XLA's count
    of a step with no loops (layers unrolled, one chunk of logits, the plain attention
    math), which also counts elementwise ops: within 3%, where dots adds 7% and block 25%."""
    cfg = ModelConfig(
        vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=1024,
        attention="reference",
    )  # fmt: skip
    b, s = 1, 512
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    loss_fn = train.make_loss_fn(
        cfg, DistillLossConfig(), "float32", None, policy, mesh, unroll=True
    )
    i32, f32 = (jax.ShapeDtypeStruct((b, s, *k), t) for k, t in (((), np.int32), ((), np.float32)))
    top = TeacherOutput(
        jax.ShapeDtypeStruct((b, s, 8), np.float32), jax.ShapeDtypeStruct((b, s, 8), np.int32)
    )
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    compiled = grad.lower(model.abstract_params(cfg), Batch(i32, i32, i32, i32, f32), top).compile()
    cost = compiled.cost_analysis()
    counted = (cost[0] if isinstance(cost, list) else cost)["flops"] / (b * s)
    assert counted == pytest.approx(train_flops_per_token(cfg, s, policy), rel=0.03)
