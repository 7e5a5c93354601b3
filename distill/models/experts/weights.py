"""The experts' weights as one value the grouped kernels take (`Experts`), and the per-row
bias of a row's expert that the kernels built on whole-group matmuls add around them."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp


class Experts(NamedTuple):
    """A device's experts: gate, up [E, D, F], down [E, F, D] (F may be this shard's
    columns: the rows' results are then partial over `tp`), and with `expert_bias` the
    biases b_gate, b_up [E, F] and b_down [E, D] (None without; `moe` zeroes b_down on all
    but one `tp` shard, so that the sum over `tp` adds it once)."""

    gate: Any
    up: Any
    down: Any
    b_gate: Any = None
    b_up: Any = None
    b_down: Any = None

    @property
    def n(self) -> int:
        return self.gate.shape[0]


def row_bias(b_ef, expert_m, dt):
    """Each row's expert's bias [M, F] from b [E, F] (zeros for rows of no expert, id E);
    0 when there is no bias."""
    return 0 if b_ef is None else b_ef.astype(dt).at[expert_m].get(mode="fill", fill_value=0)


def group_ids(sizes_e, rows: int):
    """Each of `rows` rows' group [rows] when groups of `sizes_e` rows run in order; E for
    the rows past them."""
    return jnp.searchsorted(jnp.cumsum(sizes_e), jnp.arange(rows), side="right").astype(jnp.int32)
