"""`pipeline.mode: ray`: teacher and student Ray actors, each owning its devices.

The driver (the `distill run` process, JAX on CPU only) reads batches with Grain in the
local mode's order, puts each batch in the object store once and submits its teacher
forward ahead, round-robin over `teacher.replicas` actors, with at most `pipeline.prefetch`
outputs in flight. The student actor takes batches strictly in data order; its teacher
output arrives as an object reference that Ray resolves in the student's process, so
outputs never pass through the driver. The driver waits only on small values: a forward's
busy time (so that a dead teacher is noticed before its output is handed on) and step
n-lag's metrics, as the local loop does.

The loop mirrors `pipelines.local.distill_local` step for step: the same records, evals,
checkpoints (with the data state of the next unconsumed batch) and summary. A student that
dies is recreated from the latest checkpoint and the loop restarts from there
(`pipelines.ray_pool` has the actors and their restarts).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable

import ray

from distill.config import Config
from distill.data import Corpus
from pipelines import evaluation
from pipelines.progress import Progress, distill_record
from pipelines.ray_pool import ActorPool, StudentLost

log = logging.getLogger("distill")


# Called as after_step(step, pool) right after student step `step` is submitted; tests use
# it to kill actors at a chosen point of a run.
after_step: Callable[[int, ActorPool], None] | None = None


def driver_view(cfg: Config) -> Config:
    """The config as the driver process uses it: JAX on CPU only (validation, data, the
    teacher bootstrap) whatever the actors' platform, so the driver holds no accelerator."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    return cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"platform": "cpu"})})


def _sigterm_flag() -> threading.Event:
    flag = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: flag.set())
    return flag


