"""The routing and expert variants of the DeepSeek-V3 (Kimi K2), GLM-4.5 and gpt-oss
mixtures, as `ModelConfig` data in distill's one MoE layer, against transformers' own
modules (`DeepseekV3MoE`, `Glm4MoeMoE`, `GptOssMLP`) on tiny random configs, every weight
randomised (the correction and router biases too, so that they matter), float32: the
teacher's layout at ep x tp = 1x1 (both XLA kernels), 2x1 and 2x2, the capacity path, the
expert loads; group-limited selection where it differs from the plain top-k; the
student's per-device layout (experts split over fsdp) and its gradients against
`jax.grad` of a dense reference; the parameters, sharding specs and validation each
variant asks for."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from distill.config import ModelConfig  # noqa: E402
from distill.mesh import EP, FSDP, TP  # noqa: E402
from distill.models import counts, model, moe  # noqa: E402
from student import optim  # noqa: E402
from student import sharding as student_sharding  # noqa: E402
from teacher import sharding as teacher_sharding  # noqa: E402

D, E, K, F = 32, 8, 3, 16  # d_model, routed experts, experts a token, each expert's width
SHAPE = (4, 6, D)  # rows (split over ep), tokens a row, d_model

# name: (transformers config class and keys, the module's class, distill's config)
VARIANTS = {
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            n_routed_experts=E,
            num_experts_per_tok=K,
            moe_intermediate_size=F,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
        dict(
            router_score="sigmoid",
            router_correction_bias=True,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scale=2.5,
            d_ff_shared=2 * F,
            shared_expert_gate=False,
        ),
    ),
    "glm4_moe": (  # its own defaults: one group (n_group = topk_group = 1), one shared expert
        "Glm4MoeConfig",
        dict(
            n_routed_experts=E,
            num_experts_per_tok=K,
            moe_intermediate_size=F,
            routed_scaling_factor=1.5,
        ),
        "glm4_moe.modeling_glm4_moe.Glm4MoeMoE",
        dict(
            router_score="sigmoid",
            router_correction_bias=True,
            norm_topk_prob=True,
            routed_scale=1.5,
            d_ff_shared=F,
            shared_expert_gate=False,
        ),
    ),
    "gpt_oss": (  # a clamp of 1 that the gate and up activations reach
        "GptOssConfig",
        dict(num_local_experts=E, num_experts_per_tok=K, intermediate_size=F, swiglu_limit=1.0),
        "gpt_oss.modeling_gpt_oss.GptOssMLP",
        dict(
            router_bias=True,
            norm_topk_prob=True,
            expert_bias=True,
            activation="swiglu_clamped",
            swiglu_limit=1.0,
            swiglu_alpha=1.702,
        ),
    ),
}


def _cfg(name: str, **over) -> ModelConfig:
    keys = VARIANTS[name][3]
    shape = dict(d_model=D, n_heads=4, n_kv_heads=2, n_experts=E, experts_per_token=K)
    return ModelConfig(**{**shape, "d_ff_expert": F, **keys, **over})


def _hf_module(name: str, seed: int = 0):
    """transformers' MoE module of `name`, every parameter and buffer random."""
    cls_name, keys, module, _ = VARIANTS[name]
    config = getattr(transformers, cls_name)(hidden_size=D, hidden_act="silu", **keys)
    config._experts_implementation = "eager"  # the modules' own per-expert loop
    path, cls = module.rsplit(".", 1)
    mod = getattr(
        __import__(f"transformers.models.{path}", fromlist=[cls]), cls
    )(config)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*mod.parameters(), *mod.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    return mod.eval()


def _t(x) -> jnp.ndarray:
    return jnp.asarray(x.detach().numpy())


