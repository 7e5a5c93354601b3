"""The routed feed-forward: a mixture of gated-MLP experts, top-k routed, with expert
parallelism as an argument (`ep_axis`), as tensor parallelism is one (`tp_axis`).

Routing (`route`, in float32, as data in `ModelConfig`): the router's logits (plus gpt-oss'
learned bias) give each expert a score, softmax over the experts (Mixtral, Qwen-MoE, OLMoE,
gpt-oss) or each one's sigmoid (DeepSeek-V3, Kimi K2, GLM-4.5). The k experts chosen are
those of the largest scores, DeepSeek's selection-only correction bias added for the
choice, and with groups (`n_group`) only among the `topk_group` groups whose two best
biased scores sum highest. A token's weights are its chosen experts' unbiased scores,
renormalised to sum to 1 when `norm_topk_prob` (Mixtral's and gpt-oss' softmax over the k
chosen logits is the same numbers), times `routed_scale`.

Experts are gated MLPs, `glu(gate, up)` from `ModelConfig.activation` (SwiGLU, GeGLU,
gpt-oss' clamped SwiGLU), with gpt-oss' biases on gate, up and down when `expert_bias`:
the down projection's bias is added on one `tp` shard only (its rows are partial sums over
`tp`, summed once), so every path below carries the biases as weights of their expert.

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

A shared expert (Qwen2-MoE's and DeepSeek's, `ModelConfig.d_ff_shared`) runs every token of
the device through one more gated MLP (its hidden columns split over `tp` as a dense MLP's,
replicated over `ep`), scaled by sigmoid(h @ shared_gate) in Qwen2-MoE (not in DeepSeek,
`shared_expert_gate`), and is added to the routed output before the one `psum` over `tp`
(the down projections are row-parallel, as a dense layer's).

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
from flax import nnx

from distill import collectives as cc
from distill.models.experts import dispatch, grouped
from distill.models.topk import top_k

EXPERTS = ("we_gate", "we_up", "we_down")  # [E, ...]: split over the expert axis
EXPERT_BIASES = ("be_gate", "be_up", "be_down")  # [E, F], [E, F], [E, D]: as their experts
SHARED = ("ws_gate", "ws_up", "ws_down")  # every token's: never split by expert
# Every weight an MoE layer may hold (`weight_keys`: those a model's layers do).
ALL_KEYS = ("router", "router_bias", "router_correction", *EXPERTS, *EXPERT_BIASES, *SHARED)
ALL_KEYS += ("shared_gate", "router_scale", "router_expert_scale")
NORM_EPS = 1e-20  # transformers' DeepSeek-V3 / GLM-4.5 renormalisation epsilon (sigmoid)


def weight_keys(cfg) -> tuple[str, ...]:
    """The layer weights an MoE layer of `cfg` reads: the router (its bias, its selection
    bias), the experts (their biases), the shared expert with its gate, as the model has."""
    keys = ["router"]
    keys += ["router_scale"] if cfg.router_norm else []
    keys += ["router_expert_scale"] if cfg.expert_scale else []
    keys += ["router_bias"] if cfg.router_bias else []
    keys += ["router_correction"] if cfg.router_correction_bias else []
    keys += [*EXPERTS, *(EXPERT_BIASES if cfg.expert_bias else ())]
    keys += [*SHARED, *(["shared_gate"] if cfg.shared_expert_gate else [])] if cfg.f_shared else []
    return tuple(keys)


def layer_params(cfg, normal) -> dict:
    """One MoE layer's parameters (nnx.Param), for `distill.models.model.Block`:
    `normal(shape, out)` draws a matrix (`out`: an output projection's scale), biases
    start at zero. The router [D, E], experts we_gate, we_up [E, D, F], we_down [E, F, D],
    a shared expert ws_gate, ws_up [D, Fs], ws_down [Fs, D] with Qwen2-MoE's gate [D, 1];
    only those `weight_keys` names."""
    d, e, fe, fs = cfg.d_model, cfg.n_experts, cfg.f_expert, cfg.f_shared
    shapes = {
        "router": (d, e), "router_bias": (e,), "router_correction": (e,),
        "we_gate": (e, d, fe), "we_up": (e, d, fe), "we_down": (e, fe, d),
        "be_gate": (e, fe), "be_up": (e, fe), "be_down": (e, d),
        "ws_gate": (d, fs), "ws_up": (d, fs), "ws_down": (fs, d), "shared_gate": (d, 1),
        "router_scale": (d,), "router_expert_scale": (e,),
    }  # fmt: skip
    zeros = ("router_bias", "router_correction", *EXPERT_BIASES)
    ones, out = ("router_scale", "router_expert_scale"), ("we_down", "ws_down")

    def param(k):
        if k in zeros or k in ones:
            return nnx.Param(jnp.full(shapes[k], float(k in ones), jnp.float32))
        return normal(shapes[k], k in out)

    return {k: param(k) for k in weight_keys(cfg)}


def glu(cfg):
    """`glu(gate, up)`: the gated MLP's hidden activations of `cfg.activation` (dense layers
    and experts alike): silu(gate) * up, gelu_tanh(gate) * up, or gpt-oss' clamped SwiGLU
    (transformers' GptOssExperts._apply_gate)."""
    if cfg.activation == "swiglu_clamped":
        limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha

        def clamped(gate, up):
            gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
            return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))

        return clamped
    act = jax.nn.silu if cfg.activation == "silu" else lambda x: jax.nn.gelu(x, approximate=True)
    return lambda gate, up: act(gate) * up


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


