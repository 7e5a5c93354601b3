"""Context parallelism in the student's step: each row's sequence split over the training
mesh's `cp` axis (`mesh.student.cp`).

The step is GSPMD (`jax.jit` over `dp` x `fsdp` x `cp`); two things in it are explicit
`jax.shard_map`s over the whole mesh:

- `Context.pieces`: a batch and its teacher output arrive split over `cp` in row order
  (`student.sharding.batch_spec`: device c of a row's cp group holds tokens [c S/cp,
  (c+1) S/cp), so the teacher's output lands without a whole row on any device) and are
  laid out once, at the top of the step, as ring attention wants them: device c gets
  chunks c and 2cp-1-c of L = S / 2cp tokens (`ring_attention.balance`: two `ppermute`s).
  Each device's two chunks are then its own row of S/cp tokens: the [B, S, ...] arrays
  become [B * cp, S / cp, ...] split over (`dp`, `fsdp`, `cp`)
  (`student.sharding.pieces_spec`), without moving anything. Every per-token part of the
  model and of the losses (embedding, RoPE from the permuted positions, which are each
  token's true positions, the matmuls, norms, the chunked KD and CE losses) runs on these
  rows as under plain data parallelism, and the losses, sums over tokens divided by the
  batch's token count, are the whole batch's whatever the order of its tokens.
- `Context.attend`: attention, the one part that crosses positions, runs
  `ring_attention` on each device's pieces, key/value blocks passed around the `cp` ring
  (or gathered, `exchange`), with the causal mask from each chunk's place in the row and
  the segment ids, windows and soft-caps as the single-device kernels apply them.

Across tokenizers (a batch carrying a `TeacherView`) the teacher's output arrives already at
the student's positions ([B, S, ...], `teacher.positions`), split like the batch: its
pieces are made as the batch's, the teacher's own rows are left out of the step, and the
alignment becomes, for each piece, its own position where the student's position is aligned
(-1 where not), so the cross-tokenizer loss reads each position's teacher values in place.

Evaluation (`student.eval_programs`) compares the teacher's dense logits, too large to
lay out again, with each device's row-order slice of the student's (`slices`,
`unbalance`).

With `cp` 1 (no cp axis on the mesh) there is no Context and the step is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distill.mesh import CP
from distill.models.kernels.ring import balance, ring_attention, unbalance
from distill.types import TeacherView
from student import sharding


class Context:
    """The `cp` axis of the training mesh `mesh` (which must have one)."""

    def __init__(self, mesh, exchange: str = "auto"):
        self.mesh, self.exchange = mesh, exchange
        self.cp = dict(mesh.shape)[CP]
        self._batch = sharding.batch_spec(mesh)  # P((dp, fsdp), cp)
        self._pieces = sharding.pieces_spec(mesh)  # P((dp, fsdp, cp))

    @classmethod
    def of(cls, mesh, exchange: str = "auto") -> Context | None:
        """The mesh's Context, None when it has no cp axis."""
        return cls(mesh, exchange) if CP in mesh.axis_names else None

    def pieces(self, tree):
        """Every [B, S, ...] array of `tree` (a Batch, a TeacherOutput; None leaves kept) in
        row order, split as `batch_spec` -> [B * cp, S / cp, ...], each device's row its two
        load-balanced chunks, split as `pieces_spec`. A `TeacherView` becomes its alignment
        alone, in place (see the module's docstring)."""
        run = jax.shard_map(
            functools.partial(balance, axis=CP),
            mesh=self.mesh,
            in_specs=self._batch,
            out_specs=self._pieces,
        )
        views = lambda f, t: jax.tree.map(f, t, is_leaf=_is_view)  # noqa: E731
        return views(_in_place, jax.tree.map(run, views(_alignment, tree)))

    def slices(self, tree):
        """Every [B, S, ...] array of `tree` in row order, split as `batch_spec`, as
        [B * cp, S / cp, ...] split as `pieces_spec`: each device's slice of positions in
        row order a row of its own, the rows in the order `pieces` gives them. Nothing
        moves (evaluation's teacher logits, which are vocabulary-wide)."""
        return jax.tree.map(self._map(lambda x: x, self._batch), tree)

    def unbalance(self, x):
        """x [B * cp, S / cp, ...] as `pieces` lays it out (each device's two load-balanced
        chunks) as `slices` does (each device's slice in row order): two `ppermute`s."""
        return self._map(functools.partial(unbalance, axis=CP), self._pieces)(x)

    def _map(self, fn, in_spec):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_spec, out_specs=self._pieces)

    def attend(
        self, q_bshd, k_bskd, v_bskd, segment_ids_bs, *, scale, window, softcap, sinks=None
    ):  # fmt: skip
        """Attention of every device's pieces (q [B * cp, S / cp, H, hd], ...), as
        `distill.models.attention.attention` on the whole rows. `window`: a Python int,
        None, or a traced int32 scalar (a layer's, under the layer scan). `sinks`: float32
        [H] (on every device; its gradient summed over the ring) or None."""
        rows = self._pieces
        kw = dict(axis=CP, scale=scale, softcap=softcap, exchange=self.exchange)
        # arrays (a traced window, the sinks) go in replicated; None and a Python int as they are
        arrays = {} if sinks is None else {"sinks": sinks}
        if window is None or isinstance(window, int):
            kw["window"] = window
        else:
            arrays["window"] = window

        def local(q, k, v, s, arrays):
            return ring_attention(q, k, v, s, **arrays, **kw)

        run = jax.shard_map(local, mesh=self.mesh, in_specs=(rows,) * 4 + (P(),), out_specs=rows)
        return run(q_bshd, k_bskd, v_bskd, segment_ids_bs, arrays)


def _is_view(x) -> bool:
    return isinstance(x, TeacherView)


def _alignment(x):
    """A TeacherView without the teacher's rows (the step reads its output in place)."""
    return TeacherView(None, x.align) if _is_view(x) else x


def _in_place(x):
    """A TeacherView's alignment [rows, s] as each position's own index where aligned."""
    if not _is_view(x):
        return x
    own = jnp.broadcast_to(jnp.arange(x.align.shape[1], dtype=jnp.int32), x.align.shape)
    return TeacherView(None, jnp.where(x.align >= 0, own, -1))
