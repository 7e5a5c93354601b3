"""`pipeline.mode: ray`: teacher and student groups of Ray actors, each process owning its
host's devices (`mesh.<role>.hosts` processes per group, one JAX distributed system each).

The driver (the `distill run` process, JAX on CPU only) reads no training rows: it counts
the data position (`{"next_index": n}`, the Grain iterator state of local mode) and submits
each step's teacher forward ahead with only that state, round-robin over `teacher.replicas`
teacher groups, with at most `pipeline.prefetch` outputs in flight. Every process reads its
own rows of batch n from its own copy of the corpus (`ray_rows.BatchReader`), so the data
does not pass through the driver either. The student group takes batches strictly in data
order; each student process reads only its rows, and its rows of the teacher output arrive
as object references (one per teacher process) that Ray resolves in that process, so
outputs never pass through the driver. The one data state the student checkpoints is every
process's: a resume on any host count restarts every process at that batch (the global
batch is the same; only its split over the processes differs). The driver waits only on small
values: a forward's busy time (so that a dead teacher is noticed before its output is
handed on) and step n-lag's metrics, as the local loop does.

The loop is the local mode's own (`pipelines.loop.Loop`) with a Ray teacher source and a Ray
student executor: the same records, evals, checkpoints (with the data state of the next
unconsumed batch) and summary. A student group that loses a process is recreated from the
latest checkpoint and the loop restarts from there (`pipelines.ray.pool` has the groups
and their restarts).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import deque
from collections.abc import Sequence

import ray

from distill.config import Config
from distill.data.corpus import Corpus
from distill.mesh import Placement
from distill.observability.expert_load import LoadWindow
from distill.observability.metrics import MetricsStore
from pipelines.evaluation import Evaluation, eval_batches
from pipelines.hooks import Hook, Status
from pipelines.local import distill_hooks
from pipelines.loop import Item, Loop, LoopSpec
from pipelines.on_policy import eval_prompts, schedule_figures, takes_on_policy
from pipelines.progress import distill_record
from pipelines.ray import rows as ray_rows
from pipelines.ray.pool import ActorPool
from pipelines.sources import taught_of
from student.evaluate import combine
from student.executor import eval_byte_lengths

log = logging.getLogger("distill")


def driver_view(cfg: Config) -> Config:
    """The config as the driver process uses it: JAX on CPU only (validation, data, the
    teacher bootstrap) whatever the actors' platform, so the driver holds no accelerator."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    view = cfg.model_copy(deep=True)  # the actors resolve `auto` dtypes for their own devices
    view.mesh.platform = "cpu"
    return view


