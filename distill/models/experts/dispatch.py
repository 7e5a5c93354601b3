"""The dropless expert-parallel dispatch (ep > 1): every (token, expert) assignment to its
expert's device, through the grouped matmul there and back, exact, with buffers sized
from the load rather than for the worst case.

Each device holds its A = T * k assignments sorted by expert, hence by destination device
(`count_n[j]` rows for device j, contiguous), and every device learns every other's counts
first (an all-gather of ep integers, `distill.collectives.gather_shards`): the [n, n]
matrix (n = ep) of rows sender i has for receiver j, the same on every device. Each receiver has
room for `ep * C` rows a round, C = ceil(SLACK * T * k / ep) (`pair_slots`): one round
suffices when every device gets at most SLACK times its share. Rounds repeat
(`jax.lax.while_loop`) until every row has been sent: exact whatever the load, nothing
dropped, and one round for a balanced router. Every device computes the same schedule
from the same counts, so all run the same number of rounds.

Two transports (`kind()` chooses by platform, `distill plan` names it):

- `ragged` (GPU, TPU): `jax.lax.ragged_all_to_all` sends each receiver exactly its rows,
  the receivers' room shared among the senders in device order; the all-to-alls carry the
  routed rows' bytes and nothing more, whatever the rounds.
- `rounds` (CPU: XLA:CPU has no ragged all-to-all, "HLO opcode `ragged-all-to-all` is not
  supported by XLA:CPU ThunkEmitter" in jax 0.10.2): a dense all-to-all of [ep, C, D]
  blocks, at most C rows from each sender to each receiver a round; SLACK times the
  routed rows' bytes when balanced, more rounds when a pair overflows.

The received rows (grouped by sender, within one by expert) go through the grouped matmul
(`distill.models.experts.grouped.expert_rows` lays them out by local expert), and the results
travel back by the same transport into each row's place. The backward (`jax.custom_vjp`)
runs the same rounds: each row travels again with its cotangent, the receiver recomputes
gate and up and runs the grouped matmul's transpose (`grouped.expert_rows_grads`: no
residual is kept across rounds, whose number is known only at run time), and the rows'
cotangents come back; the experts' gradients add up over the rounds in one accumulator
and are summed over the other mesh axes once, after the loop (inside it, no collective
but over `ep`, whose group alone agrees on the trip count).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from distill import collectives as cc
from distill.models import attention
from distill.models.experts import grouped

KINDS = ("ragged", "rounds")
SLACK = 1.125  # a receiver's room a round over its share of a balanced load


def kind(platform: str | None = None) -> str:
    """The transport for `platform` (default: attention's, `attention.platform`): `rounds`
    on CPU, which lacks a ragged all-to-all; `ragged` elsewhere."""
    return "rounds" if (platform or attention.platform()) == "cpu" else "ragged"


def pair_slots(tokens: int, k: int, ep: int) -> int:
    """C: a receiver's room a round is ep * C rows (`rounds`: C from each sender)."""
    return max(1, math.ceil(SLACK * tokens * k / ep))


def rows_per_call(tokens: int, k: int, ep: int, kind_name: str) -> int:
    """Rows one device's all-to-alls carry each way in a layer under a balanced load (one
    round): `ragged`, its T * k assignments; `rounds`, its whole [ep, C] buffer."""
    return tokens * k if kind_name == "ragged" else ep * pair_slots(tokens, k, ep)


class _Round(NamedTuple):
    """One round's schedule, each [n, n] over (sender i, receiver j): rows i sends j, where
    they land in j's buffer, and where they start in i's sorted rows."""

    send: jax.Array
    at: jax.Array
    start: jax.Array


def _schedule(counts, sent, kind_name: str, slots: int) -> _Round:
    """The round after `sent` [n, n] rows of `counts` [n, n] went: `rounds` sends each pair
    up to `slots` rows at block i of j's buffer; `ragged` fills each receiver's n * slots
    rows from the senders in order."""
    n = counts.shape[0]
    rem = counts - sent
    if kind_name == "rounds":
        send = jnp.minimum(rem, slots)
        at = jnp.broadcast_to(jnp.arange(n, dtype=counts.dtype)[:, None] * slots, (n, n))
    else:
        before = jnp.cumsum(rem, axis=0) - rem
        send = jnp.clip(n * slots - before, 0, rem)
        at = jnp.cumsum(send, axis=0) - send
    start = jnp.cumsum(counts, axis=1) - counts + sent
    return _Round(send, at, start)


def _pair_rows(r: _Round, me, slots: int, rows: int):
    """[n, slots]: the sorted rows `me` sends each receiver this round (`rounds`), `rows`
    (past the end) for the empty slots."""
    c = jnp.arange(slots, dtype=r.send.dtype)
    return jnp.where(c < r.send[me][:, None], r.start[me][:, None] + c, rows)


def _full(shape, fill, like):
    """An array of `fill`, varying over the mesh axes `like` varies over."""
    return cc.vary(jnp.full(shape, fill, like.dtype), cc.varying(like))


def _index(r: _Round, me, slots: int, n_rows: int, rows):
    """[n, slots]: where `rounds` reads (and writes back) each slot's row: `_pair_rows`,
    through `rows` (each sorted row's row of the table, [A]) when given; past the end for
    the empty slots."""
    idx = _pair_rows(r, me, slots, n_rows if rows is None else rows.shape[0])
    return idx if rows is None else jnp.append(rows, n_rows)[idx]


def _there(x, r: _Round, me, axis, kind_name: str, slots: int, fill, rows=None):
    """This round's rows on their receivers, each receiver's buffer [n * slots, ...] (`fill`
    where nothing arrived): the rows x[rows] (x itself when `rows` is None), sorted by
    destination. `rounds` gathers its send buffer straight from x."""
    n = r.send.shape[0]
    shape = (n * slots, *x.shape[1:])
    if kind_name == "ragged":
        x = x if rows is None else x[rows]
        out = _full(shape, fill, x)
        return cc.ragged_all_to_all(x, out, r.start[me], r.send[me], r.at[me], r.send[:, me], axis)
    buf = x.at[_index(r, me, slots, x.shape[0], rows)].get(mode="fill", fill_value=fill)
    return cc.all_to_all(buf, axis).reshape(shape)


def _back(y, acc, r: _Round, me, axis, kind_name: str, slots: int, rows=None):
    """`acc` with this round's results y (a receiver's buffer [n * slots, ...]) back on
    their senders, added at their rows' places: acc [A, ...] in sorted order, or with
    `rounds` and `rows` given, acc[rows[a]] += row a's."""
    if kind_name == "ragged":
        back = (r.at[:, me], r.send[:, me], r.start[:, me], r.send[me])
        return cc.ragged_all_to_all(y, acc, *back, axis)  # writes: acc holds zeros there
    n = r.send.shape[0]
    back = cc.all_to_all(y.reshape(n, slots, *y.shape[1:]), axis)
    return acc.at[_index(r, me, slots, acc.shape[0], rows)].add(back, mode="drop")


def _loop(body, init, counts, kind_name: str, slots: int):
    """`body(round, carry)` over the rounds until every row of `counts` went."""

    def step(c):
        sent, carry = c
        r = _schedule(counts, sent, kind_name, slots)
        return sent + r.send, body(r, carry)

    done = lambda c: jnp.any(c[0] < counts)  # noqa: E731
    return jax.lax.while_loop(done, step, (jnp.zeros_like(counts), init))[1]


def expert_outputs(h_td, token_a, local_a, count_n, experts, *, axis, glu, kernel: str,
                   slots: int, kind_name: str | None = None):  # fmt: skip
    """y [A, D]: row a, this device's assignment a (sorted by destination device, `count_n[j]`
    of them for device j of `axis`), is h[token_a[a]] through the gated MLP (`glu`) of
    expert `local_a[a]` of that device (`experts`: its `grouped.Experts`, [E/ep, ...]);
    partial over `tp` as the experts' columns are. `slots`: `pair_slots`."""
    f = _exchange(axis, glu, kernel, kind_name or kind(), slots)
    return f(h_td, token_a, local_a, count_n.astype(jnp.int32), experts)


def _exchange(axis, glu, kernel: str, kind_name: str, slots: int):
    if kind_name not in KINDS:
        raise ValueError(f"unknown dispatch {kind_name!r}; expected one of {KINDS}")
    ragged = kind_name == "ragged"

    def setup(h, token, count):
        """(counts [n, n], this device's index, the rows to send: the table and their
        index in it, or with `ragged` the rows gathered once, contiguous)."""
        counts, me = cc.gather_shards(count, axis), jax.lax.axis_index(axis)
        return counts, me, ((h[token], None) if ragged else (h, token))

    def vma_of(*trees):
        return frozenset().union(*(cc.varying(a) for a in jax.tree.leaves(trees)))

    def run(h, token, local, count, weights):
        counts, me, (x, rows) = setup(h, token, count)
        n_local = weights.n

        def body(r, acc):
            xr = _there(x, r, me, axis, kind_name, slots, 0, rows)
            er = _there(local, r, me, axis, kind_name, slots, n_local)
            y = grouped.expert_rows(xr, jnp.arange(xr.shape[0]), er, weights, glu, kernel)
            return _back(y, acc, r, me, axis, kind_name, slots)

        vma = vma_of(h, token, local, weights)
        init = cc.vary(jnp.zeros((token.shape[0], h.shape[1]), h.dtype), vma)
        return _loop(body, init, counts, kind_name, slots)

    @jax.custom_vjp
    def f(h, token, local, count, weights):
        return run(h, token, local, count, weights)

    def fwd(h, token, local, count, weights):
        return run(h, token, local, count, weights), (h, token, local, count, weights)

    def bwd(res, dy):
        h, token, local, count, weights = res
        counts, me, (x, rows) = setup(h, token, count)
        n_local = weights.n
        vma = vma_of(h, token, local, dy, weights)
        # the weights varying as the rows do: no psum inside the loop (`cotangent` after)
        ws = jax.tree.map(lambda w: cc.vary(w, vma - cc.varying(w)), weights)

        def body(r, acc):
            dx, dws = acc
            xr = _there(x, r, me, axis, kind_name, slots, 0, rows)
            dyr = _there(dy, r, me, axis, kind_name, slots, 0)
            er = _there(local, r, me, axis, kind_name, slots, n_local)
            rows_r = jnp.arange(xr.shape[0])
            dxr, dws = grouped.expert_rows_grads(xr, rows_r, er, ws, dyr, dws, glu, kernel)
            return _back(dxr, dx, r, me, axis, kind_name, slots, rows), dws

        # the rows' cotangents: sorted [A, D] (ragged; summed per token after), or each
        # token's [T, D] (rounds, added in as they come back)
        dx = jnp.zeros(x.shape if ragged else h.shape, h.dtype)
        zeros = jax.tree.map(lambda w: cc.vary(jnp.zeros(w.shape, jnp.float32), vma), weights)
        dx, dws = _loop(body, (cc.vary(dx, vma), zeros), counts, kind_name, slots)
        dh = jax.ops.segment_sum(dx, token, num_segments=h.shape[0]) if ragged else dx
        dh = cc.cotangent(dh, h)  # summed over tp: each shard's columns gave a part
        return (dh, None, None, None, jax.tree.map(cc.cotangent, dws, weights))

    f.defvjp(fwd, bwd)
    return f
