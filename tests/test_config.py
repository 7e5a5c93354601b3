"""The config schema documents itself, and the generated reference covers every key."""

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


def test_every_field_is_documented_and_in_the_reference():
    reference = Path(__file__).parent.parent.joinpath("docs/reference/config.md").read_text()
    for path, field in _fields(Config):
        if not path.startswith("student.model."):  # documented as overrides of teacher.model.*
            assert field.description, f"{path} has no description"
        assert f"| `{path}` |" in reference, f"{path} is missing from docs/reference/config.md"


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


@pytest.mark.parametrize(
    "tree, line",
    [
        ({"trian": {}}, "config: trian: unknown key; did you mean train?"),
        ({"mesh": {"teacher": {"tpp": 2}}}, "config: mesh.teacher.tpp: unknown key; did you mean "
         "mesh.teacher.tp?"),
        ({"distill": {"loss": "forward_kll"}}, "config: distill.loss: Input should be "
         "'forward_kl', 'reverse_kl' or 'jsd'; did you mean forward_kl?"),
        ({"mesh": {"placement": "colocatd"}}, "config: mesh.placement: Input should be 'split', "
         "'colocated' or 'auto'; did you mean colocated?"),
        ({"teacher": {"model": {"d_modle": 8}}}, "config: teacher.model.d_modle: unknown key; "
         "did you mean teacher.model.d_model?"),
    ],
)  # fmt: skip
def test_unknown_keys_and_values_name_the_nearest_valid_one(tree, line):
    """`difflib.get_close_matches` over the section's field names (or the field's choices),
    in the one line of the mistake."""
    with pytest.raises(DistillError) as err:
        config_from_dict({"data": {"source": "x"}, **tree})
    assert line in str(err.value).splitlines()


def test_every_mistake_is_reported_one_line_each():
    tree = {
        "teacher": {"modle": {"d_model": 8}},  # a typo: an unknown key
        "train": {"steps": "many"},  # a bad value
        "bogus": {"x": 1},  # an unknown section
    }  # and no data section
    with pytest.raises(DistillError) as err:
        config_from_dict(tree)
    lines = str(err.value).splitlines()
    assert "config: teacher.modle: unknown key; did you mean teacher.model?" in lines
    assert "config: bogus: unknown key" in lines  # nothing near it
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