class _Loop:
    """The driver loop over an ActorPool; `run` restarts it when the student is lost."""

    def __init__(self, cfg: Config, corpus: Corpus, store, pool: ActorPool):
        self.cfg, self.corpus, self.store, self.pool = cfg, corpus, store, pool
        self.sigterm = _sigterm_flag()
        self.eval_batches = [ray.put(b) for b in evaluation.eval_batches(cfg, corpus)]
        # The frozen teacher's eval logits are computed once and kept when small (as local
        # mode does), else again for every evaluation.
        self.cache_eval = evaluation.eval_cache_fits(cfg)
        self.eval_logits = None

    def run(self) -> dict:
        t_start = time.perf_counter()
        start, data_state = first = self.pool.start()
        self.store.set_mesh(self.pool.layout())
        while True:
            try:
                summary = self._distill(start, data_state)
                break
            except StudentLost as e:
                start, data_state = self.pool.restart_student(e.__cause__ or e)
        tokens_per_step = self.cfg.train.batch_size * self.cfg.train.seq_len
        return {
            **summary,
            "wall_time_s": time.perf_counter() - t_start,
            "tokens": (summary["steps"] - first[0]) * tokens_per_step,
            "teacher_replicas": self.pool.replicas,
            "actor_restarts": dict(self.pool.restarts),
            "student_resumed_from": list(self.pool.resumed_from),
        }

    def _distill(self, start: int, data_state: dict | None) -> dict:
        """From checkpoint step `start` (data state `data_state`) to the end."""
        cfg, store, pool, student = self.cfg, self.store, self.pool, self.pool.student
        steps, tokens_per_step = cfg.train.steps, cfg.train.batch_size * cfg.train.seq_len
        it = self.corpus.train_iterator(cfg.train.batch_size, seed=cfg.run.seed)
        if data_state is not None:
            it.set_state(data_state)
        pool.in_flight.clear()

        def submit_teacher() -> None:
            data_state = it.get_state()
            pool.submit(data_state, ray.put(next(it)))

        def resume_point() -> dict:
            return pool.in_flight[0].data_state if pool.in_flight else it.get_state()

        bytes_per_token = None
        progress = Progress(steps, start, cfg.run.name)
        store.set_phase("distill", total_steps=steps)
        pending: deque[tuple[int, ray.ObjectRef, int, float]] = deque()  # step, metrics, r, ms
        window: list[tuple[int, float, float]] = []  # (replica, teacher ms, student ms)
        last_eval: dict | None = None
        last_log_t, last_log_step = time.perf_counter(), start
        last_saved = start

        def save(step: int) -> None:
            nonlocal last_saved
            store.set_phase("checkpoint")
            student.save.remote(step, resume_point())
            store.set_checkpoint(step, time.time())
            store.set_phase("distill")
            last_saved = step

        def read_metrics(drain: bool = False) -> None:
            nonlocal last_log_t, last_log_step, bytes_per_token
            while len(pending) > (0 if drain else cfg.train.metrics_lag):
                step, ref, replica, teacher_ms = pending.popleft()
                m = pool.student_result(ref)
                window.append((replica, teacher_ms, m["student_ms"]))
                bytes_per_token = m["bytes_per_token"]
                if step % cfg.train.log_every and step != steps:
                    continue
                now = time.perf_counter()
                elapsed = max(now - last_log_t, 1e-9)
                t_ms, s_ms = sum(w[1] for w in window), sum(w[2] for w in window)
                for r in range(pool.replicas):
                    r_ms = sum(w[1] for w in window if w[0] == r)
                    pool.busy[f"teacher-{r}"] = min(1.0, r_ms / 1e3 / elapsed)
                pool.busy["student"] = min(1.0, s_ms / 1e3 / elapsed)
                record = distill_record(
                    step,
                    m,
                    tokens_per_s=(step - last_log_step) * tokens_per_step / elapsed,
                    teacher_ms=t_ms / len(window),
                    student_ms=s_ms / len(window),
                    teacher_busy=min(1.0, t_ms / 1e3 / elapsed / pool.replicas),
                    student_busy=pool.busy["student"],
                    in_flight=len(pool.in_flight),
                    bytes_per_token=bytes_per_token,
                )
                store.log(record)
                progress.update(step, record)
                window.clear()
                last_log_t, last_log_step = now, step

        def run_eval(step: int) -> dict:
            store.set_phase("eval")
            logits = self.eval_logits or pool.eval_teacher_logits(self.eval_batches)
            if self.cache_eval:
                self.eval_logits = logits
            result = student.evaluate.remote(self.eval_batches, logits, self.cache_eval)
            m = {"step": step, **pool.student_result(result)}
            store.log_eval(m)
            progress.note(
                f"eval step {step}: student {m['student_loss']:.4f} "
                f"teacher {m['teacher_loss']:.4f} kl {m['kl']:.4f} top1 {m['top1_agreement']:.3f}"
            )
            store.set_phase("distill")
            return m

        try:
            if start == 0:
                last_eval = run_eval(0)
            for _ in range(cfg.pipeline.prefetch):
                submit_teacher()
            stopped_early = False
            step = start
            for step in range(start + 1, steps + 1):
                item, teacher_ms = pool.next_output()
                metrics = student.step.remote(step, item.batch, item.out)
                pending.append((step, metrics, item.replica, teacher_ms))
                if step < steps:
                    while len(pool.in_flight) < cfg.pipeline.prefetch:
                        submit_teacher()
                if after_step is not None:
                    after_step(step, pool)
                read_metrics()
                if step % cfg.train.eval_every == 0 and step != steps:
                    last_eval = run_eval(step)
                if step % cfg.train.checkpoint_every == 0 or store.take_checkpoint_request():
                    save(step)
                if self.sigterm.is_set() or store.stop_requested():
                    log.info("stop requested: saving a checkpoint at step %d and exiting", step)
                    stopped_early = step != steps
                    break
                store.update(step=step, in_flight=len(pool.in_flight))
                pool.student_queued = len(pending)
                pool.publish()

            read_metrics(drain=True)
            if not stopped_early:
                last_eval = run_eval(step)
            if last_saved != step:
                save(step)
            pool.student_result(student.wait_for_checkpoints.remote())
            pool.student_queued = 0
            pool.publish()
        finally:
            progress.close()
        return {
            "steps": step,
            "completed": not stopped_early,
            "final_eval": last_eval,
            "bytes_per_token": bytes_per_token,
        }


def distill_ray(cfg: Config, corpus: Corpus, store) -> dict:
    """Distil the student with Ray actors; returns the summary written to summary.json.

    Joins `ray.address` if set (or the Ray instance this process already runs), else starts
    a local cluster for the run and stops it at the end."""
    owned = not ray.is_initialized()
    with warnings.catch_warnings():  # Ray starts its processes with fork+exec, which is safe
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        if owned and cfg.ray.address:
            ray.init(address=cfg.ray.address)
        elif owned:
            cpus = max(os.cpu_count() or 1, cfg.teacher.replicas + 1)
            ray.init(num_cpus=cpus, include_dashboard=False)
    pool = None
    try:
        pool = ActorPool(cfg, store)
        return _Loop(cfg, corpus, store, pool).run()
    finally:
        if pool is not None:
            pool.shutdown()
        if owned:
            ray.shutdown()
