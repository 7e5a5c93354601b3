"""`pipeline.mode: ray` on a real local Ray cluster: parity with local mode, killed actors,
teacher replicas. One cluster serves the whole module; every run uses the teacher that the
session's tiny run (local mode) bootstrapped, so all runs distil from the same weights."""

import warnings

import pytest

from distill.errors import RUN_FAILED
from pipelines.commands.cli import main
from tests.conftest import kill_process as _kill
from tests.conftest import read_summary as _summary
from tests.conftest import run_with_fault, tiny_config, write_config
from tests.conftest import train_by_step as _train
from tests.test_alpha_gate import gated_run  # noqa: F401 (the local run compared against)
from tests.test_cross_context import (
    assert_same_as_cp_1,
    cross_cp_1,  # noqa: F401 (the local run compared against)
    with_cp,
)
from tests.test_cross_tokenizer import cross_run  # noqa: F401 (the local run compared against)

ray = pytest.importorskip("ray")
pytest.importorskip("pipelines.ray.mode")

pytestmark = pytest.mark.ray

KEYS = ("loss", "kd_loss", "ce_loss", "lr")


@pytest.fixture(scope="module")
def ray_cluster():
    with warnings.catch_warnings():  # fork+exec of Ray's processes, safe with JAX loaded
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(tmp_path, cfg: dict, fault=None) -> int:
    """The run's exit status; `fault(step, pool)` after each student step's dispatch."""
    if fault is not None:
        return run_with_fault(tmp_path, cfg, fault)
    return main(["run", write_config(tmp_path, cfg)])


@pytest.fixture(scope="module")
def local_run(tiny_run):
    """The session's tiny run: local mode on `tiny_config`, the reference of the ray runs
    below and their teacher."""
    return tiny_run.out


def _ray_config(corpus_dir, out, local_out, **sections) -> dict:
    cfg = tiny_config(
        str(corpus_dir),
        str(out),
        pipeline={"mode": "ray"},
        teacher={"checkpoint": str(local_out / "teacher")},
    )
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _assert_same_losses(out, local_out, rel=1e-5) -> None:
    """The local run's losses and final student loss; `rel`: for another layout, whose
    reductions may sum in another order (and 1e-6 absolute: a student started as the
    teacher has a KD loss near 0; `rel=0`: to 1e-6 absolute alone)."""
    ray_records, local_records = _train(out), _train(local_out)
    assert sorted(ray_records) == sorted(local_records) == [2, 4, 6]
    for step, expected in local_records.items():
        for key in KEYS:
            want = pytest.approx(expected[key], rel=rel, abs=1e-6)
            assert ray_records[step][key] == want, (step, key)
    final, local_final = _summary(out)["final_eval"], _summary(local_out)["final_eval"]
    assert final["student_loss"] == pytest.approx(local_final["student_loss"], rel=rel, abs=1e-6)
    for key in ("student_bpb", "teacher_bpb"):  # the losses x tokens / bytes / ln 2 (~2.5x)
        want = pytest.approx(local_final[key], rel=max(rel, 1e-6), abs=1e-6)
        assert final[key] == want, key


def test_ray_matches_local(ray_cluster, local_run, corpus_dir, tmp_path):
    out = tmp_path / "out"
    assert _run(tmp_path, _ray_config(corpus_dir, out, local_run)) == 0
    _assert_same_losses(out, local_run)
    records = _train(out)
    assert all(r["teacher_ms"] > 0 and r["student_ms"] > 0 for r in records.values())
    assert records[6]["bytes_per_token"] == 8 * 8  # top-8 float32 values + int32 ids
    summary = _summary(out)
    assert summary["completed"] and summary["steps"] == 6 and summary["tokens"] == 6 * 4 * 32
    assert summary["actor_restarts"] == {"teacher": 0, "student": 0}
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == ["3", "6"]


