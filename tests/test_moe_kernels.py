"""The experts' grouped matmuls (`distill.models.experts.grouped`): the tiled XLA kernel equals
`jax.lax.ragged_dot` (today's dropless layer) forward and backward; one layer of the
Qwen3-30B-A3B shape compiles, on every pure-XLA path, to at most 1.3x its active FLOPs
(counted over every loop iteration by `distill.compiled_flops`), with no [E, T*k, D]
array and under 3 GiB of temporaries, and its program lowered for CUDA holds no
ragged_dot (which XLA rewrites there into a dense matmul over every expert)."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.compiled_flops import compiled_dot_flops, dot_counts, dot_flops
from distill.config import ModelConfig
from distill.models import moe
from distill.models.experts import grouped

SWIGLU = moe.glu(ModelConfig())


def _params(d, e, f, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return {
        "router": jax.random.normal(keys[0], (d, e)),
        "we_gate": jax.random.normal(keys[1], (e, d, f)) * 0.3,
        "we_up": jax.random.normal(keys[2], (e, d, f)) * 0.3,
        "we_down": jax.random.normal(keys[3], (e, f, d)) * 0.3,
    }


def test_kernel_per_platform_and_tile_scaling():
    assert grouped.kernel("tpu") == "ragged_dot"
    assert grouped.kernel("gpu") == grouped.kernel("cpu") == "tiled"  # no Hopper here
    for rows, experts, m in [(32768, 128, 32), (4096, 8, 64), (1 << 20, 128, 128), (48, 8, 1)]:
        assert grouped.tile_rows(rows, experts) == m
        assert experts * (m - 1) <= max(rows // grouped.PAD_SHARE, 0)


def test_tiled_rows_equal_ragged_dot_and_skip_rows_of_no_expert():
    """Rows to experts in any order, one expert unused, two rows of no expert (id E)."""
    d, e, f = 8, 4, 6
    p = _params(d, e, f)
    x = jax.random.normal(jax.random.key(1), (5, d))
    src = jnp.array([0, 4, 2, 2, 1, 3, 0, 4, 1])
    expert = jnp.array([3, 0, 4, 3, 0, 3, 1, 4, 3])  # none to expert 2; 4 = no expert
    w = grouped.Experts(p["we_gate"], p["we_up"], p["we_down"])
    rows = jax.jit(grouped.expert_rows, static_argnums=(4, 5))
    got = rows(x, src, expert, w, SWIGLU, "tiled")
    want = rows(x, src, expert, w, SWIGLU, "ragged_dot")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert not np.asarray(got)[[2, 7]].any()


@pytest.mark.parametrize("experts_per_token", [1, 3])
def test_tiled_layer_and_its_gradient_equal_ragged_dot(experts_per_token):
    cfg = ModelConfig(
        d_model=16, n_experts=8, experts_per_token=experts_per_token, d_ff_expert=8,
        activation="gelu_tanh",
    )  # fmt: skip
    p = _params(16, 8, 8, seed=2)
    h = jax.random.normal(jax.random.key(3), (2, 12, 16))
    probe = jax.random.normal(jax.random.key(4), (2, 12, 16))

    def loss(h, p, kernel):
        y, _ = moe.moe_ffn(h, p, cfg, tp_axis=None, kernel=kernel)
        return jnp.sum(y * probe), y

    def grads(kernel):
        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(h, p, kernel)

    (gh, gp), y = grads("tiled")
    (wh, wp), want = grads("ragged_dot")
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gh), np.asarray(wh), atol=1e-4, rtol=1e-4)
    for name in p:
        np.testing.assert_allclose(
            np.asarray(gp[name]), np.asarray(wp[name]), atol=1e-4, rtol=1e-4, err_msg=name
        )


# gpt-oss' experts: biases on gate, up and down, the clamped SwiGLU (a limit the rows reach)
GPT_OSS = ModelConfig(activation="swiglu_clamped", swiglu_limit=1.5, expert_bias=True)
VARIANTS = {"swiglu": (SWIGLU, False), "gpt_oss": (moe.glu(GPT_OSS), True)}


def _sorted_rows(d=64, e=4, f=128, rows=40, live=33, seed=5, biased=False):
    """Rows sorted by expert (one expert empty), the last `rows - live` of no expert."""
    keys = jax.random.split(jax.random.key(seed), 8)
    sizes = jnp.array([10, 0, 15, live - 25], jnp.int32)
    x = jax.random.normal(keys[0], (rows, d))
    shapes = [(e, d, f), (e, d, f), (e, f, d)] + ([(e, f), (e, f), (e, d)] if biased else [])
    w = grouped.Experts(
        *(jax.random.normal(k, s) * 0.2 for k, s in zip(keys[1:7], shapes, strict=False))
    )
    return x, sizes, w, jax.random.normal(keys[7], (rows, d))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mosaic_composition_and_its_backward_equal_autodiff(variant):
    """The `mosaic_gpu` kernel's SwiGLU and hand-written backward, run with XLA's reference
    grouped matmuls in place of the Hopper kernels: output and every gradient equal plain
    autodiff of `ragged_dot`, and the rows of no expert are zero; with gpt-oss' biases
    (added per row outside the kernels) and clamped SwiGLU too."""
    from distill.models.experts import mosaic

    glu, biased = VARIANTS[variant]
    x, sizes, w, probe = _sorted_rows(biased=biased)
    f = mosaic.grouped_swiglu(glu, mosaic.reference_ops())

    def loss(fn, x, w):
        y = fn(x, sizes, w)
        return jnp.sum(y * probe), y

    plain = lambda x, s, w: grouped.ragged_swiglu(x, s, w, glu)  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)(f, x, w)
    want = jax.jit(jax.grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)(plain, x, w)
    (g_got, y_got), (g_want, y_want) = got, want
    np.testing.assert_allclose(np.asarray(y_got), np.asarray(y_want), atol=1e-5, rtol=1e-5)
    assert not np.asarray(y_got)[33:].any()
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mosaic_kernel_lowers_for_cuda_without_ragged_dot(monkeypatch, variant):
    """The layer and its gradient in bfloat16 lowered for CUDA on this CPU machine: Mosaic
    GPU kernels (three forward, six backward), no `ragged_dot` for XLA to rewrite densely;
    gpt-oss' biases and clamped SwiGLU add no kernel. A float32 layer, or widths the
    kernels' blocks do not divide, take the tiled kernel."""
    from types import SimpleNamespace

    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as transposed

    from distill.models.experts import mosaic

    # the transposed kernel sizes its grid by the first device's SMs: an H100's 132 here
    gpu = SimpleNamespace(core_count=132)
    monkeypatch.setattr(
        transposed, "jax", SimpleNamespace(**{**vars(jax), "devices": lambda: [gpu]})
    )

    glu, biased = VARIANTS[variant]
    x, _, w, probe = _sorted_rows(biased=biased)
    src, expert = jnp.arange(40) % 40, jnp.arange(40) % 5  # 4 = no expert

    def loss(x, w):
        y = grouped.expert_rows(x, src, expert, w, glu, "mosaic_gpu")
        return jnp.sum(y.astype(jnp.float32) * probe)

    x, w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, w))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, w).lower(
        lowering_platforms=("cuda",)
    ).as_text()  # fmt: skip
    assert text.count("custom_call @mosaic_gpu") == 9  # 3 forward, 3 + 3 backward
    assert not re.search(r"(chlo|stablehlo)\.ragged_dot", text)
    assert mosaic.usable(64, 128, jnp.bfloat16)
    assert not mosaic.usable(64, 128, jnp.float32)
    assert not mosaic.usable(64, 96, jnp.bfloat16)


