"""KV-cache sampling (`distill.models.decode`) against the model's full forward, and the student's
sampler on the training mesh (`student.generate`) against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from distill.config import ModelConfig
from distill.mesh import DP, FSDP
from distill.models import decode, model
from distill.types import Continuations, Prompts
from student import train
from student.generate import ParamHistory, Sampler

CFG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, attention="reference"
)


def _prompts():
    """Three rows of 6 prompt tokens: one document; a document boundary; left padding."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 64, (3, 6)).astype(np.int32)
    seg = np.array([[1] * 6, [1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1]], np.int32)
    pos = np.array([[0, 1, 2, 3, 4, 5], [7, 8, 0, 1, 2, 3], [0, 0, 0, 1, 2, 3]], np.int32)
    return Prompts(jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos))


def _greedy_without_cache(params, prompts, n):
    """Each row's last document grown one argmax token at a time by the full forward (a
    fixed length, zero-padded: attention is causal, so the padding is never read)."""
    full = jax.jit(lambda ids, pos: model.apply(CFG, params, ids, jnp.ones_like(ids), pos))
    out = []
    for b in range(prompts.tokens.shape[0]):
        seg = np.asarray(prompts.segment_ids[b])
        doc = seg == seg[-1]
        ids = list(np.asarray(prompts.tokens[b])[doc])
        first = int(np.asarray(prompts.positions[b])[doc][0])
        length = len(ids) + n
        for _ in range(n):
            k = len(ids)
            padded = jnp.array([ids + [0] * (length - k)])
            logits = full(padded, jnp.arange(first, first + length)[None])
            ids.append(int(jnp.argmax(logits[0, k - 1])))
        out.append(ids[-n:])
    return np.array(out)


@pytest.mark.parametrize("attention", ["reference", "blockwise"])
def test_greedy_decoding_equals_the_full_forward(attention):
    cfg = CFG.model_copy(update={"attention": attention})
    params = model.init_params(cfg, 0)
    prompts = _prompts()
    tokens, valid, _ = jax.jit(
        lambda p, pr: decode.generate(
            cfg, p, pr, jax.random.key(0), max_new_tokens=5, temperature=0
        )
    )(params, prompts)
    np.testing.assert_array_equal(np.asarray(tokens), _greedy_without_cache(params, prompts, 5))
    assert bool(jnp.all(valid))


