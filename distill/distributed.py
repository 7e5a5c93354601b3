"""One process's membership in a multi-process JAX group (a role spanning hosts).

Each role of `pipeline.mode: ray` with `mesh.<role>.hosts > 1` is its own JAX distributed
system: process 0 of the group picks a free port on its node (`free_port`), the others
learn that address from the driver, and every process calls `join` before its first JAX
computation. Afterwards `jax.devices()` lists every device of the group, process by
process, and a mesh over them spans the hosts. On CPU the collectives between processes
go through gloo, which prints "[Gloo] Rank i is connected to n peer ranks" on stdout from
C++ for every new set of communicating devices; `join` drops those lines
(`drop_stdout_lines`) and passes everything else on.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading

GLOO_CHATTER = b"[Gloo] Rank "


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
        drop_stdout_lines(GLOO_CHATTER)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=300,
    )


def drop_stdout_lines(prefix: bytes) -> None:
    """From now on, drop what this process's stdout (file descriptor 1, so C++ output too)
    prints from `prefix` to the end of a line: fd 1 becomes a pipe that a thread copies to the
    old stdout line by line. At exit the pipe is closed and drained first, so no line is
    lost. Idempotent per prefix."""
    if prefix in _dropped:
        return
    _dropped.add(prefix)
    sys.stdout.flush()
    out = os.dup(1)
    sink = os.fdopen(os.dup(out), "wb")
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def copy() -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                cut = line.find(prefix)  # C++ may print in the middle of a Python line
                if cut >= 0:
                    line = line[:cut]
                if line:
                    sink.write(line)
                    sink.flush()

    thread = threading.Thread(target=copy, name="stdout-filter", daemon=True)
    thread.start()

    def drain() -> None:
        sys.stdout.flush()
        os.dup2(out, 1)  # closes the pipe's last write end: the thread sees EOF
        thread.join(timeout=5)

    atexit.register(drain)


_dropped: set[bytes] = set()
