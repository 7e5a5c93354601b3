"""`pipeline.mode: local`: one process owns both meshes; JAX's async dispatch overlaps them.

The loop for step n, in dispatch order:
  1. dispatch the student step for batch n (its teacher output is already on the training
     mesh, moved there during step n-1);
  2. top the teacher queue up to `pipeline.prefetch` outputs in flight (Grain fetch, put
     on the inference mesh, dispatch the sharded teacher forward);
  3. move the next batch's teacher output to the training mesh. This transfer may wait
     for the teacher, so it comes after step 1: the training mesh is busy meanwhile;
  4. read step n-lag's metrics, which are long done: the loop never waits on the current
     step. Busy time per mesh comes from watcher threads (`pipelines.timing`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from typing import NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill import losses, outputs
from distill.checkpoint import Checkpointer
from distill.config import Config
from distill.data import Corpus
from distill.mesh import Meshes
from distill.tokenizers import vocab_limit
from distill.types import Batch, TeacherOutput
from pipelines import evaluation
from pipelines.progress import Progress, distill_record
from pipelines.timing import ReadyWatcher
from student import train
from student.state import start_student
from teacher.forward import make_forward
from teacher.weights import load_teacher, student_init_params

log = logging.getLogger("distill")


class InFlight(NamedTuple):
    data_state: dict  # iterator state *before* this batch: where a resume restarts
    batch: Batch  # host arrays
    teacher_out: TeacherOutput  # on the inference mesh (dispatched, maybe not ready)


class Evaluator:
    """Held-out metrics of teacher vs student: dense teacher logits, exact full-vocab KL."""

    def __init__(
        self, cfg: Config, meshes: Meshes, teacher_params, corpus: Corpus, teacher_logits=None
    ):
        limit = vocab_limit(corpus.tokenizer, cfg.teacher.model.vocab_size)
        self._teacher = make_forward(
            cfg.teacher.model,
            meshes.teacher,
            mode="logits",
            dtype=cfg.teacher.dtype,
            vocab_limit=limit,
        )
        self._student = train.make_logits_fn(
            cfg.student_model(), meshes.student, cfg.student.dtype, vocab_limit=limit
        )
        self._params = teacher_params
        self._split = train.batch_sharding(meshes.student)
        self._tput = NamedSharding(meshes.teacher, P())
        self._batches = evaluation.eval_batches(cfg, corpus)
        self._metrics = jax.jit(losses.eval_metrics)
        # the teacher is frozen: keep its logits if they are small (or take them from a cache)
        self._teacher_logits = teacher_logits
        self._keep = evaluation.eval_cache_fits(cfg)

    def _teacher_logits_for(self, i: int, batch: Batch):
        if self._teacher_logits is not None:
            return self._teacher_logits[i]
        logits = self._teacher(self._params, jax.device_put(batch, self._tput))
        return jax.device_put(logits, self._split)

    def __call__(self, student_params) -> dict:
        if self._teacher_logits is None and self._keep:
            self._teacher_logits = [
                self._teacher_logits_for(i, b) for i, b in enumerate(self._batches)
            ]

        def per_chunk():
            for i, b in enumerate(self._batches):
                t_logits = self._teacher_logits_for(i, b)
                sb = jax.device_put(b, self._split)
                logits = self._student(student_params, sb)
                m = self._metrics(logits, t_logits, sb.targets, sb.mask)
                yield {k: float(v) for k, v in jax.device_get(m).items()}

        return evaluation.token_weighted_means(per_chunk())


def _sigterm_flag() -> threading.Event:
    flag = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: flag.set())
    return flag


def distill_local(cfg: Config, corpus: Corpus, meshes: Meshes, store) -> dict:
    """Distil the student; returns the summary written to summary.json."""
    t_start = time.perf_counter()
    tcfg = cfg.teacher.model
    steps, bsz, seq = cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len
    tokens_per_step = bsz * seq
    limit = vocab_limit(corpus.tokenizer, tcfg.vocab_size)  # padded ids: masked throughout

    cached = cfg.teacher.source == "cache"  # offline: batches + teacher outputs from disk
    if cached:
        from pipelines import teacher_cache

        teacher_params = teacher_fwd = None
    else:
        teacher_params = load_teacher(cfg, meshes.teacher)
        mode = "topk" if cfg.teacher.top_k else "dense"
        teacher_fwd = make_forward(
            tcfg,
            meshes.teacher,
            mode=mode,
            temperature=cfg.distill.temperature,
            top_k=cfg.teacher.top_k,
            dtype=cfg.teacher.dtype,
            vocab_limit=limit,
        )
    tx, step_fn = train.distill_step_for(cfg, meshes.student, vocab_limit=limit)
    if cached:  # the stored teacher eval logits, or no periodic eval if too large to store
        logits = teacher_cache.eval_logits(cfg)
        split = train.batch_sharding(meshes.student)
        stored = [jax.device_put(x, split) for x in logits] if logits else None
        evaluate = Evaluator(cfg, meshes, None, corpus, stored) if stored else None
    else:
        evaluate = Evaluator(cfg, meshes, teacher_params, corpus)
    ckpt = Checkpointer(outputs.checkpoint_dir(cfg), keep=cfg.train.keep_checkpoints)

    it = teacher_cache.train_iterator(cfg) if cached else corpus.train_iterator(bsz, cfg.run.seed)
    state, data_state, start = start_student(
        cfg, tx, meshes.student, ckpt, lambda: student_init_params(cfg)
    )
    if start:
        it.set_state(data_state)
        log.info("resuming from checkpoint step %d", start)

    t_put, s_put = NamedSharding(meshes.teacher, P()), train.batch_sharding(meshes.student)
    t_watch, s_watch = ReadyWatcher("teacher"), ReadyWatcher("student")
    in_flight: deque[InFlight] = deque()

    def submit_teacher() -> None:
        data_state = it.get_state()
        if cached:
            batch, out = next(it)  # host arrays; moved to the training mesh like online outputs
        else:
            batch = next(it)
            out = teacher_fwd(teacher_params, jax.device_put(batch, t_put))
            t_watch.watch(out)
        in_flight.append(InFlight(data_state, batch, out))

    def resume_point() -> dict:
        return in_flight[0].data_state if in_flight else it.get_state()

    bytes_per_token = None
    sigterm = _sigterm_flag()
    progress = Progress(steps, start, cfg.run.name)
    store.set_phase("distill", total_steps=steps)
    pending_metrics: deque[tuple[int, dict]] = deque()
    last_eval: dict | None = None
    last_log_t, last_log_step = time.perf_counter(), start
    last_saved = start

    def save(step: int, force: bool = False) -> None:
        nonlocal last_saved
        store.set_phase("checkpoint")
        ckpt.save(step, state, resume_point(), force=force)
        store.set_checkpoint(step, time.time())
        store.set_phase("distill")
        last_saved = step

    def read_metrics(drain: bool = False) -> None:
        nonlocal last_log_t, last_log_step
        while len(pending_metrics) > (0 if drain else cfg.train.metrics_lag):
            step, m = pending_metrics.popleft()
            if step % cfg.train.log_every and step != steps:
                continue
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            now = time.perf_counter()
            rate = (step - last_log_step) * tokens_per_step / max(now - last_log_t, 1e-9)
            n = max(step - last_log_step, 1)
            record = distill_record(
                step,
                m,
                tokens_per_s=rate,
                teacher_ms=t_watch.recent_ms(n),
                student_ms=s_watch.recent_ms(n),
                teacher_busy=t_watch.busy_fraction(last_log_t),
                student_busy=s_watch.busy_fraction(last_log_t),
                in_flight=len(in_flight),
                bytes_per_token=bytes_per_token,
            )
            store.log(record)
            progress.update(step, record)
            last_log_t, last_log_step = now, step

    def run_eval(step: int) -> dict | None:
        if evaluate is None:
            return None
        store.set_phase("eval")
        m = {"step": step, **evaluate(state.params)}
        store.log_eval(m)
        progress.note(
            f"eval step {step}: student {m['student_loss']:.4f} teacher {m['teacher_loss']:.4f} "
            f"kl {m['kl']:.4f} top1 {m['top1_agreement']:.3f}"
        )
        store.set_phase("distill")
        return m

    if start == 0:
        last_eval = run_eval(0)
    for _ in range(cfg.pipeline.prefetch):
        submit_teacher()
    stopped_early = False
    step, next_out = start, None
    for step in range(start + 1, steps + 1):
        item = in_flight.popleft()
        t_out = jax.device_put(item.teacher_out, s_put) if next_out is None else next_out
        state, metrics = step_fn(state, jax.device_put(item.batch, s_put), t_out)  # (1)
        s_watch.watch(metrics)
        pending_metrics.append((step, metrics))
        if step < steps:
            while len(in_flight) < cfg.pipeline.prefetch:  # (2)
                submit_teacher()
            next_out = jax.device_put(in_flight[0].teacher_out, s_put)  # (3)
        if bytes_per_token is None:
            bytes_per_token = sum(x.nbytes for x in jax.tree.leaves(t_out)) / tokens_per_step
        read_metrics()  # (4)
        if step % cfg.train.eval_every == 0 and step != steps:
            last_eval = run_eval(step)
        if step % cfg.train.checkpoint_every == 0 or store.take_checkpoint_request():
            save(step, force=True)
        if sigterm.is_set() or store.stop_requested():
            log.info("stop requested: saving a checkpoint at step %d and exiting", step)
            stopped_early = step != steps
            break
        store.update(step=step, in_flight=len(in_flight))

    read_metrics(drain=True)
    if not stopped_early:
        last_eval = run_eval(step)
    if last_saved != step:
        save(step, force=True)
    ckpt.close()
    t_watch.close()
    s_watch.close()
    progress.close()
    return {
        "steps": step,
        "completed": not stopped_early,
        "wall_time_s": time.perf_counter() - t_start,
        "tokens": (step - start) * tokens_per_step,
        "final_eval": last_eval,
        "bytes_per_token": bytes_per_token,
    }
