"""A run that diverges stops and keeps what was good.

The student step skips a step whose loss or gradient norm is not finite (the state after it
is the state before it, bit for bit) and counts the skips on device; the guard names the
step and what was not finite; a whole CLI run with a learning rate far too high exits with
status 3, writes strict JSON everywhere, keeps its newest finite checkpoint, and a resume
continues from it."""

from __future__ import annotations

import contextlib
import io
import json
import re

import jax
import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient
from jax.sharding import Mesh

from distill.checkpoint import Checkpointer
from distill.config import DistillLossConfig, ModelConfig, OptimConfig
from distill.errors import RUN_FAILED
from distill.observability.metrics import MetricsStore
from distill.observability.server.app import create_app
from distill.types import Batch, TeacherOutput
from pipelines.commands.cli import main
from pipelines.divergence import Divergence
from student import optim, train
from tests.conftest import read_train, tiny_config, write_config

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1)


def _batch(b=4, s=8, seed=0) -> Batch:
    rng = np.random.default_rng(seed)
    tokens, targets = (rng.integers(0, 64, (b, s)).astype(np.int32) for _ in range(2))
    seg = np.ones((b, s), np.int32)
    pos = np.arange(s, dtype=np.int32)[None].repeat(b, 0)
    return Batch(tokens, targets, seg, pos, np.ones((b, s), np.float32))


def _teacher(b=4, s=8) -> TeacherOutput:
    logits = np.random.default_rng(1).normal(size=(b, s, 64)).astype(np.float32)
    return TeacherOutput(np.array(jax.nn.log_softmax(logits)), None)


def _step(with_teacher: bool):
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    tx = optim.make_optimizer(OPTIM, 10)
    step = train.make_train_step(
        CFG,
        tx,
        mesh,
        loss_cfg=DistillLossConfig(temperature=2.0, alpha=0.5) if with_teacher else None,
        lr_schedule=optim.schedule(OPTIM, 10),
        with_teacher=with_teacher,
    )
    return step, train.init_state(CFG, tx, 0, mesh)


def _same(a, b) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.array_equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("with_teacher", [True, False], ids=["kd", "ce"])
def test_a_nonfinite_step_leaves_the_state_and_is_counted(with_teacher):
    """A NaN in the batch's loss mask makes the loss NaN, in the distillation step and in
    the CE step of the teacher bootstrap: the state after the step is the state before it
    (parameters, optimizer state, update count), the skip counted; a finite step then
    updates and ends the run of skips, the longest run remembered."""
    step, state = _step(with_teacher)
    good, bad = _batch(), _batch()
    bad.mask[0, 3] = np.nan
    args = (_teacher(),) if with_teacher else ()

    state, m = step(state, good, *args)  # one update: the optimizer moments are set
    before = jax.device_get(train.saved(state))
    for n in (1, 2):
        state, m = step(state, bad, *args)
        m = jax.device_get(m)
        assert np.isnan(m["loss"]) and np.isnan(m["grad_norm"])
        assert (m["nonfinite_run"], m["nonfinite_longest"]) == (n, n)
        assert m["nonfinite_kinds"] == train.LOSS | train.GRAD_NORM
        assert _same(jax.device_get(train.saved(state)), before)
    state, m = step(state, good, *args)
    m = jax.device_get(m)
    assert np.isfinite(m["loss"]) and (m["nonfinite_run"], m["nonfinite_longest"]) == (0, 2)
    after = jax.device_get(train.saved(state))
    assert int(after.step) == int(before.step) + 1  # skipped steps do not advance the schedule
    assert not _same(after.params, before.params)


def test_the_guard_names_the_step_and_what_was_not_finite():
    guard = Divergence(3)
    m = lambda run, longest, kinds=train.LOSS | train.GRAD_NORM: {  # noqa: E731
        "loss": float("nan"),
        "nonfinite_run": run,
        "nonfinite_longest": longest,
        "nonfinite_kinds": kinds,
    }
    assert guard.check(10, m(2, 2)) is None and guard.check(10, {"loss": 1.0}) is None
    reason = guard.check(12, m(4, 4))
    assert reason == (
        "training diverged: non-finite loss and grad_norm at steps 9..12 (4 in a row, "
        "train.max_nonfinite_steps=3); the weights are those after step 8"
    )
    # a run of skips that ended between two reads is still seen at the next one
    reason = guard.check(20, m(0, 3, train.GRAD_NORM))
    assert reason == (
        "training diverged: non-finite grad_norm for 3 steps in a row before step 20 "
        "(train.max_nonfinite_steps=3)"
    )