@pytest.mark.slow
def test_ray_across_tokenizers_matches_local(ray_cluster, cross_run, tmp_path):  # noqa: F811
    """A byte-level teacher and a BPE student, half the steps on-policy: the teacher actor
    reads the teacher's rows, the student actor the alignment and re-tokenises its own
    samples for the teacher; the local run's losses and evaluation."""
    local_out, cfg = cross_run
    out = tmp_path / "out"
    cfg = {**cfg, "run": {**cfg["run"], "output_dir": str(out)}}
    cfg["pipeline"] = {**cfg.get("pipeline", {}), "mode": "ray"}
    assert _run(tmp_path, cfg) == 0
    _assert_same_losses(out, local_out)
    assert _train(out)[6]["aligned_fraction"] == _train(local_out)[6]["aligned_fraction"]


@pytest.mark.slow
def test_a_student_resumed_with_the_alpha_gate_closed_matches_local(
    ray_cluster,
    gated_run,  # noqa: F811
    tmp_path,
):
    """tests/test_alpha_gate.py's run (the gate closes at step 2's evaluation; half the
    steps on-policy, those after it data steps) in ray mode, its student killed at step 6
    (checkpoint 4 on disk): the student actor takes the checkpoint's alpha 0 up again, the
    source its closed gate, and every step's record is the local run's."""

    def kill_at_6(step, pool):
        if step == 6 and not pool.resumed_from:
            ray.get(pool.student.wait_for_checkpoints.remote())  # checkpoint 4 is on disk
            _kill(pool.info["student"]["pid"])

    local_out, cfg, _ = gated_run
    out = tmp_path / "out"
    cfg = {**cfg, "run": {**cfg["run"], "output_dir": str(out)}}
    cfg["pipeline"] = {**cfg.get("pipeline", {}), "mode": "ray"}
    assert _run(tmp_path, cfg, kill_at_6) == 0
    assert _summary(out)["student_resumed_from"] == [4]
    ray_records, local_records = _train(out), _train(local_out)
    assert sorted(ray_records) == sorted(local_records) == list(range(1, 9))
    for step, expected in local_records.items():
        for key in (*KEYS, "alpha", "on_policy"):
            want = pytest.approx(expected[key], rel=1e-5, abs=1e-6)
            assert ray_records[step][key] == want, (step, key)
    assert ray_records[5]["alpha"] == 0 and ray_records[6]["on_policy"] == 0


def test_killed_actors_recover_and_the_run_matches_local(
    ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch
):
    """Two teacher replicas share the batches; the first is killed at step 2 and restarted,
    the student at step 5 (checkpoint 3 on disk) and resumed from it; the run's losses are
    still the local run's."""
    statuses = []

    def kill_teacher_then_student(step, pool):
        statuses.append(pool.store.status())
        if step == 2 and not pool.resumed_from:
            _kill(pool.info["teacher-0"]["pid"])
        if step == 5 and not pool.resumed_from:
            ray.get(pool.student.wait_for_checkpoints.remote())  # checkpoint 3 is on disk
            _kill(pool.info["student"]["pid"])

    out = tmp_path / "out"
    cfg = _ray_config(corpus_dir, out, local_run, teacher={"replicas": 2})
    assert _run(tmp_path, cfg, kill_teacher_then_student) == 0
    _assert_same_losses(out, local_run)
    summary = _summary(out)
    assert summary["teacher_replicas"] == 2
    assert summary["actor_restarts"] == {"teacher": 1, "student": 1}
    assert summary["student_resumed_from"] == [3]
    first, last = statuses[0], statuses[-1]  # what /api/status shows
    assert [a["role"] for a in first["actors"]] == ["teacher", "teacher", "student"]
    for actor in first["actors"]:
        assert actor["alive"] and actor["restarts"] == 0 and actor["node"]
        assert actor["devices"].startswith("cpu:") and isinstance(actor["queued"], int)
    assert [a["restarts"] for a in last["actors"]] == [1, 0, 1]
    assert all(a["alive"] for a in last["actors"]) and last["restarts"] == 2


