"""The CLI end to end on a tiny config: run, outputs, eval, plan, exact resume, bad input."""

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipelines.commands.cli import main
from tests.conftest import cli_env, tiny_config
from tests.conftest import read_records as _records
from tests.conftest import read_train as _train
from tests.conftest import write_config as _write


@pytest.fixture(scope="module")
def finished_run(tiny_run):
    """The session's tiny run (tests/conftest.py: `tiny_run`), which this file's first test
    checks end to end; the others read it or reuse its bootstrapped teacher."""
    return tiny_run.tmp, tiny_run.out, tiny_run.cfg_path


def test_run_writes_every_output(finished_run):
    _, out, _ = finished_run
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["steps"] == 6
    records = _records(out)
    train = _train(out)
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in train] == [2, 4, 6]
    for key in (
        "step",
        "loss",
        "kd_loss",
        "ce_loss",
        "lr",
        "tokens_per_s",
        "teacher_ms",
        "student_ms",
    ):
        assert all(isinstance(r[key], (int, float)) for r in train), key
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert evals[-1]["student_loss"] < evals[0]["student_loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["completed"]
    assert summary["tokens"] == 6 * 4 * 32
    assert set(summary["final_eval"]) >= {"teacher_loss", "student_loss", "kl", "top1_agreement"}
    assert (out / "teacher").is_dir()  # the bootstrapped teacher, reused by later runs


@pytest.fixture(scope="module")
def whole_eval(finished_run):
    """`distill eval` of the finished run with the default memory budget: whole batches."""
    _, _, cfg_path = finished_run
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["eval", cfg_path]) == 0
    return json.loads(printed.getvalue().strip().splitlines()[-1])


def test_eval_prints_one_json_object(whole_eval):
    result = whole_eval
    assert set(result) == {
        "step", "teacher_loss", "student_loss", "kl", "top1_agreement", "sample_teacher_nll",
        "sample_student_nll", "sample_kl", "sample_len",
    }  # fmt: skip
    assert result["step"] == 6 and 0 <= result["top1_agreement"] <= 1


def test_eval_in_chunks_gives_the_same_metrics(finished_run, whole_eval, capsys, monkeypatch):
    """Evaluation split into chunks of `dp` rows (what a large vocabulary gets) gives the
    metrics of whole-batch evaluation (`whole_eval`, the default budget): the same rows,
    token-weighted."""
    from distill import handoff
    from distill.config.load import load_config

    _, _, cfg_path = finished_run
    cfg = load_config(cfg_path)
    assert handoff.eval_rows(cfg) == cfg.train.batch_size  # what `whole_eval` ran
    monkeypatch.setattr(handoff, "EVAL_DEVICE_BYTES", 1)
    capsys.readouterr()
    assert main(["eval", cfg_path]) == 0
    chunked = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert handoff.eval_rows(cfg) == cfg.mesh.student.dp < cfg.train.batch_size
    assert chunked["step"] == whole_eval["step"] == 6
    for key in ("teacher_loss", "student_loss", "kl", "top1_agreement"):
        assert chunked[key] == pytest.approx(whole_eval[key], rel=1e-5), key


