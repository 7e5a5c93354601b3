"""The one loop's contract, on a recording source and executor (no devices).

What every mode relies on: the student step for batch n is dispatched before the teacher
work of later batches is topped up and before batch n+1's hop; at most `pipeline.prefetch`
batches are in flight; metrics are read `train.metrics_lag` steps late; a checkpoint
records the data state of the oldest batch in flight; a lost student restarts the pass
from the executor's checkpoint with the source rewound to match. The real sources and
executors are covered end to end by tests/test_cli.py, test_teacher_cache.py, test_ray.py.
"""

from __future__ import annotations

from collections import deque

import pytest

from distill.config.load import config_from_dict
from pipelines.loop import Hooks, Item, Loop, StudentLost


class Source:
    def __init__(self, log: list):
        self.log, self.q, self.next = log, deque(), 0
        self.max_in_flight = 0

    def start(self, data_state):
        self.next = 0 if data_state is None else data_state["next_index"]
        self.q.clear()
        self.log.append(("start", self.next))

    def submit(self):
        self.q.append(Item({"next_index": self.next}, self.next, f"out{self.next}"))
        self.log.append(("submit", self.next))
        self.next += 1
        self.max_in_flight = max(self.max_in_flight, len(self.q))

    def pop(self):
        return self.q.popleft()

    def peek(self):
        return self.q[0]

    def in_flight(self):
        return len(self.q)

    def resume_point(self):
        return self.q[0].data_state if self.q else {"next_index": self.next}

    def figures(self, steps, since, step):
        return {"teacher_ms": 1.0, "teacher_busy": 0.5}

    def eval_logits(self, batches):
        return None

    def close(self):
        pass


class Executor:
    hops = True

    def __init__(self, log: list, lose_at: int | None = None):
        self.log, self.lose_at, self.saved = log, lose_at, {}
        self.trained: list[int] = []

    def start(self):
        return 0, None

    def restart(self, err):
        step = max(self.saved)
        self.log.append(("restart", step))
        self.trained = self.trained[:step]
        return step, self.saved[step]

    def hop(self, out):
        self.log.append(("hop", out))
        return out

    def step(self, step, batch, out):
        if step == self.lose_at:
            self.lose_at = None
            raise StudentLost()
        assert out == f"out{batch}"
        self.trained.append(batch)
        self.log.append(("step", step, batch))
        return step

    def read(self, handle, wanted):
        self.log.append(("read", handle))
        return {"loss": float(handle)}

    def figures(self, steps, since):
        return {"student_ms": 1.0, "student_busy": 0.5, "bytes_per_token": 2.0}

    def evaluate(self, batches, logits, keep):
        return {}

    def save(self, step, data_state):
        self.saved[step] = data_state
        self.log.append(("save", step, data_state["next_index"]))

    def finish(self):
        pass


def _cfg(prefetch=2, lag=2):
    return config_from_dict(
        {
            "data": {"source": "unused"},
            "train": {"steps": 8, "checkpoint_every": 3, "log_every": 1, "metrics_lag": lag},
            "pipeline": {"prefetch": prefetch},
        }
    )


def _run(cfg, lose_at=None):
    log: list = []
    source, executor = Source(log), Executor(log, lose_at)
    hooks = Hooks(record=lambda step, m, figures: {"step": step, **m, **figures}, progress=False)
    summary = Loop(cfg, source, executor, None, hooks).run()
    return log, source, executor, summary


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_dispatch_order_and_bounded_in_flight(prefetch):
    log, source, executor, summary = _run(_cfg(prefetch))
    assert executor.trained == list(range(8)) and summary["steps"] == 8
    assert source.max_in_flight == prefetch
    for n in range(1, 8):  # step n dispatched before batch n's successors are topped up/hopped
        i = log.index(("step", n, n - 1))
        later = log[i + 1 :]
        assert later.index(("hop", f"out{n}")) < later.index(("step", n + 1, n))
        if n - 1 + prefetch < 8:  # the top-up that step n makes room for comes after it
            assert log.index(("submit", n - 1 + prefetch)) > i
    assert not [e for e in log if e[0] == "submit" and e[1] >= 8]  # no read past the end


def test_metrics_are_read_lag_steps_late():
    log, *_ = _run(_cfg(lag=2))
    steps = [e for e in log if e[0] in ("step", "read")]
    for n in range(3, 9):  # step n-2's metrics are read after step n is dispatched
        assert steps.index(("read", n - 2)) > steps.index(("step", n, n - 1))


def test_checkpoint_records_the_oldest_batch_in_flight():
    log, _, executor, _ = _run(_cfg(prefetch=2))
    # after step 3 (batches 0..2 trained) the next unconsumed batch is 3, whatever is in flight
    assert executor.saved[3] == {"next_index": 3}
    assert executor.saved[6] == {"next_index": 6}
    assert executor.saved[8] == {"next_index": 8}


def test_lost_student_restarts_from_its_checkpoint():
    log, _, executor, summary = _run(_cfg(prefetch=2), lose_at=5)
    assert ("restart", 3) in log and ("start", 3) in log  # the source rewound to batch 3
    assert executor.trained == list(range(8)) and summary["steps"] == 8


def test_a_check_that_fails_stops_the_run_without_final_evaluation_or_checkpoint():
    """`Hooks.check` names a reason at step 4's (lagged) read, during step 6: the loop stops
    there, before step 6's checkpoint, reads nothing more, makes no final evaluation or
    checkpoint, still waits for the checkpoints being written, and says why."""
    log: list = []
    source, executor = Source(log), Executor(log)
    executor.finish = lambda: log.append(("finish",))
    evaluated: list[int] = []
    hooks = Hooks(
        record=lambda step, m, figures: {"step": step, **m},
        evaluate=lambda step: evaluated.append(step),
        check=lambda step, m: f"diverged at {step}" if m["loss"] >= 4 else None,
        progress=False,
    )
    summary = Loop(_cfg(), source, executor, None, hooks).run()
    assert summary["completed"] is False and summary["failure"] == "diverged at 4"
    assert summary["steps"] == 6 and evaluated == [0]
    assert [e for e in log if e[0] == "save"] == [("save", 3, 3)]
    assert [e[1] for e in log if e[0] == "read"] == [1, 2, 3, 4]
    assert log[-1] == ("finish",)
