"""The teacher's running object: the frozen teacher on the inference mesh.

`OnlineTeacher` loads its weights once and dispatches, batch by batch, its training-time
output (top-k or dense log-probs) and its dense eval logits, never waiting for them. Local
mode's online source, the Ray teacher actors, on-policy scoring, `distill eval` and the
teacher cache all run this one object (`pipelines.sources`, `pipelines.ray.actors`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from distill.config import Config
from distill.data.tokenizers import Tokenizer, vocab_limit
from distill.handoff import dense_blocks, eval_windows
from distill.types import Batch, TeacherOutput
from teacher import positions
from teacher.forward import forward_for, make_output_forward
from teacher.sharding import batch_sharding
from teacher.weights import load_teacher


class OnlineTeacher:
    """The frozen teacher on the inference mesh: its weights, its training-time output
    (top-k or dense log-probs, as configured) and its dense eval logits, each batch-major
    with its rows split over the mesh's devices (`teacher.forward`)."""

    def __init__(self, cfg: Config, mesh: Mesh, tokenizer: Tokenizer):
        mcfg = cfg.teacher.model
        self._cfg, self.mesh = cfg, mesh
        limit = vocab_limit(tokenizer, mcfg.vocab_size)  # padded ids: masked throughout
        self.params = load_teacher(cfg, mesh)
        self.put = batch_sharding(mesh)  # batches: rows split over dp, replicated over tp
        self.moe = bool(mcfg.n_experts)
        self._output = make_output_forward(cfg, mesh, limit, expert_load=self.moe)
        kw = {
            "dtype": cfg.teacher.dtype,
            "vocab_limit": limit,
            "microbatch": cfg.teacher.microbatch,
        }
        self._in_place = positions.wanted(cfg)
        self._logits = partial(forward_for, mcfg, mesh, mode="logits", **kw)
        self._target_logprobs = forward_for(mcfg, mesh, mode="target_logprobs", **kw)

    def output(self, batch: Batch) -> tuple:
        """Dispatch the teacher's output for a host batch (not waited for): on the teacher's
        own rows [B, T] when the batch carries them (cross-tokenizer), else on the batch; a
        dense one too large for one array per device in blocks, one per `train.grad_accum`
        microbatch (`distill.handoff.dense_blocks`: block j holds rows j, j + n, ...).
        Returns (the output, a mixture of experts' `moe.ExpertLoad` on device, else None).
        Across tokenizers to a student with `cp`, the output is at the student's positions
        (`teacher.positions`)."""
        out, load = self._own_output(batch)
        if self._in_place and batch.teacher is not None:
            out = positions.at_student_positions(self.mesh, out, batch.teacher.align)
        return out, load

    def _own_output(self, batch: Batch) -> tuple:
        rows = own_rows(batch)
        n = dense_blocks(self._cfg, rows.tokens.shape[1])
        if n == 1:
            out = self._output(self.params, jax.device_put(rows, self.put))
            return out if self.moe else (out, None)
        made = [
            self._output(self.params, jax.device_put(every(rows, j, n), self.put)) for j in range(n)
        ]
        if not self.moe:
            return TeacherOutput(tuple(o.logprobs for o in made), None), None
        load = jax.tree.map(lambda *c: sum(c), *(load for _, load in made))
        return TeacherOutput(tuple(o.logprobs for o, _ in made), None), load

    def logits(self, batch: Batch):
        """The dense logits [B, S, V] of an eval chunk, or where those would reach 2^31
        elements a tuple of its position windows (`distill.handoff.eval_windows`)."""
        rows = own_rows(batch)
        forward = self._logits(windows=eval_windows(self._cfg, rows.tokens.shape[1]))
        return forward(self.params, jax.device_put(rows, self.put))

    def eval_logits(self, batches: list[Batch]):
        """Dense logits of each batch (`logits`), dispatched one at a time as they are
        consumed."""
        return (self.logits(b) for b in batches)

    def nll(self, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """(the teacher's summed NLL of `batch`'s masked targets, their count), on device:
        from its log-probs of the targets alone, never its [B, S, V] ones."""
        batch = jax.device_put(own_rows(batch), self.put)
        return _masked_nll(self._target_logprobs(self.params, batch), batch)


def every(rows: Batch, j: int, n: int) -> Batch:
    """Rows j, j + n, j + 2n, ... of `rows` (`train.grad_accum` microbatch j of n)."""
    return jax.tree.map(lambda x: x[j::n], rows)


def own_rows(batch: Batch) -> Batch:
    """The rows the teacher reads: its own tokens of the batch's text when the batch carries
    them (`distill.types.TeacherView`), else the batch itself; without the batch's route of
    several teachers (`Batch.route`, the host's to weigh their outputs by)."""
    return batch._replace(route=None) if batch.teacher is None else batch.teacher.rows


@jax.jit
def _masked_nll(target_logprobs, batch: Batch):
    return -jnp.sum(target_logprobs * batch.mask), jnp.sum(batch.mask)