def test_dot_flops_count_every_loop_iteration():
    """XLA's cost analysis counts a scan's body once; `dot_flops` times its trip count."""

    def f(x, w):
        return jax.lax.scan(lambda c, x: (c, jnp.tanh(x @ w) @ w.T), 0, x)[1]

    x, w = jnp.zeros((10, 4, 16)), jnp.zeros((16, 32))
    compiled = jax.jit(f).trace(x, w).lower().compile()
    assert compiled_dot_flops(compiled) == 10 * 2 * (2 * 4 * 16 * 32)
    assert compiled.cost_analysis()["flops"] < 2 * (2 * 4 * 16 * 32) + 10 * 4 * 32 * 4
    assert dot_flops("ENTRY %e () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}") == 0


def test_dot_counts_name_what_loops_bounded_by_data_hold():
    """A loop whose trip count depends on the data (causal attention's key blocks) is
    counted once, and `dot_counts` says how much of the total that is: a lower bound."""

    def f(x, w, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w) @ w.T, x)

    x, w = jnp.zeros((4, 16)), jnp.zeros((16, 32))
    one = 2 * (2 * 4 * 16 * 32)
    compiled = jax.jit(f).trace(x, w, 3).lower().compile()
    assert dot_counts(compiled.as_text()) == (one, one)
    fixed = jax.jit(f, static_argnums=2).trace(x, w, 3).lower().compile()
    assert dot_counts(fixed.as_text()) == (3 * one, 0)