def _distill_params(name: str, mod) -> dict:
    """The module's weights in distill's layout (the registry's job for a checkpoint)."""
    if name == "gpt_oss":
        r, x = mod.router, mod.experts
        gu, gub = _t(x.gate_up_proj), _t(x.gate_up_proj_bias)  # gate and up interleaved
        return {
            "router": _t(r.weight).T, "router_bias": _t(r.bias),
            "we_gate": gu[..., ::2], "we_up": gu[..., 1::2], "we_down": _t(x.down_proj),
            "be_gate": gub[:, ::2], "be_up": gub[:, 1::2], "be_down": _t(x.down_proj_bias),
        }  # fmt: skip
    gu = _t(mod.experts.gate_up_proj)  # [E, 2F, D]: gate's F outputs, then up's
    shared = mod.shared_experts
    return {
        "router": _t(mod.gate.weight).T,
        "router_correction": _t(mod.gate.e_score_correction_bias),
        "we_gate": jnp.swapaxes(gu[:, :F], 1, 2),
        "we_up": jnp.swapaxes(gu[:, F:], 1, 2),
        "we_down": jnp.swapaxes(_t(mod.experts.down_proj), 1, 2),
        "ws_gate": _t(shared.gate_proj.weight).T,
        "ws_up": _t(shared.up_proj.weight).T,
        "ws_down": _t(shared.down_proj.weight).T,
    }


def _hf_forward(name: str, mod, h):
    """(transformers' output [B, S, D], its chosen experts [T, k])."""
    x = torch.tensor(np.asarray(h))
    with torch.no_grad():
        if name == "gpt_oss":
            out = mod(x)[0]
            ids = mod.router(x.reshape(-1, D))[2]
        else:
            out = mod(x)
            ids = mod.gate(x)[2]
    return out.numpy(), ids.numpy()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    """(name, distill's config, its weights, h [B, S, D], transformers' output, its ids)."""
    name = request.param
    mod = _hf_module(name)
    h = jax.random.normal(jax.random.key(1), SHAPE)
    want, ids = _hf_forward(name, mod, h)
    return name, _cfg(name), _distill_params(name, mod), h, want, ids


def _teacher_layer(cfg, p, ep, tp, **opts):
    """The layer in the teacher's layout (its table's specs, the layer axis dropped) on an
    ep x tp mesh, rows split over ep: (output, tokens per expert [E], dropped)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: ep * tp]).reshape(ep, tp), (EP, TP))
    specs = {k: P(*teacher_sharding.LAYER_SPECS[k][1:]) for k in p}

    def f(h, p):
        y, load = moe.moe_ffn(h, p, cfg, tp_axis=TP, ep_axis=EP, **opts)
        return y, jax.lax.psum(load.tokens, EP), jax.lax.psum(load.dropped, EP)

    run = jax.shard_map(
        f, mesh=mesh, in_specs=(P(EP), specs), out_specs=(P(EP), P(), P())
    )  # fmt: skip
    return jax.jit(run)


@pytest.mark.parametrize(
    "ep, tp, kernel", [(1, 1, "tiled"), (1, 1, "ragged_dot"), (2, 1, None), (2, 2, None)]
)
def test_the_teacher_layer_equals_transformers(variant, ep, tp, kernel):
    """Output to 1e-5, and the loads count transformers' own choice of experts."""
    name, cfg, p, h, want, ids = variant
    y, load, dropped = _teacher_layer(cfg, p, ep, tp, kernel=kernel)(h, p)
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5, rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(load), np.bincount(ids.reshape(-1), minlength=E))
    assert int(dropped) == 0


def test_the_capacity_path_equals_transformers(variant):
    """A capacity factor with room for every assignment (ep x tp = 2 x 2): the biases and
    the clamped activation ride the batched matmuls too."""
    name, cfg, p, h, want, _ = variant
    y, load, dropped = _teacher_layer(cfg, p, 2, 2, capacity_factor=float(E))(h, p)
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5, rtol=1e-5, err_msg=name)
    assert int(dropped) == 0 and int(load.sum()) == SHAPE[0] * SHAPE[1] * K


