"""distill.models.kernels.ring against the single-device reference, on the simulated CPUs.

Rows are packed (documents crossing chunk edges, trailing padding, one row whose first
document is a few tokens), heads grouped-query (4 query / 2 key-value), float32; chunks
of 12 tokens (cp = 4) or 24 (cp = 2) with kernel tiles of 8, so a chunk ends mid-tile
(the padded-tile path). Values and gradients wrt q, k and v must match
`attention(..., backend="reference")` on the whole row to 1e-6 of the largest reference
magnitude. Memory is XLA's compile-time analysis, nothing runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from distill.models.attention import attention
from distill.models.kernels.ring import (
    choose_exchange,
    cp_positions,
    from_cp_layout,
    ring_attention,
    to_cp_layout,
)

B, S, H, KV, HD = 2, 96, 4, 2, 8
AXIS = "cp"


def _segments() -> np.ndarray:
    seg = np.zeros((B, S), np.int32)
    seg[0, :21], seg[0, 21:40], seg[0, 40:77], seg[0, 77:88] = 1, 2, 3, 4  # then padding
    seg[1, :5], seg[1, 5:60], seg[1, 60:] = 7, 3, 9
    return seg


def _inputs():
    kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, S, H, HD), jnp.float32)
    k = jax.random.normal(kk, (B, S, KV, HD), jnp.float32)
    v = jax.random.normal(kv, (B, S, KV, HD), jnp.float32)
    w = jax.random.normal(kw, (B, S, H, HD), jnp.float32)  # a loss that weighs every output
    return q, k, v, w, jnp.asarray(_segments())


def _value_and_grads(attend):
    q, k, v, w, seg = _inputs()

    def loss(q, k, v):
        o = attend(q, k, v, seg)
        return jnp.sum(o * w), o

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x) for x in (out, *grads)]


def _context_parallel(cp: int, **kw):
    """Whole rows in, whole rows out: laid out, split over `cp` devices, attended, back."""
    mesh = Mesh(np.array(jax.devices()[:cp]), (AXIS,))
    sharded = jax.shard_map(
        lambda q, k, v, seg: ring_attention(q, k, v, seg, axis=AXIS, **kw),
        mesh=mesh,
        in_specs=P(None, AXIS),
        out_specs=P(None, AXIS),
    )

    def attend(q, k, v, seg):
        laid = [to_cp_layout(x, cp) for x in (q, k, v, seg)]
        return from_cp_layout(sharded(*laid), cp)

    return attend


@pytest.mark.parametrize(
    "cp, exchange, window, softcap",
    [(2, "ring", None, 2.0), (4, "ring", 20, 2.0), (4, "gather", 20, None)],
)
def test_matches_single_device_attention(cp, exchange, window, softcap):
    opts = dict(window=window, softcap=softcap)
    want = _value_and_grads(
        lambda q, k, v, seg: attention(q, k, v, seg, backend="reference", **opts)
    )
    got = _value_and_grads(_context_parallel(cp, exchange=exchange, block_q=8, block_kv=8, **opts))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err <= 1e-6, (name, err)


def test_layout_round_trips_and_balances_the_causal_work():
    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    for cp in (1, 2, 4):
        laid = to_cp_layout(x, cp)
        np.testing.assert_array_equal(from_cp_layout(laid, cp), x)
        np.testing.assert_array_equal(np.asarray(to_cp_layout(jnp.asarray(x), cp)), laid)
        np.testing.assert_array_equal(
            np.asarray(jax.jit(lambda y, cp=cp: from_cp_layout(y, cp))(laid)), x
        )
    pos = cp_positions(16, 4).reshape(4, 4)  # device i's 4 tokens: chunks i and 7 - i
    np.testing.assert_array_equal(pos[1], [2, 3, 12, 13])
    work = (pos + 1).sum(axis=1)  # causal keys each device's queries see
    assert work.min() == work.max()
    q, k, v, _, seg = _inputs()  # unsharded (axis None): the row is whole, blockwise
    np.testing.assert_array_equal(
        ring_attention(q, k, v, seg, axis=None, window=20),
        attention(q, k, v, seg, backend="blockwise", window=20),
    )
    with pytest.raises(ValueError, match="does not split into 2 \\* cp = 8 chunks"):
        to_cp_layout(np.zeros((1, 12)), 4)
    assert choose_exchange((1, 1024, 2, 64), jnp.bfloat16, 4) == "gather"
    assert choose_exchange((1, 16384, 8, 128), jnp.bfloat16, 4) == "ring"


def _temp_bytes(cp: int, s: int = 4096) -> int:
    """XLA's per-device temporaries of the forward and backward at `s` tokens a row."""
    mesh = Mesh(np.array(jax.devices()[:cp]), (AXIS,))
    sharded = jax.shard_map(
        lambda q, k, v, seg: ring_attention(q, k, v, seg, axis=AXIS, exchange="ring"),
        mesh=mesh,
        in_specs=P(None, AXIS),
        out_specs=P(None, AXIS),
    )

    def loss(q, k, v, seg):
        return jnp.sum(sharded(q, k, v, seg))

    f32 = jnp.float32
    shapes = [(1, s, 4, 64), (1, s, 2, 64), (1, s, 2, 64)]
    args = [jax.ShapeDtypeStruct(x, f32) for x in shapes]
    args.append(jax.ShapeDtypeStruct((1, s), jnp.int32))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower().compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_per_device_temporaries_fall_with_cp():
    one, four = _temp_bytes(1), _temp_bytes(4)
    assert four <= 0.5 * one, (four / one, one, four)
