"""Teacher sources of one process: online on the inference mesh, the offline cache, none.

Each reads batches in data order from an iterator whose state is `{"next_index": n}` and
keeps the items whose teacher work has started in a queue, oldest first
(`pipelines.loop.TeacherSource`). The Ray teacher pool is the fourth source
(`pipelines.ray.mode`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from distill.config import Config
from distill.data.tokenizers import Tokenizer, vocab_limit
from distill.handoff import dense_blocks, eval_windows
from distill.observability.expert_load import LoadWindow
from distill.types import Batch, TeacherOutput
from pipelines.loop import Item
from pipelines.offline import teacher_cache
from pipelines.timing import ReadyWatcher
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
    them (`distill.types.TeacherView`), else the batch itself."""
    return batch if batch.teacher is None else batch.teacher.rows


@jax.jit
def _masked_nll(target_logprobs, batch: Batch):
    return -jnp.sum(target_logprobs * batch.mask), jnp.sum(batch.mask)


class QueueSource:
    """A source over `iterator_fn()`, whose items come from `work(next(iterator))`: (batch,
    teacher output, a mixture of experts' routing counts or None), the counts kept as the
    item's tag and, once popped, in `loads` for the records."""

    def __init__(
        self, iterator_fn: Callable[[], Iterator], work: Callable, watcher=None, dropping=False
    ):
        self._iterator_fn, self._work, self._watch = iterator_fn, work, watcher
        self._it: Iterator | None = None
        self._queue: deque[Item] = deque()
        self.loads = LoadWindow(dropping)
        self._taught: deque[bool] = deque(maxlen=4096)  # whether recent pops had an output

    def start(self, data_state: dict | None) -> None:
        self._it = self._iterator_fn()
        if data_state is not None:
            self._it.set_state(data_state)
        self._queue.clear()
        self.loads.clear()

    def submit(self) -> None:
        data_state = self._it.get_state()
        batch, out, load = self._work(next(self._it))
        if self._watch is not None and out is not None:  # None: made later (`pop`)
            self._watch.watch(out)
        self._queue.append(Item(data_state, batch, out, load))

    def pop(self) -> Item:
        item = self._queue.popleft()
        if item.tag is not None:
            self.loads.add(item.tag)
        self._taught.append(item.teacher_out is not None)
        return item

    def peek(self) -> Item:
        return self._queue[0]

    def in_flight(self) -> int:
        return len(self._queue)

    def resume_point(self) -> dict:
        return self._queue[0].data_state if self._queue else self._it.get_state()

    def figures(self, steps: int, since: float, step: int = 0) -> dict:
        """The teacher's time figures and the expert load of the logged steps' batches."""
        if self._watch is None:
            return {"teacher_ms": 0.0, "teacher_busy": 0.0, **self.loads.figures(steps)}
        taught = taught_of(self._taught, steps)  # the steps with a forward (alpha gate)
        return {
            "teacher_ms": self._watch.recent_ms(taught) if taught else 0.0,
            "teacher_busy": self._watch.busy_fraction(since),
            **self.loads.figures(steps),
        }

    def eval_logits(self, batches: list):
        return None

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()


class OnlineSource(QueueSource):
    """Batches from the corpus, each with the teacher's output dispatched on the inference
    mesh (JAX's async dispatch: the teacher works while the student trains). While the
    `distill.alpha_gate` is closed (`gate`) the batches come without one."""

    def __init__(self, cfg: Config, corpus, teacher: OnlineTeacher):
        bsz, seed = cfg.train.batch_size, cfg.run.seed
        super().__init__(
            lambda: corpus.train_iterator(bsz, seed),
            self._work,
            ReadyWatcher("teacher", devices=teacher.mesh.devices.flat),
            dropping=cfg.teacher.moe_capacity_factor is not None,
        )
        self.teacher = teacher
        self._open = True

    def gate(self, open_: bool) -> bool:
        """The `distill.alpha_gate` for the batches not yet popped: open, each with the
        teacher's output; closed (alpha 0: the step is cross-entropy alone), none, and no
        teacher work. A batch in flight made otherwise is remade when popped. False: no
        on-policy steps."""
        self._open = bool(open_)
        return False

    def _work(self, batch: Batch) -> tuple:
        return (batch, *self.teacher.output(batch)) if self._open else (batch, None, None)

    def pop(self) -> Item:
        self._settle()
        return super().pop()

    def peek(self) -> Item:
        self._settle()
        return super().peek()

    def _settle(self) -> None:
        """The oldest batch as the gate now wants it: its output made now, or dropped."""
        head = self._queue[0]
        if (head.teacher_out is not None) != self._open:
            _, out, load = self._work(head.batch)
            if out is not None:
                self._watch.watch(out)
            self._queue[0] = head._replace(teacher_out=out, tag=load)

    def eval_logits(self, batches: list):
        return self.teacher.eval_logits(batches)


class CacheSource(QueueSource):
    """Offline distillation: batches and top-k teacher outputs read back from the teacher
    cache (host arrays); no teacher on any device. Evaluation uses the stored dense eval
    logits, or is skipped when they were too large to store. While the `distill.alpha_gate`
    is closed the batches are handed on without their outputs (the cross-entropy step)."""

    def __init__(self, cfg: Config):
        in_place = positions.wanted(cfg)
        super().__init__(
            lambda: teacher_cache.train_iterator(cfg),
            lambda item: (*(_in_place(*item) if in_place else item), None),
        )
        self._eval = teacher_cache.eval_logits(cfg)
        self._open = True

    def gate(self, open_: bool) -> bool:
        """As `OnlineSource.gate`: closed, the batches come without their outputs."""
        self._open = bool(open_)
        return False

    def pop(self) -> Item:
        return self._gated(super().pop())

    def peek(self) -> Item:
        return self._gated(super().peek())

    def _gated(self, item: Item) -> Item:
        return item if self._open else item._replace(teacher_out=None)

    def eval_logits(self, batches: list):
        return self._eval


def taught_of(taught: deque[bool], steps: int) -> int:
    """How many of the last `steps` batches handed on had a teacher output (all of them
    unless the `distill.alpha_gate` closed): the forwards `teacher_ms` averages over."""
    return sum(list(taught)[-steps:])


def _in_place(batch: Batch, out: TeacherOutput) -> tuple[Batch, TeacherOutput]:
    """A cache record's output [B, T, ...] at the student's positions [B, S, ...]."""
    return batch, positions.on_host(out, batch.teacher.align)


class NoTeacher(QueueSource):
    """Batches alone, for cross-entropy training (the teacher bootstrap)."""

    def __init__(self, iterator_fn: Callable[[], Iterator]):
        super().__init__(iterator_fn, lambda batch: (batch, None, None))