def _sets(ids):
    return [frozenset(map(int, row)) for row in np.asarray(ids)]


def test_group_limited_selection_is_transformers_and_differs_from_plain_top_k():
    """DeepSeek's router: the chosen experts are transformers' (as sets: it leaves them
    unsorted), the weights its unbiased, renormalised, scaled scores; on this input the
    groups change the choice of some tokens, and so does the correction bias (the
    weights staying the unbiased sigmoid scores, renormalised and scaled)."""
    mod = _hf_module("deepseek_v3", seed=3)
    cfg, p = _cfg("deepseek_v3"), _distill_params("deepseek_v3", mod)
    h = jax.random.normal(jax.random.key(4), (64, D))
    with torch.no_grad():
        _, hf_weights, hf_ids = mod.gate(torch.tensor(np.asarray(h)))
    weights, ids = moe.route(h, p, cfg)
    assert _sets(ids) == _sets(hf_ids.numpy())
    order = np.argsort(np.asarray(ids), axis=-1)
    hf_order = np.argsort(hf_ids.numpy(), axis=-1)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1),
        np.take_along_axis(hf_weights.numpy(), hf_order, -1), atol=1e-6, rtol=1e-6,
    )  # fmt: skip
    plain = _cfg("deepseek_v3", n_group=1, topk_group=1)
    _, plain_ids = moe.route(h, p, plain)
    changed = sum(a != b for a, b in zip(_sets(ids), _sets(plain_ids), strict=True))
    assert 0 < changed < len(h)
    # every chosen expert inside the two best groups of four, which the plain top-k leaves
    groups = np.asarray(ids) // (E // 4)
    assert all(len(set(row)) <= 2 for row in groups)
    assert any(len(set(row)) > 2 for row in np.asarray(plain_ids) // (E // 4))
    unbiased = {k: v for k, v in p.items() if k != "router_correction"}
    no_bias = _cfg("deepseek_v3", router_correction_bias=False)
    _, unbiased_ids = moe.route(h, unbiased, no_bias)
    assert _sets(unbiased_ids) != _sets(ids)
    s = jax.nn.sigmoid(h @ p["router"])
    chosen = np.take_along_axis(np.asarray(s), np.asarray(ids), -1)
    np.testing.assert_allclose(
        np.asarray(weights), 2.5 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-6
    )


def _dense_reference(h_bsd, p, cfg):
    """Every token through every expert (no grouping, no dispatch), combined by the
    router's weights; plus the shared expert: the layer's plain-JAX reference."""
    glu = moe.glu(cfg)
    h = h_bsd.reshape(-1, D)
    weights, ids = moe.route(h, p, cfg)
    combine = jnp.zeros((h.shape[0], E)).at[jnp.arange(h.shape[0])[:, None], ids].add(weights)
    g = jnp.einsum("td,edf->tef", h, p["we_gate"]) + p.get("be_gate", 0)
    u = jnp.einsum("td,edf->tef", h, p["we_up"]) + p.get("be_up", 0)
    y = jnp.einsum("tef,efd->ted", glu(g, u), p["we_down"]) + p.get("be_down", 0)
    out = jnp.einsum("ted,te->td", y, combine)
    if "ws_gate" in p:
        out = out + glu(h @ p["ws_gate"], h @ p["ws_up"]) @ p["ws_down"]
    return out.reshape(h_bsd.shape)


def _probe(y):  # a cotangent that is not all ones
    return jnp.sum(y * jnp.sin(jnp.arange(y.size).reshape(y.shape)))


def test_the_reference_is_transformers(variant):
    """The dense reference of the gradient test below is itself transformers' layer."""
    name, cfg, p, h, want, _ = variant
    np.testing.assert_allclose(np.asarray(_dense_reference(h, p, cfg)), want, atol=1e-5)


@pytest.mark.parametrize("fsdp", [1, 4])
def test_the_student_layer_and_its_gradients_equal_a_reference(variant, fsdp):
    """The student's per-device layer (`moe.Layout`; at fsdp = 4 the experts split over
    it, tokens dispatched to them) and its gradients with respect to the input and every
    weight: finite and those of `jax.grad` of the dense reference. The correction bias
    gets none (it only chooses)."""
    name, cfg, p, h, _, _ = variant
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:fsdp]), (FSDP,))
    layout = moe.Layout(mesh, (FSDP,), FSDP if fsdp > 1 else None)

    def layer(h, p):
        return moe.moe_ffn(h, p, cfg, tp_axis=None, layout=layout)[0]

    def run(h, p):
        return layer(h, p), jax.grad(lambda h, p: _probe(layer(h, p)), (0, 1))(h, p)

    got, (dh, dp) = jax.jit(run)(h, p)
    want = _dense_reference(h, p, cfg)
    want_dh, want_dp = jax.grad(lambda h, p: _probe(_dense_reference(h, p, cfg)), (0, 1))(h, p)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dh), np.asarray(want_dh), atol=1e-4, rtol=1e-4)
    for k in p:
        assert np.isfinite(np.asarray(dp[k])).all(), k
        np.testing.assert_allclose(
            np.asarray(dp[k]), np.asarray(want_dp[k]), atol=1e-4, rtol=1e-4, err_msg=k
        )
    if "router_correction" in p:
        assert not np.asarray(dp["router_correction"]).any()
    assert np.asarray(dp["router"]).any()


