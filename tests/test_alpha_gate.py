"""`distill.alpha_gate`: the divergence's weight follows the held-out evaluation. The rule,
the steps it keeps, and a tiny run whose student overtakes a barely trained teacher: each
record's alpha is the rule applied to the evaluation before it, the run's on-policy steps
are data steps while the gate is closed, and a resume from a checkpoint written with the
gate closed repeats the steps exactly."""

from __future__ import annotations

import math
import shutil

import pytest

from pipelines.on_policy import is_on_policy
from student.alpha import AlphaSteps, compared, gated_alpha

SEED, ON_POLICY = 26, 0.5  # the schedule's on-policy steps of 1-8: 2, 3, 4, 6, 7


@pytest.mark.parametrize(
    ("evaluation", "want"),
    [
        ({"student_bpb": 2.0, "teacher_bpb": 1.5}, 0.9),  # the teacher is better: alpha
        ({"student_bpb": 1.4, "teacher_bpb": 1.98}, 0.0),  # the student passed it: CE alone
        ({"student_bpb": 1.5, "teacher_bpb": 1.5}, 0.0),  # caught up: nothing left to teach
        ({"student_loss": 2.0, "teacher_loss": 1.0, "kl": 0.3}, 0.9),  # one vocabulary
        ({"student_loss": 1.0, "teacher_loss": 2.0, "kl": 0.3}, 0.0),
        ({"student_loss": 1.0, "teacher_loss": 2.0}, 0.5),  # no comparable figures: as it is
        ({"student_bpb": math.nan, "teacher_bpb": 1.0}, 0.5),  # not finite: as it is
    ],
)
def test_the_rule(evaluation, want):
    assert gated_alpha(0.9, 0.5, evaluation) == want


def test_bits_per_byte_decide_over_the_losses():
    """Across tokenizers the losses are in different tokens: bits per byte compare."""
    m = {"student_loss": 3.0, "teacher_loss": 1.0, "student_bpb": 1.2, "teacher_bpb": 1.9}
    assert compared(m) == (1.2, 1.9) and gated_alpha(0.7, 0.7, m) == 0.0


def test_alpha_steps_build_each_weight_once_and_keep_it_in_the_note():
    built = []

    def build(alpha):
        built.append(alpha)
        return lambda *args: (alpha, args)

    def build_ce():
        built.append("ce")
        return lambda *args: ("ce", args)

    steps = AlphaSteps(build, 0.9, build_ce)
    assert steps(1, 2, 3) == (0.9, (1, 2, 3)) and steps.note() == {"alpha": 0.9}
    with pytest.raises(ValueError, match="without a teacher output at alpha 0.9"):
        steps(1, 2, None)
    steps.set(0.0)
    assert steps(1, 2, 3) == (0.0, (1, 2, 3)) and steps.note() == {"alpha": 0.0}
    assert steps(1, 2, None) == ("ce", (1, 2))  # no teacher output: the step that takes none
    steps(1, 2, None)
    steps.set(0.9)
    assert built == [0.9, 0.0, "ce"]  # each step built once
    resumed = AlphaSteps(build, 0.9, build_ce)
    resumed.restore({"alpha": 0.0})
    assert resumed.alpha == 0.0 and resumed(1, 2, 3)[0] == 0.0
    resumed.restore(None)  # a checkpoint without the note: as it is
    assert resumed.alpha == 0.0


@pytest.fixture(scope="module")
def gated_run(corpus_dir, tmp_path_factory):
    """A tiny run under a teacher bootstrapped one step (nearly uniform), the student's
    lr high enough to pass it within three steps: evaluations at 0, 2, 4, 6, 8; records
    every step; checkpoints at 4 and 8; half the steps on-policy (`SEED`'s schedule: step
    2 while the gate is open, 3 and 4 in flight when it closes at step 2's evaluation, so
    remade as data steps, 3 after its output was moved to the student). Its output dir,
    config tree and the number of training outputs the teacher made."""
    from pipelines.commands.cli import main
    from teacher.online import OnlineTeacher
    from tests.conftest import tiny_config, write_config

    tmp = tmp_path_factory.mktemp("gated_run")
    out = tmp / "out"
    cfg = tiny_config(str(corpus_dir), str(out))
    cfg["teacher"].update(checkpoint=str(tmp / "teacher"), pretrain_steps=1)
    cfg["train"].update(steps=8, log_every=1, eval_every=2, checkpoint_every=4)
    cfg["optim"] = {"warmup_steps": 1, "lr": 0.02}
    cfg["run"]["seed"] = SEED
    on_policy = {"fraction": ON_POLICY, "max_new_tokens": 8}
    cfg["distill"] = {"alpha": 0.8, "temperature": 1.0, "on_policy": on_policy}
    made = []
    output = OnlineTeacher.output
    with pytest.MonkeyPatch.context() as mp:  # the real forward, counted
        mp.setattr(OnlineTeacher, "output", lambda self, b: made.append(1) or output(self, b))
        assert main(["run", write_config(tmp, cfg)]) == 0
    return out, cfg, len(made)


