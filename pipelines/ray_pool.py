"""The driver's side of the ray-mode actors: placement, teacher work, restarts, status.

All actors live in one placement group, one bundle per actor (`ray_actors.device_options`),
packed onto as few nodes as fit; a recreated actor takes its predecessor's bundle. Teacher
work is submitted round-robin over the replicas and tracked in `in_flight`, in data order.
A teacher replica that dies is recreated and its in-flight batches are submitted again (the
teacher is deterministic, so nothing downstream changes); a student that dies is recreated
and restores the latest checkpoint. Both are bounded by `ray.max_*_restarts`.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import NamedTuple

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distill import outputs
from distill.config import Config
from distill.errors import DistillError
from distill.mesh import student_size, teacher_size
from pipelines.loop import StudentLost
from pipelines.ray_actors import StudentActor, TeacherActor, device_options

log = logging.getLogger("distill")

PLACEMENT_TIMEOUT_S = 120.0


class Pending(NamedTuple):
    """A batch whose teacher forward was submitted."""

    data_state: dict  # iterator state *before* this batch: where a resume restarts
    batch: ray.ObjectRef  # Batch of host arrays, shared by the teacher and the student
    replica: int
    out: ray.ObjectRef  # TeacherOutput, resolved only in the student's process
    busy_ms: ray.ObjectRef  # small; ready (or failed) together with `out`


def _actor_config(cfg: Config) -> dict:
    """The config tree for the actors, local paths made absolute (their cwd may differ)."""

    def absolute(path: str | None) -> str | None:
        return path if path is None or "://" in path else os.path.abspath(path)

    tree = cfg.model_dump(mode="json")
    tree["run"]["output_dir"] = absolute(cfg.run.output_dir)
    tree["teacher"]["checkpoint"] = absolute(cfg.teacher.checkpoint)
    return tree


def _platform(cfg: Config) -> str:
    if cfg.mesh.platform != "auto":
        return cfg.mesh.platform
    resources = ray.cluster_resources()
    return "gpu" if resources.get("GPU") else "tpu" if resources.get("TPU") else "cpu"


class ActorPool:
    """`teacher.replicas` teacher actors and one student actor, and their bookkeeping."""

    def __init__(self, cfg: Config, store):
        self.cfg, self.store = cfg, store
        self.replicas = cfg.teacher.replicas
        self._tree = _actor_config(cfg)
        platform = _platform(cfg)
        t_bundle, self._t_opts = device_options(teacher_size(cfg), platform)
        s_bundle, self._s_opts = device_options(student_size(cfg), platform)
        self._pg = placement_group([t_bundle] * self.replicas + [s_bundle], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self._pg)
            raise DistillError(
                f"ray: the cluster cannot place {self.replicas} teacher actor(s) with "
                f"{t_bundle} and a student actor with {s_bundle} (mesh.teacher.dp x tp, "
                f"teacher.replicas, mesh.student.dp x fsdp); it has {ray.cluster_resources()}"
            )
        self.teachers: list = [None] * self.replicas
        self.student = None
        self.info: dict[str, dict] = {}  # actor name -> node, pid, platform, layout
        self.restarts = {"teacher": 0, "student": 0}
        self.resumed_from: list[int] = []  # checkpoint steps a recreated student restored
        self.busy: dict[str, float] = {}  # actor name -> busy fraction (set by the loop)
        self.in_flight: deque[Pending] = deque()
        self.student_queued = 0  # steps submitted whose metrics were not read yet
        self._replica_restarts = [0] * self.replicas
        self._rr = 0
        if cfg.pipeline.prefetch < self.replicas:
            log.warning(
                "pipeline.prefetch=%d < teacher.replicas=%d: some teacher replicas will idle",
                cfg.pipeline.prefetch,
                self.replicas,
            )

    # -- lifecycle ------------------------------------------------------------------------

    def _placed(self, index: int, opts: dict) -> dict:
        strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=index)
        return {**opts, "scheduling_strategy": strategy}

    def _new_teacher(self, r: int) -> None:
        opts = self._placed(r, self._t_opts)
        self.teachers[r] = TeacherActor.options(**opts).remote(self._tree)

    def _new_student(self) -> None:
        opts = self._placed(self.replicas, self._s_opts)
        self.student = StudentActor.options(**opts).remote(self._tree)

    def _student_ready(self) -> tuple[int, dict | None]:
        self.info["student"] = _started(self.student, "student")
        return ray.get(self.student.resume_point.remote())

    def start(self) -> tuple[int, dict | None]:
        """Start every actor at once; returns the student's (step, data state) to resume at."""
        for r in range(self.replicas):
            self._new_teacher(r)
        self._new_student()
        for r, actor in enumerate(self.teachers):
            self.info[f"teacher-{r}"] = _started(actor, "teacher")
        resume = self._student_ready()
        self.publish()
        return resume

    def restart_teacher(self, r: int, err: Exception) -> None:
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
        self._replace(f"teacher-{r}", self.teachers[r])
        self._new_teacher(r)
        self.info[f"teacher-{r}"] = _started(self.teachers[r], "teacher")
        self.publish()

    def restart_student(self, err: BaseException) -> tuple[int, dict | None]:
        """Recreate the student; returns the checkpoint (step, data state) it restored."""
        self.restarts["student"] += 1
        limit = self.cfg.ray.max_student_restarts
        if self.restarts["student"] > limit:
            raise DistillError(
                f"ray.max_student_restarts: the student actor died {self.restarts['student']} "
                f"times (limit {limit}); last: {_first_line(err)}"
            ) from None
        log.warning("student actor died (%s); restarting it from its checkpoint", _first_line(err))
        self._replace("student", self.student)
        self._new_student()
        start, data_state = self._student_ready()
        self.resumed_from.append(start)
        log.info("student resumed from checkpoint step %d", start)
        self.publish()
        return start, data_state

    def _replace(self, name: str, actor) -> None:
        ray.kill(actor, no_restart=True)  # if only unreachable, make sure it is gone
        self.info.pop(name, None)
        self.publish()

    def _checkpoint_note(self) -> str:
        try:
            latest = ray.get(self.student.wait_for_checkpoints.remote(), timeout=300)
        except (RayError, TimeoutError):
            latest = None
        where = outputs.checkpoint_dir(self.cfg)
        return f"Latest checkpoint: step {latest} in {where}" if latest else "No checkpoint yet."

    def shutdown(self) -> None:
        for actor in [*self.teachers, self.student]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        remove_placement_group(self._pg)

    # -- teacher work ---------------------------------------------------------------------

    def submit(self, data_state: dict, batch: ray.ObjectRef) -> None:
        """Queue a teacher forward for `batch` on the next replica, round-robin."""
        r, self._rr = self._rr % self.replicas, self._rr + 1
        self.in_flight.append(self._forward(data_state, batch, r))

    def _forward(self, data_state: dict, batch: ray.ObjectRef, r: int) -> Pending:
        out, busy_ms = self.teachers[r].forward.remote(batch)
        return Pending(data_state, batch, r, out, busy_ms)

    def next_output(self) -> tuple[Pending, float]:
        """Pop the oldest in-flight batch once its teacher output exists; with it, the
        forward's busy milliseconds. A dead teacher is recreated and that replica's whole
        share of `in_flight` resubmitted, as often as `ray.max_teacher_restarts` allows."""
        while True:
            head = self.in_flight[0]
            try:
                busy_ms = ray.get(head.busy_ms)
                return self.in_flight.popleft(), busy_ms
            except RayActorError as e:
                self.restart_teacher(head.replica, e)
                redo = [
                    self._forward(p.data_state, p.batch, p.replica)
                    if p.replica == head.replica
                    else p
                    for p in self.in_flight
                ]
                self.in_flight = deque(redo)

    def eval_teacher_logits(self, batches: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Dense teacher logits of each eval batch, spread over the replicas."""
        while True:
            calls = [
                self.teachers[i % self.replicas].eval_logits.remote(b)
                for i, b in enumerate(batches)
            ]
            try:
                ray.get([busy_ms for _, busy_ms in calls])
                return [logits for logits, _ in calls]
            except RayActorError as e:
                dead = [i for i, a in enumerate(self.teachers) if not _alive(a)]
                for r in dead or [0]:
                    self.restart_teacher(r, e)

    # -- status ---------------------------------------------------------------------------

    def student_result(self, ref):
        """ray.get on a student result. The actor's death, or a lost input (which shows as
        a dependency's actor error), raises StudentLost; an error in its code propagates."""
        try:
            return ray.get(ref)
        except RayActorError as e:
            raise StudentLost() from e
        except RayError as e:
            if isinstance(getattr(e, "cause", None), RayActorError):
                raise StudentLost() from e
            raise

    def layout(self) -> dict:
        """The mesh layout the dashboard draws: replica 0's inference mesh, the training mesh."""
        teacher = self.info["teacher-0"]
        return {
            "platform": teacher["platform"],
            "teacher": teacher["layout"],
            "student": self.info["student"]["layout"],
            "teacher_replicas": self.replicas,
        }

    def publish(self) -> None:
        """Each actor's role, node, devices, liveness, restarts, queued work and busy
        fraction, for /api/status and the dashboard."""
        rows = [
            self._row(
                "teacher",
                f"teacher-{r}",
                self._replica_restarts[r],
                sum(p.replica == r for p in self.in_flight),
            )
            for r in range(self.replicas)
        ]
        rows.append(self._row("student", "student", self.restarts["student"], self.student_queued))
        self.store.update(actors=rows, restarts=sum(self.restarts.values()))

    def _row(self, role: str, name: str, restarts: int, queued: int) -> dict:
        info = self.info.get(name, {})
        devices = None
        if info:
            ids = ",".join(str(d["id"]) for d in info["layout"]["devices"])
            devices = f"{info['platform']}:{ids}"
        return {
            "role": role,
            "name": name,
            "node": info.get("node"),
            "devices": devices,
            "alive": bool(info),
            "restarts": restarts,
            "queued": queued,
            "busy": self.busy.get(name),
        }


def _alive(actor) -> bool:
    try:
        ray.get(actor.info.remote(), timeout=60)
        return True
    except (RayError, TimeoutError):
        return False


def _started(actor, role: str) -> dict:
    """Wait for a new actor's constructor; a failure there is reported as one line."""
    try:
        return ray.get(actor.info.remote())
    except RayError as e:
        raise DistillError(f"ray: the {role} actor failed to start: {_cause(e)}") from None


def _cause(err: BaseException) -> str:
    """The last line naming an exception in a Ray error's text (the root cause)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    named = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception"))]
    return (named or lines or [type(err).__name__])[-1]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