def scores(h_td: jax.Array, p: dict, cfg) -> jax.Array:
    """The router's expert scores [T, E] float32: softmax or sigmoid (`router_score`) of
    the logits h @ router (+ router_bias), computed in float32 as transformers' routers."""
    h32 = h_td.astype(jnp.float32)
    if "router_scale" in p:  # Gemma 4: the input RMS-normed, scaled, over sqrt(D)
        h32 = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + cfg.norm_eps)
        h32 = h32 * p["router_scale"][...].astype(jnp.float32) * h32.shape[-1] ** -0.5
    logits = h32 @ p["router"][...].astype(jnp.float32)
    if "router_bias" in p:
        logits = logits + p["router_bias"][...].astype(jnp.float32)
    if cfg.router_score == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)


def route(h_td: jax.Array, p: dict, cfg):
    """(weights [T, k] float32, expert ids [T, k] int32) of router weights `p` (router,
    router_bias, router_correction as `cfg` has them): the experts of the k largest
    scores, plus the correction bias and among the best groups when `cfg` says so; the
    weights their unbiased scores, renormalised when `norm_topk_prob`, times
    `routed_scale` (module docstring)."""
    s = scores(h_td, p, cfg)
    choice = s + p["router_correction"][...].astype(jnp.float32) if "router_correction" in p else s
    if cfg.n_group > 1:
        choice = _best_groups(choice, cfg.n_group, cfg.topk_group)
    weights, ids = top_k(choice, cfg.experts_per_token)
    if choice is not s:  # chosen on biased or masked scores: weighed by the unbiased
        weights = jnp.take_along_axis(s, ids, axis=-1)
    if cfg.norm_topk_prob:
        eps = NORM_EPS if cfg.router_score == "sigmoid" else 0.0
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
    if "router_expert_scale" in p:  # Gemma 4: each chosen expert's own scale
        weights = weights * p["router_expert_scale"][...].astype(jnp.float32)[ids]
    return (weights * cfg.routed_scale if cfg.routed_scale != 1.0 else weights), ids


