"""The tensor-parallel teacher forward equals the single-device model."""

import jax
import numpy as np
import pytest

from distill.config import ModelConfig
from distill.mesh import teacher_mesh
from distill.models import counts, model
from distill.types import Batch
from teacher.forward import make_forward
from teacher.sharding import shard_params


def _batch(b=2, s=12, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, s)).astype(np.int32)
    seg = np.array([[1] * 7 + [2] * 5] + [[1] * s] * (b - 1), np.int32)
    pos = np.array([list(range(7)) + list(range(5))] + [list(range(s))] * (b - 1), np.int32)
    return Batch(tokens, tokens, seg, pos, np.ones((b, s), np.float32))


def _mesh(tp):
    return teacher_mesh(jax.devices()[:tp], 1, tp)


CASES = [  # (tp, n_heads, n_kv_heads, tie)
    (4, 4, 4, False),  # one KV head per shard
    (4, 8, 2, False),  # fewer KV heads than tp: replicated per shard
    (2, 4, 1, True),  # multi-query, tied embeddings
    (8, 8, 8, False),
]


@pytest.mark.parametrize("tp,n_heads,n_kv,tie", CASES)
def test_tp_forward_matches_single_device(tp, n_heads, n_kv, tie):
    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=8,
        d_ff=48,
        tie_embeddings=tie,
    )
    params, batch = model.init_params(cfg, 1), _batch()
    ref = np.asarray(model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions))
    sharded = shard_params(params, cfg, _mesh(tp))
    assert sharded["layers"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
    out = make_forward(cfg, _mesh(tp), mode="logits")(sharded, batch)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)

    t = 2.0
    ref_lp = np.asarray(jax.nn.log_softmax(ref / t))
    dense = make_forward(cfg, _mesh(tp), mode="dense", temperature=t)(sharded, batch)
    assert dense.ids is None
    np.testing.assert_allclose(np.asarray(dense.logprobs), ref_lp, atol=2e-5)

    k = 5
    top = make_forward(cfg, _mesh(tp), mode="topk", temperature=t, top_k=k)(sharded, batch)
    ref_vals, ref_ids = jax.lax.top_k(ref_lp, k)
    np.testing.assert_allclose(np.asarray(top.logprobs), np.asarray(ref_vals), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(top.ids), np.asarray(ref_ids))
    assert top.logprobs.shape == (2, 12, k)


def test_attention_does_not_cross_documents():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    params, batch = model.init_params(cfg, 0), _batch(b=1)
    full = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    # The second document alone, at the same positions, gives the same logits.
    second = model.apply(
        cfg, params, batch.tokens[:, 7:], batch.segment_ids[:, 7:], batch.positions[:, 7:]
    )
    np.testing.assert_allclose(np.asarray(full[:, 7:]), np.asarray(second), atol=1e-5)


def test_bfloat16_forward_close_to_float32():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    params, batch = model.init_params(cfg, 0), _batch()
    f32 = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    bf16 = model.apply(
        cfg, params, batch.tokens, batch.segment_ids, batch.positions, dtype="bfloat16"
    )
    assert bf16.dtype == np.float32
    np.testing.assert_allclose(np.asarray(bf16), np.asarray(f32), atol=0.05)


def test_flops_and_params():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    n = counts.param_count(cfg)
    assert n == sum(x.size for x in jax.tree.leaves(model.init_params(cfg, 0)))
    assert counts.flops_per_token(cfg, 16) > 2 * (n - 64 * 32 - 5 * 32)
