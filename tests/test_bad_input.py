"""Every user mistake: one line naming the field or file, exit status 2, nothing lost."""

import glob
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import yaml

from distill.config.load import load_config
from distill.mesh import devices_needed
from pipelines.commands.cli import main
from tests.conftest import cli_env, tiny_config
from tests.test_tutorial import PIPELINES as TUTORIAL_PIPELINES

CASES = [  # (--set overrides, text the one-line message must contain)
    (["train.stepz=3"], "train.stepz: unknown key"),
    (["train.steps=abc"], "train.steps"),
    (["mesh.teacher.tp=8", "mesh.student.dp=4"], "needs 12 devices"),
    (
        ["teacher.model.n_heads=6", "teacher.model.head_dim=8", "mesh.teacher.tp=4"],
        "teacher.model.n_heads: 6 is not divisible by mesh.teacher.tp=4",
    ),
    (["teacher.model.d_ff=66", "mesh.teacher.tp=4"], "teacher.model.d_ff"),
    (["teacher.model.vocab_size=261"], "teacher.model.vocab_size: 261"),
    (
        [
            "teacher.model.n_kv_heads=4",
            "teacher.model.n_heads=12",
            "teacher.model.head_dim=8",
            "teacher.model.d_ff=66",
            "teacher.model.vocab_size=261",
            "mesh.teacher.tp=3",
        ],
        "teacher.model.n_kv_heads: 4 must divide or be a multiple of mesh.teacher.tp=3",
    ),
    (["train.batch_size=5"], "train.batch_size: 5 is not divisible by mesh.student.dp=2"),
    (["mesh.student.fsdp=4"], "student dp=2 x fsdp=4 needs 10 devices"),
    (
        ["mesh.student.fsdp=2", "train.grad_accum=2"],
        "train.batch_size: 4 is not divisible by mesh.student.dp=2 x mesh.student.fsdp=2 x "
        "train.grad_accum=2 = 8",
    ),
    (
        ["mesh.student.fsdp=2", "mesh.student.devices=[2, 3]"],
        "mesh.student.devices: 2 ids given but mesh.student.dp=2 x mesh.student.fsdp=2",
    ),
    (["mesh.teacher.dp=3"], "train.batch_size: 4 is not divisible by mesh.teacher.dp=3"),
    (
        ["mesh.teacher.dp=2", "train.batch_size=12", "teacher.microbatch=4"],
        "teacher.microbatch: 4 does not divide the 6 rows of each teacher dp group",
    ),
    (
        ["teacher.top_k=null", "teacher.model.vocab_size=128256", "train.seq_len=4096"],
        "teacher.top_k: null sends dense teacher log-probs, 2 rows x 4096 tokens x 128256 ids "
        "x 4 B x 2 buffers = 7.8 GiB per student device, over the fixed budget of a cpu device "
        "(4.0 GiB); set teacher.top_k",
    ),
    (
        ["teacher.top_k=null", "teacher.model.vocab_size=128256", "train.seq_len=16384"],
        "teacher.top_k: null makes dense teacher outputs of 2 rows x 16384 tokens x 128256 ids "
        "= 4,202,692,608 elements on a device (an array per train.grad_accum microbatch), not "
        "under 2^31 (32-bit GPU indexing); at most 1 rows a device and microbatch fit",
    ),
    (["student.model.vocab_size=200"], "student.model.vocab_size: 200 is smaller"),
    (["teacher.model.vocab_size=128"], "tokenizer"),
    (["data.source=/nonexistent/corpus"], "/nonexistent/corpus"),
    (["teacher.pretrain_steps=0", "teacher.checkpoint=/nonexistent/teacher"], "teacher.checkpoint"),
    (["mesh.student.devices=[1]"], "mesh.student.devices"),
    (["distill.alpha=2"], "distill.alpha"),
    (["pipeline.mode=bogus"], "pipeline.mode"),
    (["pipeline.mode=ray", "mesh.teacher.devices=[0, 1]"], "mesh.teacher.devices: not used in"),
    (["pipeline.mode=ray", "teacher.source=cache"], "teacher.source: cache is read in pipeline"),
    (
        ["teacher.format=hf", "teacher.checkpoint=gs://bucket/llama"],
        "teacher.checkpoint: gs://bucket/llama: a Hugging Face teacher is read from a local",
    ),
    (["student.init=from_teacher"], "student.model.d_model: 16 differs from the teacher's 32"),
    (["student.init_layers=[0]"], "student.init_layers: set, but student.init is random"),
    (
        ["student.init=from_teacher", "student.model={n_layers: 3}"],
        "student.model.n_layers: 3 exceeds the teacher's 2",
    ),
    (
        ["student.init=from_teacher", "student.model={n_layers: 1}", "student.init_layers=[2]"],
        "student.init_layers: [2] must be increasing teacher layer indices in [0, 2)",
    ),
    (
        ["student.init=from_teacher", "student.model={n_layers: 1}", "student.init_layers=[0, 1]"],
        "student.init_layers: 2 layers given, but student.model.n_layers is 1",
    ),
]


