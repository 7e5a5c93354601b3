"""Context parallelism across tokenizers (`mesh.student.cp`, `mesh.teacher.cp` with a
`teacher.tokenizer` of its own) against one device.

The teacher's outputs on its own rows [B, T] are gathered at the student's positions on the
inference mesh (`teacher.positions`: around its cp ring, or in place without one) and
equal the host gather; the student's cross-tokenizer loss and gradients on cp = 2 from
those outputs equal one device's from the teacher's rows (float32, 1e-6), for a dense
teacher under `first_byte` conditioned on the boundary and a top-k one under `mapped`;
and what cannot work is refused in one line.
"""

import copy

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from distill import handoff
from distill.config import Config, DistillLossConfig, ModelConfig
from distill.config.load import config_from_dict
from distill.data.token_bytes import FirstBytes, VocabMap
from distill.data.tokenizers import ByteTokenizer
from distill.errors import DistillError
from distill.mesh import check_context, student_mesh, teacher_mesh
from distill.models import model
from distill.models.cross import losses as cross_losses
from distill.models.cross.losses import CrossSpec
from distill.types import Batch, TeacherOutput, TeacherView
from student import train
from student.context import Context
from teacher import positions
from teacher.sharding import out_spec
from tests.test_cross_tokenizer import bpe  # noqa: F401  (the fixture)

B, S, T, VT, VS = 4, 32, 48, 259, 320
STUDENT = ModelConfig(vocab_size=VS, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
LOSS = DistillLossConfig(temperature=2.0, alpha=0.7)


def _align(rng) -> np.ndarray:
    """[B, S]: increasing teacher positions, about a fifth of them unmatched (-1)."""
    rows = [np.sort(rng.choice(T, S, replace=False)) for _ in range(B)]
    align = np.stack(rows).astype(np.int32)
    return np.where(rng.random((B, S)) < 0.2, -1, align).astype(np.int32)


def _batch(seed: int) -> Batch:
    """Packed student rows (three documents, then padding) with the teacher's view."""
    rng = np.random.default_rng(seed)
    ids = lambda n, v: rng.integers(0, v, (B, n)).astype(np.int32)  # noqa: E731
    seg = np.zeros((B, S), np.int32)
    seg[:, :11], seg[:, 11:27], seg[:, 27:30] = 1, 2, 3
    pos = np.tile(np.concatenate([np.arange(11), np.arange(16), np.arange(3), [0, 1]]), (B, 1))
    mask = (rng.random((B, S)) > 0.2).astype(np.float32) * (seg > 0)
    own = Batch(ids(T, VT), ids(T, VT), np.ones((B, T), np.int32), ids(T, T), np.ones((B, T)))
    view = TeacherView(own._replace(mask=own.mask.astype(np.float32)), _align(rng))
    return Batch(ids(S, VS), ids(S, VS), seg, pos.astype(np.int32), mask, view)


def _teacher(seed: int, k: int | None) -> TeacherOutput:
    logits = np.random.default_rng(seed).normal(size=(B, T, VT)).astype(np.float32) * 3
    lp = np.asarray(jax.nn.log_softmax(logits / LOSS.temperature))
    if k is None:
        return TeacherOutput(lp)
    vals, ids = jax.lax.top_k(lp, k)
    return TeacherOutput(np.asarray(vals), np.asarray(ids, np.int32))


def _cross(method: str, tok, batch: Batch) -> CrossSpec:
    if method == "mapped":
        return CrossSpec(method, VocabMap.between(ByteTokenizer(), tok, VT, VS), VT)
    fb = FirstBytes.between(ByteTokenizer(), tok, VT, VS)
    stream = batch.tokens.ravel()
    return CrossSpec(method, fb.after_tokens(stream, np.zeros(len(stream), bool)), VT)


@pytest.mark.parametrize(
    "axes", [(1, 2, 2), (2, 1, 2), (2, 2, 1)], ids=["tp2-cp2", "dp2-cp2", "dp2-tp2"]
)
def test_the_outputs_reach_the_students_positions(axes):
    """On the inference mesh, split by position over cp (or not): the host gather's values,
    laid out as the teacher's outputs are."""
    dp, tp, cp = axes
    mesh = teacher_mesh(jax.devices()[: dp * tp * cp], dp, tp, cp=cp)
    batch, out = _batch(0), _teacher(1, 5)
    placed = jax.device_put(out, NamedSharding(mesh, out_spec(B, mesh)))
    got = positions.at_student_positions(mesh, placed, batch.teacher.align)
    want = positions.on_host(out, batch.teacher.align)
    for g, w, x in zip(got, want, out, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
        assert g.sharding.spec == out_spec(B, mesh)
        np.testing.assert_array_equal(
            w, np.asarray(cross_losses.at_student_positions(x, batch.teacher.align))
        )


def _loss_and_grads(mesh, cross: CrossSpec, batch: Batch, out: TeacherOutput):
    """(loss, metrics, gradients) of the step's loss on `mesh`, the batch laid out as the
    step lays it out (`student.context`)."""
    loss_fn = train.make_loss_fn(STUDENT, LOSS, "float32", None, "none", mesh, cross=cross)
    context = Context.of(mesh)

    def run(params, batch, out):
        if context is not None:
            batch, out = context.pieces((batch, out))
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, out)
        return loss, metrics, grads

    split = train.batch_sharding(mesh)
    params = model.init_params(STUDENT, 0)
    return jax.device_get(jax.jit(run, in_shardings=(None, split, split))(params, batch, out))


@pytest.mark.parametrize("method, k", [("first_byte", None), ("mapped", 6)])
def test_cp_across_tokenizers_gives_one_devices_loss_and_gradients(bpe, method, k):  # noqa: F811
    """One device reads the teacher's rows [B, T]; the cp = 2 student reads the outputs the
    cp = 2 inference mesh gathered at its positions, hopped onto its mesh."""
    devices = jax.devices()
    batch, out = _batch(2), _teacher(3, k)
    cross = _cross(method, bpe, batch)
    want = _loss_and_grads(student_mesh(devices[:1], 1, 1), cross, batch, out)

    tmesh = teacher_mesh(devices[:2], 1, 1, cp=2)
    smesh = student_mesh(devices[2:4], 1, 1, 2)
    placed = jax.device_put(out, NamedSharding(tmesh, out_spec(B, tmesh)))
    moved = handoff.hop(
        positions.at_student_positions(tmesh, placed, batch.teacher.align),
        train.batch_sharding(smesh),
    )
    got = _loss_and_grads(smesh, cross, batch, moved)
    assert want[1]["aligned_fraction"] < 1 and want[1]["kd_loss"] > 0
    np.testing.assert_allclose(got[0], want[0], atol=1e-6, rtol=0)
    for key in want[1]:
        np.testing.assert_allclose(got[1][key], want[1][key], atol=1e-6, rtol=0, err_msg=key)
    for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)


