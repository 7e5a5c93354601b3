"""The actors of `pipeline.mode: ray`: the processes of each teacher replica's group and of
the student's group, each process owning its host's devices.

An actor process gets its devices from Ray before it imports JAX: GPUs (or TPU chips) as
Ray resources, which Ray makes the only visible ones, or on a host without accelerators its
own simulated CPU devices through `XLA_FLAGS` in the actor's runtime environment
(`device_options`). An actor is built in two calls: its constructor only keeps the config,
and `setup` makes it member `i` of its group's JAX distributed system (when the group has
more than one process: `distill.distributed.join`, with the coordinator that process 0
offered through `address`) and then builds the role's mesh over all of the group's
devices. JAX is imported only inside the actors' methods, never by importing this module.

Actors get the config as a plain tree and validate it themselves, and load the corpus
themselves: for a step the driver sends only its data state (`{"next_index": n}`), and each
process reads the rows of global batch n it needs (`ray_rows.BatchReader`): each process
the rows its devices hold. What crosses between actors is host numpy: a `TeacherOutput`
(top-k, or dense for small vocabularies) and the on-policy rows; between groups of several
processes, row blocks of them (`ray_rows`): each teacher process sends each student
process those of the student process's rows that it holds, and a student process
assembles its rows into the global arrays with the other processes'. Each member runs its
role's own running object, the one local mode runs (`teacher.online.OnlineTeacher`, the
executor of `student.executor.student_executor`), so both modes compute the same numbers.
"""

from __future__ import annotations

import logging
import os
import re
import time

import ray

from distill.allocator import tunables_env
from distill.config.load import config_from_dict
from distill.data.tokenizers import vocab_limit
from distill.errors import DistillError
from distill.mesh import DP, TP, device_grid, student_shape, teacher_shape
from distill.types import TeacherOutput
from pipelines.ray import rows as ray_rows

log = logging.getLogger("distill")

_COUNT_FLAG = "--xla_force_host_platform_device_count"


# The custom Ray resource a node offers (`ray start --resources '{"teacher_host": 1}'`, a
# KubeRay worker group's rayStartParams) to host one process of that role's group.
HOST_RESOURCES = {"teacher": "teacher_host", "student": "student_host"}