class RayTeacherSource:
    """The teacher source of ray mode: the driver counts the data position and submits each
    batch's forward to the pool's replicas, round-robin, by its data state alone (every
    process reads its rows of the batch itself)."""

    def __init__(self, cfg: Config, pool: ActorPool):
        self._cfg, self._pool = cfg, pool
        self._next_index = 0  # the data position: the next batch's index
        # (when handed on, replica, busy ms) of recent forwards, as `ReadyWatcher` keeps them
        self._recent: deque[tuple[float, int, float]] = deque(maxlen=256)
        self._next_step = 1
        self._open = True  # the `distill.alpha_gate` (`gate`)
        # (step, what it was made as: `_want`'s "policy", "teacher" or "data") of those in flight
        self._made: deque[tuple[int, str]] = deque()
        self._taken: dict[int, bool] = {}  # whether recent steps trained on-policy
        self._taught_out: deque[bool] = deque(maxlen=4096)  # whether recent pops had an output
        self.loads = LoadWindow(cfg.teacher.moe_capacity_factor is not None)

    def start(self, data_state: dict | None) -> None:
        """Start at `data_state` (a `Corpus.train_iterator` state; None: the first batch)."""
        self._next_index = 0 if data_state is None else int(data_state["next_index"])
        self._pool.in_flight.clear()
        self._made.clear()
        self.loads.clear()
        self._next_step = self._pool.student_start + 1

    def gate(self, open_: bool) -> bool:
        """As `pipelines.on_policy.OnPolicySource.gate`: closed, no teacher forward, and the
        on-policy steps are data steps; True where the run has on-policy steps."""
        self._open = bool(open_)
        return self._cfg.distill.on_policy.fraction > 0

    def submit(self) -> None:
        """The next batch's teacher work; on an on-policy step (as `pipelines.on_policy`
        picks them, `takes_on_policy`) first the student group's continuations of its
        prompts."""
        data_state = {"next_index": self._next_index}
        self._next_index += 1
        step, self._next_step = self._next_step, self._next_step + 1
        self._made.append((step, self._make(step, data_state)))

    def _want(self, step: int) -> str:
        """What step `step` is made as with the gate as it stands: on-policy, a data step
        with the teacher's output, or (closed) a data step without one."""
        if takes_on_policy(self._cfg, step, self._open):
            return "policy"
        return "teacher" if self._open else "data"

    def _make(self, step: int, data_state: dict, head: bool = False) -> str:
        """Submit step `step`'s work as the gate now wants it (`head`: in place of the oldest
        in flight); what it was made as (`_want`)."""
        want = self._want(step)
        if want != "policy":
            self._pool.submit(data_state, head, teacher=want == "teacher")
            return want
        source_step = max(step - 1 - self._cfg.pipeline.max_staleness, 0)
        self._pool.submit_on_policy(data_state, step, source_step, head)
        return want

    def _settle(self) -> None:
        """The oldest batch in flight remade when the gate changed since it was submitted."""
        step, made = self._made[0]
        if self._want(step) != made:
            self._made[0] = (step, self._make(step, self._pool.in_flight[0].data_state, True))

    def pop(self) -> Item:
        """Waits for the forward's busy time (small), so that a dead teacher is noticed and
        its work redone before its output is handed to the student."""
        self._settle()
        step, made = self._made.popleft()
        self._taken[step] = made == "policy"
        self._taken.pop(step - 4096, None)  # steps are popped one by one, in order
        p, busy_ms, load = self._pool.next_output()
        self._taught_out.append(p.out is not None)
        if p.out is not None:
            self._recent.append((time.perf_counter(), p.replica, busy_ms))
        if load is not None:
            self.loads.add(load)
        return Item(p.data_state, p.batch, p.out, p.replica)

    def peek(self) -> Item:
        self._settle()
        p = self._pool.in_flight[0]
        return Item(p.data_state, p.batch, p.out, p.replica)

    def in_flight(self) -> int:
        return len(self._pool.in_flight)

    def resume_point(self) -> dict:
        in_flight = self._pool.in_flight
        return in_flight[0].data_state if in_flight else {"next_index": self._next_index}

    def figures(self, steps: int, since: float, step: int) -> dict:
        """Mean busy ms of the last `steps` forwards; busy fractions since `since`, per
        replica (for the status rows) and over all replicas; the on-policy figures and the
        expert load of the logged steps (step - steps, step]."""
        elapsed = max(time.perf_counter() - since, 1e-9)
        taught = taught_of(self._taught_out, steps)  # the steps with a forward (alpha gate)
        last = list(self._recent)[-taught:] if taught else []
        window = [(r, ms) for t, r, ms in self._recent if t >= since]
        for r in range(self._pool.replicas):
            r_ms = sum(ms for replica, ms in window if replica == r)
            self._pool.busy[f"teacher-{r}"] = min(1.0, r_ms / 1e3 / elapsed)
        t_ms = sum(ms for _, ms in window)
        return {
            "teacher_ms": sum(ms for _, _, ms in last) / max(len(last), 1),
            "teacher_busy": min(1.0, t_ms / 1e3 / elapsed / self._pool.replicas),
            **self._on_policy_figures(range(step - steps + 1, step + 1)),
            **self.loads.figures(steps),
        }

    def _on_policy_figures(self, steps: range) -> dict:
        """The on-policy figures of `pipelines.on_policy.OnPolicySource.figures`, the
        generation figures from the student group's that are ready (never waited for)."""
        if self._cfg.distill.on_policy.fraction == 0:
            return {}
        window = schedule_figures(self._cfg, steps, self._taken)
        n = round(window["on_policy"] * len(steps))
        refs = list(self._pool.generated)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs and n else ([], [])
        figs = ray.get(ready)[-n:] if ready else []
        ms = sum(f["ms"] for f in figs) / len(figs) if figs else 0.0
        tokens = sum(f["tokens"] for f in figs) / len(figs) if figs else 0.0
        return {
            **window,
            "generate_ms": ms,
            "gen_tokens_per_s": tokens / (ms / 1e3) if ms > 0 else 0.0,
        }

    def eval_logits(self, batches: list):
        return self._pool.eval_teacher_logits(batches)

    def close(self) -> None:
        pass