def _config(role: str, **distill) -> Config:
    return config_from_dict(
        {
            "data": {"source": "x", "tokenizer": "bpe/tokenizer.json"},
            "teacher": {"tokenizer": "bytes"},
            "mesh": {role: {"cp": 2}},
            "train": {"seq_len": S, "batch_size": 4},
            "distill": distill,
        }
    )


def test_cp_across_tokenizers_is_checked_in_one_line():
    """Either role's cp takes a teacher tokenizer of its own; the student's refuses
    `byte_path` (its deeper bytes read teacher positions past the aligned one, which the
    outputs gathered at the student's positions do not hold), the teacher's takes it."""
    for role in ("student", "teacher"):
        assert _config(role).cross_tokenizer()
        check_context(_config(role))
    check_context(_config("teacher", cross_tokenizer="byte_path"))
    with pytest.raises(DistillError, match="distill.cross_tokenizer") as err:
        check_context(_config("student", cross_tokenizer="byte_path"))
    assert "\n" not in str(err.value) and "mesh.student.cp" in str(err.value)


def cross_tree(teacher_dir, corpus_dir, tmp, **mesh) -> dict:
    """A byte-level teacher (`teacher_dir`: the tiny run's; dense outputs) and a BPE
    student tokenizer trained on the same corpus, on the meshes `mesh` (role -> axes)."""
    from distill.data.bpe import train_bpe
    from tests.conftest import tiny_config

    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]
    cfg = tiny_config(str(corpus_dir), str(tmp / "out"))
    cfg["teacher"].update(
        checkpoint=str(teacher_dir), pretrain_steps=0, top_k=None, tokenizer="bytes"
    )
    cfg["student"]["model"]["vocab_size"] = 320
    cfg["data"]["tokenizer"] = str(train_bpe(texts, 300, tmp / "bpe" / "tokenizer.json"))
    # every step compares the vocabularies: the student soon predicts better than this
    # weak teacher, where the gate would make its steps cross-entropy alone
    cfg.setdefault("distill", {})["alpha_gate"] = False
    for role, axes in mesh.items():
        cfg["mesh"][role].update(axes)
    return cfg


@pytest.fixture(scope="module")
def cross_cp_1(tiny_run, corpus_dir, tmp_path_factory):
    """The run across tokenizers (`cross_tree`: the tiny run's byte-level teacher, dense, a
    BPE student) in local mode on cp = 1 in both roles, the reference of the cp runs: its
    output directory and config tree."""
    from pipelines.commands.cli import main
    from tests.conftest import write_config

    tmp = tmp_path_factory.mktemp("cross_cp_1")
    tree = cross_tree(tiny_run.out / "teacher", corpus_dir, tmp)
    assert main(["run", write_config(tmp, tree)]) == 0
    return tmp / "out", tree


