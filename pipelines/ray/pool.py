"""The driver's side of the ray-mode groups: placement, teacher work, restarts, status.

Each teacher replica and the student is a group of processes (`ray_groups.Group`, one
process unless `mesh.<role>.hosts` says more), each in its placement-group bundle; a
recreated group takes its predecessor's bundles. Teacher work is submitted round-robin over
the replicas and tracked in `in_flight`, in data order. The driver sends every process only
the step's data state (a small dict): each reads its rows of the step's batch itself; every
process of a replica's group runs every forward, and each sends each student process only
its rows of the output (`ray_rows`). A
teacher group that loses a process is recreated and its in-flight batches are submitted
again (the teacher is deterministic, so nothing downstream changes); a student group that
loses one is recreated and restores the latest checkpoint. Both are bounded by
`ray.max_*_restarts`.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import NamedTuple

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import remove_placement_group

from distill import outputs
from distill.config import Config
from distill.errors import DistillError
from distill.mesh import Placement, colocated, devices_per_host, hosts
from pipelines.loop import StudentLost
from pipelines.on_policy import sample_metrics
from pipelines.ray import rows as ray_rows
from pipelines.ray.actors import HOST_RESOURCES, StudentActor, TeacherActor, device_options
from pipelines.ray.colocated import ColocatedActor
from pipelines.ray.groups import Group, get_all, place

log = logging.getLogger("distill")


class Pending(NamedTuple):
    """A batch whose teacher forward was submitted."""

    data_state: dict  # iterator state *before* this batch: where a resume restarts
    # the data state again (every process reads its rows of that batch) or, on an on-policy
    # step, refs of the rows each student process made, one per process
    batch: dict | list
    replica: int | None  # None: no forward (the `distill.alpha_gate` closed)
    out: list | None  # per student process, the refs of its rows from each teacher process
    busy_ms: list  # (busy ms, routing counts) per teacher process, small; ready with `out`


def _actor_config(cfg: Config) -> dict:
    """The config tree for the actors, local paths made absolute (their cwd may differ)."""

    def absolute(path: str | None) -> str | None:
        if path is None or "://" in path or path.startswith(("{", "~")):
            return path  # a URI, `{stdlib}/...`, `~/...`: the same from any cwd
        return os.path.abspath(path)

    tree = cfg.model_dump(mode="json")
    tree["run"]["output_dir"] = absolute(cfg.run.output_dir)
    tree["teacher"]["checkpoint"] = absolute(cfg.teacher.checkpoint)
    # every process reads its own rows of the data
    data = tree["data"]
    data["source"], data["prepared_dir"] = absolute(data["source"]), absolute(data["prepared_dir"])
    if data["tokenizer"] != "bytes":
        data["tokenizer"] = absolute(data["tokenizer"])
    if tree["teacher"]["tokenizer"] not in (None, "bytes"):
        tree["teacher"]["tokenizer"] = absolute(tree["teacher"]["tokenizer"])
    return tree


def _platform(cfg: Config) -> str:
    if cfg.mesh.platform != "auto":
        return cfg.mesh.platform
    resources = ray.cluster_resources()
    return "gpu" if resources.get("GPU") else "tpu" if resources.get("TPU") else "cpu"


def _host_resource(role: str) -> str | None:
    """The custom resource marking the nodes of `role` (`ray_actors.HOST_RESOURCES`) when
    the cluster has it (a pod per role's worker group); None: any node will do."""
    name = HOST_RESOURCES[role]
    return name if ray.cluster_resources().get(name) else None


class ActorPool:
    """`teacher.replicas` teacher groups and one student group, and their bookkeeping."""

    def __init__(self, cfg: Config, store, data_check: str | None = None):
        """`data_check`: the driver's `ray_rows.data_check` of the corpus; every process
        must read the same rows (checked as each group starts)."""
        self.cfg, self.store, self._data_check = cfg, store, data_check
        self.replicas = cfg.teacher.replicas
        tree, platform = _actor_config(cfg), _platform(cfg)
        self.student_hosts = hosts(cfg, "student")
        self.colocated = colocated(cfg)
        if self.colocated:  # one group holds both roles (`pipelines.ray.colocated`)
            n = max(devices_per_host(cfg, "teacher"), devices_per_host(cfg, "student"))
            bundle, opts = device_options(n, platform, _host_resource("student"))
            self._pgs, where = place([(self.student_hosts, bundle)])
            self.students = Group("student", ColocatedActor, tree, opts, where[0], platform)
            self.teachers = [self.students]
        else:
            self._split_groups(cfg, tree, platform)
        self.info: dict[str, dict] = {}  # group name -> process 0's info and every process's
        self.restarts = {"teacher": 0, "student": 0}
        self.resumed_from: list[int] = []  # checkpoint steps a recreated student restored
        self.busy: dict[str, float] = {}  # group name -> busy fraction (set by the loop)
        self.in_flight: deque[Pending] = deque()
        self.generated: deque = deque(maxlen=64)  # refs of recent generation figures
        self.student_queued = 0  # steps submitted whose metrics were not read yet
        self.owners: tuple[int, ...] = ()  # ray_rows.row_owners, once the student is ready
        self._replica_restarts = [0] * self.replicas
        self._rr = 0
        if cfg.pipeline.prefetch < self.replicas:
            log.warning(
                "pipeline.prefetch=%d < teacher.replicas=%d: some teacher replicas will idle",
                cfg.pipeline.prefetch,
                self.replicas,
            )

    def _split_groups(self, cfg: Config, tree: dict, platform: str) -> None:
        """`teacher.replicas` teacher groups and the student group, on their own devices."""
        t_bundle, t_opts = device_options(
            devices_per_host(cfg, "teacher"), platform, _host_resource("teacher")
        )
        s_bundle, s_opts = device_options(
            devices_per_host(cfg, "student"), platform, _host_resource("student")
        )
        t_hosts = hosts(cfg, "teacher")
        self._pgs, where = place(
            [(t_hosts, t_bundle)] * self.replicas + [(self.student_hosts, s_bundle)]
        )
        self.teachers = [
            Group("teacher", TeacherActor, tree, t_opts, where[r], platform)
            for r in range(self.replicas)
        ]
        self.students = Group("student", StudentActor, tree, s_opts, where[-1], platform)

    def groups(self) -> list[Group]:
        """Every group once (a colocated pool's one group is its teacher and its student)."""
        return self.teachers if self.colocated else [*self.teachers, self.students]

    @property
    def student(self):
        """Process 0 of the student group (its results stand for the group's)."""
        return self.students.members[0]

    # -- lifecycle ------------------------------------------------------------------------

    def _record(self, name: str, group: Group) -> None:
        self.info[name] = {**group.info[0], "hosts": group.hosts, "processes": group.info}
        for process in group.info:
            if self._data_check is not None and process["data"] != self._data_check:
                raise DistillError(
                    f"data.source: process {process['process']} of {name} on {process['node']} "
                    f"reads other rows ({process['data']}) than the driver ({self._data_check}); "
                    "every host must see the same corpus (data.source or data.prepared_dir)"
                )

    def _student_ready(self) -> tuple[int, dict | None]:
        self._record("student", self.students)
        if self.colocated:
            self._record("teacher-0", self.students)
        self.owners = tuple(self.students.info[0]["row_owners"])  # its layout's rows
        self.student_start, data_state = ray.get(self.student.resume_point.remote())
        return self.student_start, data_state

    def start(self) -> tuple[int, dict | None]:
        """Start every group at once; returns the student's (step, data state) to resume at."""
        for group in self.groups():
            group.launch()
        for r, group in enumerate(self.teachers):
            group.ready()
            self._record(f"teacher-{r}", group)
        self.students.ready()
        resume = self._student_ready()
        self.publish()
        return resume

    def restart_teacher(self, r: int, err: Exception) -> None:
        """Recreate replica r's group and resubmit its share of the in-flight batches (whichever
        call found the death: a forward's, an evaluation's), so one death is one restart."""
        self.restarts["teacher"] += 1
        self._replica_restarts[r] += 1
        limit = self.cfg.ray.max_teacher_restarts
        if self.restarts["teacher"] > limit:
            raise DistillError(
                f"ray.max_teacher_restarts: teacher actors died {self.restarts['teacher']} "
                f"times (limit {limit}); last: replica {r}: {_first_line(err).rstrip('.')}. "
                f"{self._checkpoint_note()}"
            )
        log.warning("teacher replica %d died (%s); restarting it", r, _first_line(err))
        self._down(f"teacher-{r}", self.teachers[r])
        self.teachers[r].start()
        self._record(f"teacher-{r}", self.teachers[r])
        self.in_flight = deque(
            self._forward(p.data_state, p.batch, p.replica) if p.replica == r else p
            for p in self.in_flight
        )
        self.publish()

    def restart_student(self, err: BaseException) -> tuple[int, dict | None]:
        """Recreate the student group; returns the checkpoint (step, data state) it restored."""
        self.restarts["student"] += 1
        limit = self.cfg.ray.max_student_restarts
        if self.restarts["student"] > limit:
            raise DistillError(
                f"ray.max_student_restarts: the student actor died {self.restarts['student']} "
                f"times (limit {limit}); last: {_first_line(err)}"
            ) from None
        log.warning("student actor died (%s); restarting it from its checkpoint", _first_line(err))
        self._down("student", self.students)
        self.students.start()
        start, data_state = self._student_ready()
        self.resumed_from.append(start)
        log.info("student resumed from checkpoint step %d", start)
        self.publish()
        return start, data_state

    def _down(self, name: str, group: Group) -> None:
        group.kill()  # every process: a JAX distributed system cannot lose a member
        self.info.pop(name, None)
        self.publish()

    def wait_for_checkpoints(self, timeout: float | None = None) -> int | None:
        """Block until every checkpoint the student group started is written (on every
        process); the latest step on disk."""
        return get_all(self.students.call("wait_for_checkpoints"), timeout=timeout)[0]

    def _checkpoint_note(self) -> str:
        try:
            latest = self.wait_for_checkpoints(timeout=300)
        except (RayError, TimeoutError):
            latest = None
        where = outputs.checkpoint_dir(self.cfg)
        return f"Latest checkpoint: step {latest} in {where}" if latest else "No checkpoint yet."

    def shutdown(self) -> None:
        for group in self.groups():
            group.kill()
        for pg in self._pgs:
            remove_placement_group(pg)

    # -- teacher work ---------------------------------------------------------------------

    def submit(self, data_state: dict, head: bool = False, teacher: bool = True) -> None:
        """Queue a teacher forward for the batch at `data_state` on the next replica,
        round-robin. Only the data state is sent: every process reads its own rows.
        `head`: in place of the oldest batch in flight (remade), not after the last.
        `teacher` False: the batch alone, no forward (a cross-entropy step)."""
        if not teacher:
            self._queue(Pending(data_state, data_state, None, None, []), head)
            return
        r, self._rr = self._rr % self.replicas, self._rr + 1
        self._queue(self._forward(data_state, data_state, r), head)

    def submit_on_policy(
        self, data_state: dict, step: int, source_step: int, head: bool = False
    ) -> None:
        """Queue on-policy step `step`: every student process continues its rows of the
        step's prompts (made from the batch at `data_state`, or `data.prompt_field`) with
        the parameters after `source_step` (queued after the steps already submitted to
        it), and the next replica scores the rows so made, which go from each student
        process to the teacher group and back as object refs. `head`: as `submit`'s."""
        r, self._rr = self._rr % self.replicas, self._rr + 1
        calls = [
            actor.generate.remote(step, source_step, data_state) for actor in self.students.members
        ]
        self.generated.append(calls[0][1])  # process 0's figures stand for the group's
        self._queue(self._forward(data_state, [rows for rows, _ in calls], r), head)

    def _queue(self, pending: Pending, head: bool) -> None:
        if head:
            self.in_flight[0] = pending
        else:
            self.in_flight.append(pending)

    def sample_eval(self, chunks: list) -> dict:
        """The evaluation's sample metrics (`pipelines.on_policy.SampleScore`) over every
        chunk of prompts in `chunks`."""
        sums = [self._sample_chunk(prompts, i) for i, prompts in enumerate(chunks)]
        nll, logp, tokens = (sum(column) for column in zip(*sums, strict=True))
        return sample_metrics(nll, -logp, tokens, sum(p.tokens.shape[0] for p in chunks))

    def _sample_chunk(self, prompts, chunk: int) -> tuple[float, float, int]:
        """(the teacher's summed NLL, the student's summed log-probability, the tokens) of
        the evaluation's samples of chunk `chunk`: the student group continues `prompts`,
        replica 0 scores the continuations."""
        n = self.student_hosts
        blocks = [prompts] if n == 1 else ray_rows.split_batch(prompts, self.owners)
        calls = [
            actor.sample_eval.remote(blocks[p], chunk)
            for p, actor in enumerate(self.students.members)
        ]
        stats = self.student_result([c for _, c in calls])
        rows = [rows for rows, _ in calls]
        nll, _ = self._on_teacher(
            0, lambda group: get_all(group.call("nll", self.owners, *rows))[0]
        )
        return nll, stats["logp"], stats["tokens"]

    def _on_teacher(self, r: int, call):
        """call(replica r's group); a group that lost a process is recreated and the call
        made again, as often as `ray.max_teacher_restarts` allows."""
        while True:
            try:
                return call(self.teachers[r])
            except RayError as e:
                if not isinstance(e, RayActorError) and self.teachers[r].alive():
                    raise
                self.restart_teacher(r, e)

    def _forward(self, data_state: dict, batch: dict | list, r: int) -> Pending:
        """Every process of replica r's group runs the forward on `batch` (`Pending.batch`);
        process q's result p is the rows it holds of student process p's (one part, the whole
        output, when both groups are one process)."""
        n = self.student_hosts
        parts = batch if isinstance(batch, list) else [batch]
        returns = None if n == 1 else n + 1
        calls = self.teachers[r].call("forward", self.owners, *parts, num_returns=returns)
        out = [[refs[p] for refs in calls] for p in range(n)]
        return Pending(data_state, batch, r, out, [refs[-1] for refs in calls])

    def next_output(self) -> tuple[Pending, float, object]:
        """Pop the oldest in-flight batch once its teacher output exists; with it, the
        forward's busy milliseconds (its slowest process's) and a mixture of experts'
        routing counts (`moe.ExpertLoad` of host arrays, equal on every process; else
        None). A teacher group that lost a process is recreated and that replica's whole
        share of `in_flight` resubmitted, as often as `ray.max_teacher_restarts` allows."""
        while True:
            head = self.in_flight[0]
            if head.out is None:  # no forward to wait for
                return self.in_flight.popleft(), 0.0, None
            try:
                done = get_all(head.busy_ms)  # (busy ms, counts) of each process
                return self.in_flight.popleft(), max(ms for ms, _ in done), done[0][1]
            except RayActorError as e:
                self.restart_teacher(head.replica, e)
            except RayError as e:
                if self.teachers[head.replica].hosts == 1 or self.teachers[head.replica].alive():
                    raise
                self.restart_teacher(head.replica, e)

    def eval_teacher_logits(self, batches: list[ray.ObjectRef]):
        """Per eval chunk, for each student process the refs of its rows of the teacher's
        dense logits (one per teacher process; `TeacherActor.eval_logits`), as they are
        consumed: the next chunk's forward (on the next replica) overlaps this chunk's
        evaluation, and no more than those two chunks exist. A teacher group that dies is
        recreated and its chunks recomputed."""
        n, replicas = self.student_hosts, self.replicas

        def submit(i: int) -> list:
            group = self.teachers[i % replicas]
            return group.call("eval_logits", self.owners, batches[i], num_returns=n + 1)

        calls = {0: submit(0)} if batches else {}
        for i in range(len(batches)):
            if i + 1 < len(batches):
                calls[i + 1] = submit(i + 1)
            while True:
                try:
                    get_all([refs[-1] for refs in calls[i]])
                    break
                except RayError as e:
                    r = i % replicas
                    if not isinstance(e, RayActorError) and self.teachers[r].alive():
                        raise
                    self.restart_teacher(r, e)
                    calls = {j: submit(j) if j % replicas == r else c for j, c in calls.items()}
            out = calls.pop(i)
            yield [[refs[p] for refs in out] for p in range(n)]

    # -- the student group ----------------------------------------------------------------

    def student_step(self, step: int, batch: dict | list, teacher_out: list) -> list:
        """Student process p trains on its rows (`Pending.batch`: it reads them at the data
        state, or takes the rows it made) and its teacher pieces (None: none, alpha 0)."""
        parts = teacher_out or [()] * len(self.students.members)  # None: no teacher this step
        return [
            actor.step.remote(step, batch[p] if isinstance(batch, list) else batch, *parts[p])
            for p, actor in enumerate(self.students.members)
        ]

    def student_result(self, refs: list) -> dict:
        """The results of a call on every student process, process 0's standing for the
        group's, with `student_ms` the slowest process's and `bytes_per_token` summed (what
        every process received). A process's death, or a lost input (which shows as a
        dependency's actor error), raises StudentLost; an error in its code propagates."""
        try:
            results = get_all(refs)
        except RayActorError as e:
            raise StudentLost() from e
        except RayError as e:
            if isinstance(getattr(e, "cause", None), RayActorError) or not self.students.alive():
                raise StudentLost() from e
            raise
        first = results[0]
        if isinstance(first, dict) and "student_ms" in first:
            first = dict(first, student_ms=max(m["student_ms"] for m in results))
            first["bytes_per_token"] = sum(m["bytes_per_token"] for m in results)
        return first

    # -- status ---------------------------------------------------------------------------

    def layout(self) -> dict:
        """The mesh layout the dashboard draws: replica 0's inference mesh, the training mesh."""
        teacher = self.info["teacher-0"]
        return {
            "platform": teacher["platform"],
            "placement": str(Placement.COLOCATED if self.colocated else Placement.SPLIT),
            "teacher": teacher.get("teacher_layout", teacher["layout"]),
            "student": self.info["student"]["layout"],
            "teacher_replicas": self.replicas,
            "teacher_hosts": self.teachers[0].hosts,
            "student_hosts": self.students.hosts,
        }

    def publish(self) -> None:
        """Each group's role, hosts (processes), nodes, devices (per process), liveness,
        restarts, queued work and busy fraction, for /api/status and the dashboard (a
        colocated group: one row, both roles)."""
        if self.colocated:
            queued, restarts = len(self.in_flight) + self.student_queued, self.restarts["student"]
            row = self._row("teacher+student", "student", self.students, restarts, queued)
            row["name"] = "colocated"
            row["busy"] = min(1.0, sum(self.busy.get(k) or 0.0 for k in ("teacher-0", "student")))
            self.store.update(actors=[row], restarts=self.restarts["student"])
            return
        rows = [
            self._row(
                "teacher",
                f"teacher-{r}",
                self.teachers[r],
                self._replica_restarts[r],
                sum(p.replica == r for p in self.in_flight),
            )
            for r in range(self.replicas)
        ]
        student = (
            "student",
            "student",
            self.students,
            self.restarts["student"],
            self.student_queued,
        )
        rows.append(self._row(*student))
        self.store.update(actors=rows, restarts=sum(self.restarts.values()))

    def _row(self, role: str, name: str, group: Group, restarts: int, queued: int) -> dict:
        where = group.row() if name in self.info else {**group.row(), "alive": False}
        return {
            "role": role,
            "name": name,
            **where,
            "restarts": restarts,
            "queued": queued,
            "busy": self.busy.get(name),
        }


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
