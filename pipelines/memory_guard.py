"""Stop a run before the kernel's out-of-memory killer does (`train.min_free_host_memory_gib`).

On a host whose memory the run outgrows (a teacher and a student on simulated CPU devices
share the host's RAM; a GPU host's loader, caches and pinned buffers grow too) the kernel
kills the process with no message and the step's work is lost. Once each step is
dispatched this hook reads the memory still available
(`pipelines.plan.host_memory.available_bytes`: one small file read, no device wait);
below the floor the run fails (`Loop.fail`: no evaluation or
checkpoint of the state then, since a save needs host memory itself; the newest checkpoint
is kept), with one line naming the figures. The summary records the process's peak
resident memory (`host_rss_peak_bytes`), to set against the plan's host figures.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from typing import Any

from pipelines.hooks import Hook
from pipelines.loop import Loop
from pipelines.plan.host_memory import available_bytes

GIB = 2**30


def peak_rss_bytes() -> int:
    """The process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class HostMemoryGuard(Hook):
    """Fail the run when fewer than `min_free_gib` GiB of host memory remain once a step is
    dispatched (before the step's checkpoint, which the failure then skips). `read`: the
    available bytes now, or None where not known (then nothing is checked); default
    `available_bytes`."""

    def __init__(self, min_free_gib: float, read: Callable[[], int | None] | None = None):
        self.floor, self.read = int(min_free_gib * GIB), read

    def after_dispatch(self, loop: Loop, step: int, handle: Any) -> None:
        if not self.floor:
            return
        free = (self.read or available_bytes)()
        if free is None or free >= self.floor:
            return
        loop.fail(
            f"host memory: {free / GIB:.2f} GiB available after step {step} (this process "
            f"peaked at {peak_rss_bytes() / GIB:.1f} GiB resident), under "
            f"train.min_free_host_memory_gib={self.floor / GIB:g}: stopped before the "
            "kernel's out-of-memory killer would, the newest checkpoint kept; lower "
            "train.batch_size or teacher.microbatch, raise train.grad_accum, set "
            "train.remat: block, or give the run more memory"
        )

    def summary(self) -> dict:
        return {"host_rss_peak_bytes": peak_rss_bytes()}
