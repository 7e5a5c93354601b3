"""`mesh.placement`: split, colocated, and `auto`'s choice from a table of role costs."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from distill.config.load import config_from_dict, load_config
from distill.errors import DistillError
from distill.mesh import build_meshes, check_fit, devices_needed
from pipelines import placement
from pipelines.commands.cli import main
from pipelines.placement import Layout, RoleCost, candidates, choose, predict
from tests.conftest import (
    cli_env,
    read_evals,
    read_summary,
    read_train,
    tiny_config,
    train_by_step,
    write_config,
)

GIB = 2**30


def _cfg(corpus_dir, tmp_path, **mesh):
    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    tree["mesh"].update(mesh)
    return config_from_dict(tree)


def test_colocated_meshes_share_the_first_devices(corpus_dir, tmp_path):
    cfg = _cfg(corpus_dir, tmp_path, placement="colocated")
    assert devices_needed(cfg) == 2  # tp=2 and dp=2 on the same two devices
    meshes = build_meshes(cfg)
    ids = lambda m: [d.id for d in m.devices.flat]  # noqa: E731
    assert ids(meshes.teacher) == ids(meshes.student) == [0, 1]
    assert meshes.layout()["placement"] == "colocated"
    assert build_meshes(_cfg(corpus_dir, tmp_path)).layout()["placement"] == "split"
    split = _cfg(corpus_dir, tmp_path, student={"dp": 2, "devices": [1, 2]})
    with pytest.raises(DistillError, match="overlap: \\[1\\]; set mesh.placement: colocated"):
        check_fit(split, 8, "cpu")
    check_fit(
        split.model_copy(update={"mesh": split.mesh.model_copy(update={"placement": "colocated"})}),
        8,
        "cpu",
    )


@pytest.mark.parametrize(
    "mesh, teacher, expected",
    [
        ({"placement": "auto"}, {}, "mesh.placement: auto chooses from the devices of one process"),
        ({"placement": "colocated"}, {"replicas": 2}, "teacher.replicas: 2 replicas need mesh.pl"),
        (
            {"placement": "colocated", "student": {"dp": 2, "hosts": 2}},
            {},
            "mesh.teacher.hosts: 1 differs from mesh.student.hosts: 2; colocated, both roles",
        ),
    ],
)
def test_ray_mode_refuses_what_one_colocated_group_cannot_hold(
    corpus_dir, tmp_path, mesh, teacher, expected
):
    from pipelines.preflight import check_mode

    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"), pipeline={"mode": "ray"})
    tree["mesh"].update(mesh)
    tree["teacher"].update(teacher)
    with pytest.raises(DistillError, match="^" + expected):
        check_mode(config_from_dict(tree))
    tree["mesh"]["placement"] = "split"
    check_mode(config_from_dict(tree))


def test_candidates_follow_the_divisibility_rules():
    """The quick start (8 heads, 4 KV heads, vocabulary 384, batch 16) on 8 devices: the
    colocated layouts of all 8 and the splits of 8 that the batch divides; on one device
    only colocated with every axis 1."""
    cfg = load_config("pipelines/quickstart.yaml")
    layouts = candidates(cfg, 8)
    split = [x for x in layouts if x.placement == "split"]
    assert {x.teacher for x in split} == {(4, 1, 1), (2, 1, 2), (1, 1, 4)}  # 4 + 4 only
    assert {x.student for x in split} == {(4, 1), (2, 2), (1, 4)}
    assert Layout("split", (1, 1, 4), (4, 1)) in split  # the quick start's own
    co = [x for x in layouts if x.placement == "colocated"]
    assert len(co) == 16 and layouts[: len(co)] == co  # colocated first
    assert candidates(cfg, 1) == [Layout("colocated", (1, 1, 1), (1, 1))]
    two = [x for x in candidates(cfg, 2) if x.placement == "split"]
    assert two == [Layout("split", (1, 1, 1), (1, 1))]  # 1 + 1


def test_placement_is_one_type_that_the_config_spells_as_yaml_strings():
    """`distill.mesh.Placement` names exactly the strings `mesh.placement` accepts, and a
    config's value compares equal to its member, so code compares against the type."""
    import typing

    from distill.config.schema import MeshConfig
    from distill.mesh import Placement

    accepted = typing.get_args(MeshConfig.model_fields["placement"].annotation)
    assert accepted == tuple(Placement) == ("split", "colocated", "auto")
    cfg = load_config("pipelines/quickstart.yaml", ["mesh.placement=colocated"])
    assert (
        cfg.mesh.placement == Placement.COLOCATED
        and Placement(cfg.mesh.placement) is Placement.COLOCATED
    )
    assert Layout("split", (1, 1, 4), (4, 1)) == Layout(Placement.SPLIT, (1, 1, 4), (4, 1))


