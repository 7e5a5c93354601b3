"""The config schema documents itself, and the README's reference covers every key."""

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from distill.config import Config
from distill.config.load import config_from_dict
from distill.errors import DistillError


def _fields(model, prefix=""):
    for name, field in model.model_fields.items():
        sub = [
            t
            for t in (field.annotation, *typing.get_args(field.annotation))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        if sub and name != "rope_scaling":
            yield from _fields(sub[0], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def test_every_field_is_documented_and_in_the_readme():
    root = Path(__file__).parent.parent
    # the README's reference, and the guides' tables of the keys they introduce
    readme = "\n".join(
        p.read_text() for p in [root / "README.md", *sorted(root.glob("docs/guides/*.md"))]
    )
    for path, field in _fields(Config):
        if path.startswith("student.model."):
            continue  # documented as overrides of teacher.model.*
        assert field.description, f"{path} has no description"
        assert f"`{path}`" in readme, f"{path} is missing from the README's config reference"


def test_public_key_paths_exist():
    paths = {p for p, _ in _fields(Config)}
    for p in (
        "run.output_dir",
        "run.seed",
        "mesh.teacher.tp",
        "mesh.student.dp",
        "teacher.checkpoint",
        "teacher.top_k",
        "teacher.pretrain_steps",
        "distill.loss",
        "distill.temperature",
        "distill.alpha",
        "optim.lr",
        "train.steps",
        "train.batch_size",
        "train.seq_len",
        "train.checkpoint_every",
        "train.eval_every",
        "data.source",
        "pipeline.mode",
        "pipeline.prefetch",
        "teacher.model.vocab_size",
        "teacher.model.d_model",
        "teacher.model.n_layers",
        "teacher.model.n_heads",
        "teacher.model.n_kv_heads",
        "teacher.model.d_ff",
        "student.model.d_model",
    ):
        assert p in paths, p


def test_every_mistake_is_reported_one_line_each():
    tree = {
        "teacher": {"modle": {"d_model": 8}},  # a typo: an unknown key
        "train": {"steps": "many"},  # a bad value
        "bogus": {"x": 1},  # an unknown section
    }  # and no data section
    with pytest.raises(DistillError) as err:
        config_from_dict(tree)
    lines = str(err.value).splitlines()
    assert "config: teacher.modle: unknown key" in lines
    assert "config: bogus: unknown key" in lines
    assert "config: data: required field is missing" in lines
    assert any(line.startswith("config: train.steps: ") for line in lines), lines
    assert len(lines) == 4, lines


def test_the_schema_does_no_io_and_the_loader_resolves_the_format(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    tree = {"data": {"source": "x"}, "teacher": {"checkpoint": str(hf_dir)}}
    assert not Config.model_validate(tree).teacher.is_hf()  # auto is resolved only by the loader
    plain = config_from_dict({"data": {"source": "x"}, "teacher": {"checkpoint": "gs://b/t"}})
    assert plain.teacher.format == "distill" and not plain.teacher.is_hf()
    with pytest.raises(DistillError, match="teacher.checkpoint: required"):
        config_from_dict({"data": {"source": "x"}, "teacher": {"format": "hf"}})
