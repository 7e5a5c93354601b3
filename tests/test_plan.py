"""`distill plan`: sizes, and both roles' per-device memory from XLA's compile-time analysis."""

import json
import math
import re
import subprocess
import sys

import jax
import pytest
import yaml

from distill.config.load import config_from_dict, load_config
from distill.errors import DistillError
from distill.mesh import teacher_mesh
from distill.models.experts import dispatch
from pipelines import plan
from pipelines.commands.cli import main
from pipelines.plan import flops as plan_flops
from pipelines.plan import memory as plan_memory
from pipelines.plan.memory import check_fits, cp_that_fits
from tests.conftest import cli_env, tiny_config


def _plan(capsys, argv) -> dict:
    assert main(["plan", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_memory_figures_are_present_and_sane(tmp_path, corpus_dir, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config(str(corpus_dir), str(tmp_path / "out"))))
    p = _plan(capsys, [str(path)])
    t, s = p["teacher"], p["student"]
    assert p["device_memory_bytes"] is None  # CPU: no device memory to compare with
    assert 0 < t["forward_temp_bytes_per_device"] < t["peak_bytes_per_device"]
    assert 0 < s["step_temp_bytes_per_device"] < s["peak_bytes_per_device"]
    assert s["remat"] == "none" and "auto on CPU devices" in s["remat_reason"]  # the default
    state = s["weight_bytes_per_device"] + s["optimizer_bytes_per_device"]
    assert s["peak_bytes_per_device"] >= state  # the state is an argument of the step
    assert not (tmp_path / "out").exists()  # planning writes nothing

    # on-policy: the sampler's temporaries and two kept parameter copies (staleness 1)
    p = _plan(capsys, [str(path), "--set", "distill.on_policy.fraction=0.5"])
    on = p["student"]
    assert on["generate_temp_bytes_per_device"] > 0
    assert on["param_history_bytes_per_device"] == 2 * s["weight_bytes_per_device"]
    peak = s["peak_bytes_per_device"] + on["param_history_bytes_per_device"]
    assert on["peak_bytes_per_device"] >= peak


def test_the_8b_to_1b_pipeline_fits_8_gpus_planned_on_cpu(capsys):
    """The shipped real-size pipeline, planned from shapes alone on simulated CPU devices
    (no weights, no data): both roles' compiled peaks fit an 80 GB GPU with the most
    recompute (`remat: block`), so `remat: auto` finds a policy that fits there (on CPU
    devices, with no memory limit, auto is `none`)."""
    path = "pipelines/llama3-8b-to-1b.yaml"
    cfg = load_config(path)
    assert cfg.train.seq_len == 4096 and cfg.teacher.model.vocab_size == 128256
    assert cfg.train.remat == "auto"
    p = _plan(capsys, [path, "--set", "mesh.platform=cpu", "--set", "train.remat=block"])
    assert p["student"]["remat"] == "block"
    for role in ("teacher", "student"):
        assert p[role]["peak_bytes_per_device"] < 80e9, role
    assert p["layout"]["teacher"]["shape"] == {"dp": 4, "ep": 1, "tp": 1}
    assert p["layout"]["student"]["shape"] == {"dp": 1, "fsdp": 4}
    assert p["student"]["params"] == pytest.approx(1.236e9, rel=1e-3)
    assert p["eval"] == {"rows": 4, "windows": 1}  # 4,096-token rows: whole


@pytest.mark.slow  # about a minute on 2 cores: both real-size programs at 32k compiled
def test_the_8b_to_1b_32k_pipeline_fits_8_gpus_planned_on_cpu(capsys):
    """The shipped long-context pipeline (32,768-token rows, the student's rows split over
    cp=4), planned from shapes alone: with no recompute (auto on CPU devices) the student's
    compiled peak fits an 80 GB GPU with room for `remat: auto` to choose `none` there
    (under 90%), the weights and optimizer state split over cp, and the ring's bytes are
    counted. (Its evaluation's programs: tests/test_vocab_bound.py.)"""
    path = "pipelines/llama3-8b-to-1b-32k.yaml"
    cfg = load_config(path)
    assert (cfg.train.seq_len, cfg.mesh.student.cp, cfg.train.remat) == (32768, 4, "auto")
    p = _plan(capsys, [path, "--set", "mesh.platform=cpu"])
    assert p["student"]["remat"] == "none"
    assert p["student"]["peak_bytes_per_device"] < 0.9 * 80e9
    assert p["teacher"]["peak_bytes_per_device"] < 80e9
    assert p["layout"]["teacher"]["shape"] == {"dp": 4, "ep": 1, "tp": 1}
    assert p["layout"]["student"]["shape"] == {"dp": 1, "fsdp": 1, "cp": 4}
    state = p["student"]["weight_bytes_per_device"] + p["student"]["optimizer_bytes_per_device"]
    assert state < 1.236e9 * 12 / 4 * 1.01  # float32 weights + AdamW, a quarter a device
    assert p["student"]["ring_bytes_per_step"] > 0
    assert p["eval"] == {"rows": 4, "windows": 8}  # 4 x 4,096 x 128,256 < 2^31 a window


@pytest.mark.slow  # about 40 s on 2 cores: the 405B forward and the 8B step compiled
def test_the_405b_to_8b_pipeline_fits_80_gb_planned_on_cpu():
    """The shipped 405B teacher in 2 stages of tp=8 (two 8-GPU hosts of one Ray group) and
    an 8B student on a third host, planned from shapes alone on simulated CPU devices. CPU
    devices hold a bfloat16 weight stack again in float32 for the matmuls (a CPU compile's
    copy, not a GPU's), so the teacher is planned in float32: its weights then take twice
    their bfloat16 bytes and its temporaries no less than bfloat16's, so the bfloat16 peak
    on a GPU is at most the float32 peak less half the float32 weights, under 80 GB."""
    path = "pipelines/llama3-405b-to-8b.yaml"
    cfg = load_config(path)
    assert cfg.teacher.dtype == "bfloat16" and cfg.pipeline.mode == "ray"
    assert (cfg.mesh.teacher.hosts, cfg.mesh.student.hosts) == (2, 1)
    sets = ["mesh.platform=cpu", "teacher.dtype=float32", "train.remat=block"]
    argv = [sys.executable, "-m", "pipelines.commands.cli", "plan", path]
    argv += sum((["--set", s] for s in sets), [])
    done = subprocess.run(argv, env=cli_env(24), capture_output=True, text=True, check=True)
    p = json.loads(done.stdout.strip().splitlines()[-1])  # 24 CPU devices: its own process
    t, s = p["teacher"], p["student"]
    assert p["layout"]["teacher"]["shape"] == {"pp": 2, "dp": 1, "ep": 1, "tp": 8}
    assert p["layout"]["student"]["shape"] == {"dp": 1, "fsdp": 8}
    assert t["params"] == pytest.approx(405.85e9, rel=1e-3)
    assert s["params"] == pytest.approx(8.03e9, rel=1e-3)
    assert (t["stages"], t["layers_per_stage"], t["microbatches"]) == (2, 63, 16)
    assert t["bubble"] == pytest.approx(1 / 17)
    # float32 here: [2, 4096, 16384] x 4 B per microbatch and boundary (bfloat16: half)
    assert t["stage_bytes_per_step"] == 16 * 2 * 4096 * 16384 * 4
    bf16_peak = t["peak_bytes_per_device"] - t["weight_bytes_per_device"] / 2
    assert t["weight_bytes_per_device"] / 2 < 55e9 and bf16_peak < 75e9
    assert s["peak_bytes_per_device"] < 80e9


def test_a_role_over_the_device_memory_is_one_line_naming_its_keys():
    """As `validate` and `run` refuse on an accelerator (no device here: the figures given)."""
    role = {"peak_bytes_per_device": 3 * 2**30}
    mem = {"teacher": {"peak_bytes_per_device": 2**30}, "student": role}
    check_fits({**mem, "device_memory_bytes": None})  # CPU: nothing to compare with
    check_fits({**mem, "device_memory_bytes": 4 * 2**30})
    with pytest.raises(DistillError) as e:
        check_fits({**mem, "device_memory_bytes": 2 * 2**30})
    assert str(e.value).startswith("student: the compiled program needs 3.0 GiB per device")
    assert "train.remat" in str(e.value) and "max_staleness" not in str(e.value)
    on_policy = {**mem, "student": {**role, "param_history_bytes_per_device": 2**20}}
    with pytest.raises(DistillError, match="pipeline.max_staleness / distill.on_policy"):
        check_fits({**on_policy, "device_memory_bytes": 2 * 2**30})


def test_a_row_over_the_device_memory_names_the_cp_that_fits_it():
    """A whole 32k row a device (the long pipeline with fsdp in place of cp): 147 GiB at
    peak, 144 of them the step's temporaries, which fall with the positions a device holds;
    cp=2 (75 GiB) is over an 80 GB device, cp=4 (39 GiB) fits. Figures as the plan gave."""
    cfg = load_config(
        "pipelines/llama3-8b-to-1b-32k.yaml", ["mesh.student.cp=1", "mesh.student.fsdp=4"]
    )
    gib = 2**30
    student = {"peak_bytes_per_device": 147.36 * gib, "step_temp_bytes_per_device": 143.89 * gib}
    mem = {"teacher": {"peak_bytes_per_device": 36 * gib}, "student": student}
    assert cp_that_fits(cfg, "student", student, 80e9) == 4
    with pytest.raises(DistillError) as e:
        check_fits({**mem, "device_memory_bytes": 80e9}, cfg)
    assert "\n" not in str(e.value) and str(e.value).startswith("student: the compiled")
    assert str(e.value).endswith("its rows would fit with mesh.student.cp=4 (each device 1/cp "
                                 "of a row's positions: about 39.4 GiB)")  # fmt: skip
    tiny = {**student, "step_temp_bytes_per_device": 0}  # nothing that falls with cp
    assert cp_that_fits(cfg, "student", tiny, 80e9) is None
    ray = load_config(
        "pipelines/llama3-8b-to-1b-32k.yaml", ["mesh.student.cp=1", "pipeline.mode=ray"]
    )
    assert cp_that_fits(ray, "student", student, 80e9) == 4  # ray mode has cp too
    on_policy = load_config(
        "pipelines/llama3-8b-to-1b-32k.yaml",
        ["mesh.student.cp=1", "distill.on_policy.fraction=0.5"],
    )
    assert cp_that_fits(on_policy, "student", student, 80e9) is None  # cp refuses on-policy


def test_validate_refuses_a_row_over_the_device_memory_naming_cp(
    tmp_path, corpus_dir, capsys, monkeypatch
):
    """`distill validate` on an accelerator compiles both roles (here CPU devices told to be
    accelerators of a set size: between the student's peak and its estimate at cp=2): exit
    2, one line naming mesh.student.cp=2."""
    from distill.mesh import build_meshes
    from pipelines.commands import run

    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    cfg = config_from_dict(tree)
    cfg.resolve_dtypes("cpu")
    mem = run._memory(cfg, build_meshes(cfg), None)
    s = mem["student"]
    at_cp2 = s["peak_bytes_per_device"] - s["step_temp_bytes_per_device"] / 2
    limit = int(at_cp2 * 1.1)
    assert mem["teacher"]["peak_bytes_per_device"] <= limit < s["peak_bytes_per_device"]
    monkeypatch.setattr(plan_memory, "device_memory", lambda mesh: limit)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    capsys.readouterr()
    assert main(["validate", str(path), "--set", f"train.remat={cfg.train.remat}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mesh.student.cp=2 (each device 1/cp" in err, err


@pytest.mark.slow  # about a minute each on 2 cores: both real-size programs are compiled
@pytest.mark.parametrize(
    "path, teacher, student",
    [
        ("pipelines/qwen3-8b-to-1.7b.yaml", 8.191e9, 1.721e9),
        ("pipelines/gemma3-12b-to-1b.yaml", 11.766e9, 0.9999e9),
        ("pipelines/qwen3-30b-a3b-to-1.7b.yaml", 30.532e9, 1.721e9),
    ],
)
def test_shipped_family_pipelines_fit_80_gb_planned_on_cpu(capsys, path, teacher, student):
    """Qwen3 8B -> 1.7B, Gemma 3 12B -> 1B and Qwen3-30B-A3B (experts over ep=4) -> 1.7B at
    their released shapes, planned from shapes alone on simulated CPU devices: both roles'
    compiled peaks fit an 80 GB GPU (in float32, CPU's compute dtype; bfloat16 on the GPUs
    halves the teacher's weights)."""
    cfg = load_config(path)
    assert cfg.student_model().family == cfg.teacher.model.family.removesuffix("_moe")
    p = _plan(capsys, [path, "--set", "mesh.platform=cpu"])
    for role in ("teacher", "student"):
        assert p[role]["peak_bytes_per_device"] < 80e9, role
    assert p["teacher"]["params"] == pytest.approx(teacher, rel=1e-3)
    assert p["student"]["params"] == pytest.approx(student, rel=1e-3)
    cfg.resolve_dtypes("cpu")
    if cfg.teacher.model.n_experts:  # 3.3B activated, as the model card says
        assert p["teacher"]["active_params"] == pytest.approx(3.353e9, rel=1e-3)
        assert p["teacher"]["all_to_all_bytes_per_step"] == plan.all_to_all_bytes_per_step(cfg)


def _moe_config(capacity_factor=None):
    """A tiny MoE teacher (4 experts, top-2, 3 layers) on dp x ep = 1 x 2, 2 rows per
    microbatch of each device's 4."""
    tree = tiny_config("unused", "unused", mesh={"teacher": {"ep": 2, "tp": 1}})
    tree["train"].update(batch_size=8, seq_len=16)
    tree["teacher"]["model"].update(n_experts=4, experts_per_token=2, d_ff_expert=16, n_layers=3)
    tree["teacher"].update(microbatch=2, dtype="float32", moe_capacity_factor=capacity_factor)
    tree["student"]["model"]["n_experts"] = 0
    return config_from_dict(tree)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_all_to_all_bytes_are_the_compiled_programs(capacity_factor):
    """The plan's all-to-all bytes per step equal the all-to-alls of the compiled teacher
    forward on CPU (one layer's, in one microbatch's body; dropless, one round of the
    dispatch): their buffers' bytes x 2 microbatches x 3 MoE layers x 2 devices."""
    cfg = _moe_config(capacity_factor)
    mesh = teacher_mesh(jax.devices()[:2], 1, 1, 2)
    compiled, _ = plan_memory._teacher(cfg, mesh, None)
    size = {"f32": 4, "s32": 4}
    calls = re.findall(r"= \(([^)]*)\) all-to-all\(", compiled.as_text())
    # the tokens there, the results back, and dropless the expert ids (with a capacity
    # each expert's slots are at fixed places)
    assert len(calls) == (3 if capacity_factor is None else 2)
    per_body = sum(
        size[dt] * math.prod(int(n) for n in dims.split(","))
        for call in calls
        for dt, dims in re.findall(r"(\w+)\[([\d,]+)\]", call)
    )
    # dropless on CPU: a round's [2, C] buffer, C = ceil(1.125 x 32 tokens x 2 / 2) = 36;
    # capacity: 2 experts x 16 slots for each of the 2 devices
    slots = 2 * 36 if capacity_factor is None else 2 * 32
    ids = 4 if capacity_factor is None else 0
    assert per_body == slots * (2 * 32 * 4 + ids)
    assert plan.all_to_all_bytes_per_step(cfg) == per_body * 2 * 3 * 2


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_shipped_moe_all_to_all_is_the_routed_rows(platform):
    """The shipped 30B-A3B layout (ep=4, 48 MoE layers, 4,096-token microbatches): the
    dropless all-to-alls carry the routed rows' bytes (GPU's ragged all-to-all; their int32
    expert ids aside) or at most 1.2x them (CPU's rounds, one round when balanced), not
    ep = 4 times them; and the plan's kernel line names the transport."""
    cfg = load_config("pipelines/qwen3-30b-a3b-to-1.7b.yaml")
    cfg.resolve_dtypes(platform)
    routed = 32 * 4096 * 8 * 48 * 2 * 2048 * (2 if platform == "gpu" else 4)
    assert plan.routed_bytes_per_step(cfg) == routed
    ratio = plan.all_to_all_bytes_per_step(cfg, platform) / routed
    assert 1.0 <= ratio <= (1.002 if platform == "gpu" else 1.2), ratio
    assert dispatch.kind(platform) == ("ragged" if platform == "gpu" else "rounds")


def test_plan_names_the_moe_dispatch():
    """The compiled-matmuls line names how tokens reach their experts: CPU's `rounds` at
    ep > 1, the capacity path's dense all-to-all, nothing at ep = 1 or for a dense student."""
    cfg, capacity, one = _moe_config(), _moe_config(1.0), _moe_config()
    one.mesh.teacher.ep = 1
    assert plan_flops.moe_dispatch(cfg, "teacher") == "rounds"  # CPU devices here
    assert plan_flops.moe_dispatch(capacity, "teacher") == "all_to_all"
    assert plan_flops.moe_dispatch(one, "teacher") is None
    assert plan_flops.moe_dispatch(cfg, "student") is None
    role = {"compiled_flops_per_token": 1e6, "forward_flops_per_token": 1e6}
    teacher = {**role, "moe_kernel": "tiled", "moe_dispatch": "rounds"}
    line = plan_flops.format_flops(
        {"teacher": teacher, "student": {**role, "train_flops_per_token": 1}}
    )
    assert "(model 1.0, MoE kernel tiled, dispatch rounds)" in line
    assert "at least" not in line
    bound = {**role, "train_flops_per_token": 1, "compiled_flops_counted_once_per_token": 1e5}
    line = plan_flops.format_flops({"teacher": teacher, "student": bound})
    assert "student step at least 1.0 MFLOP/token" in line and "counted once" in line
    assert "teacher forward 1.0" in line


def test_moe_teacher_figures():
    """Total and active parameters; the experts' bytes split over ep."""
    cfg = _moe_config()
    t = plan.teacher_figures(cfg)
    experts = 3 * 4 * 3 * 32 * 16  # layers x experts x (gate, up, down) x D x F
    assert plan.expert_params(cfg) == experts
    assert t["params"] - t["active_params"] == experts // 2  # top-2 of 4: half idle
    assert t["expert_bytes_per_device"] == experts * 4 // 2
    assert t["weight_bytes_per_device"] == (t["params"] - experts) * 4 + experts * 4 // 2
    assert "active_params" not in plan.teacher_figures(config_from_dict(tiny_config("a", "b")))
