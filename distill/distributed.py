"""One process's membership in a multi-process JAX group (a role spanning hosts).

Each role of `pipeline.mode: ray` with `mesh.<role>.hosts > 1` is its own JAX distributed
system: process 0 of the group picks a free port on its node (`free_port`), the others
learn that address from the driver, and every process calls `join` before its first JAX
computation. Afterwards `jax.devices()` lists every device of the group, process by
process, and a mesh over them spans the hosts. On CPU the collectives between processes
go through gloo, which prints "[Gloo] Rank i is connected to n peer ranks. Expected ..." on
stdout from C++ for every new set of communicating devices; `join` drops those lines
(`drop_gloo_chatter`) and passes everything else on.
"""

from __future__ import annotations

import atexit
import io
import os
import re
import socket
import sys
import threading

# The pieces gloo writes to stdout one `<<` (one write) at a time: these, the rank and peer
# counts between them, and `std::endl` after the last one.
GLOO_START = b"[Gloo] Rank "
_GLOO_PIECES = re.compile(
    rb"(?:\[Gloo\] Rank | is connected to | peer ranks\. "
    rb"|Expected number of connected peer ranks is : |\d+)*\n?"
)


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
        drop_gloo_chatter()
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=300,
    )


class GlooChatter:
    """What to keep of each line C and C++ code print to stdout, gloo's messages dropped.

    gloo's threads connecting different cliques print at once and their pieces interleave:
    a line may hold one message and the head of another (`[Gloo] Rank 0 is connected to 1
    peer ranks. Expected ... : 1[Gloo] Rank 0 is connected to`), whose tail (`1 peer ranks.
    ...`) comes as a later line of its own. Lines count the messages begun but not ended,
    and while any are, a line made only of gloo's pieces is such a tail (so would be a line
    of bare digits that other C code printed just then). Text before a message's start in a
    line is kept."""

    def __init__(self) -> None:
        self.open = 0  # messages begun whose `std::endl` has not come

    def __call__(self, line: bytes) -> bytes:
        cut = line.find(GLOO_START)
        head = line if cut < 0 else line[:cut]
        if self.open and head and _GLOO_PIECES.fullmatch(head):
            head = b""  # the tail of a message begun in an earlier line
        elif cut < 0:
            return line
        self.open += line.count(GLOO_START) - 1  # this line's newline ended one message
        return head


def drop_gloo_chatter() -> None:
    """From now on, what C and C++ code print to this process's stdout (file descriptor 1)
    goes through a thread that drops gloo's messages (`GlooChatter`) and copies the rest to
    the real stdout. Python's `sys.stdout` moves to a descriptor of its own on the real
    stdout, written through at once (as Ray's workers' is), so gloo's pieces, written one
    at a time, never land inside its lines. At exit the pipe is closed and drained first,
    so no line is lost. Idempotent."""
    global _dropping
    if _dropping:
        return
    _dropping = True
    old = sys.stdout
    old.flush()
    real = os.dup(1)
    sys.stdout = io.TextIOWrapper(
        io.FileIO(os.dup(real), "w"),
        encoding=getattr(old, "encoding", None) or "utf-8",
        errors=getattr(old, "errors", None) or "strict",
        line_buffering=True,
        write_through=True,
    )
    sink = os.fdopen(os.dup(real), "wb")
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)
    keep = GlooChatter()

    def copy() -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                line = keep(line)
                if line:
                    sink.write(line)
                    sink.flush()

    thread = threading.Thread(target=copy, name="gloo-chatter-filter", daemon=True)
    thread.start()

    def drain() -> None:
        sys.stdout.flush()
        os.dup2(real, 1)  # closes the pipe's last write end: the thread sees EOF
        thread.join(timeout=5)

    atexit.register(drain)


_dropping = False
