"""A mixture-of-experts student's routing in its training step: where its MoE layers run on
the training mesh, and what routing adds to the loss and the metrics.

The step is GSPMD (`jax.jit` over `dp` x `fsdp`), but routing sorts tokens by expert, which
over the whole batch would gather every row on every device. So each MoE layer runs per
device inside `jax.shard_map` (`distill.models.moe.Layout`): a device routes its own rows.
When `fsdp` divides the experts, the student's table splits the expert weights over their
expert axis and the layer dispatches tokens to their experts over `fsdp` by all-to-all,
as the teacher does over `ep` (the experts stay put; `dp` replicas each hold a copy);
otherwise each expert weight is split along another dimension and gathered whole for the
layer, like every dense weight (ZeRO-3). With a `cp` axis (`student.context`) a device's
rows are its pieces of the rows: it routes their tokens (routing is per token), the experts
split over `fsdp` x `cp` when that divides them (the weights' axes, `weight_axes`), and
the load-balancing statistics are summed over every axis, so the auxiliary loss is the
whole batch's. Either way the numbers are the single device's.
Evaluation runs the same layout; generation runs the plain layer under the partitioner.

Metrics of an MoE student's step: `moe_aux_loss` (transformers' load-balancing loss over
the batch's real tokens, `distill.models.moe.balance_loss`; `distill.moe_aux_loss` times
it is added to the loss) and `student_expert_counts` (real tokens' assignments to each
expert, summed over the MoE layers), which a record turns into `student_expert_load`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distill.config import ModelConfig
from distill.mesh import CP, DP, FSDP
from distill.models import moe
from distill.observability.expert_load import load_figures
from student import sharding

# Step metrics that are counts over the batch: summed over microbatches, not averaged.
COUNTS = ("tokens", "student_expert_counts")


class Routing:
    """The MoE part of a student's loss on `mesh`: `opts(batch)` for the forward,
    `add(loss, metrics, stats)` after it. `coef`: `distill.moe_aux_loss`."""

    def __init__(self, cfg: ModelConfig, mesh, coef: float = 0.0):
        self.cfg, self.coef = cfg, coef
        names = mesh.axis_names
        split = sharding.experts_split(cfg, sharding.weight_shards(dict(mesh.shape)))
        rows = tuple(a for a in (DP, FSDP, CP) if a in names)  # with cp: each device's pieces
        experts = sharding.weight_axes(names) if split else None
        self.layout = moe.Layout(mesh, rows, experts)

    @property
    def active(self) -> bool:
        return bool(self.cfg.n_experts)

    def opts(self, batch) -> dict | None:
        """`moe_opts` of the forward: the per-device layout, and the real tokens (segment
        id not 0: padding is not balanced) as the balance mask."""
        if not self.active:
            return None
        return {"layout": self.layout, "token_mask": batch.segment_ids != 0}

    def add(self, loss, metrics: dict, stats, batch):
        """(loss + coef * aux, metrics with `moe_aux_loss` and `student_expert_counts`)
        from the forward's per-layer stats (`moe.ExpertLoad` of [L, ...] arrays)."""
        if not self.active:
            return loss, metrics
        cfg = self.cfg
        layers = sum(cfg.moe_layers())
        balance = jax.tree.map(lambda x: jnp.sum(x, axis=0), stats.balance)
        real = jnp.sum((batch.segment_ids != 0).astype(jnp.float32))
        aux = moe.balance_loss(balance, real, layers, cfg.n_experts)
        loss = loss + self.coef * aux
        return loss, dict(metrics, loss=loss, moe_aux_loss=aux, student_expert_counts=balance[0])


def load_record(metrics: dict) -> dict:
    """A training record's student routing fields from its step's metrics:
    `moe_aux_loss`, `student_expert_load` (each expert's share of the real tokens'
    assignments, summed over the MoE layers) and `student_expert_load_max_mean` (largest
    count over the mean; 1.0 is balanced); {} for a dense student."""
    if "student_expert_counts" not in metrics:
        return {}
    load = load_figures(metrics["student_expert_counts"], dropped=None)  # the teacher's fields
    return {"moe_aux_loss": metrics["moe_aux_loss"], **{f"student_{k}": v for k, v in load.items()}}


def host_metrics(metrics) -> dict:
    """A step's metrics as host numbers: floats, and lists for per-expert vectors."""
    host = jax.device_get(metrics)
    return {k: float(v) if np.ndim(v) == 0 else [float(x) for x in v] for k, v in host.items()}