def with_cp(tree: dict, out, **sections) -> dict:
    """`tree` writing to `out`, with cp = 2 in both roles and `sections` merged in."""
    tree = copy.deepcopy(tree)
    tree["run"]["output_dir"] = str(out)
    for role in ("teacher", "student"):
        tree["mesh"][role]["cp"] = 2
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return tree


def assert_same_as_cp_1(out, cp_1) -> None:
    """The losses, the aligned share and the evaluations (bits per byte of both models) of
    the cp = 1 run `cp_1`, to 1e-6 (the evaluations' means also to 1e-6 relative)."""
    from tests.conftest import read_evals, train_by_step

    got, want = train_by_step(out), train_by_step(cp_1)
    assert sorted(got) == sorted(want) == [2, 4, 6]
    keys = ("loss", "kd_loss", "ce_loss", "lr", "aligned_fraction")
    for step, r in want.items():
        assert 0.8 < r["aligned_fraction"] <= 1.0
        for key in keys:
            assert got[step][key] == pytest.approx(r[key], rel=0, abs=1e-6), (step, key)
    evals = [read_evals(o) for o in (out, cp_1)]
    assert len(evals[0]) == len(evals[1]) == 3
    for e, w in zip(*evals, strict=True):
        for key in ("student_loss", "teacher_loss", "student_bpb", "teacher_bpb"):
            # means over every held-out token, summed in the layout's order: float32's
            # 1e-7 relative is 1e-6 absolute at 5 to 8 nats or bits
            assert e[key] == pytest.approx(w[key], rel=1e-6, abs=1e-6), key


@pytest.mark.slow
def test_a_cross_tokenizer_run_with_cp_in_both_roles_gives_the_runs_losses(cross_cp_1, tmp_path):
    """The byte-level teacher on tp = 2 x cp = 2 over its own rows, the BPE student on dp =
    2 x cp = 2 reading the outputs gathered at its positions: the run on one cp's."""
    from pipelines.commands.cli import main
    from tests.conftest import write_config

    cp_1, tree = cross_cp_1
    assert main(["run", write_config(tmp_path, with_cp(tree, tmp_path / "out"))]) == 0
    assert_same_as_cp_1(tmp_path / "out", cp_1)


def test_a_ray_teacher_process_gathers_at_the_students_positions(corpus_dir, tmp_path):
    """What a ray teacher process puts on its mesh across tokenizers
    (`pipelines.ray.rows.global_batch`, reading only its devices' rows): the teacher's rows
    and the alignment of the batch the iterator yields, the alignment laid out as the
    outputs; the outputs on its rows then reach the student's positions as the host gather
    puts them (`OnlineTeacher.output`'s call), on a dp x cp x tp mesh and a dp x tp one."""
    from pipelines.preflight import cross_tokenizer_corpus
    from pipelines.ray import rows as ray_rows
    from teacher.sharding import batch_sharding

    axes = {"teacher": {"dp": 2, "tp": 2, "cp": 2}, "student": {"cp": 2}}
    cfg = config_from_dict(cross_tree(tmp_path / "none", corpus_dir, tmp_path, **axes))
    assert positions.wanted(cfg)
    corpus, _ = cross_tokenizer_corpus(cfg)
    reader = ray_rows.BatchReader(corpus, cfg.train.batch_size, cfg.run.seed)
    state = {"next_index": 3}
    want = reader.rows(state)
    for dp, tp, cp in ((2, 2, 2), (2, 4, 1)):
        mesh = teacher_mesh(jax.devices()[: dp * tp * cp], dp, tp, cp=cp)
        batch = ray_rows.global_batch(reader, state, batch_sharding(mesh))
        assert batch.tokens is None and batch.mask is None  # only what the teacher reads
        for got, field in zip(batch.teacher.rows, want.teacher.rows, strict=True):
            assert (got is None) == (field is None)
            if field is not None:
                assert got.sharding == batch_sharding(mesh)
                np.testing.assert_array_equal(np.asarray(got), field)
        align = batch.teacher.align
        assert align.sharding == positions.align_sharding(mesh, align.shape[0])
        np.testing.assert_array_equal(np.asarray(align), want.teacher.align)
        assert (want.teacher.align >= 0).mean() > 0.8
        shape = want.teacher.rows.tokens.shape
        rng = np.random.default_rng(dp * tp)
        out = TeacherOutput(
            rng.normal(size=(*shape, 3)).astype(np.float32),
            rng.integers(0, VT, (*shape, 3)).astype(np.int32),
        )
        placed = jax.device_put(out, NamedSharding(mesh, out_spec(shape[0], mesh)))
        got = positions.at_student_positions(mesh, placed, align)
        for g, w in zip(got, positions.on_host(out, want.teacher.align), strict=True):
            assert g.shape == (*want.tokens.shape, 3)
            np.testing.assert_array_equal(np.asarray(g), w)
