"""Starts you can trust: a bootstrapped teacher carries how it was made, a distill teacher
checkpoint has the configured shape, and a student checkpoint pins its teacher."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from distill.checkpoint import save_params
from distill.config import ModelConfig
from distill.identity import checkpoint_identity
from distill.models.model import abstract_params
from pipelines.commands.cli import main
from teacher import provenance
from tests.conftest import tiny_config


def _files(root):
    """{relative path: (size, mtime_ns)} of every file under `root`."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("distill: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, corpus_dir):
    """Run A: a 4-step teacher bootstrapped at <tmp>/teacher, a student distilled 3 steps."""
    tmp = tmp_path_factory.mktemp("prov")
    cfg = tiny_config(
        str(corpus_dir),
        str(tmp / "a"),
        teacher={"checkpoint": str(tmp / "teacher"), "pretrain_steps": 4},
        train={"steps": 3},
    )
    path = tmp / "a.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path)]) == 0
    return tmp, str(path)


def test_a_teacher_made_otherwise_is_refused_until_rebootstrapped(first_run, capsys):
    tmp, cfg = first_run
    teacher, out_b = tmp / "teacher", tmp / "b"
    assert provenance.read(str(teacher))["settings"]["teacher.pretrain_steps"] == 4
    before = _files(teacher)
    six = ["--set", "teacher.pretrain_steps=6", "--set", f"run.output_dir={out_b}"]
    capsys.readouterr()
    assert main(["run", cfg, *six]) == 2
    err = _one_error(capsys)
    assert "teacher.pretrain_steps: 6 differs from 4" in err and "teacher.rebootstrap" in err
    assert _files(teacher) == before and not out_b.exists()  # nothing written

    assert main(["run", cfg, *six, "--set", "teacher.rebootstrap=true"]) == 0
    assert provenance.read(str(teacher))["settings"]["teacher.pretrain_steps"] == 6
    assert _files(teacher) != before


def test_a_student_pins_its_teacher_and_a_teacher_has_its_shape(first_run, capsys):
    tmp, cfg = first_run
    out_a, other = tmp / "a", tmp / "other-teacher"  # a user's own teacher: no provenance
    mcfg = ModelConfig(**yaml.safe_load(Path(cfg).read_text())["teacher"]["model"])
    save_params(str(other), _constant(abstract_params(mcfg)))
    use_other = ["--set", f"teacher.checkpoint={other}"]

    capsys.readouterr()  # another shape: one line naming teacher.checkpoint, in preflight
    shape = ["--set", "teacher.model.n_layers=4", "--set", f"run.output_dir={tmp / 'c'}"]
    assert main(["validate", cfg, *use_other, *shape]) == 2
    err = _one_error(capsys)
    assert f"teacher.checkpoint: {other}: layers." in err
    assert "stored [2, " in err and "teacher.model gives [4, " in err

    before = _files(out_a)  # resuming run A against another teacher is refused
    more = ["--set", "train.steps=6"]
    assert main(["run", cfg, *use_other, *more]) == 2
    err = _one_error(capsys)
    assert f"teacher.checkpoint: {other} " in err and "run.allow_teacher_change=true" in err
    assert _files(out_a) == before

    allow = ["--set", "run.allow_teacher_change=true"]
    assert main(["run", cfg, *use_other, *more, *allow]) == 0
    assert (out_a / "checkpoints" / "6").is_dir()
    assert main(["export", str(out_a)]) == 0
    record = json.loads((out_a / "hf" / "distill.json").read_text())
    assert record["step"] == 6 and record["recorded"]
    assert record["teacher"]["sha256"] == checkpoint_identity(str(other))["sha256"]
    assert record["tokenizer"]["kind"] == "bytes"


def _constant(tree):
    return jax.tree.map(lambda x: np.full(x.shape, 0.01, x.dtype), tree)