def test_parameters_exist_where_the_config_asks_and_every_table_places_them():
    """Each variant's layer weights, no more; the teacher's and the student's tables have
    a spec for each (experts and their biases over ep, over fsdp when it divides E), and
    the selection-only bias is never decayed."""
    names = {
        "deepseek_v3": {"router_correction", "ws_gate", "ws_up", "ws_down"},
        "glm4_moe": {"router_correction", "ws_gate", "ws_up", "ws_down"},
        "gpt_oss": {"router_bias", "be_gate", "be_up", "be_down"},
    }
    base = {"router", "we_gate", "we_up", "we_down"}
    for name, extra in names.items():
        cfg = _cfg(name, n_layers=2)
        layers = model.abstract_params(cfg)["layers"]
        moe_keys = set(moe.weight_keys(cfg))
        assert moe_keys == base | extra, name
        assert moe_keys <= set(layers) and "shared_gate" not in layers
        teacher = teacher_sharding.param_specs(cfg)["layers"]
        student = student_sharding.param_specs(cfg, 4)["layers"]
        for k in extra & {"be_gate", "be_up", "be_down"}:
            assert teacher[k][1] == EP and student[k] == P(None, FSDP, None), k
        assert teacher["we_gate"] == P(None, EP, None, TP)
        mask = optim.decay_mask(model.init_params(cfg, 0))["layers"]
        assert mask["we_gate"] and mask.get("router_correction", False) is False
    qwen = ModelConfig(d_model=D, n_experts=E, d_ff_expert=F, d_ff_shared=F)
    assert "shared_gate" in moe.weight_keys(qwen) and "router_bias" not in moe.weight_keys(qwen)


def test_the_down_bias_is_added_once_over_tp():
    """At tp = 2 each shard's rows are partial sums: the down projection's bias is added on
    one shard only, so the sum holds it once (the 2x2 comparison above sees it; here the
    experts are zero and only the biases remain)."""
    cfg = _cfg("gpt_oss")
    p = _distill_params("gpt_oss", _hf_module("gpt_oss"))
    p = {k: (jnp.zeros_like(v) if k in moe.EXPERTS else v) for k, v in p.items()}
    h = jax.random.normal(jax.random.key(2), SHAPE)
    y1 = _teacher_layer(cfg, p, 1, 1)(h, p)[0]
    y2 = _teacher_layer(cfg, p, 1, 2)(h, p)[0]
    assert np.abs(np.asarray(y1)).max() > 0.1
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y1), atol=1e-6)


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(n_group=3), "n_group: 3 does not divide n_experts 8"),
        (dict(n_group=8), "n_group: 8 groups of 1 expert; each needs two"),
        (dict(n_group=4, topk_group=5), "topk_group: 5 exceeds n_group 4"),
        (dict(n_group=4, topk_group=1), "experts_per_token: 3 exceeds the 2 experts"),
    ],
)
def test_group_limited_routing_is_validated(keys, message):
    with pytest.raises(ValueError, match=message):
        _cfg("deepseek_v3", **keys)