def test_no_checkpoint_of_a_nonfinite_state(tmp_path):
    """A state holding a NaN is not written; the newest checkpoint stays the finite one,
    and retention (keep=1) does not delete it."""
    _, state = _step(with_teacher=False)
    saved = train.saved(state)
    ckpt = Checkpointer(str(tmp_path), keep=1)
    assert ckpt.save(1, saved, {"next": 1}) is not False
    bad = saved._replace(params=jax.tree.map(lambda x: x * np.nan, saved.params))
    assert ckpt.save(2, bad, {"next": 2}) is False
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["1"]


def _strict(text: str):
    """json.loads that refuses NaN and infinities, as jq and browsers do."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _stopping_config(tiny_run, out) -> dict:
    """The session's tiny run continued on its bootstrapped teacher for 12 steps, a
    checkpoint every step and the last two kept, stopped after 2 skipped steps."""
    cfg = tiny_config(
        str(tiny_run.out.parent.parent),
        str(out),
        train={"steps": 12, "log_every": 2, "checkpoint_every": 1, "keep_checkpoints": 2},
    )
    cfg["data"] = yaml.safe_load((tiny_run.out / "config.yaml").read_text())["data"]
    cfg["teacher"].update(checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0)
    cfg["train"]["max_nonfinite_steps"] = 2
    return cfg


@pytest.fixture(scope="module")
def diverged(tiny_run, tmp_path_factory):
    """A run with a learning rate a million times too high (on the session's bootstrapped
    teacher): checkpoints every step, the last two kept, stopped after 2 skipped steps."""
    tmp = tmp_path_factory.mktemp("diverged")
    out = tmp / "out"
    cfg = _stopping_config(tiny_run, out)
    path = write_config(tmp, cfg)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", path, "--set", "optim.lr=1e6"])
    return tmp, out, code, err.getvalue()


def test_a_diverged_run_stops_with_status_3_and_strict_json(diverged):
    _, out, code, err = diverged
    assert code == RUN_FAILED
    lines = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = _strict((out / "summary.json").read_text())
    assert summary["completed"] is False
    # the huge update leaves the loss finite and overflows the gradient's norm
    failure = re.fullmatch(
        r"training diverged: non-finite grad_norm at steps (\d+)\.\.(\d+) \(2 in a row, "
        r"train.max_nonfinite_steps=2\); the weights are those after step (\d+)",
        summary["failure"],
    )
    assert failure, summary["failure"]
    first, stopped, kept = (int(g) for g in failure.groups())
    assert stopped == first + 1 == kept + 2 and stopped < 12
    assert summary["steps"] >= stopped
    assert f"distill: error: {summary['failure']}\n" in err
    final_eval = summary["final_eval"]  # the last evaluation made; none after the divergence
    assert final_eval is None or final_eval["step"] < stopped
    failed = [r for r in lines if r.get("event") == "failed"]
    assert len(failed) == 1 and failed[0]["reason"] == summary["failure"]
    records = read_train(out)
    assert records[-1]["step"] == stopped and records[-1]["grad_norm"] is None  # inf: null
    # healthz 503 with the reason, from the run directory as `distill dashboard` reads it
    client = TestClient(create_app(MetricsStore.from_run_dir(str(out)), token=None))
    r = client.get("/healthz")
    assert r.status_code == 503 and summary["failure"] in r.json()["reason"]
    status = _strict(client.get("/api/status").text)
    assert status["phase"] == "failed" and status["summary"]["completed"] is False


def test_no_checkpoint_during_the_skipped_steps(diverged):
    """The update before the first skipped step spoilt the weights (finite, but their
    gradient overflows): every checkpoint left is finite, and none was written during the
    skipped steps, so retention kept the older ones."""
    _, out, *_ = diverged
    summary = _strict((out / "summary.json").read_text())
    kept = int(summary["failure"].rsplit(" ", 1)[1])  # "the weights are those after step K"
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [kept - 1, kept]
    for step in steps:
        params = _restore_params(out, step)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


@pytest.fixture
def poison(monkeypatch) -> dict:
    """`poison["from"] = n`: from step n on, every batch's loss mask is NaN (data gone bad),
    so those steps are skipped; None: good data."""
    from student.executor import LocalExecutor

    poison, step = {"from": None}, LocalExecutor.step

    def poisoned_step(self, n, batch, teacher_out):
        if poison["from"] is not None and n >= poison["from"]:
            batch = batch._replace(mask=np.full_like(batch.mask, np.nan))
        return step(self, n, batch, teacher_out)

    monkeypatch.setattr(LocalExecutor, "step", poisoned_step)
    return poison


def test_a_resume_continues_from_the_last_finite_checkpoint(tiny_run, tmp_path, poison):
    """A run whose data turns NaN at step 4 stops (status 3), its newest checkpoint the
    one of step 3; rerun on good data, it resumes there and completes."""
    out = tmp_path / "out"
    cfg = _stopping_config(tiny_run, out)
    path = write_config(tmp_path, cfg)
    poison["from"] = 4
    assert main(["run", path]) == RUN_FAILED
    summary = _strict((out / "summary.json").read_text())
    assert summary["failure"] == (
        "training diverged: non-finite loss and grad_norm at steps 4..6 (3 in a row, "
        "train.max_nonfinite_steps=2); the weights are those after step 3"
    )
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 3]
    first = {r["step"]: r for r in read_train(out)}
    poison["from"] = None
    assert main(["run", path, "--set", "train.steps=6"]) == 0
    records = read_train(out)
    resumed = records[len(first) :]
    assert [r["step"] for r in resumed] == [4, 6] and all(r["loss"] > 0 for r in resumed)
    summary = _strict((out / "summary.json").read_text())
    assert summary["completed"] and summary["failure"] is None and summary["steps"] == 6
    assert first[2]["loss"] is not None and first[4]["loss"] is None


def _restore_params(out, step: int):
    from distill.config.load import load_config

    cfg = load_config(str(out / "config.yaml"))
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    ckpt = Checkpointer(str(out / "checkpoints"))
    try:
        abstract = train.saved(train.abstract_state(cfg.student_model(), tx, mesh))
        state, _, _ = ckpt.restore(abstract, step)
    finally:
        ckpt.close()
    return jax.device_get(state.params)


def test_a_diverged_teacher_bootstrap_stops_with_status_3(tmp_path, corpus_dir):
    """The teacher bootstrap runs the same step and guard: too high a `teacher.pretrain_lr`
    stops it with one line, exit status 3, and no teacher saved."""
    out = tmp_path / "out"
    cfg = tiny_config(str(corpus_dir), str(out), train={"max_nonfinite_steps": 2})
    cfg["teacher"]["pretrain_lr"] = 1e6
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["run", write_config(tmp_path, cfg)]) == RUN_FAILED
    (line,) = [x for x in err.getvalue().splitlines() if x.startswith("distill: error:")]
    assert line.startswith("distill: error: teacher bootstrap: training diverged: non-finite ")
    assert f"no teacher was saved at {out}/teacher" in line
    assert not (out / "teacher").exists()
    status = MetricsStore.from_run_dir(str(out)).status()
    assert status["phase"] == "failed" and not status["healthy"]


def test_every_json_record_is_made_by_the_strict_helper():
    """`json.dump(s)` appears once in the product's records, in `metrics_log.dumps`
    (allow_nan=False): every record, summary, manifest and command output goes through it.
    The other calls write no record: chat templates' `tojson` filter (rendered as
    transformers renders it), the config reference's defaults (Markdown), and a tokenizer's
    decoder serialised to recognise its kind."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    calls = [
        str(path.relative_to(root))
        for folder in ("distill", "pipelines", "student", "teacher")
        for path in sorted((root / folder).rglob("*.py"))
        for line in path.read_text().splitlines()
        if re.search(r"\bjson\.dumps?\(", line) and "`json.dumps`" not in line
    ]
    not_records = [
        "distill/config/reference.py",
        "distill/data/chat.py",
        "distill/data/token_bytes.py",
    ]
    assert calls == [*not_records, "distill/observability/metrics_log.py"]
