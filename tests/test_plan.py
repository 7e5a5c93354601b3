"""`distill plan`: sizes, and both roles' per-device memory from XLA's compile-time analysis."""

import json

import pytest
import yaml

from distill.config.load import load_config
from distill.errors import DistillError
from pipelines.commands.cli import main
from pipelines.plan_memory import check_fits
from tests.conftest import tiny_config


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
    (no weights, no data): both roles' compiled peaks fit an 80 GB GPU."""
    path = "pipelines/llama3-8b-to-1b.yaml"
    cfg = load_config(path)
    assert cfg.train.seq_len == 4096 and cfg.teacher.model.vocab_size == 128256
    p = _plan(capsys, [path, "--set", "mesh.platform=cpu"])
    for role in ("teacher", "student"):
        assert p[role]["peak_bytes_per_device"] < 80e9, role
    assert p["layout"]["teacher"]["shape"] == {"dp": 4, "ep": 1, "tp": 1}
    assert p["layout"]["student"]["shape"] == {"dp": 1, "fsdp": 4}
    assert p["student"]["params"] == pytest.approx(1.236e9, rel=1e-3)


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


@pytest.mark.slow  # about a minute each on 2 cores: both real-size programs are compiled
@pytest.mark.parametrize(
    "path, teacher, student",
    [
        ("pipelines/qwen3-8b-to-1.7b.yaml", 8.191e9, 1.721e9),
        ("pipelines/gemma3-12b-to-1b.yaml", 11.766e9, 0.9999e9),
    ],
)
def test_shipped_family_pipelines_fit_80_gb_planned_on_cpu(capsys, path, teacher, student):
    """Qwen3 8B -> 1.7B and Gemma 3 12B -> 1B at their released shapes, planned from shapes
    alone on simulated CPU devices: both roles' compiled peaks fit an 80 GB GPU (in float32,
    CPU's compute dtype; bfloat16 on the GPUs halves the teacher's weights)."""
    cfg = load_config(path)
    assert cfg.teacher.model.family == cfg.student_model().family
    p = _plan(capsys, [path, "--set", "mesh.platform=cpu"])
    for role in ("teacher", "student"):
        assert p[role]["peak_bytes_per_device"] < 80e9, role
    assert p["teacher"]["params"] == pytest.approx(teacher, rel=1e-3)
    assert p["student"]["params"] == pytest.approx(student, rel=1e-3)
