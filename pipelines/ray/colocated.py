"""`mesh.placement: colocated` in ray mode: one group whose processes hold both roles.

Each process of the group builds the teacher's inference mesh and the student's training
mesh over the same devices (its own and, in a group of several processes, the others', as
in local mode's colocated placement) and runs both roles' calls in the order the driver
issues them: the forward of batch n+1, then the step of batch n. A teacher output never
leaves its devices: `forward` keeps it in the process under a key and returns only the key
(`Kept`), and the step (or evaluation) that the driver hands that key to takes it and moves
it to the training mesh's layout on device (`distill.handoff.hop`: no copy where the row
blocks agree). Nothing but keys and metrics crosses the object store, so the steps report
no teacher bytes received.

The group is the pool's only group (`pipelines.ray.pool.ActorPool`): its teacher replica
and its student. A death of any process loses both roles' state, so the pool recreates the
group from the latest checkpoint, as it does a student group (`ray.max_student_restarts`).
"""

from __future__ import annotations

import uuid
from typing import NamedTuple

import ray

from distill.mesh import TP
from pipelines.ray.actors import StudentMember, TeacherMember, _info


class Kept(NamedTuple):
    """A teacher output kept on the devices of the process that made it: `owner` names the
    process (a new one each time the group is recreated), `key` the output there."""

    owner: str
    key: int


class ColocatedMember(StudentMember, TeacherMember):
    """One process of a colocated group: a teacher process and a student process in one."""

    def setup(self, coordinator: str | None, n: int, i: int, platform: str) -> dict:
        cfg = self._join(coordinator, n, i, platform)
        corpus = self._load_data(cfg)
        self._kept: dict[Kept, object] = {}
        self._made, self._me = 0, uuid.uuid4().hex
        self._start_teacher(cfg, corpus)
        self._start_student(cfg, corpus)
        return self.info()

    def info(self) -> dict:
        """The student's process info, with the teacher's mesh layout beside its own."""
        return {**StudentMember.info(self), "teacher_layout": _info(self._t_mesh, TP)["layout"]}

    def _send(self, out, owners: tuple[int, ...], whole: bool):
        """Keep `out` here; its key (for every student process: each takes its own process's
        key, `_mine`). The forward's busy time is its own: it is waited for here, the
        student's next step runs after it anyway."""
        self._jax.block_until_ready(out)
        self._made += 1
        key = Kept(self._me, self._made)
        self._kept[key] = out
        return key if whole else [key] * (max(owners) + 1)

    def _mine(self, teacher_parts: tuple) -> Kept | None:
        """This process's key among a step's teacher parts (one per process of the group);
        None if they are not keys (never, in a colocated pool)."""
        key = teacher_parts[self._i if len(teacher_parts) > 1 else 0]
        return key if isinstance(key, Kept) else None

    def evaluate(self, batch, *teacher_parts, keep: bool = False) -> dict:
        """As the student's; eval logits the driver kept from before the group was recreated
        are made again here (the teacher is frozen: the same logits)."""
        key = self._mine(teacher_parts)
        if key is not None and key.owner != self._me and key not in self._kept:
            self._kept[key] = self._teacher.logits(batch)
        return super().evaluate(batch, *teacher_parts, keep=keep)

    def _receive(self, teacher_parts: tuple, spans, rows: int, keep: bool = False):
        """The kept output the driver named, on the training mesh; no bytes received. It
        is let go once used, unless `keep` (eval logits the driver hands out again)."""
        from distill import handoff

        key = self._mine(teacher_parts)
        if key is None:
            return super()._receive(teacher_parts, spans, rows, keep)
        if key not in self._kept:
            raise RuntimeError(f"teacher output {key} was made by a process that is gone")
        out = self._kept[key] if keep else self._kept.pop(key)
        return handoff.hop(out, self._split), 0


ColocatedActor = ray.remote(ColocatedMember)
