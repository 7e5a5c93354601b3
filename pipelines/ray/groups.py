"""Process groups of `pipeline.mode: ray`: each role (a teacher replica, the student) is a
group of `mesh.<role>.hosts` Ray actors, one per host, forming their own JAX distributed
system.

A group starts in two rounds: its actors are created in their placement-group bundles,
process 0 offers a free port on its node as the group's coordinator, and every process
then joins and builds the role (`ray_actors`), all at once, since joining blocks until
every member has. A JAX distributed system cannot lose a member: when one process dies,
the others may wait forever in a collective, so the group is killed whole and recreated
with a new coordinator (`restart`). `get_all` waits on a result of every member and
reports a dead member as soon as it is known.

Placement (`place`): groups of one process share one placement group packed onto as few
nodes as fit (as before groups existed); a group of several processes gets a placement
group of its own, one bundle per process, STRICT_SPREAD when the cluster has a node for
each, else SPREAD (on one machine, every process on the one node). On a cluster whose
nodes offer a role's custom resource (`teacher_host`, `student_host`: a KubeRay worker group
per role), every bundle asks for one unit of it, so a role's processes land on its own
nodes. On a multi-host TPU slice the members are ordered by the slice's worker index, which
JAX's process index must match.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distill.errors import DistillError

log = logging.getLogger("distill")

PLACEMENT_TIMEOUT_S = 120.0
# After a member's error, how long to wait for the others' results: when a member dies,
# the survivors' collectives may fail too, before or after its death is known.
DEATH_GRACE_S = 20.0


def place(groups: list[tuple[int, dict]]) -> tuple[list[PlacementGroup], list[list[dict]]]:
    """Placement groups for `groups` ((processes, bundle) each); with them, each group's
    scheduling options, one per process. Raises DistillError when the cluster cannot
    place them within PLACEMENT_TIMEOUT_S (the message names the bundles)."""
    single = [i for i, (n, _) in enumerate(groups) if n == 1]
    pgs, where = [], [[] for _ in groups]
    if single:
        pgs.append(placement_group([groups[i][1] for i in single], strategy="PACK"))
        for k, i in enumerate(single):
            where[i] = [_in(pgs[-1], k)]
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    for i, (n, bundle) in enumerate(groups):
        if n > 1:
            strategy = "STRICT_SPREAD" if nodes >= n else "SPREAD"
            if nodes < n:
                log.info("ray: %d processes of one group share %d node(s)", n, nodes)
            pgs.append(placement_group([bundle] * n, strategy=strategy))
            where[i] = [_in(pgs[-1], k) for k in range(n)]
    ready, _ = ray.wait(
        [pg.ready() for pg in pgs], num_returns=len(pgs), timeout=PLACEMENT_TIMEOUT_S
    )
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise DistillError(
            f"ray: the cluster cannot place {_described(groups)} (mesh.teacher.dp x tp / "
            f"hosts, teacher.replicas, mesh.student.dp x fsdp / hosts); it has "
            f"{ray.cluster_resources()}"
        )
    return pgs, where


def _in(pg: PlacementGroup, index: int) -> dict:
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
    return {"scheduling_strategy": strategy}


def _described(groups: list[tuple[int, dict]]) -> str:
    return ", ".join(f"{n} process(es) with {bundle}" for n, bundle in groups)


class Group:
    """One role's processes: actors of `cls` (a `ray_actors` member class), each in its
    placement, members of one JAX distributed system when there are several."""

    def __init__(self, role: str, cls, tree: dict, opts: dict, where: list[dict], platform: str):
        self.role, self._cls, self._tree, self._opts = role, cls, tree, opts
        self._where, self._platform = where, platform
        self.hosts = len(where)
        self.members: list = []
        self._setup: list = []  # the members' setup results, until `ready`
        self.info: list[dict] = []  # per process: node, pid, devices, the group's layout

    def start(self) -> list[dict]:
        """`launch`, then `ready`."""
        self.launch()
        return self.ready()

    def launch(self) -> None:
        """Create the members and give them the group's coordinator; their setups run (the
        model loaded, the state restored) while the driver launches other groups."""
        opts = self._opts
        self.members = [self._cls.options(**opts, **w).remote(self._tree) for w in self._where]
        self._setup = []
        try:
            coordinator = None
            if self.hosts > 1 and self._platform == "tpu":
                self.members = self._by_tpu_worker()
            if self.hosts > 1:
                coordinator = ray.get(self.members[0].address.remote())
        except RayError as e:
            self._failed(e)
        self._setup = [
            m.setup.remote(coordinator, self.hosts, i, self._platform)
            for i, m in enumerate(self.members)
        ]

    def _by_tpu_worker(self) -> list:
        """The members in their TPU slice's worker order: on a multi-host slice, JAX process
        i must run on the slice's worker i, and the group must be the whole slice."""
        workers = ray.get([m.tpu_worker.remote() for m in self.members])
        if sorted(w for w in workers if w is not None) != list(range(self.hosts)):
            self.kill()
            raise DistillError(
                f"mesh.{self.role}.hosts: the {self.role} group's {self.hosts} processes run on "
                f"TPU workers {workers}; a group must be one whole multi-host slice, one process "
                "on each of its hosts"
            )
        return [m for _, m in sorted(zip(workers, self.members, strict=True), key=lambda x: x[0])]

    def ready(self) -> list[dict]:
        """Wait for every member's setup; a failure there is reported as one line."""
        try:
            self.info = get_all(self._setup)
        except RayError as e:
            self._failed(e)
        return self.info

    def _failed(self, err: RayError) -> None:
        self.kill()
        raise DistillError(f"ray: the {self.role} actor failed to start: {_cause(err)}") from None

    def kill(self) -> None:
        """Kill every member (one that is only unreachable too; a survivor may be stuck in a
        collective waiting for a dead one)."""
        for actor in self.members:
            ray.kill(actor, no_restart=True)
        self.members, self.info = [], []

    def restart(self) -> list[dict]:
        """Kill the whole group and start it again (a new JAX distributed system)."""
        self.kill()
        return self.start()

    def call(self, method: str, *args, num_returns: int | None = None) -> list:
        """`method(*args)` on every member, in member order: each member's result ref(s)."""
        refs = []
        for actor in self.members:
            m = getattr(actor, method)
            refs.append((m.options(num_returns=num_returns) if num_returns else m).remote(*args))
        return refs

    def alive(self) -> bool:
        try:
            get_all([actor.info.remote() for actor in self.members], timeout=60)
            return True
        except (RayError, TimeoutError):
            return False

    def row(self) -> dict:
        """Its hosts, nodes and devices for the status rows: `cpu:0,1` for one process,
        `cpu:0,1;2048,2049` (each process's devices, in process order) for several."""
        if not self.info:
            return {"hosts": self.hosts, "node": None, "devices": None, "alive": False}
        nodes = list(dict.fromkeys(i["node"] for i in self.info))
        per_host = ";".join(",".join(str(d) for d in i["local_devices"]) for i in self.info)
        return {
            "hosts": self.hosts,
            "node": ",".join(nodes),
            "devices": f"{self.info[0]['platform']}:{per_host}",
            "alive": True,
        }


def get_all(refs: list, timeout: float | None = None) -> list:
    """ray.get of every ref of a group's members. The first failure is raised as soon as it
    is known, without waiting for the others (in a group whose member died, the survivors
    may wait forever for it); a member's death (RayActorError, also as the cause of a
    task's error) is preferred to the survivors' own errors, waited for DEATH_GRACE_S."""
    pending, deadline = list(refs), None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise TimeoutError(f"{len(pending)} of {len(refs)} results not ready in {timeout} s")
        try:
            ray.get(ready)
        except RayActorError:
            raise
        except RayError as e:
            if len(refs) > 1:
                _raise_death(pending)
            raise e
    return ray.get(refs)


def _raise_death(pending: list) -> None:
    """Raise the RayActorError of a dead member among `pending`, if one shows within
    DEATH_GRACE_S."""
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError:
            raise
        except RayTaskError as e:
            if isinstance(getattr(e, "cause", None), RayActorError):
                raise
        except RayError:
            pass


def _cause(err: BaseException) -> str:
    """The last line naming an exception in a Ray error's text (the root cause)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    named = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception"))]
    return (named or lines or [type(err).__name__])[-1]
