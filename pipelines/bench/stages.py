"""The measured bubble of pipeline stages (`mesh.teacher.pp` > 1), for `distill bench
--role teacher`, beside the schedule's (pp - 1) / (m + pp - 1).

In SPMD every stage computes at every one of the m + pp - 1 ticks of the stages' loop
(`teacher.stages.hidden`), an idle stage on a stale buffer, so the bubble is the share
of the loop's time that is not the m ticks of real work. It is measured from two timings
of the loop alone (no head): on the batch (m microbatches, time T(m)) and on the batch
twice over (2m microbatches of the same size, T(2m)). One tick costs t = (T(2m) - T(m)) /
m, so the measured bubble is (T(m) - m t) / T(m) = 2 - T(2m) / T(m): the fill and drain
ticks and whatever else the loop costs beyond its m microbatches (launch, the transfers
an idle tick still makes). Where the devices cannot run at once (simulated CPU devices
sharing a few cores) this measures the tick count only, not overlap.
"""

from __future__ import annotations

import jax
import numpy as np

from distill.config import Config
from distill.mesh import DP, EP, PP
from teacher import stages
from teacher.forward import microbatch_rows
from teacher.sharding import BATCH_BS, batch_sharding, param_specs


def stage_loop(cfg: Config, mesh):
    """jit(shard_map) of the stages' loop alone on `mesh`, as the forward runs it (the
    teacher's dtype and microbatch): (params, batch) -> a corner of each stage's hidden
    states (so that nothing is copied out)."""
    mcfg, micro, dtype = cfg.teacher.model, cfg.teacher.microbatch, cfg.teacher.dtype
    moe_opts = {"ep_axis": EP, "capacity_factor": cfg.teacher.moe_capacity_factor}

    def loop(params, batch):
        size = microbatch_rows(batch.tokens.shape[0], micro)
        opts = moe_opts if mcfg.n_experts else None
        x, _, _ = stages.hidden(mcfg, params, batch, size, dtype=dtype, split=True,
                                  moe_opts=opts)  # fmt: skip
        return x[:, :1, :1]

    sharded = jax.shard_map(
        loop,
        mesh=mesh,
        in_specs=(param_specs(mcfg, mesh.shape[PP]), BATCH_BS),
        out_specs=jax.P((DP, EP, PP)),
    )
    return jax.jit(sharded)


def measured_bubble(cfg: Config, mesh, params, host_batch, timed) -> dict:
    """{stage_loop_ms, stage_loop_2x_ms, bubble_measured, bubble_predicted}: `timed`
    ({name: fn}) -> {name: median ms} (`pipelines.bench.phases._interleaved_ms`)."""
    loop = stage_loop(cfg, mesh)
    twice = jax.tree.map(lambda x: None if x is None else np.concatenate([x, x]), host_batch)
    one, two = (jax.device_put(b, batch_sharding(mesh)) for b in (host_batch, twice))
    ms = timed({"stage_loop_ms": lambda: loop(params, one),
                "stage_loop_2x_ms": lambda: loop(params, two)})  # fmt: skip
    t = cfg.mesh.teacher
    rows = cfg.train.batch_size // (t.dp * t.ep)
    m = rows // microbatch_rows(rows, cfg.teacher.microbatch)
    return {
        **ms,
        "microbatches": m,
        "bubble_measured": 2 - ms["stage_loop_2x_ms"] / ms["stage_loop_ms"],
        "bubble_predicted": stages.bubble(t.pp, m),
    }


def format_bubble(r: dict) -> str:
    return (
        f"stages: loop {r['stage_loop_ms']:.1f} ms at {r['microbatches']} microbatches, "
        f"{r['stage_loop_2x_ms']:.1f} ms at twice as many: bubble measured "
        f"{100 * r['bubble_measured']:.1f}%, predicted {100 * r['bubble_predicted']:.1f}%"
    )
