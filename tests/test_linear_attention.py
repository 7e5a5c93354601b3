"""The gated delta rule (`distill.models.linear_attention`): the chunked form equals the
per-token recurrence (chunks that do not divide the row, several documents, a carried
state), both equal transformers' torch fallbacks, a packed row equals its documents run
as separate rows (state and convolution window reset), and the whole linear-attention
layer equals transformers' `Qwen3_5GatedDeltaNet`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.config import ModelConfig
from distill.models import linear_attention as la

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_q35  # noqa: E402

B, H, DK, DV = 2, 3, 8, 6


def _inputs(s, seed=0, h=H):
    r = np.random.default_rng(seed)
    q = r.normal(size=(B, s, h, DK)).astype(np.float32)
    k = r.normal(size=(B, s, h, DK)).astype(np.float32)
    v = r.normal(size=(B, s, h, DV)).astype(np.float32)
    g = -np.exp(r.normal(size=(B, s, h))).astype(np.float32) * 0.5  # log decays, some strong
    beta = (1 / (1 + np.exp(-r.normal(size=(B, s, h))))).astype(np.float32)
    return q, k, v, g, beta


def _docs(lengths_per_row, s):
    seg = np.zeros((B, s), np.int32)
    for row, lengths in enumerate(lengths_per_row):
        pos = 0
        for i, n in enumerate(lengths):
            seg[row, pos : pos + n] = i + 1
            pos += n
        seg[row, pos:] = 0  # padding: one more segment
    return jnp.asarray(seg)


@pytest.mark.parametrize("s, chunk", [(37, 8), (16, 16), (5, 64)])
def test_chunked_equals_recurrence(s, chunk):
    q, k, v, g, beta = _inputs(s)
    q, k = la.prepare_qk(jnp.asarray(q), jnp.asarray(k), H)
    docs = la.doc_index(_docs([[10, 20, 7], [3, 30]], s)[:, :s])
    state0 = jnp.asarray(np.random.default_rng(1).normal(size=(B, H, DK, DV)), jnp.float32)
    want_o, want_s = la.recurrent_gated_delta_rule(q, k, v, g, beta, docs, state0)
    got_o, got_s = jax.jit(la.gated_delta_rule, static_argnames="chunk")(
        q, k, v, g, beta, docs, state0, chunk=chunk
    )
    np.testing.assert_allclose(got_o, want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got_s, want_s, atol=2e-5, rtol=1e-4)


def test_rule_equals_transformers():
    """Both forms against transformers' torch_chunk_gated_delta_rule and
    torch_recurrent_gated_delta_rule (its L2 norm in the kernel), with grouped heads (one
    query/key head per two value heads) and an initial state."""
    s = 70
    q, k, v, g, beta = _inputs(s, seed=2, h=4)
    q, k = q[:, :, :2], k[:, :, :2]
    state0 = np.random.default_rng(3).normal(size=(B, 4, DK, DV)).astype(np.float32)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
    args = dict(initial_state=t(state0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_c, want_cs = hf_q35.torch_chunk_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta), **args
    )
    want_r, _ = hf_q35.torch_recurrent_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta), **args
    )
    qq, kk = la.prepare_qk(jnp.asarray(q), jnp.asarray(k), 4)
    got_c, got_cs = la.gated_delta_rule(qq, kk, v, g, beta, None, state0)
    got_r, _ = la.recurrent_gated_delta_rule(qq, kk, v, g, beta, None, state0)
    np.testing.assert_allclose(got_c, want_c.numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got_cs, want_cs.numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got_r, want_r.numpy(), atol=2e-5, rtol=1e-4)


def _hf_config(**kw):
    keys = dict(
        vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
        linear_num_value_heads=4, rms_norm_eps=1e-6,
    )  # fmt: skip
    return transformers.Qwen3_5TextConfig(**(keys | kw))


def _cfg(hf_cfg) -> ModelConfig:
    return ModelConfig(
        vocab_size=hf_cfg.vocab_size, d_model=hf_cfg.hidden_size, n_layers=1, n_heads=2,
        n_kv_heads=1, head_dim=8, linear_k_heads=hf_cfg.linear_num_key_heads,
        linear_v_heads=hf_cfg.linear_num_value_heads, linear_k_dim=hf_cfg.linear_key_head_dim,
        linear_v_dim=hf_cfg.linear_value_head_dim,
        linear_conv_kernel=hf_cfg.linear_conv_kernel_dim, norm_eps=hf_cfg.rms_norm_eps,
        layer_types=("linear",),
    )  # fmt: skip


def layer_weights(hf_layer, cfg: ModelConfig) -> dict:
    """distill's weights of one transformers `Qwen3_5GatedDeltaNet`."""
    sd = {k: v.detach().numpy() for k, v in hf_layer.state_dict().items()}
    qk = cfg.linear_k_heads * cfg.linear_k_dim
    qkv, conv = sd["in_proj_qkv.weight"].T, sd["conv1d.weight"]
    return {
        "lin_wq": qkv[:, :qk], "lin_wk": qkv[:, qk : 2 * qk], "lin_wv": qkv[:, 2 * qk :],
        "lin_conv_q": conv[:qk], "lin_conv_k": conv[qk : 2 * qk], "lin_conv_v": conv[2 * qk :],
        "lin_wz": sd["in_proj_z.weight"].T, "lin_wb": sd["in_proj_b.weight"].T,
        "lin_wa": sd["in_proj_a.weight"].T, "lin_a_log": sd["A_log"],
        "lin_dt_bias": sd["dt_bias"], "lin_norm": sd["norm.weight"],
        "lin_wo": sd["out_proj.weight"].T,
    }  # fmt: skip