class RayStudentExecutor:
    """The student executor of ray mode: the student group, fed object refs (each process's
    rows of its teacher outputs are resolved in that process, never in the driver's)."""

    hops = False

    def __init__(self, pool: ActorPool, resume: tuple[int, dict | None], byte_lengths=None):
        """`byte_lengths`: as `student.evaluate.StudentEval`'s, for bits per byte."""
        self._pool, self._resume, self._bytes = pool, resume, byte_lengths
        self.tokens = pool.cfg.train.batch_size * pool.cfg.train.seq_len
        self._window: list[float] = []  # student busy ms since the last record
        self._bytes_per_token: float | None = None

    @property
    def pool(self) -> ActorPool:
        """The driver's pool of groups (hooks reach the actors through it)."""
        return self._pool

    @property
    def alpha(self) -> float:
        """The `distill.alpha` the student group's next steps train with."""
        return self._pool.student_result(self._pool.students.call("alpha"))

    def set_alpha(self, alpha: float) -> None:
        """Train the group's next steps with `alpha` (every process, before the next step)."""
        self._pool.student_result(self._pool.students.call("set_alpha", alpha))

    def start(self) -> tuple[int, dict | None]:
        return self._resume

    def restart(self, err: BaseException) -> tuple[int, dict | None]:
        return self._pool.restart_student(err)

    def hop(self, teacher_out):
        return teacher_out

    def step(self, step: int, batch, teacher_out):
        return self._pool.student_step(step, batch, teacher_out)

    def read(self, ref, wanted: bool) -> dict:
        """Every step's result is fetched: a dead student must be noticed."""
        m = self._pool.student_result(ref)
        self._window.append(m["student_ms"])
        self._bytes_per_token = m["bytes_per_token"]
        return m

    def figures(self, steps: int, since: float) -> dict:
        elapsed = max(time.perf_counter() - since, 1e-9)
        window, self._window = self._window, []
        busy = min(1.0, sum(window) / 1e3 / elapsed)
        self._pool.busy["student"] = busy
        return {
            "student_ms": sum(window) / max(len(window), 1),
            "student_busy": busy,
            "bytes_per_token": self._bytes_per_token,
        }

    def evaluate(self, batches: list, teacher_logits, keep: bool) -> dict:
        """Chunk by chunk: each student process gets the chunk's token ids and only its rows
        of the teacher's logits (`keep` is the driver's: kept chunks are its refs)."""
        members = self._pool.students.members
        per_chunk = [
            self._pool.student_result(
                [a.evaluate.remote(batch, *out[p], keep=keep) for p, a in enumerate(members)]
            )
            for batch, out in zip(batches, teacher_logits, strict=True)
        ]
        return combine(per_chunk, [ray.get(b) for b in batches], self._bytes)

    def save(self, step: int, data_state: dict) -> None:
        self._pool.students.call("save", step, data_state)

    def finish(self) -> None:
        self._pool.student_result(self._pool.students.call("wait_for_checkpoints"))


def _run(
    cfg: Config, corpus: Corpus, store: MetricsStore, pool: ActorPool, extra: Sequence[Hook]
) -> dict:
    resume = pool.start()
    store.set_mesh(pool.layout())
    source = RayTeacherSource(cfg, pool)
    executor = RayStudentExecutor(pool, resume, eval_byte_lengths(cfg, corpus))
    batches = eval_batches(cfg, corpus)
    prompts = eval_prompts(cfg, batches)
    samples = lambda: pool.sample_eval(prompts)  # noqa: E731
    if corpus.teacher is not None:  # the teacher scores samples in its own tokens: not built
        samples = None
    evaluate = Evaluation(cfg, [ray.put(b) for b in batches], source, executor, samples)

    def publish(step: int, queued: int) -> None:
        pool.student_queued = queued
        pool.publish()

    hooks = distill_hooks(cfg, evaluate, store, source, [Status(publish), *extra])
    loop = Loop(LoopSpec.of(cfg), source, executor, hooks, record=distill_record, store=store)
    summary = loop.run()
    per_token = summary.get("bytes_per_token")
    return {
        **summary,
        # teacher rows crossing from the teacher groups to the student group, per step
        "bytes_per_step": None if per_token is None else per_token * executor.tokens,
        "teacher_replicas": pool.replicas,
        "hosts": {"teacher": pool.teachers[0].hosts, "student": pool.students.hosts},
        "actor_restarts": dict(pool.restarts),
        "student_resumed_from": list(pool.resumed_from),
    }


def distill_ray(
    cfg: Config, corpus: Corpus, store: MetricsStore, extra: Sequence[Hook] = ()
) -> dict:
    """Distil the student with Ray actors; returns the summary written to summary.json.
    `extra`: hooks after the run's own (a hook reaches the pool as `loop.executor.pool`).

    Joins `ray.address` if set (or the Ray instance this process already runs), else starts
    a local cluster for the run and stops it at the end."""
    owned = not ray.is_initialized()
    processes = actor_processes(cfg)
    with warnings.catch_warnings():  # Ray starts its processes with fork+exec, which is safe
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        if owned and cfg.ray.address:
            ray.init(address=cfg.ray.address)
        elif owned:
            cpus = max(os.cpu_count() or 1, processes)
            ray.init(num_cpus=cpus, include_dashboard=False)
    _warn_raw_corpus(cfg, processes)
    pool = None
    try:
        reader = ray_rows.BatchReader(corpus, cfg.train.batch_size, cfg.run.seed)
        pool = ActorPool(cfg, store, ray_rows.data_check(reader))
        return _run(cfg, corpus, store, pool, extra)
    finally:
        if pool is not None:
            pool.shutdown()
        if owned:
            ray.shutdown()


def actor_processes(cfg: Config) -> int:
    """The run's actor processes: every teacher replica's group and the student's (one
    group for both, colocated)."""
    if cfg.mesh.placement == Placement.COLOCATED:
        return cfg.mesh.student.hosts
    return cfg.teacher.replicas * cfg.mesh.teacher.hosts + cfg.mesh.student.hosts


def _warn_raw_corpus(cfg: Config, processes: int) -> None:
    """Every actor process reads the corpus itself: from `data.source`, each tokenises all
    of it and holds its tokens in memory. Say so once when that is more than two copies."""
    if cfg.data.prepared_dir is None and processes > 2:
        log.warning(
            "data.prepared_dir is not set: each of the %d actor processes tokenises "
            "data.source itself and holds all its tokens; for a large corpus run `distill "
            "prepare` once and set data.prepared_dir (every process then reads only its rows)",
            processes,
        )
