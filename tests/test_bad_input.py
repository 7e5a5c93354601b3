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
from tests.test_tutorial import WITH_DOWNLOADS

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


QUICKSTART_CASES = [  # the quick start as a user mistypes it: (--set overrides, the line's text)
    (["mesh.teacher.tp=3"], "teacher.model.n_heads: 8 is not divisible by mesh.teacher.tp=3"),
    (
        ["mesh.student.dp=3", "train.batch_size=8"],
        "train.batch_size: 8 is not divisible by mesh.student.dp=3",
    ),
    (
        ["mesh.student.dp=4", "train.batch_size=10"],
        "train.batch_size: 10 is not divisible by mesh.student.dp=4",
    ),
    (
        ["mesh.teacher.dp=4", "mesh.teacher.tp=4"],
        "mesh.placement: auto keeps the axes written (mesh.teacher.dp=4, mesh.teacher.tp=4), "
        "and no layout of 8 cpu device(s) with them",
    ),
    (["student.model.vocab_size=200"], "student.model.vocab_size: 200 is smaller than the"),
    (["teacher.top_k=500"], "teacher.top_k: 500 exceeds the smaller model vocabulary"),
    (["data.source=/nonexistent/corpus"], "/nonexistent/corpus"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer: "),
    (
        ["teacher.checkpoint=/nonexistent/teacher", "teacher.pretrain_steps=0"],
        "teacher.checkpoint: /nonexistent/teacher has no weights and teacher.pretrain_steps is 0",
    ),
    (["student.checkpoint=/nonexistent/student"], "student.checkpoint: /nonexistent/student is"),
    (
        ["data.max_bytes=3000", "train.batch_size=64"],
        "train rows (of train.seq_len=128 tokens, after data.eval_fraction) are fewer than "
        "train.batch_size=64",
    ),
    (["train.stepz=3"], "train.stepz: unknown key; did you mean train.steps?"),
    (["distill.loss=forward_kll"], "distill.loss: Input should be"),
    (["mesh.placement=colocatd"], "did you mean colocated?"),
    (["optim.lr=-1"], "optim.lr"),
    (["distill.alpha=2"], "distill.alpha"),
    (
        ["mesh.student.cp=2", "distill.on_policy.fraction=0.5"],
        "distill.on_policy.fraction: not supported with mesh.student.cp=2",
    ),
    (["mesh.student.cp=3"], "train.seq_len: 128 does not split into 2 x mesh.student.cp = 6"),
    (["pipeline.mode=ray"], "mesh.placement: auto chooses from the devices of one process"),
    (["mesh.student.devices=[4, 5]"], "mesh.student.devices: mesh.placement auto lays the dev"),
]


@pytest.mark.parametrize("overrides,expected", QUICKSTART_CASES)
def test_quickstart_mistakes_are_refused_alike_by_validate_and_run(
    tmp_path, capsys, caplog, overrides, expected
):
    """`distill validate` and `distill run` of the quick start (`mesh.placement: auto`) with
    a user's mistake: the same one line and exit status 2 from both, before auto compiles
    or prints anything, and nothing written into an existing run.output_dir."""
    import logging

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    sets = [f"run.output_dir={out}", f"teacher.checkpoint={tmp_path / 'teacher'}", *overrides]
    args = ["pipelines/quickstart.yaml", *(a for o in sets for a in ("--set", o))]
    caplog.set_level(logging.INFO)
    lines = []
    for command in ("validate", "run"):
        assert main([command, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert expected in err, err
        lines.append(err)
    assert lines[0] == lines[1]
    assert "mesh.placement auto" not in caplog.text  # no candidate compiled, no table
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == "precious\n"
    assert not (tmp_path / "teacher").exists()


def test_a_missing_download_is_named_as_missing(capsys):
    """The laptop pipeline without its download: its teacher's shape comes from the missing
    directory's config.json, so the line names the directory, not a shape of the default
    teacher the student would not fit."""
    sets = ["--set", "teacher.checkpoint=/nonexistent/Qwen3-0.6B"]
    for command in ("validate", "run"):
        assert main([command, "pipelines/qwen3-0.6b-laptop-chat.yaml", *sets]) == 2
        assert capsys.readouterr().err.strip() == (
            "distill: error: teacher.checkpoint: /nonexistent/Qwen3-0.6B is missing (no such "
            "file or directory); download the model there, or point teacher.checkpoint at it"
        )


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
    sorted(
        p
        for p in glob.glob("pipelines/*.yaml")
        if Path(p).name not in (*TUTORIAL_PIPELINES, *WITH_DOWNLOADS)
    ),  # fmt: skip
)
def test_every_shipped_pipeline_validates(path, capsys):
    """Each shipped pipeline validates, or is refused as `run` would refuse it here: a
    real-size teacher whose weights are not on this machine, too large to bootstrap on it
    (`teacher.pretrain_steps` stands in for its weights), in the run's one line; a
    real-size student of a teacher behind a server, too large for this machine's RAM."""
    cfg = load_config(path)
    # auto's table compiles every candidate layout (tests/test_placement.py does on a
    # tiny config): here the layout the file gives is validated
    split = ["--set", "mesh.placement=split"] if cfg.mesh.placement == "auto" else []
    if devices_needed(cfg) > len(jax.devices()):  # more CPU devices: a process of its own
        argv = [sys.executable, "-m", "pipelines.commands.cli", "validate", path, *split]
        proc = subprocess.run(argv, env=cli_env(devices_needed(cfg)), capture_output=True)
        rc, err = proc.returncode, proc.stderr.decode()
    else:
        rc, err = main(["validate", path, *split]), capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("distill: error:")]
    if rc != 0:
        assert rc == 2 and len(lines) == 1, err
        if not cfg.teacher.loaded():  # a teacher behind a server: the student's real size
            assert lines[0].startswith("distill: error: host memory: "), err
            return
        assert lines[0].startswith("distill: error: teacher.checkpoint: no weights at "), err
        assert "-parameter teacher (teacher.pretrain_steps) needs" in lines[0], err
    assert cfg.pipeline.mode in ("local", "ray")


def test_set_overrides_are_typed():
    cfg = load_config(
        "pipelines/quickstart.yaml",
        ["train.steps=7", "optim.lr=1e-4", "teacher.top_k=null", "run.name=x y"],
    )
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-4 and cfg.teacher.top_k is None
    assert cfg.run.name == "x y"
    assert cfg.student_model().d_model == 128 and cfg.student_model().vocab_size == 384
    # data.source's placeholders as written in YAML files, unquoted (YAML reads {stdlib}
    # as a one-key mapping)
    for name in ("{stdlib}", "{stdlib_chat}"):
        assert load_config("pipelines/quickstart.yaml", [f"data.source={name}"]).data.source == name


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


def test_validate_names_a_teacher_this_host_cannot_bootstrap_and_passes(tmp_path, capsys):
    """The shipped 8B-to-1B pipeline without the teacher's weights validates (every other
    check made) and prints, as its second line, the line `run` stops at on this machine."""
    argv = ["validate", "pipelines/llama3-8b-to-1b.yaml"]
    out_dir = ["--set", f"run.output_dir={tmp_path / 'out'}"]
    assert main([*argv, *out_dir, "--set", f"teacher.checkpoint={tmp_path / 'teacher'}"]) == 0
    ok, here = capsys.readouterr().out.strip().splitlines()
    assert ok.startswith("pipelines/llama3-8b-to-1b.yaml: ok (")
    assert here.startswith("pipelines/llama3-8b-to-1b.yaml: not runnable on this machine: ")
    assert "teacher.checkpoint: no weights at " in here and "8.0B" in here


def test_an_8b_teacher_is_not_bootstrapped_on_this_host(tmp_path, capsys):
    """The shipped 8B-to-1B pipeline without the teacher's weights: one line, exit 2,
    before anything is written (not an out-of-memory crash in the bootstrap)."""
    out = tmp_path / "out"
    argv = ["run", "pipelines/llama3-8b-to-1b.yaml", "--set", f"run.output_dir={out}"]
    assert main([*argv, "--set", f"teacher.checkpoint={tmp_path / 'teacher'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distill: error: teacher.checkpoint:") and "8.0B" in err
    assert len(err.splitlines()) == 1 and not out.exists()
