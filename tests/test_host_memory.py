"""Host memory on CPU devices (pipelines/plan/host_memory.py): the plan sums both roles'
compiled peaks over their devices, and a run refuses, in one line naming a layout that
fits, a layout whose sum exceeds the memory available (here set by the test: the
machine's own is what it is)."""

import json

from distill.config import Config
from distill.mesh import build_meshes
from pipelines.commands.cli import main
from pipelines.plan import host_memory
from pipelines.plan import memory as plan_memory
from tests.conftest import tiny_config, write_config

WIDE = {  # weights, not activations, dominate: replicas cost what they copy
    "model": {"vocab_size": 260, "d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
              "d_ff": 1024},
    "top_k": 8,
}  # fmt: skip


def _tree(corpus_dir, tmp_path, mesh):
    return tiny_config(
        str(corpus_dir), str(tmp_path / "out"), mesh=mesh, teacher=WIDE,
        student={"model": {"d_model": 128, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
                           "d_ff": 1024}},
        train={"batch_size": 4, "seq_len": 16},
    )  # fmt: skip


def _needed(tree) -> tuple[int, dict]:
    cfg = Config.model_validate(tree)
    cfg.resolve_dtypes("cpu")
    meshes = build_meshes(cfg)
    mem = plan_memory.memory(cfg, meshes, None)
    return host_memory.host_figures(meshes, mem, None)["needed_bytes"], mem


REPLICATED = {"teacher": {"dp": 4, "tp": 1}, "student": {"dp": 4}}
ONE_EACH = {"teacher": {"dp": 1, "tp": 1}, "student": {"dp": 1}}


def test_the_sum_counts_every_replica(corpus_dir, tmp_path):
    """Four replicas of each role hold four copies of its weights in the one RAM: the sum
    is each compiled peak times its devices, well above one device per role."""
    replicated, mem = _needed(_tree(corpus_dir, tmp_path, REPLICATED))
    one, _ = _needed(_tree(corpus_dir, tmp_path, ONE_EACH))
    peaks = sum(4 * mem[r]["peak_bytes_per_device"] for r in ("teacher", "student"))
    assert replicated == peaks + host_memory.HOST_RESERVE
    assert replicated - host_memory.HOST_RESERVE > 2 * (one - host_memory.HOST_RESERVE)


def test_a_run_is_refused_what_exceeds_the_machine(corpus_dir, tmp_path, monkeypatch, capsys):
    replicated, _ = _needed(_tree(corpus_dir, tmp_path, REPLICATED))
    one, _ = _needed(_tree(corpus_dir, tmp_path, ONE_EACH))
    available = (replicated + one) // 2
    monkeypatch.setattr(host_memory, "available_bytes", lambda: available)
    monkeypatch.setattr(host_memory, "CHECK_FROM", 0.0)  # tiny models: check all the same
    tree = _tree(corpus_dir, tmp_path, REPLICATED)
    path = write_config(tmp_path, tree)
    assert main(["run", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "host memory: the 4 teacher + 4 student devices of this run" in err[0]
    assert "one device per role fits" in err[0] and "--set mesh.student.dp=1" in err[0]
    assert not (tmp_path / "out").exists()  # refused before anything was written
    assert main(["validate", path]) == 2  # validate makes run's checks: the same line
    assert capsys.readouterr().err.strip().splitlines() == err
    # the layout it names passes the same check
    cfg = Config.model_validate(_tree(corpus_dir, tmp_path, ONE_EACH))
    cfg.resolve_dtypes("cpu")
    memory = lambda c, m: plan_memory.memory(c, m, None)  # noqa: E731
    host_memory.check_host_fits(cfg, build_meshes(cfg), memory, available)
    # with less than even that, it says what else lowers the memory
    monkeypatch.setattr(host_memory, "available_bytes", lambda: one // 2)
    assert main(["run", path]) == 2
    assert "even one device per role needs" in capsys.readouterr().err


def test_plan_reports_the_sum(corpus_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**40)
    path = write_config(tmp_path, _tree(corpus_dir, tmp_path, REPLICATED))
    assert main(["plan", path]) == 0
    out = capsys.readouterr().out
    assert "host memory (CPU devices share it): 4 teacher + 4 student devices" in out
    h = json.loads(out[out.index("{") :])["host_memory"]
    assert h["fits"] and h["devices"] == {"teacher": 4, "student": 4}


def test_tiny_runs_compile_nothing_more(corpus_dir, tmp_path):
    """Below CHECK_FROM of the memory available the check compiles nothing."""
    tree = _tree(corpus_dir, tmp_path, ONE_EACH)
    cfg = Config.model_validate(tree)
    cfg.resolve_dtypes("cpu")
    meshes = build_meshes(cfg)
    called = []
    host_memory.check_host_fits(cfg, meshes, lambda c, m: called.append(1), available=2**40)
    assert not called


def test_colocated_devices_count_once(corpus_dir, tmp_path):
    """Colocated meshes share their devices: each counts once, holding both roles (the
    larger program's temporaries), so the sum is under the split layout's of the same axes."""
    from pipelines import placement

    axes = {"teacher": {"dp": 2, "tp": 1}, "student": {"dp": 2}}
    split, _ = _needed(_tree(corpus_dir, tmp_path, axes))
    cfg = Config.model_validate(_tree(corpus_dir, tmp_path, {**axes, "placement": "colocated"}))
    cfg.resolve_dtypes("cpu")
    meshes = build_meshes(cfg)
    mem = plan_memory.memory(cfg, meshes, None)
    mem["colocated"] = placement.colocated_memory(cfg, mem)
    h = host_memory.host_figures(meshes, mem, None)
    assert h["needed_bytes"] == 2 * mem["colocated"]["peak_bytes_per_device"] + (
        host_memory.HOST_RESERVE
    )
    assert h["needed_bytes"] < split
    assert "2 colocated devices and" in host_memory.format_host(h)


def test_a_cache_run_counts_no_teacher_in_host_memory(corpus_dir, tmp_path):
    """`teacher.source: cache` loads no teacher: its reserved devices hold nothing."""
    tree = _tree(corpus_dir, tmp_path, REPLICATED)
    online, mem = _needed(tree)
    tree["teacher"]["source"] = "cache"
    cfg = Config.model_validate(tree)
    cfg.resolve_dtypes("cpu")
    h = host_memory.host_figures(build_meshes(cfg), mem, None, cfg)
    student = 4 * mem["student"]["peak_bytes_per_device"] + host_memory.HOST_RESERVE
    assert h["devices"] == {"teacher": 0, "student": 4} and h["needed_bytes"] == student
    assert h["needed_bytes"] < online
