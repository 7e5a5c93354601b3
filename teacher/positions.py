"""A cross-tokenizer teacher's outputs at the student's positions, made on the inference mesh.

Across tokenizers the teacher runs on its own rows [B, T] and the student's loss reads its
outputs at the aligned positions (`TeacherView.align` [B, S]: the teacher position whose
text prefix ends where the student's does, -1 where none does). A student whose rows are
split over its `cp` axis holds pieces of its rows, not the teacher's whole rows, so for it
the outputs are gathered at the student's positions here, before they leave the inference
mesh: [B, S, ...] (fewer positions than T for a byte-level teacher), split by position as
the student's `batch_spec` expects, like a one-vocabulary output. The student then reads
position j of its row at position j (`student.context`).

On an inference mesh with a `cp` axis each device holds T / cp of the teacher's positions
and S / cp of the student's (both in row order): the teacher's blocks go around the cp
ring (cp - 1 `ppermute`s of one block), each device picking from each block the positions
its student positions align to. No row is ever whole on a device. An unmatched student
position reads teacher position 0, as `distill.models.cross.losses.at_student_positions`
does (the loss leaves it out).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from distill import collectives as cc
from distill import programs
from distill.config import Config
from distill.mesh import CP
from distill.types import TeacherOutput
from teacher.sharding import out_spec


def wanted(cfg: Config) -> bool:
    """Whether the run's teacher outputs go to the student at its positions: across
    tokenizers, to a student with `mesh.student.cp` > 1."""
    return cfg.cross_tokenizer() and cfg.mesh.student.cp > 1


def at_student_positions(mesh, out: TeacherOutput, align_bs) -> TeacherOutput:
    """`out` ([B, T, ...] on `mesh`, laid out as the teacher forward leaves it) at the
    student's positions `align_bs` [B, S] (host or device): [B, S, ...], laid out the same
    way (`teacher.sharding.out_spec`)."""
    align = jax.device_put(align_bs, align_sharding(mesh, align_bs.shape[0]))
    return programs.cached(_program, mesh)(out, align)


def align_sharding(mesh, rows: int) -> NamedSharding:
    """Where the alignment [B, S] of a batch of `rows` rows lives on the inference mesh:
    laid out as the outputs are (`teacher.sharding.out_spec`), so that each device holds
    the student positions of the output rows it gathers. In ray mode a teacher process
    builds it there from its own rows (`pipelines.ray.rows.global_batch`)."""
    return NamedSharding(mesh, out_spec(rows, mesh))


def _program(mesh):
    axis = CP if CP in mesh.shape else None

    def run(out: TeacherOutput, align):
        spec = out_spec(align.shape[0], mesh)
        gather = jax.shard_map(
            functools.partial(_gather, axis=axis),
            mesh=mesh,
            in_specs=(spec, spec),
            out_specs=spec,
        )
        return jax.tree.map(lambda x: gather(x, align), out)

    return jax.jit(run)


def _gather(x_btk, align_bs, axis: str | None):
    """This device's student positions' values [b, S/cp, ...] from the teacher's [b, T/cp,
    ...] blocks of its rows (all of T without `axis`), the blocks passed around the ring."""
    want = jnp.maximum(align_bs, 0)
    n, cp = x_btk.shape[1], cc.axis_size(axis)
    me = 0 if axis is None else jax.lax.axis_index(axis)
    out, block = None, x_btk
    for i in range(cp):  # the block i steps round the ring came from device me - i
        local = want - ((me - i) % cp) * n
        got = _take(block, jnp.clip(local, 0, n - 1))
        hit = (local >= 0) & (local < n)  # every position is in exactly one block
        out = got if out is None else jnp.where(_trailing(hit, got), got, out)
        if i + 1 < cp:
            block = cc.ring_shift(block, axis)
    return out


def _trailing(idx_bs, like):
    """[b, s] as [b, s, 1, ...], as many dimensions as `like`."""
    return idx_bs.reshape(idx_bs.shape + (1,) * (like.ndim - 2))


def _take(x_btk, idx_bs):
    return jnp.take_along_axis(x_btk, _trailing(idx_bs, x_btk), axis=1)


def on_host(out: TeacherOutput, align_bs: np.ndarray) -> TeacherOutput:
    """`at_student_positions` of host arrays (the offline cache's records)."""
    idx = np.maximum(np.asarray(align_bs), 0)
    return jax.tree.map(lambda x: np.take_along_axis(x, _trailing(idx, x), axis=1), out)