def _expected_alpha(evals: list[dict], step: int, alpha: float) -> float:
    """The rule applied to the evaluations before `step`, from the configured alpha."""
    current = alpha
    for e in evals:
        if e["step"] < step:
            current = gated_alpha(alpha, current, e)
    return current


def test_each_step_trains_with_the_alpha_the_evaluation_before_it_set(gated_run):
    from tests.conftest import read_evals, read_train

    out, _, made = gated_run
    train, evals = read_train(out), read_evals(out)
    assert [e["step"] for e in evals] == [0, 2, 4, 6, 8]
    assert [r["step"] for r in train] == list(range(1, 9))
    for r in train:
        alpha = _expected_alpha(evals, r["step"], 0.8)
        scheduled = is_on_policy(SEED, r["step"], ON_POLICY)
        if alpha == 0:  # a data step with cross-entropy alone, on-policy or not
            assert r["alpha"] == r["on_policy"] == 0, r["step"]
            assert r["loss"] == pytest.approx(r["ce_loss"], rel=1e-6)
            assert r["kd_loss"] is None, r["step"]  # no teacher output to compare with
        else:  # on the student's samples the divergence alone: the step's alpha is 1
            assert r["on_policy"] == float(scheduled), r["step"]
            assert r["alpha"] == pytest.approx(1.0 if scheduled else alpha), r["step"]
    # the student passes the one-step teacher: the gate closes at least once, and steps
    # the schedule makes on-policy trained on-policy with it open, on the data once closed
    assert any(r["alpha"] == 0 for r in train)
    scheduled = [r for r in train if is_on_policy(SEED, r["step"], ON_POLICY)]
    assert {r["on_policy"] for r in scheduled} == {0.0, 1.0}
    # the teacher made an output for every step with the gate open, and else only for the
    # batches in flight when it closed (at most pipeline.prefetch: 2 each time), never
    # for the steps trained on cross-entropy alone
    taught = [r["alpha"] != 0 for r in train]
    closes = sum(a and not b for a, b in zip(taught, taught[1:], strict=False))
    assert sum(taught) <= made <= sum(taught) + 2 * closes, (made, taught)


def test_the_status_shows_the_alpha_in_effect():
    """The gate's gauge (the next steps' alpha) over the last record's (a lagged step's)."""
    from distill.observability.metrics import MetricsStore

    store = MetricsStore("r", 10, {})
    store.log({"step": 2, "loss": 1.0, "alpha": 0.9})
    store.update(alpha=0.0)
    assert store.status()["alpha"] == 0.0


def test_a_resume_trains_with_the_checkpoints_alpha(gated_run, tmp_path):
    """Drop the last checkpoint and rerun from step 4: steps 5-8 repeat exactly, with the
    alpha the run had after its evaluation at step 4 (kept in the checkpoint: the resumed
    run does not evaluate at step 4 again)."""
    from pipelines.commands.cli import main
    from tests.conftest import read_train, write_config

    out, cfg, _ = gated_run
    resumed = tmp_path / "out"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "8")
    (resumed / "summary.json").unlink()
    cfg = {**cfg, "run": {**cfg["run"], "output_dir": str(resumed)}}
    assert main(["run", write_config(tmp_path, cfg)]) == 0
    before = {r["step"]: r for r in read_train(out)}
    after = read_train(resumed)[len(before) :]
    assert [r["step"] for r in after] == [5, 6, 7, 8]
    assert after[0]["alpha"] == 0.0  # closed at step 2's evaluation: only the checkpoint says so
    for r in after:
        for key in ("alpha", "on_policy", "loss", "kd_loss", "ce_loss", "grad_norm"):
            assert r[key] == pytest.approx(before[r["step"]][key], rel=1e-6), key


def test_the_gate_is_an_event_a_gauge_and_a_summary_figure(gated_run):
    """Each change of the gate is an `alpha_gate` event in metrics.jsonl (the step it takes
    effect, the new alpha, why), listed in the status of the dashboard rebuilt from the
    file and counted in /metrics; summary.json says for how many steps the teacher was off."""
    import json

    from fastapi.testclient import TestClient

    from distill.observability.metrics import MetricsStore
    from distill.observability.server import create_app
    from tests.conftest import read_train

    out, _, _ = gated_run
    train = read_train(out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = [x for x in lines if x.get("event") == "alpha_gate"]
    alphas = {r["step"]: r["alpha"] for r in train}
    changes = [s for s in sorted(alphas) if (alphas[s] == 0) != (alphas.get(s - 1, 0.8) == 0)]
    assert [e["step"] for e in events] == changes and events
    assert all((e["alpha"] == 0) == (alphas[e["step"]] == 0) for e in events)
    assert all("held-out text" in e["reason"] for e in events)
    off = sum(r["alpha"] == 0 for r in train)
    assert json.loads((out / "summary.json").read_text())["teacher_off_steps"] == off > 0
    store = MetricsStore.from_run_dir(str(out))
    assert [e["step"] for e in store.status()["alpha_gate"]] == changes
    text = TestClient(create_app(store, None)).get("/metrics").text
    assert f"distill_alpha_gate_changes {float(len(changes))}" in text