def device_options(n_devices: int, platform: str, host: str | None = None) -> tuple[dict, dict]:
    """(placement-group bundle, actor options) giving an actor `n_devices` of `platform`,
    and one unit of the custom resource `host` when given (the role's nodes: see
    `HOST_RESOURCES`; a cluster without it, such as the local one, places anywhere).

    gpu/tpu: Ray resources, so the actor lands on a node that has them and sees only its
    own (JAX picks its platform itself, whatever the driver's environment pins). cpu: one
    CPU slot, and `n_devices` simulated host devices set in the actor's environment before
    its JAX starts (the driver's other XLA flags are kept), with glibc's tunables that keep
    freed host memory for the next step (`distill.allocator`)."""
    auto = {"runtime_env": {"env_vars": {"JAX_PLATFORMS": ""}}}
    mine = {host: 1} if host else {}
    if platform == "gpu":
        opts = {"num_cpus": 1, "num_gpus": n_devices, "resources": mine, **auto}
        return {"CPU": 1, "GPU": n_devices, **mine}, opts
    if platform == "tpu":
        opts = {"num_cpus": 1, "resources": {"TPU": n_devices, **mine}, **auto}
        return {"CPU": 1, "TPU": n_devices, **mine}, opts
    flags = re.sub(_COUNT_FLAG + r"=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    env = {"XLA_FLAGS": " ".join([*flags, f"{_COUNT_FLAG}={n_devices}"]), "JAX_PLATFORMS": "cpu"}
    env.update(tunables_env(os.environ))  # host memory kept between steps (distill.allocator)
    opts = {"num_cpus": 1, "resources": mine, "runtime_env": {"env_vars": env}}
    return {"CPU": 1, **mine}, opts


def _group_mesh(shape: dict[str, int], field: str):
    """A mesh of `shape` ({axis: size}, in order) over the group's first devices: every
    process's (`jax.devices()` is global in a multi-process group), laid out by topology
    across the hosts (`distill.mesh.device_grid`)."""
    import math

    import jax
    from jax.sharding import Mesh

    devices, n = jax.devices(), math.prod(shape.values())
    if len(devices) < n:
        raise DistillError(
            f"{field}: the actor needs {n} devices but sees {len(devices)} "
            f"{devices[0].platform} devices"
        )
    grid = device_grid(devices[:n], tuple(shape.values()))
    return Mesh(grid, tuple(shape))


def _info(mesh, axis: str) -> dict:
    """Where this process runs, the group's mesh and the devices this process owns (status
    API, mesh layout)."""
    import jax

    devs = list(mesh.devices.flat)
    return {
        "node": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "process": jax.process_index(),
        "platform": devs[0].platform,
        "local_devices": [int(d.id) for d in devs if d.process_index == jax.process_index()],
        "layout": {
            "axis": axis,
            "shape": {str(a): int(n) for a, n in mesh.shape.items()},
            "devices": [{"id": int(d.id), "kind": str(d.device_kind)} for d in devs],
        },
    }


class _Member:
    """What every process of a group does: keep the config, offer the group's coordinator
    (process 0), join the group's JAX distributed system."""

    def __init__(self, cfg_tree: dict):
        self._tree = cfg_tree

    def tpu_worker(self) -> int | None:
        """This host's worker index in its TPU slice (`TPU_WORKER_ID`, which GKE sets on
        each host of a multi-host slice), None elsewhere."""
        worker = os.environ.get("TPU_WORKER_ID")
        return int(worker) if worker not in (None, "") else None

    def address(self) -> str:
        """ "ip:port" on this node, free now, for the group's coordinator (process 0)."""
        from distill.distributed import free_port

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def _join(self, coordinator: str | None, n: int, i: int, platform: str):
        """Join the group (n > 1), then the validated config for this process's devices."""
        if n > 1:
            from distill.distributed import join

            join(coordinator, n, i, platform)
        import jax

        cfg = config_from_dict(self._tree)
        cfg.resolve_dtypes(jax.devices()[0].platform)
        self._jax, self._n, self._i = jax, n, i
        return cfg

    def _load_data(self, cfg):
        """This process's own copy of the corpus (rows read by index, from
        `data.prepared_dir` on demand when set; with a teacher tokenizer of its own, the
        teacher's rows of each row's text and the alignment, as local mode reads them)."""
        from distill.data.loader import load_corpus
        from pipelines.preflight import cross_tokenizer_corpus

        if cfg.cross_tokenizer():
            corpus, _ = cross_tokenizer_corpus(cfg)
        else:
            corpus = load_corpus(cfg.data, cfg.train.seq_len)
        self._reader = ray_rows.BatchReader(corpus, cfg.train.batch_size, cfg.run.seed)
        self._data_check = ray_rows.data_check(self._reader)
        return corpus


class TeacherMember(_Member):
    """One process of a teacher replica's group: the inference mesh (axes `dp` x `tp`, as
    in local mode) over the group's devices and the frozen teacher on it."""

    def setup(self, coordinator: str | None, n: int, i: int, platform: str) -> dict:
        cfg = self._join(coordinator, n, i, platform)
        self._start_teacher(cfg, self._load_data(cfg))
        return self.info()

    def _start_teacher(self, cfg, corpus) -> None:
        from teacher.online import OnlineTeacher

        self._t_mesh = _group_mesh(teacher_shape(cfg), "mesh.teacher.dp x tp")
        self._teacher = OnlineTeacher(cfg, self._t_mesh, corpus.teacher_tokenizer)

    def info(self) -> dict:
        return {**_info(self._t_mesh, TP), "data": self._data_check}

    def _send(self, out, owners: tuple[int, ...], whole: bool):
        """A teacher output as it leaves this process: host arrays when `whole` (both
        groups one process), else one list of row pieces per student process (`ray_rows`)."""
        return self._jax.device_get(out) if whole else ray_rows.teacher_parts(out, owners)

    @ray.method(num_returns=2)
    def forward(self, owners: tuple[int, ...], *batch):
        """The teacher output for the student processes that hold the row shards as
        `owners` says (`ray_rows.row_owners`). `batch` is the step's data state (this
        process reads the rows its devices hold) or, on an on-policy step, the rows each
        student process made. Returns (TeacherOutput of host arrays [B, S, k or V], done)
        when both groups are one process; else (one list of pieces per student process: the
        rows of its shards this process holds; done). done: (busy milliseconds, a mixture
        of experts' routing counts as host arrays, `moe.ExpertLoad`, else None)."""
        t0 = time.perf_counter()
        if isinstance(batch[0], dict):
            rows = ray_rows.global_batch(self._reader, batch[0], self._teacher.put)
        else:
            rows = ray_rows.join_batch(list(batch), owners)
        out, load = self._teacher.output(rows)
        whole = self._n == 1 and max(owners) == 0
        out = self._send(out, owners, whole)
        done = (1e3 * (time.perf_counter() - t0), self._jax.device_get(load))
        return (out, done) if whole else (*out, done)

    def eval_logits(self, owners: tuple[int, ...], batch):
        """The dense teacher logits [B, S, V] of an eval chunk (or its position windows:
        `OnlineTeacher.logits`), as `forward` returns its output: (host logits, busy ms)
        when both groups are one process, else (one list of pieces per student process, a
        tuple of lists with windows: the rows of its shards this process holds, busy ms).
        Nothing is gathered: each row leaves once, from a process that holds it, for the
        student process that evaluates it."""
        t0 = time.perf_counter()
        logits = self._teacher.logits(batch)  # or its position windows, a tuple
        if self._n == 1 and max(owners) == 0:
            return self._send(logits, owners, True), 1e3 * (time.perf_counter() - t0)
        if isinstance(logits, tuple):
            parts = ray_rows.window_parts(logits, owners)
        else:
            parts = self._send(TeacherOutput(logits, None), owners, False)
        return (*parts, 1e3 * (time.perf_counter() - t0))

    def nll(self, owners: tuple[int, ...], *rows) -> tuple[float, float]:
        """(the teacher's summed NLL of the masked targets of the rows the student group
        sampled, sent by each student process; their count)."""
        nll, tokens = self._teacher.nll(ray_rows.join_batch(list(rows), owners))
        return float(nll), float(tokens)


class StudentMember(_Member):
    """One process of the student's group: the training mesh (axes `dp` x `fsdp`, `cp`) over the
    group's devices, train state, train step, evaluation, checkpoints (every process writes
    its shards, Orbax multi-host).

    `setup` restores the latest checkpoint of `run.output_dir` if there is one, so a
    recreated student resumes where the last checkpoint left off; `resume_point` says
    where, and the driver's data position starts there."""

    def setup(self, coordinator: str | None, n: int, i: int, platform: str) -> dict:
        cfg = self._join(coordinator, n, i, platform)
        self._start_student(cfg, self._load_data(cfg))
        return self.info()

    def _start_student(self, cfg, corpus) -> None:
        """The student's executor on the group's mesh, assembled as local mode assembles it
        (`student.executor.student_executor`), and started: restored from the latest
        checkpoint when there is one."""
        from pipelines.plan import memory as plan_memory
        from student import train
        from student.executor import student_executor
        from teacher.weights import student_init_params

        limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
        self._mesh = _group_mesh(student_shape(cfg), "mesh.student.dp x fsdp")
        self._split = train.batch_sharding(self._mesh)
        self._owners = ray_rows.row_owners(self._split)
        self._spans = ray_rows.spans(self._owners, self._i, cfg.train.batch_size)
        plan_memory.resolve_remat(cfg, self._mesh, vocab_limit=limit)  # `auto` on these devices
        self._ex = student_executor(cfg, corpus, self._mesh, student_init_params)
        self._start, self._data_state = self._ex.start()
        self._next = self._start + 1
        self._rows = cfg.train.batch_size
        self._tokens = cfg.train.batch_size * cfg.train.seq_len
        self._setup_sampling(cfg, corpus.tokenizer, limit)
        self._cross = None  # across tokenizers: the teacher's rows of the samples
        if corpus.teacher is not None:
            from distill.data.cross.samples import SampleRows

            self._cross = SampleRows(corpus.tokenizer, corpus.teacher, corpus.train.teacher_len)

    def _setup_sampling(self, cfg, tokenizer, limit) -> None:
        """The samplers (on-policy, and the evaluation's at temperature 1); an on-policy run
        generates with the executor's recent parameters (`LocalExecutor.history`)."""
        from distill.data.prompts import prompt_set
        from student.generate import sampler_for

        self._prompt_set = None
        self._prompt_len = cfg.distill.on_policy.lengths(cfg.train.seq_len)[0]
        if cfg.distill.on_policy.fraction > 0:
            self._prompt_set = prompt_set(cfg, tokenizer)  # None: the rows' first tokens
            self._sampler = sampler_for(cfg, self._mesh, tokenizer, limit)
        self._eval_sampler = sampler_for(cfg, self._mesh, tokenizer, limit, temperature=1.0)
        self._key = self._jax.random.key(cfg.run.seed)

    def _sample(self, sampler, params, prompts, key):
        """(this process's rows of the continuations of its rows of the prompts as host
        arrays, {"tokens": the group's generated tokens, "ms": generation time}). Every
        process holds as many rows: of a step's prompts, or of an evaluation chunk's (which
        may have fewer rows than a batch)."""
        t0 = time.perf_counter()
        if self._n > 1:
            rows = prompts.tokens.shape[0] * self._n
            prompts = ray_rows.global_arrays(prompts, sampler.put, rows)  # whole rows
        rows, stats = sampler(params, prompts, key)
        rows, stats = ray_rows.local_rows(rows), self._jax.device_get(stats)
        ms = 1e3 * (time.perf_counter() - t0)
        return rows, {"tokens": int(stats["tokens"]), "logp": float(stats["logp"]), "ms": ms}

    def _prompts(self, step_no: int, data_state: dict):
        """This process's rows of step `step_no`'s prompts (`pipelines.on_policy.step_prompts`):
        of the `data.prompt_field` prompts when set, else the first tokens of its rows."""
        from distill.models.decode import prompts_of

        if self._prompt_set is not None:
            whole = self._prompt_set.batch(step_no, self._rows)
            return type(whole)(*(ray_rows.take(f, self._spans) for f in whole))
        return prompts_of(self._reader.rows(data_state, self._spans), self._prompt_len)

    @ray.method(num_returns=2)
    def generate(self, step_no: int, source_step: int, data_state: dict):
        """(this process's rows of step `step_no`'s on-policy rows, generation figures): its
        rows of the step's prompts (the batch at `data_state`) continued with the
        parameters after `source_step`, with the step's key (as
        `pipelines.on_policy.OnPolicySource`)."""
        key = self._jax.random.fold_in(self._key, step_no)
        prompts = self._prompts(step_no, data_state)
        history = self._ex.history
        rows, figures = self._sample(self._sampler, history.after(source_step), prompts, key)
        if self._cross is not None:  # its rows re-tokenised for the teacher, here on the host
            rows = rows._replace(teacher=self._cross.view(rows))
        return rows, figures

    @ray.method(num_returns=2)
    def sample_eval(self, prompts, chunk: int):
        """(this process's rows of the evaluation's samples of chunk `chunk`, generation
        figures): the current parameters, temperature 1, the chunk's fixed key
        (`pipelines.on_policy.eval_sample_key`)."""
        from pipelines.on_policy import eval_sample_key

        key = eval_sample_key(self._key, chunk)
        return self._sample(self._eval_sampler, self._ex.state.params, prompts, key)

    def info(self) -> dict:
        return {**_info(self._mesh, DP), "data": self._data_check, "row_owners": self._owners}

    def resume_point(self) -> tuple[int, dict | None]:
        """(the step the state is at, the data state of its next batch; None: from the start)."""
        return self._start, self._data_state

    def step(self, step_no: int, batch, *teacher_parts) -> dict:
        """Train on step `step_no`'s batch; metrics as host floats. Steps must come in order:
        a step whose predecessor never ran (its teacher output was lost) is refused. `batch`
        is the step's data state (this process reads its rows) or, on an on-policy step, the
        rows this process generated; in a group of several processes `teacher_parts` are
        the pieces of its rows from each teacher process. `bytes_per_token` counts the
        teacher rows it received."""
        if step_no != self._next:
            raise RuntimeError(f"student step {step_no} out of order: expected {self._next}")
        t0 = time.perf_counter()
        if isinstance(batch, dict):
            batch = self._reader.rows(batch, self._spans)
        t_out, nbytes = self._receive(teacher_parts, self._spans, self._rows)
        if self._n > 1:  # this process's rows into the group's global arrays
            batch = ray_rows.global_arrays(batch, self._split, self._rows)
        m = self._ex.read(self._ex.step(step_no, batch, t_out), True)
        self._next += 1
        m["student_ms"] = 1e3 * (time.perf_counter() - t0)
        m["bytes_per_token"] = nbytes / self._tokens
        return m

    def alpha(self) -> float:
        """The `distill.alpha` the next steps train with (`student.alpha.AlphaSteps`)."""
        return self._ex.alpha

    def set_alpha(self, alpha: float) -> float:
        """Train the next steps with `alpha`; returns it once set."""
        self._ex.set_alpha(alpha)
        return self._ex.alpha

    def evaluate(self, batch, *teacher_parts, keep: bool = False) -> dict:
        """Held-out teacher vs student metrics of one eval chunk (with its token count), by
        the local mode's own `StudentEval`: `batch` is the whole chunk (token ids), and
        `teacher_parts` as `step`'s: this process's rows of the teacher's dense logits
        (`keep`: the driver hands the same logits to every evaluation)."""
        rows = batch.tokens.shape[0]
        spans = ray_rows.spans(self._owners, self._i, rows)
        if ray_rows.is_windowed(teacher_parts):  # position windows (`eval_windows`)
            host, _ = ray_rows.student_window_rows(list(teacher_parts), spans)
            logits = ray_rows.global_arrays(host, self._split, rows)
        else:
            t_out, _ = self._receive(teacher_parts, spans, rows, keep)
            logits = getattr(t_out, "logprobs", t_out)
        if self._n == 1:
            return self._ex.evaluate_one(batch, logits)
        mine = self._jax.tree.map(lambda x: ray_rows.take(x, spans), batch)
        mine = ray_rows.global_arrays(mine, self._split, rows)
        return self._ex.evaluate_one(mine, logits)

    def _receive(self, teacher_parts: tuple, spans, rows: int, keep: bool = False):
        """(the teacher output on the training mesh, the bytes received): the whole host
        output, or this process's rows from the pieces of every teacher process."""
        jax = self._jax
        if not teacher_parts:  # a step without the teacher (`distill.alpha_gate` closed)
            return None, 0
        if len(teacher_parts) == 1 and not isinstance(teacher_parts[0], list):
            t_in = teacher_parts[0]
            nbytes = sum(x.nbytes for x in jax.tree.leaves(t_in))
            return jax.device_put(t_in, self._split), nbytes
        t_in, nbytes = ray_rows.student_rows(list(teacher_parts), spans)
        return ray_rows.global_arrays(t_in, self._split, rows), nbytes

    def save(self, step: int, data_state: dict) -> None:
        """Start an asynchronous checkpoint of the state after `step` (every process of the
        group writes its own shards), as `LocalExecutor.save` does."""
        self._ex.save(step, data_state)

    def wait_for_checkpoints(self) -> int | None:
        """Block until every started checkpoint is written; the latest step on disk."""
        return self._ex.wait_for_checkpoints()

    def close(self) -> None:
        self._ex.finish()


TeacherActor = ray.remote(TeacherMember)
StudentActor = ray.remote(StudentMember)
