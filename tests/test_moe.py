"""Mixtures of experts in the one model: tiny Mixtral, Qwen2-MoE (with its shared expert),
Qwen3-MoE (with a dense layer) and OLMoE models built by transformers (random weights,
saved to a temporary directory) give transformers' log-probabilities through distill's
teacher at ep=1, ep=2 and ep=2 x tp=2; the all-to-all dispatch equals a dense per-token
reference; a capacity factor drops the lowest-probability assignments of an over-full
expert; a short run distils an MoE teacher into a dense student."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from distill.config import ModelConfig  # noqa: E402
from distill.errors import DistillError  # noqa: E402
from distill.mesh import EP, teacher_mesh  # noqa: E402
from distill.models import hf, model, moe  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402
from tests.test_families import _save as save_family  # noqa: E402
from tests.test_hf import _batch, _hf_logits  # noqa: E402

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LIVE = 96

FAMILIES = {  # name: (transformers class prefix, config class, config keys)
    "mixtral": ("Mixtral", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_shared_expert": (
        "Qwen2Moe",
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
    ),
    "qwen3_moe_dense_layer_norm_topk": (
        "Qwen3Moe",
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            head_dim=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "olmoe_full_qk_norm": (
        "Olmoe",
        "OlmoeConfig",
        dict(num_experts=8, num_experts_per_tok=3, eos_token_id=2, pad_token_id=1),
    ),
}


def _save(path, name):
    return save_family(path, name, FAMILIES, COMMON)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, directory, its log-probs from transformers on the batch, the batch)."""
    path = tmp_path_factory.mktemp(request.param)
    ref = _save(path, request.param)
    batch = _batch(LIVE, b=4, s=12)
    logp = torch.log_softmax(torch.tensor(_hf_logits(ref, batch.tokens)), -1).numpy()
    return request.param, path, logp, batch


def _logprobs(logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


@pytest.mark.parametrize("ep, tp", [(1, 1), (2, 1), (2, 2)])
def test_teacher_logprobs_match_transformers(family, ep, tp):
    name, path, want, batch = family
    cfg = hf.read_model_config(path)
    mesh = teacher_mesh(jax.devices()[: ep * tp], 1, tp, ep)
    params = load_hf_teacher(path, cfg, mesh)
    assert params["layers"]["we_gate"].sharding.spec[1] == EP
    got = make_forward(cfg, mesh, mode="logits")(params, batch)
    np.testing.assert_allclose(_logprobs(got), want, atol=2e-4, rtol=1e-4, err_msg=name)


def test_config_reads_each_family(family):
    name, path, _, _ = family
    cfg = hf.read_model_config(path)
    assert cfg.n_experts == (8 if name.startswith("olmoe") else 4)
    assert cfg.norm_topk_prob == name.startswith(("mixtral", "qwen3"))  # Mixtral's always on
    assert cfg.qk_norm_full == name.startswith("olmoe")
    assert (cfg.f_shared, cfg.qkv_bias) == ((24, True) if name.startswith("qwen2") else (0, False))
    assert cfg.moe_layers() == ((True, False, True) if name.startswith("qwen3") else (True,) * 3)


def _reference_ffn(h_td, p, cfg):
    """Each token through its k experts, one at a time: the dense per-token reference."""
    weights, ids = moe.route(h_td, p, cfg)
    out = []
    for t in range(h_td.shape[0]):
        y = 0.0
        for w, e in zip(weights[t], ids[t], strict=True):
            g = jax.nn.silu(h_td[t] @ p["we_gate"][e]) * (h_td[t] @ p["we_up"][e])
            y = y + w * (g @ p["we_down"][e])
        out.append(y)
    return jnp.stack(out)


def _moe_params(cfg, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    d, e, f = cfg.d_model, cfg.n_experts, cfg.f_expert
    return {
        "router": jax.random.normal(keys[0], (d, e)),
        "we_gate": jax.random.normal(keys[1], (e, d, f)) * 0.3,
        "we_up": jax.random.normal(keys[2], (e, d, f)) * 0.3,
        "we_down": jax.random.normal(keys[3], (e, f, d)) * 0.3,
    }


@pytest.mark.parametrize("ep, factor", [(1, None), (2, None), (4, None), (2, 8.0)])
def test_dispatch_equals_the_per_token_reference(ep, factor):
    """The all-to-all dispatch over ep devices (each with its own rows) equals every token
    run through its experts directly, and the loads count every assignment; so does the
    capacity path's with room for every assignment (factor 8: 36 slots an expert)."""
    cfg = ModelConfig(d_model=16, n_experts=8, experts_per_token=3, d_ff_expert=8)
    p = _moe_params(cfg)
    h = jax.random.normal(jax.random.key(1), (4, 6, 16))
    want = _reference_ffn(h.reshape(-1, 16), p, cfg).reshape(4, 6, 16)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:ep]), (EP,))
    specs = {"router": jax.P(), **{k: jax.P(EP) for k in ("we_gate", "we_up", "we_down")}}

    def f(h, p):
        y, (load, dropped, _) = moe.moe_ffn(
            h, p, cfg, tp_axis=None, ep_axis=EP, capacity_factor=factor
        )
        return y, jax.lax.psum(load, EP), jax.lax.psum(dropped, EP)

    run = jax.shard_map(
        f, mesh=mesh, in_specs=(jax.P(EP), specs), out_specs=(jax.P(EP), jax.P(), jax.P())
    )
    y, load, dropped = jax.jit(run)(h, p)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert int(load.sum()) == 24 * 3 and int(dropped) == 0


