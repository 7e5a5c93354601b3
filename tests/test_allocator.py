"""distill.allocator: host memory kept for reuse on CPU runs, decided before JAX starts.

The effect is checked in fresh processes (the settings only take before JAX's CPU client
starts its threads): a jitted program with a 36 MiB intermediate (past glibc's largest
mmap threshold, 32 MiB) and little arithmetic, run ten times, with and without
`keep_freed_memory`, counting the page faults a run (without: hundreds to thousands, as
the kernel faults pages in 4 KiB or 2 MiB at a time; with: none); and the same settings as
glibc tunables in a started process's environment, as Ray actors on CPU devices get them.
"""

import subprocess
import sys

import pytest

from distill.allocator import TUNABLES, keep_freed_memory, runs_on_cpu, tunables_env

_PROGRAM = """
import resource, sys
if sys.argv[1] == "keep":
    from distill.allocator import keep_freed_memory
    assert keep_freed_memory()
import jax, jax.numpy as jnp
x = jnp.ones((3072, 8))
f = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T) @ x))
f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    f(x).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10)
"""


def _faults_per_run(mode: str, env: dict | None = None) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, mode],
        capture_output=True,
        text=True,
        check=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "", **(env or {})},
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_not_faulted_in_again_every_run():
    plain, kept = _faults_per_run("plain"), _faults_per_run("keep")
    assert plain > 200, f"{plain} faults a run without the setting: the test lost its point"
    assert kept < plain / 20, f"{kept} faults a run with it, {plain} without"
    # a process started with the tunables in its environment (a Ray actor on CPU devices)
    tuned = _faults_per_run("plain", tunables_env({}))
    assert tuned < plain / 20, f"{tuned} faults a run with the tunables, {plain} without"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's tunables")
def test_a_users_own_tunables_come_last_and_win():
    assert tunables_env({}) == {"GLIBC_TUNABLES": TUNABLES}
    theirs = "glibc.malloc.mmap_max=65536"
    assert tunables_env({"GLIBC_TUNABLES": theirs}) == {"GLIBC_TUNABLES": f"{TUNABLES}:{theirs}"}
    # glibc takes the last value of a name: theirs maps large blocks again, in a started
    # process and in the CLI's own, whose mallopt leaves the settings they name alone
    assert _faults_per_run("plain", tunables_env({"GLIBC_TUNABLES": theirs})) > 5_000
    assert _faults_per_run("keep", {"GLIBC_TUNABLES": theirs}) > 5_000


def test_cpu_runs_are_known_before_jax_starts(monkeypatch):
    assert runs_on_cpu("cpu") and not runs_on_cpu("gpu") and not runs_on_cpu("tpu")
    monkeypatch.setattr("distill.allocator.entry_points", lambda group: ["jax_cuda12_plugin"])
    assert not runs_on_cpu("auto")  # a CUDA (or ROCm) plugin installed: an accelerator host


def test_off_glibc_nothing_is_changed(monkeypatch):
    def no_libc(name):
        raise OSError(name)

    monkeypatch.setattr("distill.allocator.ctypes.CDLL", no_libc)
    assert keep_freed_memory() is False
