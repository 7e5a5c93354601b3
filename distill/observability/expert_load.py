"""A mixture-of-experts teacher's expert load in the metrics records.

The teacher's training-time forward returns, beside its output, the routing counts of its
batch (`teacher.forward.make_forward(expert_load=True)`: assignments routed to each expert
and assignments dropped, summed over the MoE layers and the mesh). A source keeps the
counts of each item it hands to the student, in step order; a logged window (step - n,
step] takes the oldest n of them. Those items were consumed by steps whose metrics the
loop has just read, so their teacher work is done and reading the counts never waits on
work in flight.
"""

from __future__ import annotations

from collections import deque

import jax
import numpy as np


class LoadWindow:
    """The routing counts of the items popped since the last logged window, oldest first.
    `dropping`: a capacity factor is set, so the dropped share is reported."""

    def __init__(self, dropping: bool = False):
        self.dropping = dropping
        self._loads: deque = deque()

    def clear(self) -> None:
        """Forget every count (the source restarts: the windows start again)."""
        self._loads.clear()

    def add(self, load) -> None:
        """The counts of the next popped item (`distill.models.moe.ExpertLoad`, on device
        or host)."""
        self._loads.append(load)

    def figures(self, steps: int) -> dict:
        """The record fields of the oldest `steps` items (`load_figures`), which are
        forgotten; {} when there are none (a dense teacher, no teacher)."""
        taken = [self._loads.popleft() for _ in range(min(steps, len(self._loads)))]
        if not taken:
            return {}
        host = jax.device_get(taken)
        tokens = np.sum([np.asarray(x.tokens, np.int64) for x in host], axis=0)
        dropped = int(sum(int(x.dropped) for x in host))
        return load_figures(tokens, dropped if self.dropping else None)


def load_figures(tokens, dropped: int | None) -> dict:
    """`expert_load`: each expert's share of the routed assignments (summed over the MoE
    layers, each of which routes every token k times: the mean of the layers' shares);
    `expert_load_max_mean`: the largest count over the mean count (1.0: balanced);
    `expert_dropped` (with a capacity factor, `dropped` not None): the share of assignments
    dropped."""
    tokens = np.asarray(tokens, np.float64)
    total = float(tokens.sum())
    if total <= 0:
        return {}
    figures = {
        "expert_load": [float(x) for x in tokens / total],
        "expert_load_max_mean": float(tokens.max() / tokens.mean()),
    }
    if dropped is not None:
        figures["expert_dropped"] = dropped / total
    return figures