def test_actors_on_other_layouts_match_local(ray_cluster, local_run, corpus_dir, tmp_path):
    """A teacher actor on mesh.teacher.dp=2 x tp=2 (4 devices, one row per forward) and a
    student actor on dp=1 x fsdp=2 (its state split over its 2 devices) that starts as
    `student.init: from_teacher`: the losses of a local run of the same student on the
    plain layout (teacher tp=2, student dp=2), within float tolerance."""
    student = {"init": "from_teacher", "model": {"n_layers": 1}, "init_layers": [1]}
    local_out, out = tmp_path / "local", tmp_path / "ray"
    teacher = {"checkpoint": str(local_run / "teacher")}
    local = tiny_config(str(corpus_dir), str(local_out), teacher=teacher, student=student)
    assert _run(tmp_path, local) == 0
    mesh = {"teacher": {"dp": 2, "tp": 2}, "student": {"dp": 1, "fsdp": 2}}
    cfg = _ray_config(
        corpus_dir, out, local_run, mesh=mesh, teacher={"microbatch": 1}, student=student
    )
    assert _run(tmp_path, cfg) == 0
    _assert_same_losses(out, local_out, rel=1e-4)


def test_a_teacher_death_past_the_restart_limit_ends_the_run(
    ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch, capsys
):
    """`ray.max_teacher_restarts: 0`: the first death ends the run with one line naming the
    limit and the latest checkpoint, which stays on disk."""

    def kill_teacher(step, pool):
        if step == 2:
            _kill(pool.info["teacher-0"]["pid"])

    out = tmp_path / "out"
    cfg = _ray_config(corpus_dir, out, local_run, ray={"max_teacher_restarts": 0})
    cfg["train"].update(steps=40, checkpoint_every=2)
    assert _run(tmp_path, cfg, kill_teacher) == 2
    err = capsys.readouterr().err
    assert "ray.max_teacher_restarts: teacher actors died 1 times (limit 0)" in err
    assert "Latest checkpoint: step" in err
    ckpts = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert ckpts and max(ckpts) >= 2


def test_a_diverged_run_stops_as_in_local_mode(ray_cluster, local_run, corpus_dir, tmp_path):
    """A learning rate far too high: the Ray student actor skips the non-finite steps and
    reports them as the local executor does, so both modes stop with the same line and
    exit status, and keep the same checkpoints (none written during the skipped steps)."""
    train = {"steps": 12, "checkpoint_every": 1, "keep_checkpoints": 2, "max_nonfinite_steps": 2}
    outcome = {}
    for mode in ("local", "ray"):
        out = tmp_path / mode
        cfg = _ray_config(corpus_dir, out, local_run, train=train, optim={"lr": 1e6})
        cfg["pipeline"]["mode"] = mode
        assert _run(tmp_path, cfg) == RUN_FAILED, mode
        ckpts = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
        outcome[mode] = (_summary(out)["failure"], ckpts)
    assert outcome["ray"] == outcome["local"]
    assert outcome["ray"][0].startswith("training diverged: non-finite grad_norm at steps ")


def test_device_options_give_each_actor_its_devices(monkeypatch):
    from distill.allocator import TUNABLES
    from pipelines.ray.actors import device_options

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8")
    bundle, opts = device_options(2, "cpu")
    env = opts["runtime_env"]["env_vars"]
    assert bundle == {"CPU": 1} and env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"
    assert env["GLIBC_TUNABLES"] == TUNABLES  # host memory kept between steps
    bundle, opts = device_options(4, "gpu")
    assert bundle == {"CPU": 1, "GPU": 4} and opts["num_gpus"] == 4
    assert opts["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": ""}  # no CPU pin leaks in
    # on a node of the role's worker group: one unit of its host resource per process
    bundle, opts = device_options(8, "gpu", "student_host")
    assert bundle == {"CPU": 1, "GPU": 8, "student_host": 1}
    assert opts["resources"] == {"student_host": 1}
    bundle, opts = device_options(4, "tpu", "teacher_host")
    assert bundle == {"CPU": 1, "TPU": 4, "teacher_host": 1}
    assert opts["resources"] == {"TPU": 4, "teacher_host": 1}


