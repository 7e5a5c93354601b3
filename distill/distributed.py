"""One process's membership in a multi-process JAX group (a role spanning hosts).

Each role of `pipeline.mode: ray` with `mesh.<role>.hosts > 1` is its own JAX distributed
system: process 0 of the group picks a free port on its node (`free_port`), the others
learn that address from the driver, and every process calls `join` before its first JAX
computation. Afterwards `jax.devices()` lists every device of the group, process by
process, and a mesh over them spans the hosts. On CPU the collectives between processes
go through gloo.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this node now (the group's coordinator binds it shortly after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join(coordinator: str, num_processes: int, process_id: int, platform: str) -> None:
    """Make this process member `process_id` of the group coordinated at `coordinator`
    ("host:port"). Blocks until every member has joined. Call before any JAX computation;
    on CPU, selects gloo for the collectives between processes."""
    import jax

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=300,
    )
