"""The dropless expert-parallel dispatch (`distill.models.experts.dispatch`) at ep = 2, 4 and
ep = 2 x tp = 2: its
outputs and gradients equal the single-device layer's (no dispatch) under a random router
and with every token routed to the same experts (overflowing the receivers' room, so
re-dispatched in rounds), by both transports: `rounds` (CPU's dense all-to-alls) and
`ragged` (`jax.lax.ragged_all_to_all`, which XLA:CPU does not implement: run here through
an emulation of its documented semantics built from dense all-to-alls, so what is tested
on CPU is the schedule and the offsets; lowered for CUDA it is the real collective)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill import collectives as cc
from distill.compiled_flops import compiled_dot_flops
from distill.config import ModelConfig
from distill.mesh import EP, TP
from distill.models import attention, moe
from distill.models.experts import dispatch

CFG = ModelConfig(d_model=16, n_experts=8, experts_per_token=3, d_ff_expert=8)
SHAPE = (4, 6, 16)  # rows, tokens a row, d_model


def _emulated_ragged(x, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    """`jax.lax.ragged_all_to_all` as its docstring specifies it, from dense all-to-alls."""
    m = out.shape[0]
    c = jnp.arange(m)
    src = jnp.where(c < send_sizes[:, None], input_offsets[:, None] + c, x.shape[0])
    blocks = cc.all_to_all(x.at[src].get(mode="fill", fill_value=0), axis)  # [n, m, ...]
    at = cc.all_to_all(output_offsets, axis)  # where each sender's rows land here
    dst = jnp.where(c < recv_sizes[:, None], at[:, None] + c, m)
    return out.at[dst].set(blocks, mode="drop")


def _params(skewed: bool):
    keys = jax.random.split(jax.random.key(0), 4)
    d, e, f = CFG.d_model, CFG.n_experts, CFG.d_ff_expert
    router = jnp.zeros((d, e)) if skewed else jax.random.normal(keys[0], (d, e))
    return {  # a zero router: every token's top-3 are experts 0, 1, 2 (ties: lowest ids)
        "router": router,
        "we_gate": jax.random.normal(keys[1], (e, d, f)) * 0.3,
        "we_up": jax.random.normal(keys[2], (e, d, f)) * 0.3,
        "we_down": jax.random.normal(keys[3], (e, f, d)) * 0.3,
    }


def _loss(y):  # a cotangent that is not all ones
    return jnp.sum(y * jnp.sin(jnp.arange(y.size).reshape(y.shape)))


def _layer(ep, tp=1):
    """(y, grads wrt (h, params)) of the layer over `ep` devices, each with its rows, and
    each expert's hidden columns split over `tp`."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: ep * tp]).reshape(ep, tp), (EP, TP))
    ffn = {"we_gate": jax.P(EP, None, TP), "we_up": jax.P(EP, None, TP), "we_down": jax.P(EP, TP)}
    specs = {"router": jax.P(), **ffn}

    def f(h, p):
        return moe.moe_ffn(h, p, CFG, tp_axis=TP, ep_axis=EP)[0]

    run = jax.shard_map(f, mesh=mesh, in_specs=(jax.P(EP), specs), out_specs=jax.P(EP))
    return jax.jit(lambda h, p: (run(h, p), jax.grad(lambda h, p: _loss(run(h, p)), (0, 1))(h, p)))


def _reference(h, p):
    def f(h, p):
        return moe.moe_ffn(h, p, CFG, tp_axis=None, ep_axis=None)[0]

    return f(h, p), jax.grad(lambda h, p: _loss(f(h, p)), (0, 1))(h, p)


def _rounds_needed(h, p, ep, kind_name):
    """Rounds the schedule takes: receivers' load over their room."""
    t, k = SHAPE[0] // ep * SHAPE[1], CFG.experts_per_token
    _, ids = moe.route(h.reshape(-1, SHAPE[2]), p, CFG)
    dest = np.asarray(ids).reshape(ep, -1) // (CFG.n_experts // ep)  # [sender, assignments]
    counts = np.stack([np.bincount(r, minlength=ep) for r in dest])  # [sender, receiver]
    c = dispatch.pair_slots(t, k, ep)
    if kind_name == "rounds":
        return int(np.ceil(counts.max() / c))
    return int(np.ceil(counts.sum(0).max() / (ep * c)))


