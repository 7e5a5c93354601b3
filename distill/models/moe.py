"""The routed feed-forward: a mixture of SwiGLU experts, top-k routed, with expert
parallelism as an argument (`ep_axis`), as tensor parallelism is one (`tp_axis`).

Routing (all three families, in float32): softmax over the experts' router logits, the k
largest probabilities, renormalised to sum to 1 when `norm_topk_prob` (Mixtral always;
Mixtral's top-k-then-softmax is the same numbers).

With every expert on the device (ep = 1, dropless) nothing is dispatched: the T * k
(token, expert) assignments read their token's row in expert order straight into the
grouped matmul (`distill.models.experts.grouped.expert_rows`: `ragged_dot` on TPU, the exact
`tiled` XLA kernel elsewhere), and each token sums its k results, weighted by its router
probabilities.

Dispatch over `ep`, inside `jax.shard_map` on one device holding its T tokens (its rows,
replicated over `tp`) and E / ep experts (each expert's hidden columns split over `tp`),
dropless: the assignments are sorted by expert (so by device), and
`distill.models.experts.dispatch` sends each to its expert's device, through the grouped matmul
there and back, with buffers sized from the load (a ragged all-to-all on GPU and TPU;
on CPU dense all-to-alls of [ep, C, D] blocks, C a little over the balanced share, in
as many rounds as the load needs); each token sums its k results weighted by its router
probabilities.

A shared expert (Qwen2-MoE's, `ModelConfig.d_ff_shared`) runs every token of the device
through one more SwiGLU (its hidden columns split over `tp` as a dense MLP's, replicated
over `ep`), scaled by sigmoid(h @ shared_gate), and is added to the routed output before
the one `psum` over `tp` (the down projections are row-parallel, as a dense layer's).

A capacity factor c (`teacher.moe_capacity_factor`) gives each expert C = ceil(c * T * k
/ E) slots per device, at fixed places of the buffer [ep, E/ep * C, D] (also at ep = 1),
so the experts run as batched matmuls [E/ep, ep * C, D] (at most c times the active
FLOPs, rounding aside): assignments past that are dropped, those with the lowest router
probability first (the notebook's rule), and contribute nothing; the per-device capacity
means no device waits for another's counts.

A student trains the same layer under GSPMD (`jax.jit` over `dp` x `fsdp`): `Layout` runs
it per device inside `jax.shard_map` (each device routes and sorts only its own rows),
with `fsdp` as the expert axis when the student's table splits the experts over it, and
a token mask gives the statistics of the auxiliary load-balancing loss (`balance_loss`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from distill import collectives as cc
from distill.models.experts import dispatch, grouped
from distill.models.topk import top_k

EXPERTS = ("we_gate", "we_up", "we_down")  # [E, ...]: split over the expert axis
SHARED = ("ws_gate", "ws_up", "ws_down", "shared_gate")  # every token's: never split by expert


def weight_keys(cfg) -> tuple[str, ...]:
    """The layer weights an MoE layer of `cfg` reads: the router, the experts, and the
    shared expert with its gate when the model has one."""
    return ("router", *EXPERTS, *(SHARED if cfg.f_shared else ()))


class ExpertLoad(NamedTuple):
    """Routing counts of a forward: assignments (token, expert) routed to each expert, [E]
    int32 (per layer [L, E] from the model, summed over layers and the mesh's rows by the
    teacher forward), and assignments a capacity factor dropped (int32; 0 when dropless).
    `balance`, with a token mask only: (the masked tokens' assignments to each expert,
    their router probabilities summed per expert), float32 [E] each: what
    `balance_loss` needs."""

    tokens: Any
    dropped: Any
    balance: Any = None


class Layout(NamedTuple):
    """Where a GSPMD program's MoE layer runs (the student's training step): per device of
    `mesh` inside `jax.shard_map`, on the rows split over `rows` (mesh axes), with the
    experts split over `experts` (a mesh axis: tokens travel to their experts by
    all-to-all, the experts stay put) or, when None, gathered whole on every device."""

    mesh: Any
    rows: tuple
    experts: str | None


def route(h_td: jax.Array, router_de: jax.Array, k: int, norm: bool):
    """(weights [T, k] float32, expert ids [T, k] int32): the top-k softmax probabilities of
    the router logits, computed in float32, renormalised when `norm`."""
    logits = h_td.astype(jnp.float32) @ router_de.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = top_k(probs, k)
    if norm:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def capacity(tokens: int, k: int, n_experts: int, factor: float | None) -> int | None:
    """Slots per expert per device for capacity factor `factor`; None: dropless."""
    if factor is None:
        return None
    return max(1, math.ceil(factor * tokens * k / n_experts))


def capacity_slots(tokens: int, k: int, n_experts: int, ep: int, factor: float) -> int:
    """Slots C of each block of a device's capacity buffer [ep, C, D] for its `tokens`
    tokens: the capacity of each of one device's E / ep experts, at fixed places."""
    return n_experts // ep * capacity(tokens, k, n_experts, factor)