def test_eval_in_position_windows_gives_the_same_metrics(
    finished_run, whole_eval, capsys, monkeypatch
):
    """With the element bound lowered below the eval chunk's logits, the teacher makes them
    in 4 strided position windows (what 32,768-token rows of 128,256 ids get) and the
    student compares each with its own: the metrics of the whole rows (`whole_eval`)."""
    from distill import handoff
    from distill.config.load import load_config

    _, _, cfg_path = finished_run
    cfg = load_config(cfg_path)
    rows, s, v = handoff.eval_rows(cfg), cfg.train.seq_len, cfg.teacher.model.vocab_size
    assert handoff.eval_windows(cfg) == 1
    monkeypatch.setattr(handoff, "MAX_ELEMENTS", rows * s // 4 * v + 1)
    assert handoff.eval_windows(cfg) == 4
    capsys.readouterr()
    assert main(["eval", cfg_path]) == 0
    windowed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("teacher_loss", "student_loss", "kl", "top1_agreement"):
        assert windowed[key] == pytest.approx(whole_eval[key], rel=1e-5), key


def test_eval_rows_for_a_large_vocabulary():
    from distill.config.load import config_from_dict
    from distill.handoff import eval_rows

    def rows(batch_size, dp, seq_len, vocab):
        tree = tiny_config("corpus", "out", train={"batch_size": batch_size, "seq_len": seq_len})
        tree["mesh"]["student"]["dp"] = dp
        tree["teacher"]["model"]["vocab_size"] = vocab
        return eval_rows(config_from_dict(tree))

    assert rows(16, 4, 128, 384) == 16  # the quick start: whole batches
    assert rows(64, 8, 2048, 128256) == 8  # Llama 3: one row per device (1 GB of logits)
    assert rows(48, 2, 512, 128256) == 2  # 256 MiB per row
    assert rows(48, 2, 256, 128256) == 4  # two rows per device fit


def test_plan_and_validate(finished_run, capsys):
    _, _, cfg_path = finished_run
    capsys.readouterr()
    assert main(["plan", cfg_path]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out.strip().splitlines()[-1])
    assert [d["id"] for d in plan["layout"]["teacher"]["devices"]] == [0, 1]
    assert [d["id"] for d in plan["layout"]["student"]["devices"]] == [2, 3]
    assert plan["teacher"]["params"] > plan["student"]["params"] > 0
    assert "teacher dp=1 x tp=2" in out
    assert plan["teacher_output_bytes_per_step"] == 8 * 8 * 4 * 32  # top-8 values + ids
    assert "MiB/step between meshes" in out
    assert main(["validate", cfg_path]) == 0


def test_resume_continues_on_the_next_batch(finished_run, tmp_path):
    """Drop the last checkpoint and rerun on another dp (4, the run had 2): steps 4-6 repeat
    exactly. (A resume on the same layout: tests/test_cloud_paths.py's
    test_resume_from_the_bucket_repeats_the_steps_exactly, through the same checkpoint code,
    and tests/test_teacher_cache.py's test_cache_mode_resumes_from_a_checkpoint.)"""
    dp = 4
    _, out, _ = finished_run
    resumed = tmp_path / "out"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    (resumed / "summary.json").unlink()
    cfg = tiny_config(str(out.parent.parent), str(resumed))  # corpus path replaced below
    cfg["data"] = yaml.safe_load((out / "config.yaml").read_text())["data"]
    cfg["mesh"]["student"]["dp"] = dp
    assert main(["run", _write(tmp_path, cfg)]) == 0
    before = {r["step"]: r for r in _train(out)}
    after = _train(resumed)[len(before) :]
    assert [r["step"] for r in after] == [4, 6]
    for r in after:
        for key in ("loss", "kd_loss", "ce_loss", "lr"):
            assert r[key] == pytest.approx(before[r["step"]][key], rel=1e-4), key
    assert json.loads((resumed / "summary.json").read_text())["steps"] == 6


@pytest.mark.parametrize("axis", ["fsdp", "cp"])
def test_student_layouts_train_as_the_dp_student(finished_run, tmp_path, corpus_dir, axis):
    """The student on dp=1 x fsdp=2 (its parameters and optimizer state split over the two
    devices), or on dp=1 x cp=2 (each row's positions split over the two, attention over
    the ring: `student.context`), gives the dp=2 run's losses and evaluations, with the
    same teacher."""
    _, first_out, _ = finished_run
    out = tmp_path / "out"
    cfg = tiny_config(str(corpus_dir), str(out))
    cfg["teacher"].update(checkpoint=str(first_out / "teacher"), pretrain_steps=0)
    layout = ["--set", f"mesh.student.{axis}=2", "--set", "mesh.student.dp=1"]
    assert main(["run", _write(tmp_path, cfg), *layout]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["mesh"]["student"][axis] == 2
    before, after = _train(first_out), _train(out)
    assert [r["step"] for r in after] == [r["step"] for r in before] == [2, 4, 6]
    for a, b in zip(before, after, strict=True):
        for key in ("loss", "kd_loss", "ce_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key
    evals = [[r for r in _records(o) if r.get("eval")] for o in (first_out, out)]
    for a, b in zip(*evals, strict=True):
        assert b["student_loss"] == pytest.approx(a["student_loss"], rel=1e-4)


def test_sigterm_saves_a_checkpoint_and_exits_0(tmp_path, corpus_dir, finished_run):
    """SIGTERM to `distill run` in its own process, once it trains (on the finished run's
    teacher, so the process does not bootstrap one first): a checkpoint of the last step,
    exit 0, an incomplete summary."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    cfg = tiny_config(
        str(corpus_dir),
        str(out),
        train={"steps": 100000, "log_every": 1, "checkpoint_every": 100000},
    )
    cfg["teacher"]["checkpoint"] = str(finished_run[1] / "teacher")
    path = _write(tmp_path, cfg)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.commands.cli", "run", path],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and _train(out):
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    saved = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and saved[0] >= _train(out)[-1]["step"]
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["completed"] and summary["steps"] == saved[0]


def test_the_quick_start_runs_on_one_device(tmp_path, finished_run):
    """The quick start's layout (`mesh.placement: auto`, no axis written) on the tiny config
    in a process with ONE simulated CPU device (as on a machine with one GPU): resolved to
    colocated with every axis 1, it trains and evaluates."""
    import subprocess
    import sys

    quick = yaml.safe_load(Path("pipelines/quickstart.yaml").read_text())["mesh"]
    assert quick == {"placement": "auto"}
    out = tmp_path / "out"
    cfg = tiny_config(str(finished_run[1].parent.parent), str(out), train={"steps": 2})
    cfg["data"] = yaml.safe_load((finished_run[1] / "config.yaml").read_text())["data"]
    cfg["mesh"] = quick
    cfg["teacher"].update(checkpoint=str(finished_run[1] / "teacher"), pretrain_steps=0)
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.commands.cli", "run", _write(tmp_path, cfg)],
        env=cli_env(devices=1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the one layout of 1 cpu device(s): colocated" in proc.stdout + proc.stderr
    mesh = yaml.safe_load((out / "config.yaml").read_text())["mesh"]
    assert mesh["placement"] == "colocated"
    assert (mesh["teacher"]["tp"], mesh["student"]["dp"]) == (1, 1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 2


def test_dense_teacher_outputs_and_jsd(tmp_path, corpus_dir, finished_run):
    """Dense log-probs (whole rows, split over the inference mesh) cross to the training
    mesh; the bootstrapped teacher of another run is reused, not retrained. With
    `train.profile`, a jax.profiler trace of the chosen steps lands under the output dir."""
    _, first_out, _ = finished_run
    out = tmp_path / "out"
    train = {"steps": 4, "checkpoint_every": 4, "profile": [2, 2]}
    cfg = tiny_config(str(corpus_dir), str(out), train=train)
    cfg["teacher"].update(top_k=None, checkpoint=str(first_out / "teacher"), pretrain_steps=0)
    cfg["distill"] = {"loss": "jsd", "beta": 0.3, "temperature": 2.0}
    assert main(["run", _write(tmp_path, cfg)]) == 0
    records = _train(out)
    assert records[-1]["bytes_per_token"] == 260 * 4  # the whole vocabulary, float32
    assert all(r["kd_loss"] > 0 for r in records)
    assert not (out / "teacher").exists()
    assert list((out / "profile").rglob("*.xplane.pb"))  # TensorBoard / Perfetto readable


def test_teacher_on_dp_x_tp_in_microbatches_trains_as_the_plain_layout(
    tmp_path, corpus_dir, finished_run
):
    """The teacher on mesh.teacher.dp=2 x tp=2, one row per forward (its outputs hopped from
    4 teacher devices to 2 student devices): the same losses and held-out metrics as the
    plain tp=2 run, from the same bootstrapped teacher."""
    _, first_out, _ = finished_run
    out = tmp_path / "out"
    cfg = tiny_config(str(corpus_dir), str(out))
    cfg["teacher"]["checkpoint"] = str(first_out / "teacher")
    sets = ["mesh.teacher.dp=2", "mesh.teacher.tp=2", "teacher.microbatch=1"]
    assert main(["run", _write(tmp_path, cfg), *[a for s in sets for a in ("--set", s)]]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["mesh"]["teacher"]["dp"] == 2
    assert not (out / "teacher").exists()
    plain, layout = _train(first_out), _train(out)
    assert [r["step"] for r in layout] == [r["step"] for r in plain] == [2, 4, 6]
    for key in ("loss", "kd_loss", "ce_loss"):
        np.testing.assert_allclose(
            [r[key] for r in layout], [r[key] for r in plain], rtol=1e-4, atol=1e-7
        )
    evals = [json.loads((o / "summary.json").read_text())["final_eval"] for o in (first_out, out)]
    for key in ("teacher_loss", "student_loss", "kl"):
        np.testing.assert_allclose(evals[1][key], evals[0][key], rtol=1e-4)


def test_bench_with_cache_prints_every_figure(tmp_path, corpus_dir, capsys):
    """`distill bench --cache` end to end on the tiny config: every phase, the pipelined
    loop and offline training from a freshly written teacher cache."""
    cfg = _write(tmp_path, tiny_config(str(corpus_dir), str(tmp_path / "out")))
    assert main(["bench", cfg, "--repeats", "2", "--cache"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("teacher_topk_ms", "student_kd_topk_ms", "pipeline_ms", "cache_pipeline_ms"):
        assert result[key] > 0, key
    for key in ("mfu", "teacher_mfu"):  # vs the measured float32 matmul rate on CPU
        assert 0 < result[key] < 1.5, key
    assert result["cache_over_student"] == pytest.approx(
        result["cache_pipeline_ms"] / result["student_kd_topk_ms"], rel=1e-3
    )
    assert result["cache_bytes_per_token"] > 0


def test_top_k_at_the_tokenizers_vocabulary(tmp_path, corpus_dir, finished_run):
    """top_k equal to the live vocabulary of a padded model vocabulary (259 byte ids of
    260) is the dense divergence over the live ids: finite, not the ~1e22 of a tail bucket
    holding only padded ids."""
    _, first_out, _ = finished_run
    out = tmp_path / "out"
    cfg = tiny_config(str(corpus_dir), str(out), train={"steps": 2, "log_every": 1})
    cfg["teacher"].update(top_k=259, checkpoint=str(first_out / "teacher"), pretrain_steps=0)
    assert main(["run", _write(tmp_path, cfg)]) == 0
    assert all(0 < r["kd_loss"] < 10 for r in _train(out))