@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("kind_name", ["rounds", "ragged"])
@pytest.mark.parametrize("ep, tp", [(2, 1), (4, 1), (2, 2)])
def test_dispatch_equals_the_single_device_layer(monkeypatch, ep, tp, kind_name, skewed):
    if kind_name == "ragged":  # the platform that has it, the collective emulated
        monkeypatch.setattr(attention, "_platform", "gpu")
        monkeypatch.setattr(cc, "ragged_all_to_all", _emulated_ragged)
    assert dispatch.kind() == kind_name
    p = _params(skewed)
    h = jax.random.normal(jax.random.key(1), SHAPE)
    want, (want_dh, want_dp) = _reference(h, p)
    got, (dh, dp) = _layer(ep, tp)(h, p)
    assert (_rounds_needed(h, p, ep, kind_name) > 1) == skewed  # overflow re-dispatched
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dh), np.asarray(want_dh), atol=1e-4, rtol=1e-4)
    for name in p:
        np.testing.assert_allclose(
            np.asarray(dp[name]), np.asarray(want_dp[name]), atol=1e-4, rtol=1e-4, err_msg=name
        )


def test_lowered_for_cuda_the_dispatch_is_ragged(monkeypatch):
    """On GPU (ep=2 x tp=2) the forward and backward send rows by `ragged_all_to_all`
    only: no dense all-to-all of a padded buffer is left (the counts travel by an
    all-gather)."""
    monkeypatch.setattr(attention, "_platform", "gpu")
    h, p = jax.random.normal(jax.random.key(1), SHAPE), _params(False)
    text = _layer(2, 2).trace(h, p).lower(lowering_platforms=("cuda",)).as_text()
    assert "@ragged_all_to_all" in text
    assert "all_to_all" not in text.replace("ragged_all_to_all", "")


@pytest.mark.parametrize("backward", [False, True])
def test_the_30b_a3b_layer_at_ep4_compiles_to_its_active_flops(backward):
    """One layer of the Qwen3-30B-A3B shape at ep = 4, a 4,096-token row a device, compiled
    on CPU (abstract inputs, float32): each device's program (one round of the dispatch:
    the loop's body counted once) does at most 1.3x its tokens' active FLOPs, with under
    3 GiB of temporaries and no [E, T*k, D] array. Forward and backward: 1.3x 4 forwards,
    the forward, its recomputation in the backward (which keeps nothing across rounds
    whose number is known only at run time) and the grouped matmul's 2x backward."""
    from tests.test_moe_kernels import ACTIVE, D, E, F, K, T
    from tests.test_moe_kernels import _params as full_params

    cfg = ModelConfig(d_model=D, n_experts=E, experts_per_token=K, d_ff_expert=F)
    h = jax.ShapeDtypeStruct((4, T, D), jnp.float32)
    p = jax.eval_shape(lambda: full_params(D, E, F))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (EP,))
    specs = {"router": jax.P(), **{k: jax.P(EP) for k in ("we_gate", "we_up", "we_down")}}

    def fwd(h, p):
        return moe.moe_ffn(h, p, cfg, tp_axis=None, ep_axis=EP)[0]

    run = jax.shard_map(fwd, mesh=mesh, in_specs=(jax.P(EP), specs), out_specs=jax.P(EP))
    f = jax.grad(lambda h, p: jnp.sum(run(h, p)), argnums=(0, 1)) if backward else run
    compiled = jax.jit(f).trace(h, p).lower().compile()
    assert compiled_dot_flops(compiled) <= 1.3 * ACTIVE * (4 if backward else 1)
    assert compiled.memory_analysis().temp_size_in_bytes <= 3 * 2**30
    sizes = re.findall(r"\[([\d,]+)\]", compiled.as_text())
    assert max(np.prod([int(n) for n in s.split(",")]) for s in sizes) < E * T * K * D
