"""The host-memory guard (`train.min_free_host_memory_gib`): a run whose host runs short
of memory stops with one line, exit status 3, before the kernel's out-of-memory killer
would, its newest checkpoint kept and nothing of the state then written; every run's
summary records its peak resident memory. The shortage is the guard's reading made small
(this machine's memory is not exhausted for a test); the loop, the checkpoints and the
exit status are the real ones."""

import json

import pytest

from pipelines import memory_guard
from pipelines.commands.cli import main
from tests.conftest import read_train, tiny_config, write_config


def test_a_run_short_of_host_memory_stops_with_its_last_checkpoint(
    tiny_run, corpus_dir, tmp_path, monkeypatch, capsys
):
    readings = iter([8 * 2**30] * 3)  # three steps' worth of room, then 0.5 GiB
    monkeypatch.setattr(memory_guard, "available_bytes", lambda: next(readings, 2**29))
    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    tree["teacher"].update(checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0)
    tree["train"].update(steps=6, log_every=1, checkpoint_every=2, eval_every=6)
    assert main(["run", write_config(tmp_path, tree)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("distill: error: host memory: 0.50 GiB available after step 4")
    assert "train.min_free_host_memory_gib=1" in err[-1]
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    assert max(r["step"] for r in read_train(out)) <= 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failure"].startswith("host memory:") and not summary["completed"]
    assert summary["host_rss_peak_bytes"] > 2**20


def test_the_guard_reads_nothing_when_off_or_unknown():
    class Loop:
        failure = None

        def fail(self, reason):
            self.failure = reason

    loop = Loop()
    memory_guard.HostMemoryGuard(0, read=lambda: 0).after_dispatch(loop, 1, None)
    memory_guard.HostMemoryGuard(1.0, read=lambda: None).after_dispatch(loop, 1, None)
    assert loop.failure is None
    memory_guard.HostMemoryGuard(1.0, read=lambda: 2**29).after_dispatch(loop, 7, None)
    assert loop.failure.startswith("host memory: 0.50 GiB available after step 7")


@pytest.mark.parametrize("limit, want", [("max", None), ("1000", 400), ("500", 0)])
def test_a_container_limit_bounds_the_available_memory(tmp_path, limit, want):
    from pipelines.plan.host_memory import _cgroup_room

    (tmp_path / "cgroup").write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text(limit + "\n")
    (tmp_path / "job" / "memory.current").write_text("600\n")
    assert _cgroup_room(tmp_path / "cgroup", tmp_path) == want
    assert _cgroup_room(tmp_path / "absent", tmp_path) is None
