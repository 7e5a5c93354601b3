"""The inference mesh dp x tp and teacher microbatches: every layout gives the single-device
teacher's outputs, batch-major with rows split over the mesh (a run on dp=2 x tp=2 in
microbatches of one row: tests/test_cli.py)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from distill.config import ModelConfig
from distill.mesh import teacher_mesh
from distill.models import model
from distill.types import Batch
from teacher.forward import make_forward
from teacher.sharding import batch_sharding, shard_params

CFG = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=48,
    attention="reference",
)
T, K = 2.0, 5


def _batch(b, s=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (b, s)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[0, 7:] = 2  # two documents in the first row
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    pos[0, 7:] -= 7
    return Batch(tokens, tokens, seg, pos, np.ones((b, s), np.float32))


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, 1)


def _reference(params, batch):
    logits = np.asarray(model.apply(CFG, params, batch.tokens, batch.segment_ids, batch.positions))
    logprobs = np.asarray(jax.nn.log_softmax(logits / T))
    values, ids = jax.lax.top_k(logprobs, K)
    return logits, logprobs, np.asarray(values), np.asarray(ids)


LAYOUTS = [  # (dp, tp, microbatch, rows); tests/test_model.py checks dp=1 x tp=1..8
    (2, 2, None, 8),
    (4, 1, None, 8),
    (2, 2, 1, 8),
    (2, 2, 2, 12),  # 6 rows per group, 3 microbatches of 2
    (2, 2, 1, 6),  # 3 rows per group do not split over tp: rows over dp, replicated over tp
]


@pytest.mark.parametrize("dp,tp,micro,rows", LAYOUTS)
def test_layout_matches_single_device(params, dp, tp, micro, rows):
    mesh = teacher_mesh(jax.devices()[: dp * tp], dp, tp)
    sharded = shard_params(params, CFG, mesh)
    assert sharded["layers"]["wq"].sharding.spec == P(None, None, "tp")  # replicated over dp
    batch = jax.device_put(_batch(rows), batch_sharding(mesh))
    logits, logprobs, values, ids = _reference(params, _batch(rows))

    kw = {"temperature": T, "microbatch": micro}
    out = {
        "logits": make_forward(CFG, mesh, mode="logits", microbatch=micro)(sharded, batch),
        "dense": make_forward(CFG, mesh, mode="dense", **kw)(sharded, batch),
        "topk": make_forward(CFG, mesh, mode="topk", top_k=K, **kw)(sharded, batch),
    }
    np.testing.assert_allclose(np.asarray(out["logits"]), logits, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["dense"].logprobs), logprobs, atol=2e-5)
    assert out["dense"].ids is None
    np.testing.assert_allclose(np.asarray(out["topk"].logprobs), values, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(out["topk"].ids), ids)

    # batch-major: every device holds whole rows [r, S, V or k], rows split over the mesh
    per_device = rows // (dp * tp) if (rows // dp) % tp == 0 else rows // dp
    for x in (out["logits"], out["dense"].logprobs, out["topk"].logprobs, out["topk"].ids):
        shapes = {s.data.shape for s in x.addressable_shards}
        assert shapes == {(per_device, *x.shape[1:])}, shapes


def test_microbatches_bound_the_forward_memory(params):
    """The compiled forward's temporaries shrink with the microbatch (one at a time)."""
    mesh = teacher_mesh(jax.devices()[:2], 2, 1)
    sharded = shard_params(params, CFG, mesh)
    batch = jax.device_put(_batch(16, s=64), batch_sharding(mesh))

    def temp_bytes(micro):
        fwd = make_forward(CFG, mesh, mode="topk", top_k=K, microbatch=micro)
        return fwd.lower(sharded, batch).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(1) < temp_bytes(None) / 2


@pytest.mark.parametrize("dp,tp", [(2, 2), (1, 4)])
def test_positions_in_chunks_match_single_device(params, monkeypatch, dp, tp):
    """The logits formed 5 positions at a time (12 = 5 + 5 + a last chunk shifted back to
    end at 12), on a vocabulary padded past the tokenizer's: equal to the whole-sequence
    single-device teacher in every mode (the targets' log-probs too)."""
    import teacher.forward as forward

    monkeypatch.setattr(forward, "default_chunk", lambda vocab, rows: 5)
    limit = 50
    mesh = teacher_mesh(jax.devices()[: dp * tp], dp, tp)
    sharded = shard_params(params, CFG, mesh)
    batch = jax.device_put(_batch(8), batch_sharding(mesh))
    ref = _batch(8)
    logits = np.array(model.apply(CFG, params, ref.tokens, ref.segment_ids, ref.positions))
    logits[..., limit:] = -np.inf
    logprobs = np.asarray(jax.nn.log_softmax(logits / T))
    values, ids = jax.lax.top_k(logprobs, K)

    kw = {"temperature": T, "vocab_limit": limit}
    got = make_forward(CFG, mesh, mode="logits", vocab_limit=limit)(sharded, batch)
    np.testing.assert_allclose(np.asarray(got), logits, atol=2e-5, rtol=1e-5)
    dense = make_forward(CFG, mesh, mode="dense", **kw)(sharded, batch)
    np.testing.assert_allclose(np.asarray(dense.logprobs), logprobs, atol=2e-5)
    topk = make_forward(CFG, mesh, mode="topk", top_k=K, **kw)(sharded, batch)
    np.testing.assert_allclose(np.asarray(topk.logprobs), np.asarray(values), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(topk.ids), np.asarray(ids))
    # the targets' log-probs alone (`distill score`, on-policy scoring); some are padded ids
    picked = make_forward(CFG, mesh, mode="target_logprobs", **kw)(sharded, batch)
    want = np.take_along_axis(logprobs, ref.targets[..., None], axis=-1)[..., 0]
    assert np.isneginf(want).any() and np.isfinite(want).any()
    np.testing.assert_allclose(np.asarray(picked), want, atol=2e-5)


def test_chunks_bound_the_top_k_memory(monkeypatch):
    """The top-k forward never holds the [rows, S, V] logits: with 32-position chunks of a
    4,096-id vocabulary its temporaries are smaller than one copy of them, which the
    whole-sequence forward does hold."""
    import teacher.forward as forward

    cfg = CFG.model_copy(update={"vocab_size": 4096})
    mesh = teacher_mesh(jax.devices()[:1], 1, 1)
    sharded = shard_params(model.init_params(cfg, 0), cfg, mesh)
    batch = jax.device_put(_batch(2, s=256), batch_sharding(mesh))

    def temp_bytes(chunk):
        monkeypatch.setattr(forward, "default_chunk", lambda vocab, rows: chunk)
        fwd = make_forward(cfg, mesh, mode="topk", top_k=K)
        return fwd.lower(sharded, batch).compile().memory_analysis().temp_size_in_bytes

    whole = 2 * 256 * 4096 * 4  # one float32 copy of the logits
    assert temp_bytes(32) < whole <= temp_bytes(256)