def _slots(ids_a, weights_a, n_local: int, n_shards: int, cap: int, slots: int):
    """Where each assignment goes with a capacity: (sort order, destination device, slot
    there, kept), the assignments sorted by expert and, within one, by falling probability;
    each local expert owns `cap` slots from local expert * cap (its [C, D] block of the
    device's buffer), `slots` (past the end) for the dropped."""
    n_experts = n_local * n_shards
    order = jnp.lexsort((-weights_a, ids_a))  # the last key is the primary one
    sid = ids_a[order]
    counts = jnp.bincount(sid, length=n_experts)
    first = jnp.cumsum(counts) - counts  # each expert's first sorted position
    pos = jnp.arange(sid.shape[0]) - first[sid]
    keep = pos < cap
    return order, sid // n_local, jnp.where(keep, sid % n_local * cap + pos, slots), keep


def moe_ffn(
    h_bsd, p: dict, cfg, *, tp_axis, ep_axis=None, capacity_factor=None, act=jax.nn.silu,
    token_mask=None, layout: Layout | None = None, kernel: str | None = None,
):  # fmt: skip
    """The mixture of experts' output [B, S, D] on h [B, S, D] (the normed residual) and
    its `ExpertLoad` (tokens per expert [E] routed from these rows, assignments dropped,
    and with `token_mask` [B, S] the balance statistics): weights `p` with router [D, E],
    we_gate, we_up [E/ep, D, F/tp], we_down [E/ep, F/tp, D], and a shared expert's ws_gate,
    ws_up [D, Fs/tp], ws_down [Fs/tp, D], shared_gate [D, 1]. `layout`: run per device of
    a GSPMD program (`Layout`; then `p` holds whole weights). `kernel`: the grouped
    matmul (`distill.models.experts.grouped.KERNELS`; None: the platform's)."""
    if layout is not None:
        return _per_device(h_bsd, p, cfg, layout, act, token_mask, kernel)
    b, s, d = h_bsd.shape
    t, k = b * s, cfg.experts_per_token
    n_local = p["we_gate"].shape[0]
    n_shards = n_local and cfg.n_experts // n_local
    h = h_bsd.reshape(t, d)
    weights, ids = route(h, p["router"], k, cfg.norm_topk_prob)
    experts = (p["we_gate"][...], p["we_up"][...], p["we_down"][...])
    if capacity_factor is not None:
        out, dropped = _capacity(h, weights, ids, experts, cfg, capacity_factor, ep_axis, act)
    elif n_shards == 1:  # every expert here: rows in expert order, no dispatch buffer
        kernel = kernel or grouped.kernel()
        y = grouped.expert_rows(h, jnp.arange(t * k) // k, ids.reshape(-1), *experts, act, kernel)
        out = jnp.einsum("tkd,tk->td", y.reshape(t, k, d).astype(jnp.float32), weights)
        dropped = jnp.zeros_like(ids[0, 0])  # varying over the mesh as the rows are
    else:
        out, dropped = _dispatch(h, weights, ids, experts, n_shards, ep_axis, act, kernel)
    if "ws_gate" in p:
        out = out + _shared(h, p, act)
    out = cc.psum(out.astype(h.dtype).reshape(b, s, d), tp_axis)  # [b, S/tp, D] under SP
    load = jnp.bincount(ids.reshape(-1), length=cfg.n_experts)
    balance = None if token_mask is None else _balance(h, p["router"], ids, token_mask)
    return out, ExpertLoad(load, dropped, balance)


def _shared(h_td, p: dict, act) -> jax.Array:
    """The shared expert's output, float32 [T, D] (partial over tp): every token's SwiGLU
    times sigmoid(h @ shared_gate), as transformers' Qwen2MoeSparseMoeBlock."""
    w = {k: p[k][...].astype(h_td.dtype) for k in SHARED}
    y = (act(h_td @ w["ws_gate"]) * (h_td @ w["ws_up"])) @ w["ws_down"]
    return (jax.nn.sigmoid(h_td @ w["shared_gate"]) * y).astype(jnp.float32)


def _dispatch(h, weights, ids, experts, n_shards: int, ep_axis, act, kernel):
    """Dropless over `ep_axis`: each assignment, sorted by expert (so by device), to its
    expert's device and back (`distill.models.experts.dispatch`, buffers sized from the load);
    float32 [T, D] (partial over tp)."""
    (t, _), k = h.shape, ids.shape[1]
    n_local = experts[0].shape[0]
    ids_a = ids.reshape(-1)
    order = jnp.argsort(ids_a, stable=True)
    sid, token = ids_a[order], order // k
    count = jnp.bincount(sid // n_local, length=n_shards)
    y = dispatch.expert_outputs(
        h, token, sid % n_local, count, experts, axis=ep_axis, act=act,
        kernel=kernel or grouped.kernel(), slots=dispatch.pair_slots(t, k, n_shards),
    )  # fmt: skip
    out = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(out, token, num_segments=t), jnp.zeros_like(ids[0, 0])


def _capacity(h, weights, ids, experts, cfg, factor: float, ep_axis, act):
    """With a capacity factor: each local expert's C slots a [C, D] block of the device's
    buffer [ep, E/ep * C, D], run as batched matmuls [E/ep, ep * C, D]; the assignments
    past an expert's capacity dropped. (float32 [T, D] partial over tp, dropped count)."""
    (t, d), k = h.shape, ids.shape[1]
    n_local = experts[0].shape[0]
    n_shards = cfg.n_experts // n_local
    cap = capacity(t, k, cfg.n_experts, factor)
    slots = n_local * cap
    ids_a, weights_a = ids.reshape(-1), weights.reshape(-1)
    order, dest, slot, keep = _slots(ids_a, weights_a, n_local, n_shards, cap, slots)
    token = order // k
    src = jnp.full((n_shards, slots), t, jnp.int32).at[dest, slot].set(token, mode="drop")
    send = h.at[src].get(mode="fill", fill_value=0)  # [ep, E/ep * C, D]
    recv = cc.all_to_all(send, ep_axis).reshape(n_shards, n_local, cap, d)
    x = recv.transpose(1, 0, 2, 3).reshape(n_local, n_shards * cap, d)
    y = grouped.batched_swiglu(x, *experts, act).reshape(n_local, n_shards, cap, d)
    back = cc.all_to_all(y.transpose(1, 0, 2, 3).reshape(n_shards, slots, d), ep_axis)
    got = back.at[dest, slot].get(mode="fill", fill_value=0)  # [A, D], sorted order
    scale = jnp.where(keep, weights_a[order], 0.0).astype(jnp.float32)
    out = jax.ops.segment_sum(got.astype(jnp.float32) * scale[:, None], token, num_segments=t)
    return out, jnp.sum(~keep)


def _balance(h_td, router_de, ids_tk, mask_bs):
    """(each expert's assignments from the masked tokens, their softmax router probabilities
    summed per expert), float32 [E]: the sums of transformers' `load_balancing_loss_func`
    (the probabilities are recomputed from the router: their gradient reaches it)."""
    n = router_de.shape[-1]
    m = mask_bs.reshape(-1).astype(jnp.float32)
    logits = h_td.astype(jnp.float32) @ router_de.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    counts = jnp.zeros((n,), jnp.float32).at[ids_tk].add(jnp.broadcast_to(m[:, None], ids_tk.shape))
    return counts, jnp.sum(probs * m[:, None], axis=0)


def balance_loss(balance, tokens, n_moe_layers: int, n_experts: int) -> jax.Array:
    """The Switch / Mixtral auxiliary load-balancing loss, as transformers'
    `load_balancing_loss_func` computes it over the MoE layers' router logits concatenated
    (with an attention mask): E * sum_e f_e * P_e, where f_e is the share of (token, slot)
    pairs routed to expert e (summing to k) and P_e its mean router probability, both over
    the `tokens` masked tokens of every MoE layer. `balance`: the per-expert sums
    (`ExpertLoad.balance`) summed over the layers."""
    counts, probs = balance
    rows = jnp.maximum(tokens * n_moe_layers, 1.0)
    return n_experts * jnp.sum((counts / rows) * (probs / rows))


def _per_device(h_bsd, p: dict, cfg, layout: Layout, act, token_mask, kernel):
    """`moe_ffn` on each device's own rows of a GSPMD program, its experts split over
    `layout.experts` (the expert axis of the dispatch) or gathered; the counts summed over
    the devices' rows."""
    rows, ax = jax.P(layout.rows), layout.experts
    specs = {k: jax.P(ax) if ax is not None and k in EXPERTS else jax.P() for k in p}
    mask = jnp.ones(h_bsd.shape[:2], jnp.float32) if token_mask is None else token_mask

    def local(h, p, m):
        y, load = moe_ffn(
            h, p, cfg, tp_axis=None, ep_axis=ax, act=act,
            token_mask=None if token_mask is None else m, kernel=kernel,
        )  # fmt: skip
        return y, jax.tree.map(lambda x: jax.lax.psum(x, layout.rows), load)

    every = ExpertLoad(jax.P(), jax.P(), None if token_mask is None else (jax.P(), jax.P()))
    run = jax.shard_map(
        local, mesh=layout.mesh, in_specs=(rows, specs, rows), out_specs=(rows, every)
    )
    return run(h_bsd, p, mask.astype(jnp.float32))