def _random_params(cfg, seed=0):
    """`model.init_params`, every weight moved off its init (the zero biases included)."""
    params = model.init_params(cfg, seed)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noise = [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(tree, noise)


def _model_cfg(name):
    """A 3-layer model of the variant, its first layer dense (first_k_dense_replace = 1)."""
    return _cfg(name, vocab_size=64, n_layers=3, d_ff=48, dense_layers=(0,))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_sharded_teacher_forward_equals_one_device(name):
    """The whole model through the teacher's forward at ep x tp = 2 x 2, its weights placed
    by the teacher's table: the single device's log-probabilities."""
    from distill.mesh import teacher_mesh
    from teacher.forward import make_forward
    from tests.test_hf import _batch

    cfg = _model_cfg(name)
    params = _random_params(cfg)
    batch = _batch(64, b=4, s=12)
    want = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    mesh = teacher_mesh(jax.devices()[:4], 1, 2, 2)
    got = make_forward(cfg, mesh, mode="logits")(
        teacher_sharding.shard_params(params, cfg, mesh), batch
    )
    np.testing.assert_allclose(
        np.asarray(jax.nn.log_softmax(got)), np.asarray(jax.nn.log_softmax(want)),
        atol=1e-4, rtol=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_a_student_step_equals_one_device(name):
    """One SGD step of a student of the variant on dp x fsdp = 1 x 4 (the experts and
    their biases split over fsdp, tokens dispatched to them) with the load-balancing loss
    on (a sigmoid router's normalised scores): the single device's metrics and weights."""
    import optax

    from distill.config import DistillLossConfig, OptimConfig
    from student import train
    from tests.test_fsdp import _batch, _mesh, _teacher

    cfg, tx = _model_cfg(name), optax.sgd(0.5)
    params = jax.device_get(_random_params(cfg))

    def step(fsdp):
        mesh = _mesh(1, fsdp)
        run = train.make_train_step(
            cfg, tx, mesh, loss_cfg=DistillLossConfig(alpha=0.7, moe_aux_loss=0.1),
            lr_schedule=optim.schedule(OptimConfig(), 10),
        )  # fmt: skip
        state, metrics = run(train.init_state(cfg, tx, 0, mesh, params), _batch(8), _teacher(8))
        return state.params, jax.device_get(metrics)

    (want_params, want), (got_params, got) = step(1), step(4)
    assert (
        got_params["layers"]["be_down" if name == "gpt_oss" else "we_up"].sharding.spec[1] == FSDP
    )
    assert np.isfinite(want["moe_aux_loss"]) and want["moe_aux_loss"] > 0
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
    flat = zip(jax.tree.leaves(want_params), jax.tree.leaves(got_params), strict=True)
    for a, b in flat:
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_the_layer_compiles_to_its_active_flops(name):
    """Forward and backward of a wider layer of the variant (abstract inputs, the tiled
    kernel): no matmul over every expert (within 1.3x of the active experts' FLOPs, as
    `teacher.moe_allow_ungrouped` guards), and no ragged_dot lowered for CUDA."""
    import re

    from distill.compiled_flops import compiled_dot_flops

    t, d, e, k, f = 2048, 256, 32, 4, 128
    cfg = _cfg(name, d_model=d, n_experts=e, experts_per_token=k, d_ff_expert=f, d_ff_shared=0)
    p = {
        key: jax.ShapeDtypeStruct(param.shape, jnp.float32)
        for key, param in moe.layer_params(cfg, lambda shape, out: jnp.zeros(shape)).items()
    }
    h = jax.ShapeDtypeStruct((1, t, d), jnp.float32)

    def loss(h, p):
        return jnp.sum(moe.moe_ffn(h, p, cfg, tp_axis=None, kernel="tiled")[0])

    f_bwd = jax.grad(loss, argnums=(0, 1))
    compiled = jax.jit(f_bwd).trace(h, p).lower().compile()
    assert compiled_dot_flops(compiled) <= 1.3 * 3 * (2 * t * k * d * f * 3)
    cuda = jax.jit(f_bwd).trace(h, p).lower(lowering_platforms=("cuda",)).as_text()
    assert not re.search(r"ragged_dot", cuda)


def test_the_ragged_dispatch_carries_the_variants(variant, monkeypatch):
    """The GPU/TPU transport (`ragged_all_to_all`, emulated here as in
    tests/test_moe_dispatch.py) at ep x tp = 2 x 2: transformers' output, and the input's
    and every weight's gradients those of the dense reference (the biases' included)."""
    from distill import collectives as cc
    from distill.models import attention
    from distill.models.experts import dispatch
    from tests.test_moe_dispatch import _emulated_ragged

    monkeypatch.setattr(attention, "_platform", "gpu")
    monkeypatch.setattr(cc, "ragged_all_to_all", _emulated_ragged)
    assert dispatch.kind() == "ragged"
    name, cfg, p, h, want, _ = variant
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (EP, TP))
    specs = {k: P(*teacher_sharding.LAYER_SPECS[k][1:]) for k in p}
    layer = jax.shard_map(
        lambda h, p: moe.moe_ffn(h, p, cfg, tp_axis=TP, ep_axis=EP, kernel="tiled")[0],
        mesh=mesh, in_specs=(P(EP), specs), out_specs=P(EP),
    )  # fmt: skip

    def run(h, p):
        return layer(h, p), jax.grad(lambda h, p: _probe(layer(h, p)), (0, 1))(h, p)

    got, (dh, dp) = jax.jit(run)(h, p)
    want_dh, want_dp = jax.grad(lambda h, p: _probe(_dense_reference(h, p, cfg)), (0, 1))(h, p)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(dh), np.asarray(want_dh), atol=1e-4, rtol=1e-4)
    for k in p:
        np.testing.assert_allclose(
            np.asarray(dp[k]), np.asarray(want_dp[k]), atol=1e-4, rtol=1e-4, err_msg=k
        )


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_the_plan_passes_the_variants_moe_flops_check(name):
    """`distill plan`'s compiled-FLOPs check (the `teacher.moe_allow_ungrouped` refusal)
    on a tiny teacher of the variant at ep = 1: its compiled forward within the bound of
    the model's FLOPs per token, so the check passes without being told to."""
    from distill.mesh import teacher_mesh
    from pipelines.plan import flops as plan_flops
    from pipelines.plan import memory as plan_memory
    from tests.test_plan import _moe_config

    cfg = _moe_config()
    cfg.mesh.teacher.ep = 1
    variant = dict(VARIANTS[name][3])
    if name == "deepseek_v3":  # 4 experts here: two groups of two, one kept
        variant.update(n_group=2, topk_group=1)
    cfg.teacher.model = ModelConfig(**{**cfg.teacher.model.model_dump(), **variant})
    mem, _ = plan_memory.teacher_memory(cfg, teacher_mesh(jax.devices()[:1], 1, 1, 1), None)
    want = counts.flops_per_token(cfg.teacher.model, cfg.train.seq_len)
    assert 0.8 * want <= mem["compiled_flops_per_token"] <= plan_flops.LIMIT * want
    assert not cfg.teacher.moe_allow_ungrouped
    plan_flops.check_moe(cfg, mem)