def _best_groups(choice_te, n_group: int, topk_group: int):
    """The selection scores [T, E] with every expert outside each token's `topk_group`
    best groups set to -inf: `n_group` consecutive groups of experts, each scored by the
    sum of its two largest scores (transformers' DeepseekV3TopkRouter)."""
    t, e = choice_te.shape
    per_group = choice_te.reshape(t, n_group, e // n_group)
    group_scores = jnp.sum(top_k(per_group, 2)[0], axis=-1)  # [T, G]
    _, best = top_k(group_scores, topk_group)
    keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice_te, -jnp.inf)


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
    h_bsd, p: dict, cfg, *, tp_axis, ep_axis=None, capacity_factor=None, token_mask=None,
    layout: Layout | None = None, kernel: str | None = None, router_input=None,
):  # fmt: skip
    """The mixture of experts' output [B, S, D] on h [B, S, D] (the normed residual) and
    its `ExpertLoad` (tokens per expert [E] routed from these rows, assignments dropped,
    and with `token_mask` [B, S] the balance statistics): weights `p` with router [D, E]
    (router_bias, router_correction [E]), we_gate, we_up [E/ep, D, F/tp], we_down
    [E/ep, F/tp, D] (be_gate, be_up [E/ep, F/tp], be_down [E/ep, D]), and a shared
    expert's ws_gate, ws_up [D, Fs/tp], ws_down [Fs/tp, D] (shared_gate [D, 1]).
    `layout`: run per device of a GSPMD program (`Layout`; then `p` holds whole weights).
    `kernel`: the grouped matmul (`distill.models.experts.grouped.KERNELS`; None: the
    platform's). `router_input` [B, S, D]: what the router reads, where it is not h (Gemma
    4's MoE block routes on the residual)."""
    if layout is not None:
        return _per_device(h_bsd, p, cfg, layout, token_mask, kernel, router_input)
    b, s, d = h_bsd.shape
    t, k = b * s, cfg.experts_per_token
    n_local = p["we_gate"].shape[0]
    n_shards = n_local and cfg.n_experts // n_local
    h, gated = h_bsd.reshape(t, d), glu(cfg)
    r = h if router_input is None else router_input.reshape(t, d)
    weights, ids = route(r, p, cfg)
    experts = _experts(p, cfg, tp_axis)
    if capacity_factor is not None:
        out, dropped = _capacity(h, weights, ids, experts, cfg, capacity_factor, ep_axis, gated)
    elif n_shards == 1:  # every expert here: rows in expert order, no dispatch buffer
        kernel = kernel or grouped.kernel()
        y = grouped.expert_rows(h, jnp.arange(t * k) // k, ids.reshape(-1), experts, gated, kernel)
        out = jnp.einsum("tkd,tk->td", y.reshape(t, k, d).astype(jnp.float32), weights)
        dropped = jnp.zeros_like(ids[0, 0])  # varying over the mesh as the rows are
    else:
        out, dropped = _dispatch(h, weights, ids, experts, n_shards, ep_axis, gated, kernel)
    if "ws_gate" in p:
        out = out + _shared(h, p, gated)
    out = cc.psum(out.astype(h.dtype).reshape(b, s, d), tp_axis)  # [b, S/tp, D] under SP
    load = jnp.bincount(ids.reshape(-1), length=cfg.n_experts)
    balance = None if token_mask is None else _balance(r, p, cfg, ids, token_mask)
    return out, ExpertLoad(load, dropped, balance)


def _experts(p: dict, cfg, tp_axis) -> grouped.Experts:
    """This device's experts, with their biases when `cfg` has them: the down projection's
    on the first `tp` shard only (zeros on the others), as its rows are summed over `tp`."""
    w = [p[k][...] for k in EXPERTS]
    if not cfg.expert_bias:
        return grouped.Experts(*w)
    b_gate, b_up, b_down = (p[k][...] for k in EXPERT_BIASES)
    if tp_axis is not None:
        b_down = jnp.where(jax.lax.axis_index(tp_axis) == 0, b_down, jnp.zeros_like(b_down))
    return grouped.Experts(*w, b_gate, b_up, b_down)


def _shared(h_td, p: dict, gated) -> jax.Array:
    """The shared expert's output, float32 [T, D] (partial over tp): every token's gated
    MLP, times sigmoid(h @ shared_gate) when it has that gate (transformers'
    Qwen2MoeSparseMoeBlock; DeepSeek-V3's and GLM-4.5's shared_experts have none)."""
    w = {k: p[k][...].astype(h_td.dtype) for k in (*SHARED, "shared_gate") if k in p}
    y = gated(h_td @ w["ws_gate"], h_td @ w["ws_up"]) @ w["ws_down"]
    if "shared_gate" in w:
        y = jax.nn.sigmoid(h_td @ w["shared_gate"]) * y
    return y.astype(jnp.float32)


def _dispatch(h, weights, ids, experts, n_shards: int, ep_axis, gated, kernel):
    """Dropless over `ep_axis`: each assignment, sorted by expert (so by device), to its
    expert's device and back (`distill.models.experts.dispatch`, buffers sized from the load);
    float32 [T, D] (partial over tp)."""
    (t, _), k = h.shape, ids.shape[1]
    n_local = experts.n
    ids_a = ids.reshape(-1)
    order = jnp.argsort(ids_a, stable=True)
    sid, token = ids_a[order], order // k
    count = jnp.bincount(sid // n_local, length=n_shards)
    y = dispatch.expert_outputs(
        h, token, sid % n_local, count, experts, axis=ep_axis, glu=gated,
        kernel=kernel or grouped.kernel(), slots=dispatch.pair_slots(t, k, n_shards),
    )  # fmt: skip
    out = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(out, token, num_segments=t), jnp.zeros_like(ids[0, 0])


def _capacity(h, weights, ids, experts, cfg, factor: float, ep_axis, gated):
    """With a capacity factor: each local expert's C slots a [C, D] block of the device's
    buffer [ep, E/ep * C, D], run as batched matmuls [E/ep, ep * C, D]; the assignments
    past an expert's capacity dropped. (float32 [T, D] partial over tp, dropped count)."""
    (t, d), k = h.shape, ids.shape[1]
    n_local = experts.n
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
    y = grouped.batched_swiglu(x, experts, gated).reshape(n_local, n_shards, cap, d)
    back = cc.all_to_all(y.transpose(1, 0, 2, 3).reshape(n_shards, slots, d), ep_axis)
    got = back.at[dest, slot].get(mode="fill", fill_value=0)  # [A, D], sorted order
    scale = jnp.where(keep, weights_a[order], 0.0).astype(jnp.float32)
    out = jax.ops.segment_sum(got.astype(jnp.float32) * scale[:, None], token, num_segments=t)
    return out, jnp.sum(~keep)


def _balance(h_td, p: dict, cfg, ids_tk, mask_bs):
    """(each expert's assignments from the masked tokens, their router probabilities summed
    per expert), float32 [E]: the sums of transformers' `load_balancing_loss_func` (the
    probabilities are recomputed from the router: their gradient reaches it). A sigmoid
    router's probabilities are its scores normalised over the experts (DeepSeek-V3's
    balance loss)."""
    n = cfg.n_experts
    m = mask_bs.reshape(-1).astype(jnp.float32)
    probs = scores(h_td, p, cfg)
    if cfg.router_score == "sigmoid":
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
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


def _per_device(h_bsd, p: dict, cfg, layout: Layout, token_mask, kernel, router_input=None):
    """`moe_ffn` on each device's own rows of a GSPMD program, its experts split over
    `layout.experts` (the expert axis of the dispatch) or gathered; the counts summed over
    the devices' rows."""
    rows, ax = jax.P(layout.rows), layout.experts
    split = (*EXPERTS, *EXPERT_BIASES)
    specs = {k: jax.P(ax) if ax is not None and k in split else jax.P() for k in p}
    mask = jnp.ones(h_bsd.shape[:2], jnp.float32) if token_mask is None else token_mask
    routed = router_input is not None

    def local(h, r, p, m):
        y, load = moe_ffn(
            h, p, cfg, tp_axis=None, ep_axis=ax, token_mask=None if token_mask is None else m,
            kernel=kernel, router_input=r if routed else None,
        )  # fmt: skip
        return y, jax.tree.map(lambda x: jax.lax.psum(x, layout.rows), load)

    every = ExpertLoad(jax.P(), jax.P(), None if token_mask is None else (jax.P(), jax.P()))
    run = jax.shard_map(
        local, mesh=layout.mesh, in_specs=(rows, rows, specs, rows), out_specs=(rows, every)
    )
    return run(h_bsd, router_input if routed else h_bsd, p, mask.astype(jnp.float32))
