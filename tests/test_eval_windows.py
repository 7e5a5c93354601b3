"""Evaluation in position windows (`distill.handoff.eval_windows`): where an eval
chunk's dense logits [rows, S, V] would reach 2^31 elements, the teacher makes them as w
strided windows [rows, S/w, V] (window j: positions j, j + w, ...) and the student
compares each with the same positions of its own, combined token-weighted.

Against the whole rows at small shapes with the windows forced: the teacher's windows are
its whole logits' positions (dp x tp with microbatches, cp = 2 beside tp, a windowed
soft-capped family), the student's metrics from windows are its metrics from the whole
logits (one device, dp x fsdp, cp = 2 on packed rows; and across tokenizers, the teacher
on rows of its own length), and how many windows the shipped layouts need at 32,768
tokens. `distill eval` end to end in windows:
tests/test_cli.py::test_eval_in_position_windows_gives_the_same_metrics; the compiled
programs at 32k hold the bound: tests/test_vocab_bound.py.
"""

import jax
import numpy as np
import pytest

from distill.config.load import load_config
from distill.errors import DistillError
from distill.handoff import eval_rows, eval_windows
from distill.limits import MAX_ELEMENTS
from distill.mesh import student_mesh
from distill.models import model
from student import eval_programs, optim, train
from tests.test_context_parallel import GEMMA, OPT, PLAIN, S, V, _batch
from tests.test_teacher_context import _outputs

W = 4  # windows of S / W = 8 positions: whole load-balanced chunks at cp = 2


@pytest.mark.parametrize(
    "family, axes",
    [("windowed", (2, 1, 1, 2)), ("dense", (1, 1, 2, 2))],
    ids=["windowed-dp2-tp2", "dense-cp2-tp2"],
)
def test_the_teachers_windows_are_its_whole_logits_positions(family, axes):
    dp, ep, cp, tp = axes
    batch = _batch(4, 0)
    want = np.asarray(_outputs(family, batch, dp, tp, 1, ep, mode="logits", microbatch=1))
    got = _outputs(family, batch, dp, tp, cp, ep, mode="logits", microbatch=1, windows=W)
    assert isinstance(got, tuple) and len(got) == W
    for j, window in enumerate(got):
        assert window.shape == (4, S // W, want.shape[-1])
        np.testing.assert_allclose(np.asarray(window), want[:, j::W], atol=1e-6, rtol=0)


def _metrics(cfg, dp: int, fsdp: int, cp: int, windows: int) -> dict:
    mesh = student_mesh(jax.devices()[: dp * fsdp * cp], dp, fsdp, cp)
    tx = optim.make_optimizer(OPT, 10)
    params = train.init_state(cfg, tx, 0, mesh, jax.device_get(model.init_params(cfg, 0))).params
    logits = np.random.default_rng(7).normal(size=(4, S, V)).astype(np.float32) * 3
    t = logits if windows == 1 else tuple(logits[:, j::windows] for j in range(windows))
    m = eval_programs.make_eval_fn(cfg, mesh)(params, _batch(4, 3), t)
    return {k: float(v) for k, v in jax.device_get(m).items()}


@pytest.mark.parametrize(
    "name, axes",
    [("plain", (1, 1, 1)), ("plain", (2, 2, 1)), ("gemma", (1, 2, 2))],
    ids=["one-device", "dp2-fsdp2", "gemma-fsdp2-cp2"],
)
def test_the_students_metrics_from_windows_are_its_whole_rows(name, axes):
    """Packed rows with padding and a random mask: each window's token count differs, so
    the token weighting is exercised."""
    cfg = {"plain": PLAIN, "gemma": GEMMA}[name]
    want = _metrics(cfg, 1, 1, 1, 1)
    got = _metrics(cfg, *axes, W)
    assert want["tokens"] > 0 and set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-6), k


def _long(*sets: str):
    return load_config("pipelines/llama3-8b-to-1b.yaml", ["train.seq_len=32768", *sets])


def test_how_many_windows_long_rows_take(monkeypatch):
    """A 4,096-token row of 128,256 ids fits (one window, the programs of before); a
    32,768-token row is 4.2e9 elements, so an eval chunk of 4 rows takes 8 windows of 4,096
    positions, under 2^31 (4 windows would not be), whole runs of each cp's chunks; where
    no window fits it is refused in one line."""
    from distill import handoff

    assert eval_windows(load_config("pipelines/llama3-8b-to-1b.yaml")) == 1
    cfg = _long()
    rows, v = eval_rows(cfg), cfg.teacher.model.vocab_size
    assert rows == 4
    w = eval_windows(cfg)
    assert w == 8 and rows * 32768 // w * v < MAX_ELEMENTS <= rows * 32768 // (w // 2) * v
    assert eval_windows(_long("mesh.student.cp=4", "mesh.student.fsdp=1")) == 8
    monkeypatch.setattr(handoff, "MAX_ELEMENTS", rows * v * 4)  # 3 positions a window
    assert eval_windows(cfg) == 16384  # 2 positions
    cp = _long("mesh.student.cp=4", "mesh.student.fsdp=1")
    with pytest.raises(DistillError, match=r"^train.seq_len: 32768 tokens x 128256 .*2\^31.* 8 "):
        eval_windows(cp)  # windows of 8 positions at the least


def test_the_cross_tokenizer_metrics_from_windows_are_its_whole_rows():
    """The teacher's loss on its own rows (length T = 40, not the student's S) from its
    logits in 4 windows equals the whole logits' (dp = 2)."""
    from distill.types import Batch, TeacherView

    t_len = 40
    mesh = student_mesh(jax.devices()[:2], 2, 1)
    rng = np.random.default_rng(4)
    own = _batch(4, 5)
    own = Batch(*(np.concatenate([f, f[:, :8]], axis=1) for f in own[:5]))  # [4, 40]
    align = rng.integers(-1, t_len, (4, S)).astype(np.int32)
    batch = _batch(4, 6)._replace(teacher=TeacherView(own, align))
    logits = rng.normal(size=(4, t_len, V)).astype(np.float32) * 3
    params = model.init_params(PLAIN, 0)
    fn = eval_programs.make_cross_eval_fn(PLAIN, mesh, "float32", None)
    want = jax.device_get(fn(params, batch, logits))
    got = jax.device_get(fn(params, batch, tuple(logits[:, j::W] for j in range(W))))
    assert want["teacher_tokens"] > 0 and set(got) == set(want)
    for k in want:
        assert float(got[k]) == pytest.approx(float(want[k]), rel=1e-6, abs=1e-6), k
