"""Eight simulated CPU devices, set once before JAX is imported anywhere in the test run.

Compiled programs go to a persistent cache under .pytest_cache/ (git-ignored): the tests
compile the same small programs many times in fresh `jax.jit` objects (one per CLI run,
Ray actor or layout), and a cache hit skips XLA. On 2 cores tests/test_cli.py takes about
80 s with an empty cache and 53 s with a warm one (a second run). Set
JAX_COMPILATION_CACHE_DIR yourself to put it elsewhere.

Python's cyclic garbage collector runs far less often than its default (700, 10, 10): the
tests trace and lower thousands of JAX programs, whose long-lived caches every full
collection walks again (with the default, about 10% of the CPU time of tests/test_cli.py,
test_tokenizers.py and test_fsdp.py goes to the collector; with these thresholds, about 4%).

XLA:CPU compiles without LLVM's optimisations (`--xla_backend_optimization_level=0`, no
expensive passes) and with its older elemental emitters rather than the MLIR fusion
emitters (`--xla_cpu_use_fusion_emitters=false`, where this XLA still has the flag): the
tests' programs are tiny, so compile time dominates and the programs run as fast either
way. The fusion-emitter flag alone takes about 40% off the compile-bound tests' time
(test_student.py, test_fsdp.py, test_cli.py and test_tokenizers.py on 2 cores with a cold
cache: 198 s without it, 112 s with it). Tests compare programs compiled alike, so their
references are unaffected.

The README's command runs two pytest-xdist workers (`-n 2`, with `--dist loadgroup` from
pyproject.toml): every `ray` test is in one group, run first on one worker, so no two local
Ray clusters share the machine at once, while the other worker takes the other modules,
each a group of its own (its module-scoped fixtures run once). The workers share the
compilation cache: an entry read while the other worker writes it fails its decompression,
which JAX answers with a warning and a compile.
"""