def test_bench_colocates_over_the_splits_devices():
    """`distill bench --colocated`: the quick start's split and both roles over its 8
    devices, each role's dp scaled; a layout the batch does not divide is one line."""
    from pipelines.bench.placements import colocated_over

    split = ["mesh.placement=split", "mesh.teacher.tp=4", "mesh.student.dp=4"]
    cfg = load_config("pipelines/quickstart.yaml", split)
    assert colocated_over(cfg) == Layout("colocated", (2, 1, 4), (8, 1))
    odd = load_config("pipelines/quickstart.yaml", [*split, "train.batch_size=4"])
    with pytest.raises(DistillError, match="^--colocated: colocated .*batch_size: 4 is not"):
        colocated_over(odd)  # student dp=8 does not divide 4 rows


def _rows(table, platform="gpu"):
    """Rows from {layout: (teacher seconds, student seconds)}, 1 GiB a role per device."""
    role = lambda s: RoleCost(s, GIB, GIB // 2, GIB // 2)  # noqa: E731
    return [predict(x, role(t), role(s), platform) for x, (t, s) in table.items()]


SPLIT = Layout("split", (1, 1, 4), (4, 1))
COLO = Layout("colocated", (2, 1, 4), (8, 1))
OTHER = Layout("split", (2, 1, 2), (2, 2))


def test_prediction_model():
    """split: the slower role (they overlap); colocated: the sum (in turn); on CPU each
    role's time summed over its devices (simulated devices share the host's cores).
    A colocated device holds both roles' resident bytes and the larger temporaries."""
    s, c = _rows({SPLIT: (2.0, 1.0), COLO: (1.0, 0.5)})
    assert s.seconds == 2.0 and c.seconds == 1.5
    assert s.bytes_per_device == GIB and c.bytes_per_device == GIB + GIB // 2
    assert c.host_bytes == 8 * c.bytes_per_device and s.host_bytes == 8 * GIB
    s, c = _rows({SPLIT: (2.0, 1.0), COLO: (1.0, 0.5)}, "cpu")
    assert s.seconds == max(4 * 2.0, 4 * 1.0) and c.seconds == 8 * 1.0 + 8 * 0.5


def test_auto_is_deterministic_for_a_table():
    # the fastest by more than the margin wins
    rows = _rows({SPLIT: (2.0, 1.0), COLO: (1.0, 0.5), OTHER: (1.9, 1.9)})
    assert choose(rows, SPLIT, None, None).layout == COLO
    # within the margin: the layout the config gives is kept
    rows = _rows({OTHER: (1.0, 0.1), SPLIT: (1.0, 1.0), COLO: (0.5, 0.45)})
    assert choose(rows, SPLIT, None, None).layout == SPLIT
    # a tie without it: the least memory per device (colocated holds both roles: more),
    # then the table's order
    assert choose(rows, Layout("split", (1, 1, 1), (1, 1)), None, None).layout == OTHER
    # ... on CPU the least host memory
    rows = _rows({SPLIT: (1.0, 1.0), OTHER: (1.0, 1.0)}, "cpu")
    assert choose(rows, COLO, None, 100 * GIB).layout == SPLIT  # equal: the first
    # what does not fit is out, whatever its speed; nothing fitting is one line
    rows = _rows({SPLIT: (2.0, 1.0), COLO: (1.0, 0.5)})
    assert choose(rows, SPLIT, int(1.2 * GIB), None).layout == SPLIT
    with pytest.raises(DistillError, match="^mesh.placement: auto found no layout that fits"):
        choose(rows, SPLIT, GIB // 2, None)
    assert [choose(rows, SPLIT, None, None).layout for _ in range(3)] == [COLO] * 3


def test_auto_on_cpu_prefers_layouts_that_copy_no_model():
    """On CPU the simulated devices share one RAM: a layout whose dp copies of the roles'
    resident state take more than 5% of the memory available goes after those that copy
    less, whatever the speeds (a student over fsdp=4 beats one over dp=4 predicted 3x
    faster); copies that small, or an accelerator, leave the choice to the speed."""
    fsdp4 = Layout("split", (1, 1, 4), (1, 4))
    table = {SPLIT: (1.0, 1.0), fsdp4: (3.0, 3.0), OTHER: (0.1, 0.1), COLO: (0.1, 0.1)}
    rows = _rows(table, "cpu")  # resident GIB / 2 a role per device
    assert [r.replicated / GIB for r in rows] == [3 * 0.5, 0, 0.5 * 2 + 0.5 * 2, 0.5 * 4 + 3.5]
    assert choose(rows, SPLIT, None, 20 * GIB).layout == fsdp4  # copies over 1 GiB: out
    assert choose(rows, SPLIT, None, 35 * GIB).layout == SPLIT  # OTHER's 2 GiB out
    assert choose(rows, SPLIT, None, 1000 * GIB).layout == OTHER  # all cheap: the fastest
    assert choose(_rows(table, "gpu"), SPLIT, None, None).layout == OTHER
    assert all(r.replicated == 0 for r in _rows(table, "gpu"))
    # no candidate copies little enough: the fewest copies, then the speed among those
    rows = _rows({OTHER: (0.1, 0.1), SPLIT: (1.0, 1.0)}, "cpu")
    assert choose(rows, OTHER, None, 20 * GIB).layout == SPLIT


def test_plan_prints_auto_table_and_chosen_layout(corpus_dir, tmp_path, capsys, caplog):
    """`distill plan` with auto on the 8 simulated devices: every candidate compiled from
    abstract shapes, the table printed once (not logged as well), the choice applied to the
    plan, and the CPU figures labelled before they come: XLA:CPU's, in the dtypes and remat
    compiled, `auto` dtypes and remat named as a CPU resolves them."""
    path = tmp_path / "cfg.yaml"
    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    tree["mesh"] = {"placement": "auto"}  # no axis written: auto chooses them all
    tree["teacher"]["model"]["attention"] = "reference"  # compiles fastest; not what is tested
    path.write_text(json.dumps(tree))
    caplog.set_level(logging.INFO)
    assert main(["plan", str(path)]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[0].startswith("mesh.placement auto: 9 candidates")
    assert captured.out.count("mesh.placement auto: 9 candidates") == 1
    assert "candidates (predicted" not in caplog.text + captured.err  # not logged as well
    note = [i for i, line in enumerate(out) if line.startswith("note: planned on CPU devices")]
    assert len(note) == 1, out
    (i,) = note
    assert "the figures are XLA:CPU's, compiled in teacher float32, student float32" in out[i]
    assert "student.dtype auto as float32" in out[i]
    assert "train.remat auto as none" in out[i]
    assert out[i + 1].startswith("memory per device")  # the label comes before the figures
    chosen = [line for line in out[1:10] if line.startswith(" ->")]
    assert len(chosen) == 1
    p = json.loads(out[-1])
    assert p["layout"]["placement"] in chosen[0]
    assert "auto" not in json.dumps(p["layout"])


def test_colocated_8b_to_1b_plans_fitting_8_gpus(capsys):
    """The shipped real-size pipeline colocated on 8 devices (teacher dp=8, student fsdp=8),
    planned from shapes alone: a device holding both roles stays under 80 GB; with less
    memory the run is refused in one line."""
    path = "pipelines/llama3-8b-to-1b.yaml"
    sets = ["mesh.platform=cpu", "mesh.placement=colocated", "mesh.teacher.dp=8"]
    sets += ["mesh.student.fsdp=8"]
    assert main(["plan", path, *sum((["--set", s] for s in sets), [])]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    both = p["colocated"]
    assert both["peak_bytes_per_device"] < 80e9
    t, s = p["teacher"], p["student"]
    assert both["teacher_resident_bytes_per_device"] >= t["weight_bytes_per_device"]
    assert both["student_resident_bytes_per_device"] >= (
        s["weight_bytes_per_device"] + s["optimizer_bytes_per_device"]
    )
    peak = max(t["peak_bytes_per_device"], s["peak_bytes_per_device"])
    assert both["peak_bytes_per_device"] > peak  # more than either role alone
    mem = {"colocated": both, "device_memory_bytes": 80 * 10**9}
    placement.check_colocated_fits(mem)
    with pytest.raises(DistillError, match="^mesh.placement: colocated needs .* per device"):
        placement.check_colocated_fits({**mem, "device_memory_bytes": 32 * GIB})


def test_a_cache_run_colocated_counts_no_teacher_on_the_devices(corpus_dir, tmp_path):
    """`teacher.source: cache` loads no teacher: a colocated device holds the student alone
    (what would refuse an online run fits), and `auto` costs the teacher nothing."""
    cfg = _cfg(corpus_dir, tmp_path, placement="colocated")
    teacher = {"peak_bytes_per_device": 6 * GIB, "forward_temp_bytes_per_device": GIB}
    student = {"peak_bytes_per_device": 3 * GIB, "step_temp_bytes_per_device": GIB}
    mem = {"teacher": teacher, "student": student, "device_memory_bytes": 4 * GIB}
    online = {**mem, "colocated": placement.colocated_memory(cfg, mem)}
    assert online["colocated"]["teacher_resident_bytes_per_device"] >= 5 * GIB
    with pytest.raises(DistillError, match="^mesh.placement: colocated needs"):
        placement.check_colocated_fits(online)
    cfg.teacher.source = "cache"
    cached = {**mem, "colocated": placement.colocated_memory(cfg, mem)}
    assert cached["colocated"]["teacher_resident_bytes_per_device"] == 0
    assert cached["colocated"]["peak_bytes_per_device"] == 3 * GIB  # the student's own
    placement.check_colocated_fits(cached)
    assert placement.teacher_cost(cfg, 2.0, teacher) == RoleCost(0.0, 0)


def test_auto_compiles_no_teacher_for_a_cache_run(corpus_dir, tmp_path, monkeypatch):
    """`auto`'s compiled costs of a cache run: the student's programs, given the teacher
    output's traced shapes; no teacher program compiled (it would never run)."""
    import jax

    from pipelines.placement import costs
    from pipelines.plan import memory as plan_memory

    cfg = _cfg(corpus_dir, tmp_path, placement="auto")
    cfg.teacher.source = "cache"
    cfg.teacher.model.attention = "reference"  # compiles fastest; not what is tested
    cfg.resolve_dtypes("cpu")

    def no_compile(*_):
        raise AssertionError("a teacher program compiled for a cache run")

    monkeypatch.setattr(plan_memory, "_teacher", no_compile)
    layouts = [Layout("colocated", (1, 1, 2), (2, 1)), Layout("split", (1, 1, 1), (1, 1))]
    got = costs.compiled_costs(cfg, jax.devices()[:2], layouts)
    assert got["teacher", (1, 1, 2)] == got["teacher", (1, 1, 1)] == RoleCost(0.0, 0)
    assert all(got["student", s].seconds > 0 for s in ((2, 1), (1, 1)))


# -- colocated runs ------------------------------------------------------------------------


def _colocated_tree(tiny_run, out, **mesh) -> dict:
    """The session's tiny run's config, colocated, on its bootstrapped teacher."""
    tree = json.loads(json.dumps(tiny_run.tree))
    tree["run"]["output_dir"] = str(out)
    tree["mesh"].update(placement="colocated", **mesh)
    tree["teacher"].update(checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0)
    return tree


@pytest.fixture(scope="module")
def colocated_run(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated") / "out"
    assert main(["run", write_config(out.parent, _colocated_tree(tiny_run, out))]) == 0
    return out


def test_colocated_gives_the_split_runs_losses(tiny_run, colocated_run):
    """The tiny run's teacher tp=2 and student dp=2 on the same two devices instead of four:
    the same arithmetic, the same losses and evaluations (local mode)."""
    split, both = train_by_step(tiny_run.out), train_by_step(colocated_run)
    assert sorted(both) == sorted(split) == [2, 4, 6]
    for step, r in split.items():
        for key in ("loss", "kd_loss", "ce_loss"):
            assert abs(both[step][key] - r[key]) <= 1e-6, (step, key)
    for a, b in zip(read_evals(tiny_run.out), read_evals(colocated_run), strict=True):
        assert abs(a["student_loss"] - b["student_loss"]) <= 1e-6
    saved = yaml.safe_load((colocated_run / "config.yaml").read_text())["mesh"]
    assert saved["placement"] == "colocated"


@pytest.mark.parametrize(
    "started, resumed_on",
    [("split", "colocated"), ("colocated", "colocated"), ("colocated", "split")],
)
def test_a_run_resumes_on_either_placement(tiny_run, colocated_run, tmp_path, started, resumed_on):
    """Drop the last checkpoint of a finished run (started split: the tiny run; or
    colocated) and rerun on a placement: it resumes from step 3 (Orbax restores the
    checkpoint onto the new training mesh's shardings) and repeats steps 4-6."""
    first = tiny_run.out if started == "split" else colocated_run
    resumed = tmp_path / "out"
    shutil.copytree(first, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    (resumed / "summary.json").unlink()
    tree = _colocated_tree(tiny_run, resumed)
    tree["mesh"]["placement"] = resumed_on
    assert main(["run", write_config(tmp_path, tree)]) == 0
    before = train_by_step(first)
    after = read_train(resumed)[len(read_train(first)) :]
    assert [r["step"] for r in after] == [4, 6]
    for r in after:
        assert abs(r["loss"] - before[r["step"]]["loss"]) <= 1e-6
    assert read_summary(resumed)["steps"] == 6
    assert yaml.safe_load((resumed / "config.yaml").read_text())["mesh"]["placement"] == resumed_on


def _saved_steps(out) -> list[int]:
    """The committed checkpoints of a run (Orbax renames a step's directory when done)."""
    root = out / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []


def test_a_colocated_run_killed_with_sigkill_resumes_exactly(tiny_run, colocated_run, tmp_path):
    """`distill run` colocated in a process of its own, a checkpoint every step, killed with
    SIGKILL as soon as its first checkpoint is committed (no handler runs: no final
    checkpoint, no summary); the rerun resumes from the newest checkpoint and its steps and
    last evaluation are the uninterrupted colocated run's (itself the split run's)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    tree = _colocated_tree(tiny_run, out)
    tree["train"].update(checkpoint_every=1, log_every=1)  # the same arithmetic
    path = write_config(tmp_path, tree)
    log = tmp_path / "killed.log"  # a file, not a pipe: a full pipe would block the run
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.commands.cli", "run", path],
            env=cli_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 300
        while not _saved_steps(out) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]  # killed, not finished
    saved = _saved_steps(out)
    assert saved and saved[-1] < 6 and not (out / "summary.json").exists()
    killed = len(read_train(out))

    assert main(["run", path]) == 0
    after = read_train(out)[killed:]
    assert [r["step"] for r in after] == list(range(saved[-1] + 1, 7))
    want = train_by_step(colocated_run)
    for r in after:
        for key in ("loss", "kd_loss", "ce_loss"):
            if r["step"] in want:  # the uninterrupted run logged every second step
                assert abs(r[key] - want[r["step"]][key]) <= 1e-6, (r["step"], key)
    last, again = read_evals(colocated_run)[-1], read_evals(out)[-1]
    assert again["step"] == last["step"] == 6
    assert abs(again["student_loss"] - last["student_loss"]) <= 1e-6
    assert read_summary(out)["completed"]


def test_dense_outputs_microbatches_and_accumulation_colocated(tiny_run, tmp_path, monkeypatch):
    """Dense teacher log-probs, teacher microbatches of one row and two gradient
    accumulation microbatches, the dense output handed over in one block per microbatch
    (the 2^31 bound lowered below a device's whole output: `distill.handoff.dense_blocks`):
    colocated (teacher dp=2 x tp=2, student dp=2 on devices 0-3; the teacher's rows sliced
    on each device) gives the split run's losses."""
    from distill import handoff

    monkeypatch.setattr(handoff, "MAX_ELEMENTS", 2 * 32 * 260)  # 2 rows a teacher device
    losses = {}
    for placement_ in ("split", "colocated"):
        out = tmp_path / placement_
        tree = _colocated_tree(tiny_run, out, teacher={"dp": 2, "tp": 2})
        tree["mesh"]["placement"] = placement_
        tree["teacher"].update(top_k=None, microbatch=1)
        tree["train"].update(steps=2, grad_accum=2, eval_every=2, checkpoint_every=2)
        assert handoff.dense_blocks(config_from_dict(tree)) == 2
        assert main(["run", write_config(tmp_path, tree, f"{placement_}.yaml")]) == 0
        losses[placement_] = train_by_step(out)
    assert sorted(losses["split"]) == sorted(losses["colocated"]) == [2]
    for key in ("loss", "kd_loss", "ce_loss"):
        assert abs(losses["split"][2][key] - losses["colocated"][2][key]) <= 1e-6, key


def test_auto_costs_are_compiled_once_per_config_devices_and_code(corpus_dir, tmp_path):
    """pipelines.placement.cache: a second resolve of the same config and devices reads the
    costs back instead of compiling; another config's shapes miss."""
    import jax

    from pipelines.placement.cache import cached_costs, key

    cfg = _cfg(corpus_dir, tmp_path, placement="auto")
    devices = jax.devices()
    costs = {("teacher", (1, 1, 2)): RoleCost(1.5, 10, 4, 6), ("student", (2, 1)): RoleCost(2.0, 7)}
    calls = []
    compute = lambda: calls.append(1) or costs  # noqa: E731
    assert cached_costs(cfg, devices, compute) == costs
    assert cached_costs(cfg, devices, compute) == costs  # read back: equal, not recompiled
    assert len(calls) == 1
    # the layout the config gives is not in the key (every candidate is costed); shapes are
    relaid = _cfg(corpus_dir, tmp_path, placement="split", teacher={"tp": 1, "dp": 2})
    assert key(relaid, devices) == key(cfg, devices)
    other = _cfg(corpus_dir, tmp_path, placement="auto")
    other.train.seq_len //= 2
    assert key(other, devices) != key(cfg, devices)
    assert key(cfg, devices[:4]) != key(cfg, devices)
    cached_costs(other, devices, compute)
    assert len(calls) == 2


def test_measured_costs_reverse_the_compiled_choice():
    """Measured role times (`distill bench --placement`) replace the compiled predictions:
    a table that reverses the compiled order reverses the choice, and its rows say so. On
    CPU a measured time is the host's already (not summed over the role's devices)."""
    compiled = _rows({SPLIT: (1.0, 1.0), COLO: (1.0, 1.0)})
    assert choose(compiled, SPLIT, None, None).layout == SPLIT
    assert not any(r.measured for r in compiled)
    role = lambda s: RoleCost(s, GIB, GIB // 2, GIB // 2, measured=True)  # noqa: E731
    measured = [
        predict(SPLIT, role(1.0), role(1.0), "gpu"),
        predict(COLO, role(0.4), role(0.4), "gpu"),
    ]
    assert all(r.measured for r in measured)
    assert [choose(measured, SPLIT, None, None).layout for _ in range(3)] == [COLO] * 3
    table = placement.format_table(measured, measured[1], 1000, False).splitlines()
    assert table[1].startswith(" -> colocated") and " measured " in table[1]
    assert " compiled " in placement.format_table(compiled, compiled[0], 1000, False)
    # CPU: compiled times are per device (x 4 devices a role), measured ones the host's
    assert predict(SPLIT, role(1.0), role(2.0), "cpu").seconds == 2.0
    assert _rows({SPLIT: (1.0, 2.0)}, "cpu")[0].seconds == 8.0


def test_bench_placement_measures_what_auto_then_uses(corpus_dir, tmp_path, monkeypatch, capsys):
    """`distill bench --placement` times every candidate role layout on the 8 simulated
    devices and stores them; `distill plan` with auto then predicts from them (every row
    marked measured) and picks what the bench printed. The flag goes alone in one line."""
    monkeypatch.setenv("DISTILL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "cfg.yaml"
    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    tree["teacher"]["model"]["attention"] = "reference"  # compiles fastest; not what is tested
    tree["mesh"] = {}  # no axis written: auto's candidates are every layout of the devices
    path.write_text(json.dumps(tree))  # placement split: the cache's key ignores the layout
    assert main(["bench", str(path), "--placement", "--repeats", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    bench = json.loads(out[-1])
    rows = bench["placement_candidates"]
    assert len(rows) == 9 and sum(r["chosen"] for r in rows) == 1
    assert all(r["tokens_per_s"] > 0 and r["compiled_tokens_per_s"] > 0 for r in rows)
    assert list((tmp_path / "cache" / "placement").glob("*.measured.json"))
    tree["mesh"]["placement"] = "auto"
    path.write_text(json.dumps(tree))
    assert main(["plan", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()[1:10]
    assert all(" measured " in line for line in table)
    chosen = [line for line in table if line.startswith(" ->")]
    assert chosen[0][4:].startswith(bench["placement_choice"])
    assert main(["bench", str(path), "--placement", "--role", "teacher", "--ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "distill: error: --placement: times each candidate's roles alone; not with --role, --ray"
    ]


def test_auto_keeps_every_axis_the_user_wrote(tmp_path):
    """Under `mesh.placement: auto` an axis written (in the YAML or by `--set`) is a
    constraint: every candidate keeps it and auto chooses only the others; what no layout
    can keep is refused in one line naming it, before anything compiles."""
    import functools
    from types import SimpleNamespace

    import jax

    from pipelines.placement.choice import written_axes
    from pipelines.preflight import check_layout

    free = candidates(load_config("pipelines/quickstart.yaml"), 8)
    cfg = load_config("pipelines/quickstart.yaml", ["mesh.teacher.tp=2", "mesh.student.dp=2"])
    assert written_axes(cfg) == {"teacher": {"tp": 2}, "student": {"dp": 2}}
    kept = candidates(cfg, 8)
    assert kept and set(kept) == {x for x in free if x.teacher[2] == 2 and x.student[0] == 2}
    tree = yaml.safe_load(Path("pipelines/quickstart.yaml").read_text())
    tree["mesh"]["teacher"] = {"tp": 2}  # written in the YAML: the same constraint
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(tree))
    from_yaml = load_config(tmp_path / "q.yaml", ["mesh.student.dp=2"])
    assert candidates(from_yaml, 8) == kept
    # one device (one GPU): nothing written is colocated, every axis 1; tp=2 is refused
    one = [SimpleNamespace(platform="gpu")]
    quick = load_config("pipelines/quickstart.yaml")
    placement.resolve(quick, one)
    assert quick.mesh.placement == "colocated" and quick.mesh.teacher.tp == 1
    with pytest.raises(DistillError) as err:
        placement.resolve(cfg, one)
    assert str(err.value).startswith(
        "mesh.placement: auto keeps the axes written (mesh.teacher.tp=2, mesh.student.dp=2), "
        "and no layout of 1 gpu device(s) with them"
    )
    # a written axis the model refuses: the run's own line for it
    check = functools.partial(check_layout, device=jax.devices()[0])
    bad = load_config("pipelines/quickstart.yaml", ["mesh.teacher.tp=3"])
    with pytest.raises(DistillError, match=r"^teacher.model.n_heads: 8 is not divisible by mes"):
        placement.resolve(bad, jax.devices(), check=check)
    # a layout the run's checks refuse is no candidate: dense teacher outputs fit a student
    # device only over 8 of them (2 rows, 3.9 GiB), not over 4 (4 rows, 7.8 GiB)
    dense = load_config(
        "pipelines/quickstart.yaml",
        ["teacher.top_k=null", "teacher.model.vocab_size=128256", "train.seq_len=2048"],
    )
    checked = candidates(dense, 8, check)
    assert checked and {x.student[0] * x.student[1] for x in candidates(dense, 8)} == {4, 8}
    assert {x.student[0] * x.student[1] for x in checked} == {8}


def test_auto_composes_with_context_parallelism(tiny_run, tmp_path):
    """`mesh.placement: auto` with a student `cp=2` (and the teacher's `tp=2` written):
    every candidate keeps both, auto chooses the rest, and the run trains on its choice."""
    out = tmp_path / "out"
    tree = json.loads(json.dumps(tiny_run.tree))
    tree["run"]["output_dir"] = str(out)
    tree["mesh"] = {"placement": "auto", "teacher": {"tp": 2}, "student": {"cp": 2}}
    tree["teacher"].update(checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0)
    tree["train"].update(steps=2, eval_every=2, checkpoint_every=2)
    layouts = candidates(config_from_dict(tree), 8)
    assert layouts and all(x.fixed == (1, 1, 2) and x.teacher[2] == 2 for x in layouts)
    assert any(x.placement == "colocated" for x in layouts)
    assert main(["run", write_config(tmp_path, tree)]) == 0
    mesh = yaml.safe_load((out / "config.yaml").read_text())["mesh"]
    assert mesh["placement"] in ("split", "colocated")
    assert mesh["student"]["cp"] == 2 and mesh["teacher"]["tp"] == 2
    assert read_summary(out)["completed"] and read_summary(out)["steps"] == 2
    assert all(r["loss"] == r["loss"] for r in read_train(out))  # finite, not NaN