@pytest.mark.parametrize("overrides,expected", CASES)
def test_bad_input_is_one_line_and_exit_2(tmp_path, corpus_dir, capsys, overrides, expected):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(corpus_dir), str(out))))
    args = [a for o in overrides for a in ("--set", o)]
    for command in ("validate", "run"):
        assert main([command, str(cfg), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert expected in err, err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == "precious\n"


def test_empty_data_and_missing_config(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(empty), str(tmp_path / "out"))))
    assert main(["validate", str(cfg)]) == 2
    assert "data.source" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("run: [unclosed")
    assert main(["validate", str(tmp_path / "bad.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize(
    "path",
    # the tutorial's pipelines name model directories a user downloads: tests/test_tutorial.py
    # validates them with tiny ones
    sorted(p for p in glob.glob("pipelines/*.yaml") if Path(p).name not in TUTORIAL_PIPELINES),
)
def test_every_shipped_pipeline_validates(path):
    cfg = load_config(path)
    # auto's table compiles every candidate layout (tests/test_placement.py does on a
    # tiny config): here the layout the file gives is validated
    split = ["--set", "mesh.placement=split"] if cfg.mesh.placement == "auto" else []
    if devices_needed(cfg) > len(jax.devices()):  # more CPU devices: a process of its own
        argv = [sys.executable, "-m", "pipelines.commands.cli", "validate", path, *split]
        subprocess.run(argv, env=cli_env(devices_needed(cfg)), capture_output=True, check=True)
    else:
        assert main(["validate", path, *split]) == 0
    assert cfg.pipeline.mode in ("local", "ray")


def test_set_overrides_are_typed():
    cfg = load_config(
        "pipelines/quickstart.yaml",
        ["train.steps=7", "optim.lr=1e-4", "teacher.top_k=null", "run.name=x y"],
    )
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-4 and cfg.teacher.top_k is None
    assert cfg.run.name == "x y"
    assert cfg.student_model().d_model == 128 and cfg.student_model().vocab_size == 384


def test_several_config_mistakes_are_all_printed(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("teacher:\n  modle: {}\ntrain:\n  steps: many\nbogus: 1\n")
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "Traceback" not in err
    assert all(line.startswith("distill: error: config: ") for line in lines), err
    for key in ("teacher.modle: unknown key", "bogus: unknown key", "train.steps: "):
        assert any(key in line for line in lines), err
    assert "distill: error: config: data: required field is missing" in lines


def test_an_8b_teacher_is_not_bootstrapped_on_this_host(tmp_path, capsys):
    """The shipped 8B-to-1B pipeline without the teacher's weights: one line, exit 2,
    before anything is written (not an out-of-memory crash in the bootstrap)."""
    out = tmp_path / "out"
    argv = ["run", "pipelines/llama3-8b-to-1b.yaml", "--set", f"run.output_dir={out}"]
    assert main([*argv, "--set", f"teacher.checkpoint={tmp_path / 'teacher'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distill: error: teacher.checkpoint:") and "8.0B" in err
    assert len(err.splitlines()) == 1 and not out.exists()