def test_sampling_is_a_function_of_the_key_and_never_draws_padded_ids():
    params = model.init_params(CFG, 1)
    run = jax.jit(
        lambda key: decode.generate(
            CFG, params, _prompts(), key, max_new_tokens=12, temperature=1.5, vocab_limit=40
        )[0]
    )
    a, b, c = run(jax.random.key(3)), run(jax.random.key(3)), run(jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    assert int(jnp.max(a)) < 40


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws, _ = jax.vmap(
        lambda k: decode.sample(logits, k, temperature=1.0, top_p=0.7, vocab_limit=None)
    )(jax.random.split(jax.random.key(0), 400))
    assert set(np.unique(np.asarray(draws))) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3


def test_a_row_stops_at_a_stop_id_and_its_rest_is_padding():
    params = model.init_params(CFG, 0)
    prompts = _prompts()
    free, _, _ = decode.generate(
        CFG, params, prompts, jax.random.key(0), max_new_tokens=6, temperature=0
    )
    stop = int(free[0, 2])  # row 0's third token becomes a stop id
    tokens, valid, _ = decode.generate(
        CFG, params, prompts, jax.random.key(0), max_new_tokens=6, temperature=0, stop_ids=(stop,)
    )
    first = int(np.argmax(np.asarray(tokens[0]) == stop))
    assert first <= 2 and bool(jnp.all(valid[0, : first + 1]))
    assert not bool(jnp.any(valid[0, first + 1 :])) and not bool(jnp.any(tokens[0, first + 1 :]))


def test_continuation_rows_mask_only_generated_targets():
    prompts = _prompts()
    gen = jnp.array([[10, 11, 12], [20, 21, 2], [30, 31, 32]], jnp.int32)
    valid = jnp.array([[1, 1, 1], [1, 1, 1], [1, 0, 0]], bool)
    rows = decode.continuation_batch(prompts, gen, valid, seq_len=10)
    assert isinstance(rows, Continuations) and rows.tokens.shape == (3, 10)
    np.testing.assert_array_equal(rows.tokens[0, :9], [*prompts.tokens[0], 10, 11, 12])
    np.testing.assert_array_equal(rows.targets[0, 5:8], [10, 11, 12])
    np.testing.assert_array_equal(rows.mask[0], [0, 0, 0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(rows.mask[2], [0, 0, 0, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(rows.positions[1, 6:9], [4, 5, 6])  # the last doc goes on
    np.testing.assert_array_equal(rows.segment_ids[1, 6:9], [2, 2, 2])
    np.testing.assert_array_equal(rows.segment_ids[2, 7:], [0, 0, 0])


def _mesh(dp, fsdp):
    return Mesh(np.array(jax.devices()[: dp * fsdp]).reshape(dp, fsdp), (DP, FSDP))


def test_sampler_on_the_training_mesh_equals_one_device():
    """dp=2 x fsdp=2 (parameters fully sharded) against a single-device sampler."""
    cfg = CFG.model_copy(update={"attention": "blockwise"})
    params = model.init_params(cfg, 0)
    prompts = Prompts(*(jnp.tile(x, (4, 1))[:8] for x in _prompts()))
    kw = dict(seq_len=16, max_new_tokens=8, temperature=1.0, top_p=0.9, stop=(2,),
              vocab_limit=60, dtype="float32")  # fmt: skip
    one = _mesh(1, 1)
    four = _mesh(2, 2)
    tx = optax.sgd(0.1)
    placed = jax.device_put(params, train.state_shardings(cfg, tx, four).params)
    key = jax.random.key(7)
    ref, s_ref = Sampler(cfg, one, **kw)(params, prompts, key)
    got, s_got = Sampler(cfg, four, **kw)(placed, prompts, key)
    assert int(s_ref["tokens"]) == int(s_got["tokens"])
    assert float(s_got["logp"]) == pytest.approx(float(s_ref["logp"]), rel=1e-5)
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sample_log_probs_are_the_models_own_on_the_continuation_rows():
    """The summed log-probabilities the sampler returns (temperature 1) equal those of the
    full forward on the rows it made, at the generated targets: the student's own NLL of
    its samples, which the evaluation's sample_kl subtracts from the teacher's."""
    params = model.init_params(CFG, 2)
    tokens, valid, logp = decode.generate(
        CFG, params, _prompts(), jax.random.key(5), max_new_tokens=7, temperature=1.0,
        vocab_limit=60,
    )  # fmt: skip
    rows = decode.continuation_batch(_prompts(), tokens, valid, seq_len=14)
    logits = model.apply(CFG, params, rows.tokens, rows.segment_ids, rows.positions)
    logits = jnp.where(jnp.arange(64) < 60, logits, -jnp.inf)
    full = jnp.take_along_axis(jax.nn.log_softmax(logits), rows.targets[..., None], -1)[..., 0]
    expected = jnp.sum(jnp.where(rows.mask > 0, full, 0.0))  # prompt ids may be padded ids
    assert float(jnp.sum(logp)) == pytest.approx(float(expected), rel=1e-5)


def test_param_history_keeps_the_recent_steps():
    h = ParamHistory(staleness=2, abstract_params=None)
    h.start(0, {"w": jnp.zeros(())}, None)
    for step in range(1, 5):
        h.record(step, {"w": jnp.full((), float(step))})
    assert [float(h.after(j)["w"]) for j in (2, 3, 4)] == [2.0, 3.0, 4.0]
    with pytest.raises(KeyError):
        h.after(1)
    assert sorted(h.extra(4)["recent_params"]) == ["2", "3"]
    fresh = ParamHistory(staleness=0, abstract_params=None)
    params = {"w": jnp.ones(())}
    fresh.start(5, params, None)
    assert fresh.after(5) is params and fresh.extra(5) is None