import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts `flag` (it aborts on an unknown one)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
# Probed once: the xdist workers inherit the flags from the controller's environment.
if _FUSION_EMITTERS not in os.environ["XLA_FLAGS"] and _xla_knows(_FUSION_EMITTERS):
    os.environ["XLA_FLAGS"] += " " + _FUSION_EMITTERS
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compilation-cache"),
)
# What distill caches per machine (mesh.placement auto's costs): fresh for each test run.
os.environ.setdefault("DISTILL_CACHE_DIR", tempfile.mkdtemp(prefix="distill-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
gc.set_threshold(10_000, 50, 100)

import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

WORDS = (
    "the teacher holds a large model and serves its logits while the student learns to match "
    "them on another mesh of devices with data parallel steps and a small vocabulary of bytes"
).split()


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """A small deterministic text corpus: 24 files of pseudo-sentences."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(24):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))) for _ in range(30)]
        (root / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """xdist groups (see the module docstring): the `ray` tests one group, first; every
    other module its own."""
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("ray") is None)  # stable


def tiny_config(corpus: str, out: str, **sections) -> dict:
    """A config tree small enough for a CLI run in seconds on CPU."""
    cfg = {
        "run": {"name": "tiny", "output_dir": out, "seed": 0},
        "mesh": {"teacher": {"tp": 2}, "student": {"dp": 2}},
        "teacher": {
            "model": {
                "vocab_size": 260,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "d_ff": 64,
            },
            "checkpoint": f"{out}/teacher",
            "pretrain_steps": 6,
            "top_k": 8,
        },
        "student": {
            "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 32}
        },
        "data": {"source": corpus, "include": ["*.txt"], "eval_batches": 1},
        "train": {
            "steps": 6,
            "batch_size": 4,
            "seq_len": 32,
            "log_every": 2,
            "eval_every": 3,
            "checkpoint_every": 3,
        },
        "optim": {"warmup_steps": 2},
        "server": {"enabled": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


HAS_WANDB = importlib.util.find_spec("wandb") is not None


class TinyRun(NamedTuple):
    tmp: Path  # a directory of the session's own, for files derived from the run
    out: Path  # the run's output dir: read it, or copy it first; never write into it
    cfg_path: str  # the config the run was made with (W&B offline where wandb is installed)
    tree: dict  # the same config tree without W&B, for tests to derive other runs from


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, corpus_dir) -> TinyRun:
    """One `distill run` of `tiny_config`, shared by the tests that only inspect its outputs
    or reuse its teacher (each CLI run traces and lowers its own programs, seconds on CPU):
    the teacher bootstrapped at <out>/teacher (6 steps), the student distilled 6 steps
    (metrics at steps 2, 4, 6; evaluations at 0, 3, 6; checkpoints 3 and 6), TensorBoard
    event files, and W&B offline (files under <out>/wandb) where wandb is installed."""
    from pipelines.commands.cli import main

    tmp = tmp_path_factory.mktemp("tiny_run")
    out = tmp / "out"
    tree = tiny_config(str(corpus_dir), str(out))
    run_tree = yaml.safe_load(yaml.safe_dump(tree))
    with pytest.MonkeyPatch.context() as mp:
        if HAS_WANDB:
            for var, sub in (("CONFIG", "config"), ("CACHE", "cache"), ("DATA", "data")):
                mp.setenv(f"WANDB_{var}_DIR", str(tmp / f"wandb-{sub}"))
            mp.setenv("WANDB_MODE", "offline")
            mp.setenv("WANDB_SILENT", "true")
            mp.delenv("WANDB_API_KEY", raising=False)
            run_tree["wandb"] = {"enabled": True, "mode": "offline", "project": "tiny"}
        cfg_path = tmp / "cfg.yaml"
        cfg_path.write_text(yaml.safe_dump(run_tree))
        assert main(["run", str(cfg_path)]) == 0
    return TinyRun(tmp, out, str(cfg_path), tree)


# -- what the end-to-end tests read back -------------------------------------------------


def write_config(tmp_path, cfg: dict, name: str = "cfg.yaml") -> str:
    """Write a config tree as YAML under `tmp_path`; its path."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def run_with_fault(tmp_path, cfg: dict, fault) -> int:
    """`distill run` of `cfg` with `fault(step, pool)` called right after each student step
    is dispatched (a hook, as `pipelines.hooks.Every` runs one): tests kill Ray actors or
    ask for a stop at a chosen point. The exit status the CLI would give (0, or 2 for a
    DistillError)."""
    from distill.config.load import load_config
    from distill.errors import DistillError
    from pipelines.commands import run
    from pipelines.commands.cli import print_error
    from pipelines.hooks import Every

    hook = Every(lambda loop, step: fault(step, loop.executor.pool), event="after_dispatch")
    try:
        run.run(load_config(write_config(tmp_path, cfg)), extra=[hook])
    except DistillError as e:
        print_error(e)
        return 2
    return 0


def read_records(out) -> list[dict]:
    """Every line of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def read_train(out) -> list[dict]:
    """The run's distillation training records, in order."""
    return [r for r in read_records(out) if r.get("phase") == "distill" and "loss" in r]


def read_evals(out) -> list[dict]:
    return [r for r in read_records(out) if r.get("eval")]


def train_by_step(out) -> dict[int, dict]:
    """The last training record of each step (a resumed run logs some steps twice)."""
    return {r["step"]: r for r in read_train(out)}


def read_summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def cli_env(devices: int | None = None) -> dict:
    """The environment for `python -m pipelines.commands.cli` in a process of its own: the
    tests' cheaper codegen flags kept, the device count left to the CLI (8 simulated CPU
    devices) or set to `devices`."""
    env = dict(os.environ)
    flags = [f for f in env["XLA_FLAGS"].split() if "device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def kill_process(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.kill(pid, signal.SIGKILL)


def run_jax_group(tmp_path, script: str, *args: str, n: int = 2) -> list[str]:
    """Run `script` as the `n` processes of one JAX group on this machine (argv: the
    group's coordinator address, the process id, then `args`); each process's stdout, once
    every one exited cleanly."""
    from distill.distributed import free_port

    path = tmp_path / "member.py"
    path.write_text(script)
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(path), address, str(i), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(n)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-3000:]
    return [out.decode() for out, _ in outs]
