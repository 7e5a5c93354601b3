"""The teacher forward in bfloat16 against float32, per family, on models whose logits have
a trained model's magnitudes.

A tiny model initialised as `model.init_params` does has logits near zero, where rounding
the hidden states or the logits to bfloat16 changes almost nothing. Here every weight is
scaled as a trained model's is (each projection ~1/sqrt(fan_in), norm scales around 1), and
the LM head so that logits have a standard deviation of about 6 over the vocabulary: they
span roughly +-20 and the softmax is peaked (the top token holds most of the mass), as in a
trained model. On such a model the float32 and bfloat16 teacher forwards are compared on
what distillation consumes: the log-probability of each target token and the distribution
as a whole (KL), within tolerances measured with margin.

End to end, bfloat16's rounding through the blocks (about 0.07 mean |delta log p| here)
hides smaller defects: logits formed in bfloat16 move the figure by 2-11%, norms
computed in bfloat16 by 30-50%. The head is therefore checked on its own as well: on the
bfloat16 forward's own hidden states its log-probs equal float64 math to about 1e-6, where
logits formed in bfloat16 err by 0.02-0.03.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.config import ModelConfig
from distill.mesh import teacher_mesh
from distill.models import model
from distill.types import Batch
from teacher.forward import make_forward
from teacher.sharding import shard_params

# Measured over these five families (seed 0; docs/guides/model-families.md): mean |delta
# log p| of the target tokens 0.059-0.074, mean KL(float32 || bfloat16) 3.0e-4-1.2e-3 nats
# per position. The stated tolerances are about 1.6x the worst of them.
MEAN_ABS_LOGP = 0.12
MEAN_KL = 2.5e-3
# The head alone, on the bfloat16 forward's hidden states, against float64 math: measured
# 5.5e-7-8.1e-7 mean |delta log p|; logits formed in bfloat16 give 0.017-0.034.
HEAD_MEAN_ABS_LOGP = 1e-3

SHAPE = dict(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128)
GEMMA = dict(norm_offset=1.0, post_norms=True, activation="gelu_tanh", embed_scale=True)
LOCAL_GLOBAL = dict(sliding_window=16, layer_types=("sliding", "full", "sliding", "full"))
FAMILIES = {
    "llama": {},
    "qwen2": dict(family="qwen2", qkv_bias=True, tie_embeddings=True, rope_theta=1e6),
    "qwen3": dict(family="qwen3", qk_norm=True, head_dim=32, rope_theta=1e6),
    "gemma2": dict(
        family="gemma2",
        head_dim=32,
        query_scale=32**-0.5,
        attn_softcap=50.0,
        final_softcap=30.0,
        tie_embeddings=True,
        **GEMMA,
        **LOCAL_GLOBAL,
    ),  # fmt: skip
    "gemma3": dict(
        family="gemma3_text",
        head_dim=32,
        query_scale=32**-0.5,
        qk_norm=True,
        rope_local_theta=1e4,
        tie_embeddings=True,
        **GEMMA,
        **LOCAL_GLOBAL,
    ),  # fmt: skip
}
LOGIT_STD = 6.0
POST_NORM = 4.0


def realistic_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Parameters with a trained model's magnitudes: matrices ~ N(0, 1/fan_in), norm scales
    1 + N(0, 0.1^2) (stored as weight - offset), biases ~ N(0, 0.1^2), and the LM head (the
    embedding when tied) scaled so the logits have a standard deviation of about
    `LOGIT_STD` (the final norm makes the hidden states' RMS about 1)."""
    params = model.init_params(cfg, seed)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))

    def draw(name, x):
        noise = jax.random.normal(next(keys), x.shape, jnp.float32)
        if name.startswith("post_"):  # Gemma: blocks add as much as the scaled embedding
            return POST_NORM - cfg.norm_offset + 0.1 * noise
        if "norm" in name:
            return 1.0 - cfg.norm_offset + 0.1 * noise
        if name.startswith("b"):
            return 0.1 * noise
        if name in ("embed", "lm_head"):
            return noise * LOGIT_STD / np.sqrt(cfg.d_model)
        return noise / np.sqrt(x.shape[-2])  # [L, fan_in, fan_out]

    layers = {k: draw(k, v) for k, v in params["layers"].items()}
    top = {k: draw(k, v) for k, v in params.items() if k != "layers"}
    return {**top, "layers": layers}


