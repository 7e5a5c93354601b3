"""Teacher sources of one process: online on the inference mesh (`teacher.online`), a
server (`teacher.endpoint`), the offline cache, none.

Each reads batches in data order from an iterator whose state is `{"next_index": n}` and
keeps the items whose teacher work has started in a queue, oldest first
(`pipelines.loop.TeacherSource`). The Ray teacher pool is the fifth source
(`pipelines.ray.mode`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

from distill.config import Config
from distill.observability.expert_load import LoadWindow
from distill.observability.timing import ReadyWatcher
from distill.types import Batch, TeacherOutput
from pipelines.loop import Item
from pipelines.offline import teacher_cache
from teacher import positions
from teacher.endpoint import EndpointTeacher
from teacher.online import OnlineTeacher

log = logging.getLogger("distill")


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
        # which batches this source's teacher works on (one of several teachers on batches
        # of one teacher's rows: `pipelines.teachers`); None: every batch
        self.wants: Callable[[Batch], bool] | None = None

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

    def teaches(self, batch: Batch) -> bool:
        """Whether this source's teacher works on `batch` (`wants`)."""
        return self.wants is None or self.wants(batch)

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
        if self._open and self.teaches(batch):
            return (batch, *self.teacher.output(batch))
        return batch, None, None

    def pop(self) -> Item:
        self._settle()
        return super().pop()

    def peek(self) -> Item:
        self._settle()
        return super().peek()

    def _settle(self) -> None:
        """The oldest batch as the gate now wants it: its output made now, or dropped."""
        head = self._queue[0]
        if (head.teacher_out is not None) != (self._open and self.teaches(head.batch)):
            _, out, load = self._work(head.batch)
            if out is not None:
                self._watch.watch(out)
            self._queue[0] = head._replace(teacher_out=out, tag=load)

    def eval_logits(self, batches: list):
        return self.teacher.eval_logits(batches)


class EndpointSource(QueueSource):
    """Batches from the corpus, each with its top-k asked of a server (`teacher.endpoint`):
    its requests go out when the batch is read (`pipeline.prefetch` batches ahead, at most
    `teacher.endpoint.concurrency` requests in flight), and a batch is handed on only once
    all of them are in. While the `distill.alpha_gate` is closed the batches come without
    their outputs; no evaluation compares with the teacher (a server gives no dense logits).

    Evaluation takes the student's held-out figures alone (`student_eval`): a server gives
    no dense logits to compare them with.

    `interrupted()` (a SIGTERM or the dashboard's stop, `pipelines.local`) ends a wait for
    the server in `peek`: the item it then gives carries a placeholder output, never trained
    on (the loop stops at the step's end and checkpoints before that batch, which `pop`
    would wait for again)."""

    def __init__(self, cfg: Config, corpus, teacher: EndpointTeacher):
        bsz, seed = cfg.train.batch_size, cfg.run.seed
        super().__init__(lambda: corpus.train_iterator(bsz, seed), self._work)
        self.teacher = teacher
        self._open = True
        self.interrupted = lambda: False
        self._waits: deque[float] = deque(maxlen=4096)  # ms the loop waited for each answer

    student_eval = True  # `pipelines.evaluation.Evaluation`: the student's figures alone

    def gate(self, open_: bool) -> bool:
        """As `OnlineSource.gate`: closed, the batches come without their outputs."""
        self._open = bool(open_)
        return False

    def _work(self, batch: Batch) -> tuple:
        if not self.teaches(batch):
            return batch, None, None
        index = self._it.get_state()["next_index"] - 1  # the batch just read
        return batch, self.teacher.output(batch, index), None

    def pop(self) -> Item:
        self._resolved_head()
        return self._gated(super().pop())

    def peek(self) -> Item:
        head = self._resolved_head(self.interrupted)
        if head is None:  # a stop asked for while the server is awaited
            log.info("stop requested while waiting for the teacher's server")
            pending = self._queue[0].teacher_out
            return self._queue[0]._replace(teacher_out=pending.placeholder())
        return self._gated(head)

    def _resolved_head(self, interrupted=None) -> Item | None:
        """The oldest batch with its output in: waits for the server (retrying as it
        must); None once `interrupted()`, the batch left waiting."""
        head = self._queue[0]
        if head.teacher_out is not None and not isinstance(head.teacher_out, TeacherOutput):
            t0 = time.perf_counter()
            out = head.teacher_out.result(interrupted)
            if out is None:
                return None
            head = self._queue[0] = head._replace(teacher_out=out)
            self._waits.append(1000 * (time.perf_counter() - t0))
        return head

    def figures(self, steps: int, since: float, step: int = 0) -> dict:
        """teacher_ms: the mean time the loop waited for a batch's answer (what the
        prefetch did not hide); teacher_wait_s: the time in waits before retrying a server
        that did not answer (`EndpointTeacher.waited_s`); teacher_busy None: the server's
        own busy time is not known here (so the status names no bottleneck)."""
        recent = list(self._waits)[-steps:]
        return {
            "teacher_ms": sum(recent) / len(recent) if recent else 0.0,
            "teacher_busy": None,
            "teacher_wait_s": self.teacher.waited_s,
        }

    def _gated(self, item: Item) -> Item:
        return item if self._open else item._replace(teacher_out=None)

    def start(self, data_state: dict | None) -> None:
        for item in self._queue:
            if not isinstance(item.teacher_out, TeacherOutput | None):
                item.teacher_out.cancel()
        super().start(data_state)

    def close(self) -> None:
        self.teacher.close()


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