def test_capacity_drops_the_lowest_probabilities_of_a_full_expert():
    """With capacity c per expert, an expert chosen by more tokens keeps the c of highest
    router probability; the dropped assignments contribute nothing."""
    cfg = ModelConfig(d_model=16, n_experts=4, experts_per_token=2, d_ff_expert=8)
    p = _moe_params(cfg, seed=3)
    h = jax.random.normal(jax.random.key(4), (1, 10, 16))
    factor = 0.8  # capacity ceil(0.8 * 10 * 2 / 4) = 4 per expert
    y, (load, dropped, _) = moe.moe_ffn(
        h, p, cfg, tp_axis=None, ep_axis=None, capacity_factor=factor
    )
    weights, ids = moe.route(h[0], p, cfg)
    keep = np.zeros(ids.shape, bool)
    for e in range(4):
        where = np.argwhere(np.asarray(ids) == e)
        probs = np.asarray(weights)[ids == e]
        for r in np.argsort(-probs, kind="stable")[:4]:
            keep[tuple(where[r])] = True
    assert int(dropped) == int((~keep).sum()) > 0
    want = []
    for t in range(10):
        acc = 0.0
        for j in range(2):
            if keep[t, j]:
                e, w, x = int(ids[t, j]), weights[t, j], h[0, t]
                g = jax.nn.silu(x @ p["we_gate"][e]) * (x @ p["we_up"][e])
                acc = acc + w * (g @ p["we_down"][e])
        want.append(acc * jnp.ones(16))
    np.testing.assert_allclose(np.asarray(y[0]), np.asarray(jnp.stack(want)), atol=1e-5)
    assert int(load.sum()) == 20


def test_student_model_matches_transformers(family):
    """The single-device model (no ep axis) on the same weights."""
    name, path, want, batch = family
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    got = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    np.testing.assert_allclose(_logprobs(got), want, atol=2e-4, rtol=1e-4, err_msg=name)


def test_ep_must_divide_the_experts():
    from teacher.sharding import check_divisible

    cfg = ModelConfig(n_experts=6)
    with pytest.raises(DistillError, match=r"teacher.model.n_experts: 6 .* mesh.teacher.ep=4"):
        check_divisible(cfg, 1, ep=4)
    with pytest.raises(DistillError, match=r"mesh.teacher.ep: 2 needs a mixture of experts"):
        check_divisible(ModelConfig(), 1, ep=2)


def test_qwen2_moe_config_keys():
    """Qwen2-MoE's config.json as transformers writes it: its dense layers from
    `decoder_sparse_step` and `mlp_only_layers`, its shared expert's width; windows whose
    layers it does not say, and a shared expert in another family, refused in one line."""
    raw = transformers.Qwen2MoeConfig(**COMMON, **FAMILIES["qwen2_moe_shared_expert"][2]).to_dict()
    assert hf.model_config_from_raw(raw, "c").dense_layers == ()
    cfg = hf.model_config_from_raw({**raw, "decoder_sparse_step": 2}, "c")
    assert (cfg.dense_layers, cfg.f_shared, cfg.f_expert) == ((0, 2), 24, 16)
    cfg = hf.model_config_from_raw({**raw, "mlp_only_layers": [2], "qkv_bias": False}, "c")
    assert (cfg.dense_layers, cfg.qkv_bias) == ((2,), False)
    no_types = {k: v for k, v in raw.items() if k != "layer_types"}
    with pytest.raises(DistillError, match=r"^c: use_sliding_window=True without layer_types"):
        hf.model_config_from_raw({**no_types, "use_sliding_window": True}, "c")
    qwen3 = transformers.Qwen3MoeConfig(**COMMON, num_experts=4).to_dict()
    with pytest.raises(DistillError, match=r"^c: shared_expert_intermediate_size=24 is not"):
        hf.model_config_from_raw({**qwen3, "shared_expert_intermediate_size": 24}, "c")