def _batch(b=4, s=64, vocab=256, seed=0) -> Batch:
    tokens = np.random.default_rng(seed).integers(0, vocab, (b, s + 1)).astype(np.int32)
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    ones = np.ones((b, s), np.int32)
    return Batch(tokens[:, :-1], tokens[:, 1:], ones, pos, ones.astype(np.float32))


def _logprobs(cfg, params, batch, dtype, tp=2):
    mesh = teacher_mesh(jax.devices()[:tp], 1, tp)
    forward = make_forward(cfg, mesh, mode="dense", dtype=dtype)
    return np.asarray(forward(shard_params(params, cfg, mesh), batch).logprobs)


def differences(f32, bf16, targets) -> tuple[float, float]:
    """(mean |delta log p| of the target tokens, mean KL(f32 || bf16) per position)."""
    at = np.take_along_axis(f32 - bf16, targets[..., None], -1)
    kl = np.sum(np.exp(f32) * (f32 - bf16), -1)
    return float(np.mean(np.abs(at))), float(np.mean(kl))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, config, realistic parameters, batch, float32 log-probs)."""
    cfg = ModelConfig(**SHAPE, **FAMILIES[request.param], attention="blockwise")
    params, batch = realistic_params(cfg), _batch()
    return request.param, cfg, params, batch, _logprobs(cfg, params, batch, "float32")


def test_the_models_logits_are_realistic(family):
    """Logits of a trained model's size: spread over about +-20, a peaked softmax."""
    name, _, _, _, f32 = family
    logits = f32 - f32.mean(-1, keepdims=True)  # log-probs up to a constant per position
    assert 4.0 < logits.std(-1).mean() < 9.0, name
    assert np.percentile(np.ptp(logits, -1), 50) > 30.0, name
    assert np.exp(f32.max(-1)).mean() > 0.5, name  # the top token holds most of the mass


def test_bfloat16_is_within_the_stated_tolerance_of_float32(family):
    name, cfg, params, batch, f32 = family
    bf16 = _logprobs(cfg, params, batch, "bfloat16")
    abs_logp, kl = differences(f32, bf16, batch.targets)
    assert abs_logp < MEAN_ABS_LOGP and kl < MEAN_KL, (name, abs_logp, kl)
    assert abs_logp > 1e-4, name  # the bfloat16 forward did run in bfloat16


def _bf16_logits(x, head, cap=None):
    """The defect the head check must catch: logits that come out of the matmul in
    bfloat16 (accumulating in bfloat16 errs at least as much)."""
    z = jnp.einsum("bsd,dv->bsv", x, head.astype(x.dtype), preferred_element_type=x.dtype)
    return model.softcap(z.astype(jnp.float32), cap)


def test_the_head_forms_logits_in_float32(family):
    """On the bfloat16 forward's own hidden states, `model.logits` equals float64 math on
    the same bfloat16 values (up to float32 accumulation order), and the same check fails
    for logits formed in bfloat16."""
    name, cfg, params, batch, _ = family
    args = (batch.tokens, batch.segment_ids, batch.positions)
    x, head = model.apply_hidden(cfg, params, *args, dtype="bfloat16")
    exact = np.asarray(x, np.float64) @ np.asarray(head.astype(jnp.bfloat16), np.float64)
    want = _logsoftmax(model.softcap(jnp.asarray(exact, jnp.float32), cfg.final_softcap))
    got = _logsoftmax(model.logits(x, head, cfg.final_softcap))
    bad = _logsoftmax(_bf16_logits(x, head, cfg.final_softcap))
    assert differences(want, got, batch.targets)[0] < HEAD_MEAN_ABS_LOGP, name
    assert differences(want, bad, batch.targets)[0] > HEAD_MEAN_ABS_LOGP, name


def _logsoftmax(z):
    return np.asarray(jax.nn.log_softmax(z, -1))