T, E, K, D, F = 4096, 128, 8, 2048, 768  # one layer of Qwen3-30B-A3B, one 4,096-token row
ACTIVE = 2 * T * K * D * F * 3


@pytest.mark.parametrize("path", ["dropless", "capacity 1.25", "dropless backward"])
def test_the_30b_a3b_layer_compiles_to_its_active_flops(path):
    """Compile-only, abstract inputs, in float32 (twice bfloat16's bytes: the stricter
    test of the temporaries)."""
    cfg = ModelConfig(d_model=D, n_experts=E, experts_per_token=K, d_ff_expert=F)
    factor = float(path.split()[1]) if path.startswith("capacity") else None
    h = jax.ShapeDtypeStruct((1, T, D), jnp.float32)
    p = jax.eval_shape(lambda: _params(D, E, F))

    def fwd(h, p):
        return moe.moe_ffn(h, p, cfg, tp_axis=None, capacity_factor=factor, kernel="tiled")[0]

    f = fwd
    if path.endswith("backward"):
        f = jax.grad(lambda h, p: jnp.sum(fwd(h, p)), argnums=(0, 1))
    compiled = jax.jit(f).trace(h, p).lower().compile()
    bound = (factor or 1.0) + 0.05 if factor else 1.3  # the factor, and the router
    work = ACTIVE * (3 if path.endswith("backward") else 1)
    assert compiled_dot_flops(compiled) <= bound * work
    assert compiled.memory_analysis().temp_size_in_bytes <= 3 * 2**30
    sizes = re.findall(r"\[([\d,]+)\]", compiled.as_text())
    assert max(np.prod([int(n) for n in s.split(",")]) for s in sizes) < E * T * K * D
    cuda = jax.jit(f).trace(h, p).lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_dot" not in cuda


def test_plan_reports_compiled_flops_and_refuses_an_ungrouped_moe(caplog):
    """The tiny MoE teacher at ep=1: its compiled forward's FLOPs per token (every layer and
    tile counted) near the model's, its kernel named; 127x is refused in one line naming
    the field that asks to run it anyway, and with that field set it is a warning. At ep=2
    (the dispatch's round counted once) it stays within the bound."""
    from distill.errors import DistillError
    from distill.mesh import teacher_mesh
    from distill.models import counts
    from pipelines.plan import flops as plan_flops
    from pipelines.plan import memory as plan_memory
    from tests.test_plan import _moe_config

    cfg = _moe_config()
    cfg.mesh.teacher.ep = 1
    mem, _ = plan_memory.teacher_memory(cfg, teacher_mesh(jax.devices()[:1], 1, 1, 1), None)
    want = counts.flops_per_token(cfg.teacher.model, cfg.train.seq_len)
    assert mem["moe_kernel"] == "tiled"
    assert 0.8 * want <= mem["compiled_flops_per_token"] <= plan_flops.LIMIT * want
    plan_flops.check_moe(cfg, mem)
    ungrouped = {**mem, "compiled_flops_per_token": 127 * want}
    with pytest.raises(DistillError, match=r"^teacher.model: the compiled MoE forward does 127"):
        plan_flops.check_moe(cfg, ungrouped)
    with pytest.raises(DistillError, match=r"; teacher.moe_allow_ungrouped: true runs it$"):
        plan_flops.check_moe(cfg, ungrouped)
    cfg.teacher.moe_allow_ungrouped = True  # asked: a warning, the same line
    with caplog.at_level(logging.WARNING, logger=plan_flops.__name__):
        plan_flops.check_moe(cfg, ungrouped)
    assert "the compiled MoE forward does 127.0x" in caplog.text
    cfg.mesh.teacher.ep = 2  # the dispatch's one round, within the bound too
    mem, _ = plan_memory.teacher_memory(cfg, teacher_mesh(jax.devices()[:2], 1, 1, 2), None)
    assert mem["compiled_flops_per_token"] <= plan_flops.LIMIT * want
    plan_flops.check_moe(cfg, mem)
