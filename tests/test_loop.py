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
from pipelines import hooks as h
from pipelines.loop import Item, Loop, LoopSpec, StudentLost


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


def _run(cfg, lose_at=None, hooks=None):
    """The loop over the recording source and executor; `hooks` default to checkpoints."""
    log: list = []
    source, executor = Source(log), Executor(log, lose_at)
    if hooks is None:
        hooks = [h.Checkpoints(cfg.train.checkpoint_every)]
    record = lambda step, m, figures: {"step": step, **m, **figures}  # noqa: E731
    summary = Loop(LoopSpec.of(cfg), source, executor, hooks, record=record).run()
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


class Remake(h.Hook):
    """At the end of step `at`, the source remakes its oldest item (the next step's, whose
    output the loop has already moved), as the on-policy source does when the alpha gate
    changes."""

    def __init__(self, at: int):
        self.at = at

    def end_of_step(self, loop, step):
        if step == self.at:
            old = loop.source.q[0]
            loop.source.q[0] = Item(old.data_state, f"{old.batch}b", f"out{old.batch}b")


def test_a_remade_item_is_moved_again():
    log, _, executor, _ = _run(_cfg(prefetch=2), hooks=[Remake(3)])
    assert executor.trained == [0, 1, 2, "3b", 4, 5, 6, 7]  # its own output (`Executor.step`)
    assert log.index(("hop", "out3")) < log.index(("hop", "out3b")) < log.index(("step", 4, "3b"))


class Recorder(h.Hook):
    """Every event it sees, as (event, step)."""

    def __init__(self, seen: list):
        self.seen = seen

    def on_start(self, loop, step):
        self.seen.append(("on_start", step))

    def on_metrics(self, loop, step, metrics, record):
        assert record["loss"] == metrics["loss"] == step  # the record of that very step
        self.seen.append(("on_metrics", step))

    def end_of_step(self, loop, step):
        self.seen.append(("end_of_step", step))

    def on_end(self, loop, step):
        self.seen.append(("on_end", step))

    def close(self, loop):
        self.seen.append(("close", None))


def test_hooks_run_at_their_cadence_in_list_order():
    seen: list = []
    every3 = h.Every(lambda loop, step: seen.append(("every3", step)), every=3)
    _, _, executor, summary = _run(_cfg(lag=2), hooks=[every3, Recorder(seen)])
    assert [s for e, s in seen if e == "every3"] == [3, 6]
    assert seen.index(("every3", 3)) < seen.index(("end_of_step", 3))  # list order
    assert [s for e, s in seen if e == "on_metrics"] == list(range(1, 9))  # lagged, all read
    assert seen.index(("on_metrics", 6)) > seen.index(("end_of_step", 7))  # 2 steps late
    assert seen[0] == ("on_start", 0) and seen[-2:] == [("on_end", 8), ("close", None)]
    assert executor.saved == {} and summary["completed"]  # no checkpoint hook: no saves


def test_a_failure_stops_with_no_final_checkpoint_or_evaluation():
    evals: list = []

    def evaluate(step):
        evals.append(step)
        return None

    class Diverge(h.Hook):
        def on_metrics(self, loop, step, metrics, record):
            if step == 4:
                loop.fail("step 4: loss is nan")

    hooks = [h.Evaluate(evaluate, every=3), Diverge(), h.Checkpoints(3)]
    log, _, executor, summary = _run(_cfg(lag=2), hooks=hooks)
    # step 4's metrics are read at step 6: the pass ends there, before step 6's evaluation
    # and checkpoint, and no later metrics are read
    assert summary["steps"] == 6 and not summary["completed"]
    assert summary["failure"] == "step 4: loss is nan"
    assert sorted(executor.saved) == [3] and evals == [0, 3]  # the last good ones only
    assert [e for e in log if e[0] == "read"][-1] == ("read", 4)


def test_a_stop_saves_and_skips_the_final_evaluation_unless_it_is_the_last_step():
    for stop_at, completed, saved in ((5, False, [3, 5]), (8, True, [3, 6, 8])):
        evals: list = []

        def evaluate(step, evals=evals):
            evals.append(step)
            return None

        def stop(loop, step, stop_at=stop_at):
            if step == stop_at:
                loop.stop("stop requested")

        hooks = [h.Evaluate(evaluate, every=100), h.Checkpoints(3), h.Every(stop)]
        _, _, executor, summary = _run(_cfg(), hooks=hooks)
        assert summary["steps"] == stop_at and summary["completed"] == completed
        assert sorted(executor.saved) == saved  # the stop's checkpoint, once
        assert evals == ([0, 8] if completed else [0])


class _Result:
    """A dispatched result that is ready when the test says (`jax.block_until_ready` calls
    its `block_until_ready`)."""

    def __init__(self):
        import threading

        self.ready = threading.Event()

    def block_until_ready(self):
        self.ready.wait(30)
        return self


@pytest.mark.parametrize("colocated", [True, False])
def test_busy_time_of_roles_on_the_same_devices_is_their_own(colocated):
    """A student step dispatched, then a teacher forward queued behind it on the same
    devices: the student's result ready after 0.3 s, the teacher's 0.1 s later. Watchers
    given the same devices (`mesh.placement: colocated`) time the teacher from the step's
    end (0.1 s, not 0.4 s), so the two roles' busy times share the devices' time; watchers
    of their own (split: disjoint devices) time each from its dispatch."""
    import time

    import jax

    from distill.observability import timing

    devices = jax.devices()[6:]  # devices no run of the session's tests uses at once
    where = (devices, devices) if colocated else (devices[:1], devices[1:])
    student, teacher = (timing.ReadyWatcher(n, devices=d) for n, d in zip("st", where, strict=True))
    try:
        step, forward = _Result(), _Result()
        student.watch(step)
        teacher.watch(forward)
        time.sleep(0.3)
        step.ready.set()
        time.sleep(0.1)
        forward.ready.set()
        deadline = time.time() + 30
        while not teacher.recent_ms(1) and time.time() < deadline:
            time.sleep(0.01)
        assert student.recent_ms(1) >= 300
        if colocated:
            # the waiting thread sees the step's end a little after it happens on a busy
            # machine, so the teacher's share can read a few ms under 100; the point is
            # that it is nowhere near the 400 ms from its dispatch
            assert 50 <= teacher.recent_ms(1) < 250
        else:
            assert teacher.recent_ms(1) >= 400
        assert (student._waiter is teacher._waiter) == colocated
    finally:
        student.close()
        teacher.close()
    teacher.close()  # idempotent
    assert frozenset(int(d.id) for d in devices) not in timing._WAITERS  # stopped with the last
