"""`student.init: from_teacher`: a depth-pruned copy of the teacher as the student's start."""

import json

import jax
import numpy as np
import pytest
import yaml

from distill.checkpoint import save_params
from distill.config import ModelConfig
from distill.config.load import config_from_dict
from distill.errors import DistillError
from distill.mesh import student_mesh
from distill.models import model, parts
from pipelines.commands.cli import main
from student import train
from teacher.weights import student_init_params
from tests.conftest import tiny_config

TEACHER = dict(vocab_size=260, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64)


def _teacher_params(seed=3):
    """A random teacher with confident predictions (large head weights), so that the
    distance of a student from it means something."""
    rng = np.random.default_rng(seed)
    params = model.init_params(ModelConfig(**TEACHER), seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            np.asarray(x)
            + (0.5 if "lm_head" in jax.tree_util.keystr(path) else 0.1)
            * rng.standard_normal(x.shape).astype(np.float32)
        ),
        params,
    )


def _tree(corpus_dir, out, teacher_ckpt, **student):
    tree = tiny_config(str(corpus_dir), str(out))
    tree["teacher"].update(model=dict(TEACHER), checkpoint=str(teacher_ckpt), pretrain_steps=0)
    tree["student"] = {"init": "from_teacher", **student}
    return tree


@pytest.mark.parametrize(
    "teacher_layers,student_layers,expected",
    [(12, 4, [0, 4, 7, 11]), (4, 2, [0, 3]), (3, 3, [0, 1, 2]), (5, 1, [0])],
)
def test_default_layers_are_evenly_spaced(
    corpus_dir, tmp_path, teacher_layers, student_layers, expected
):
    tree = _tree(corpus_dir, tmp_path, tmp_path / "t", model={"n_layers": student_layers})
    tree["teacher"]["model"]["n_layers"] = teacher_layers
    assert config_from_dict(tree).init_layers() == expected


@pytest.mark.parametrize("init", ["from_teacher", "random"])
def test_a_shallower_student_takes_the_kept_layers_types(corpus_dir, tmp_path, init):
    """A teacher whose layers differ (Gemma 3's five sliding, one full): a student of 3
    layers that does not set layer_types has those of the teacher layers kept (0, 3, 5),
    whether it starts from them or from random weights; a deeper random student must set
    its own."""
    types = ["sliding"] * 5 + ["full"]
    tree = _tree(corpus_dir, tmp_path, tmp_path / "t", init=init, model={"n_layers": 3})
    tree["teacher"]["model"].update(n_layers=6, sliding_window=4, layer_types=types)
    cfg = config_from_dict(tree)
    assert cfg.student_model().layer_types == ("sliding", "sliding", "full")
    tree["student"]["init_layers"] = [1, 2, 4]
    if init == "from_teacher":
        assert config_from_dict(tree).student_model().layer_types == ("sliding",) * 3
    del tree["student"]["init_layers"]
    tree["student"]["model"]["n_layers"] = 8
    with pytest.raises(DistillError, match=r"layer_types: 6 entries for n_layers 8|exceeds"):
        config_from_dict(tree).student_model()


@pytest.mark.parametrize("fmt, placed", [("distill", False), ("hf", False), ("distill", True)])
def test_init_params_are_the_chosen_teacher_layers(corpus_dir, tmp_path, fmt, placed):
    """The kept layers, on the host's CPU device or (placed) straight in the student's
    layout on its mesh (a Hugging Face teacher's: tests/test_host_copies.py)."""
    params = _teacher_params()
    ckpt = tmp_path / "teacher"
    if fmt == "distill":
        save_params(str(ckpt), params)
    else:
        from student.export import write_hf

        # the bytes tokenizer has 259 ids, so this 260-vocab export is trimmed to 259
        cfg259 = ModelConfig(**{**TEACHER, "vocab_size": 259})
        params = dict(params, embed=params["embed"][:259], lm_head=params["lm_head"][:, :259])
        write_hf(ckpt, cfg259, params, max_position_embeddings=32)
    tree = _tree(corpus_dir, tmp_path / "out", ckpt, model={"n_layers": 2}, init_layers=[0, 2])
    if fmt == "hf":
        tree["teacher"]["model"] = {}  # from config.json
    cfg = config_from_dict(tree)
    assert cfg.teacher.is_hf() == (fmt == "hf")
    where = None
    if placed:
        where = train.param_shardings(cfg.student_model(), student_mesh(jax.devices()[:4], 2, 2))
    got = student_init_params(cfg, where)
    want = dict(params, layers={k: v[[0, 2]] for k, v in params["layers"].items()})
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
    if placed:
        assert jax.tree.leaves(jax.tree.map(lambda g: g.sharding, got)) == jax.tree.leaves(where)


def test_from_teacher_with_every_layer_starts_equal_to_the_teacher(corpus_dir, tmp_path):
    """`distill run` end to end (teacher tp=2, student dp=2): with all of the teacher's layers
    the student's step-0 eval is the teacher's: KL 0, the same loss, the same argmax."""
    save_params(str(tmp_path / "teacher"), _teacher_params())

    def step0_eval(name, **student):
        out = tmp_path / name
        tree = _tree(corpus_dir, out, tmp_path / "teacher", **student)
        tree["train"].update(steps=1, eval_every=1)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree))
        assert main(["run", str(path)]) == 0
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return next(r for r in records if r.get("eval") and r["step"] == 0)

    full = step0_eval("full")
    assert full["kl"] < 1e-5 and full["top1_agreement"] == 1.0
    np.testing.assert_allclose(full["student_loss"], full["teacher_loss"], rtol=1e-5)


HYBRID_TEACHER = dict(
    TEACHER, n_layers=8, layer_types=["linear", "linear", "linear", "full"] * 2,
    attn_output_gate=True, qk_norm=True, norm_offset=1.0, head_dim=8, family="qwen3_5_text",
    linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=8, linear_conv_kernel=4,
)  # fmt: skip


@pytest.mark.parametrize("n, kept", [(4, [0, 2, 5, 7]), (2, [0, 7]), (6, [0, 3, 4, 5, 6, 7])])
def test_a_hybrid_teacher_is_pruned_keeping_its_pattern(corpus_dir, tmp_path, n, kept):
    """Qwen3.5's three linear layers then one full: a pruned student keeps the pattern (its
    layer j of the type of the teacher's j modulo 4, shifted so that it starts and ends as
    the teacher does), from the teacher's layers of that type nearest even spacing; its
    init weights are those layers' slices of the teacher's part stacks (each part stored
    over the layers that hold it)."""
    t = ModelConfig(**HYBRID_TEACHER)
    params = model.init_params(t, 0)
    save_params(str(tmp_path / "t"), params)
    tree = _tree(corpus_dir, tmp_path / "out", tmp_path / "t", model={"n_layers": n})
    tree["teacher"]["model"] = dict(HYBRID_TEACHER)
    cfg = config_from_dict(tree)
    s = cfg.student_model()
    assert cfg.init_layers() == kept
    assert s.types() == tuple(t.types()[i] for i in kept)
    got = student_init_params(cfg)
    for key, stack in params["layers"].items():
        holds = parts.part_layers(t, parts.weight_part(key))
        rows = [parts.layer_slot(t, key, i) for i in kept if holds[i]]
        np.testing.assert_array_equal(got["layers"][key], np.asarray(stack)[rows], err_msg=key)
        assert got["layers"][key].shape[0] == parts.stack_size(s, key)