def _matmul(x, w):
    return x @ w


def test_layer_equals_transformers_and_packed_equals_separate():
    """The whole layer (projections, convolution, rule, gated norm, output projection) on
    a packed row of three documents equals transformers' layer on each document alone,
    with the document lengths straddling the chunk and the convolution's kernel."""
    torch.manual_seed(0)
    hf_cfg = _hf_config()
    layer = hf_q35.Qwen3_5GatedDeltaNet(hf_cfg, 0).eval()
    with torch.no_grad():  # norms and decays away from their init, so they count
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.uniform_(-1, 1)
    cfg = _cfg(hf_cfg)
    w = {k: jnp.asarray(v) for k, v in layer_weights(layer, cfg).items()}
    lengths = [2, 70, 9]
    x = np.random.default_rng(0).normal(size=(1, sum(lengths), 24)).astype(np.float32)
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)

    def run(h, s):
        o, _ = la.mixer(w, h, s, cfg, _matmul)
        return o @ w["lin_wo"]

    got = np.asarray(jax.jit(run)(jnp.asarray(x), seg))
    start = 0
    for n in lengths:
        with torch.no_grad():
            want = layer(torch.from_numpy(x[:, start : start + n])).numpy()
        np.testing.assert_allclose(got[:, start : start + n], want, atol=3e-5, rtol=1e-4)
        start += n


def test_decode_steps_continue_prefill():
    """A prefill's cache then one-token recurrent steps give the outputs of the whole row
    in chunked form (state and convolution tail carried)."""
    torch.manual_seed(1)
    hf_cfg = _hf_config()
    layer = hf_q35.Qwen3_5GatedDeltaNet(hf_cfg, 0).eval()
    cfg = _cfg(hf_cfg)
    w = {k: jnp.asarray(v) for k, v in layer_weights(layer, cfg).items()}
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, 24)), jnp.float32)
    zeros = jnp.zeros((2, 12), jnp.int32)
    whole, _ = la.mixer(w, x, zeros, cfg, _matmul)
    cache = la.empty_cache(cfg, 2, cfg.linear_v_heads, jnp.float32)
    pre, cache = la.mixer(w, x[:, :7], zeros[:, :7], cfg, _matmul, cache)
    steps = [pre]
    for t in range(7, 12):
        o, cache = la.mixer(w, x[:, t : t + 1], zeros[:, :1], cfg, _matmul, cache, chunked=False)
        steps.append(o)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), whole, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("platform, low, high", [("gpu", 1 / 1.5, 1.5), ("cpu", 2.0, 3.0)])
def test_chunked_rule_flops_near_analytic(platform, low, high, monkeypatch):
    """XLA's cost analysis of the compiled chunked rule is within 1.5x of `rule_flops` as
    built for a GPU or TPU (`solve_unit_lower` a triangular solve; the chunk scan unrolled:
    the analysis counts a loop's body once); on CPU, where the solve is the inverse by
    squarings, 2-3x (2.7 measured): more FLOPs, far less time (`solve_unit_lower`)."""
    from distill.models import attention

    monkeypatch.setattr(attention, "_platform", platform)
    b, s, h, dk, dv = 1, 1024, 4, 64, 64
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (spec(b, s, h, dk), spec(b, s, h, dk), spec(b, s, h, dv), spec(b, s, h), spec(b, s, h))
    rule = functools.partial(la.gated_delta_rule, unroll=True)
    compiled = jax.jit(rule).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ratio = cost["flops"] / la.rule_flops(b, s, h, dk, dv)
    assert low <= ratio <= high, ratio
