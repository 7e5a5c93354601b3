"""Host memory for runs on CPU devices: freed blocks kept for the next step.

XLA:CPU gives each execution of a program its temporaries as one block (about 270 MB for
the student step at the quick start's layout with 16 x 256-token rows), taken with
`posix_memalign` on one of its worker threads and freed when the execution ends. glibc
serves a block that large from a thread's arena with a fresh `mmap` and returns it with
`munmap`, so every step faults in, and the kernel zeroes, every page of it again: 65,000
page faults and about 130 ms of kernel time a step there (30% of the step). With one
arena, no `mmap` for large blocks and no trimming of the heap's top, a freed block stays
in the heap and the next execution reuses it: no faults after the first step (in one
process, that step takes 328 ms with these settings against 359 ms without, the teacher's
forward 364 against 373 ms).

The settings must be made before JAX starts its CPU client: a thread that has allocated
keeps its arena. The CLI makes them in its own process (`keep_freed_memory`); a process it
starts for CPU devices (a Ray actor) gets them as glibc tunables in its environment
(`tunables_env`), which glibc reads when the process starts. Either way a setting the user
names in `GLIBC_TUNABLES` is theirs. They only apply where the devices are the host's: on an
accelerator the programs' memory is the device's, and a host of many cores keeps its arenas.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from importlib.metadata import entry_points

log = logging.getLogger(__name__)

# The settings: (glibc tunable, mallopt parameter from malloc.h, value)
_INT_MAX = 2**31 - 1
_SETTINGS = (
    ("glibc.malloc.arena_max", -8, 1),  # M_ARENA_MAX
    ("glibc.malloc.mmap_max", -4, 0),  # M_MMAP_MAX
    ("glibc.malloc.trim_threshold", -1, _INT_MAX),  # M_TRIM_THRESHOLD
)
TUNABLES = ":".join(f"{name}={value}" for name, _, value in _SETTINGS)


def runs_on_cpu(platform: str) -> bool:
    """Whether a run with `mesh.platform` `platform` uses CPU devices: asked for, or `auto`
    on a host whose JAX has no accelerator plugin (CUDA, ROCm, TPU) installed. Decided
    without starting JAX."""
    if platform != "auto":
        return platform == "cpu"
    if entry_points(group="jax_plugins"):
        return False
    return importlib.util.find_spec("libtpu") is None and _no_plugin_modules()


def _no_plugin_modules() -> bool:
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return True
    return spec is None or not list(spec.submodule_search_locations or [])


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed blocks for reuse (module docstring), but for the
    settings this process's `GLIBC_TUNABLES` names: those are the user's. Returns whether
    every setting took: False off glibc (macOS, musl), where nothing changes."""
    theirs = {t.split("=")[0] for t in os.environ.get("GLIBC_TUNABLES", "").split(":")}
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    took = [mallopt(param, value) == 1 for name, param, value in _SETTINGS if name not in theirs]
    done = all(took)
    if not done:
        log.debug("mallopt refused a setting; host allocations left as they are")
    return done


def tunables_env(environ: dict[str, str]) -> dict[str, str]:
    """The `GLIBC_TUNABLES` for a process started on CPU devices: these, then `environ`'s
    own, if any, which win where they name the same (glibc takes the last of a name)."""
    theirs = environ.get("GLIBC_TUNABLES")
    return {"GLIBC_TUNABLES": f"{TUNABLES}:{theirs}" if theirs else TUNABLES}


def release_freed_memory() -> bool:
    """Give the system back the pages of blocks freed so far (glibc's `malloc_trim(0)`,
    which releases every whole free page of the heap, not only its top).

    Kept blocks are what lets each step reuse its temporaries (module docstring), but the
    heap also keeps what one-off work freed: the checkpoint's tensors as they were read and
    converted, the student's starting weights on their way to the device, the compiler's
    own memory, a first evaluation's temporaries. On CPU devices that memory is the same
    RAM the devices' programs need, so a run releases it once that work is done
    (`pipelines.hooks.ReleaseHostMemory`); later steps reuse their blocks as before. Returns
    whether anything was released; False off glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    return trim(0) == 1