def test_a_colocated_group_matches_local_and_resumes_after_a_kill(
    ray_cluster, local_run, corpus_dir, tmp_path
):
    """`mesh.placement: colocated`: one group of processes holds both roles, the teacher's
    outputs stay on its devices (no teacher bytes cross), the losses are the local split
    run's; its process killed at step 5 (checkpoint 3 on disk), the group is recreated and
    both roles resume from the checkpoint, with the same losses."""
    statuses = []

    def kill_at_5(step, pool):
        statuses.append(pool.store.status())
        if step == 5 and not pool.resumed_from:
            ray.get(pool.student.wait_for_checkpoints.remote())  # checkpoint 3 is on disk
            _kill(pool.info["student"]["pid"])

    out = tmp_path / "out"
    cfg = _ray_config(corpus_dir, out, local_run, mesh={"placement": "colocated"})
    assert _run(tmp_path, cfg, kill_at_5) == 0
    _assert_same_losses(out, local_run, rel=1e-6)
    summary = _summary(out)
    assert summary["actor_restarts"] == {"teacher": 0, "student": 1}
    assert summary["student_resumed_from"] == [3]
    assert _train(out)[6]["bytes_per_token"] == 0  # handed over on device
    first, last = statuses[0], statuses[-1]
    assert [(a["role"], a["name"]) for a in first["actors"]] == [("teacher+student", "colocated")]
    assert first["actors"][0]["devices"] == "cpu:0,1"
    assert last["actors"][0]["restarts"] == 1 and last["actors"][0]["alive"]


# context parallelism in both roles: the teacher's rows on tp = 2 x cp = 2, the student's
# on dp = 2 x cp = 2 (each device half of each of its rows' positions)
CP_MESH = {"teacher": {"tp": 2, "cp": 2}, "student": {"dp": 2, "cp": 2}}


@pytest.mark.parametrize("placement", ["split", pytest.param("colocated", marks=pytest.mark.slow)])
def test_cp_in_both_roles_matches_cp_1_and_resumes_after_a_kill(
    ray_cluster, local_run, corpus_dir, tmp_path, placement
):
    """`mesh.teacher.cp` and `mesh.student.cp` = 2 in ray mode, the roles split (outputs
    leave the teacher actor by rows x positions blocks) or colocated (handed over on
    device): the losses and evaluations of the cp = 1 local run to 1e-6; the student (the
    group, colocated) killed at step 5 resumes from checkpoint 3 with the same losses."""

    layouts = []

    def kill_at_5(step, pool):
        layouts.append(pool.layout())
        if step == 5 and not pool.resumed_from:
            ray.get(pool.student.wait_for_checkpoints.remote())  # checkpoint 3 is on disk
            _kill(pool.info["student"]["pid"])

    out = tmp_path / "out"
    mesh = {**CP_MESH, "placement": placement}
    cfg = _ray_config(corpus_dir, out, local_run, mesh=mesh)
    assert _run(tmp_path, cfg, kill_at_5) == 0
    _assert_same_losses(out, local_run, rel=0)
    summary = _summary(out)
    assert summary["student_resumed_from"] == [3]
    assert summary["actor_restarts"] == {"teacher": 0, "student": 1}
    assert layouts[-1]["teacher"]["shape"] == {"dp": 1, "ep": 1, "cp": 2, "tp": 2}
    assert layouts[-1]["student"]["shape"] == {"dp": 2, "fsdp": 1, "cp": 2}
    per_token = _train(out)[6]["bytes_per_token"]
    assert per_token == (8 * 8 if placement == "split" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_cp_across_tokenizers_matches_cp_1(ray_cluster, cross_cp_1, tmp_path, placement):  # noqa: F811
    """Across tokenizers with `mesh.teacher.cp` and `mesh.student.cp` = 2 in ray mode: the
    teacher actor gathers its outputs at the student's positions on its mesh before they
    leave it (by rows x positions blocks, or handed over on device when colocated); the
    losses, the aligned share and the evaluations of the cp = 1 run to 1e-6."""
    cp_1, tree = cross_cp_1
    out = tmp_path / "out"
    cfg = with_cp(tree, out, pipeline={"mode": "ray"}, mesh={"placement": placement})
    assert _run(tmp_path, cfg) == 0
    assert_same_as_cp_1(out, cp_1)
    per_token = _train(out)[6]["bytes_per_token"]  # dense, at the student's positions
    assert per_token == (4 * 260 if placement == "split" else 0)
