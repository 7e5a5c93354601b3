"""Several teachers for one student (`teachers:`): the weighted divergence against the
hand-computed mixture, routed rows, and runs through the CLI: records routed by a field to
two teachers bootstrapped on their own halves, the mixture of two, /metrics, and what
validate refuses."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, write_config
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from distill.config import DistillLossConfig
from distill.models.vocab_loss import kd_loss_chunked
from distill.types import TeacherMix, TeacherOutput

GREEK = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
NUMBERS = "one two three four five six seven eight nine ten eleven twelve".split()


def _case(seed=0, b=2, s=6, d=8, v=24, n=2):
    keys = jax.random.split(jax.random.key(seed), 3 + n)
    x = jax.random.normal(keys[0], (b, s, d))
    head = jax.random.normal(keys[1], (d, v))
    mask = (jax.random.uniform(keys[2], (b, s)) > 0.2).astype(jnp.float32)
    lps = [jax.nn.log_softmax(2 * jax.random.normal(k, (b, s, v))) for k in keys[3:]]
    return x, head, mask, lps


def _hand_kl(p_lp, q_lp):
    p = np.exp(p_lp)
    return np.sum(p * (p_lp - q_lp), axis=-1)


def test_mixture_is_the_weighted_divergence_with_the_mixture_s_gradient():
    """Without routing (weights 0.25, 0.75 everywhere): KD is the weighted sum of each
    teacher's forward KL, computed by hand; its gradient is that of KL(mixture || student)
    with the mixture sum_i w_i p_i formed by hand (the two differ by a constant)."""
    x, head, mask, lps = _case()
    cfg = DistillLossConfig(loss="forward_kl", temperature=1.0, alpha=1.0)
    w = np.array([0.25, 0.75], np.float32)
    weights = jnp.broadcast_to(w, (*mask.shape, 2))
    mix = TeacherMix(tuple(TeacherOutput(lp) for lp in lps), weights)
    targets = jnp.zeros(mask.shape, jnp.int32)

    def loss(x, head, teacher):
        return kd_loss_chunked(x, head, teacher, targets, mask, cfg, chunk=4)

    _, metrics = loss(x, head, mix)
    q = np.asarray(jax.nn.log_softmax(x @ head))
    m = np.asarray(mask)
    each = [np.sum(_hand_kl(np.asarray(lp), q) * m) / m.sum() for lp in lps]
    assert float(metrics["kd_loss"]) == pytest.approx(w @ np.array(each), rel=1e-5)
    np.testing.assert_allclose(metrics["kd_loss_teachers"], each, rtol=1e-5)

    mixture = jnp.log(w[0] * jnp.exp(lps[0]) + w[1] * jnp.exp(lps[1]))
    g_mix = jax.grad(lambda x, h: loss(x, h, mix)[0], argnums=(0, 1))(x, head)
    g_hand = jax.grad(lambda x, h: loss(x, h, TeacherOutput(mixture))[0], argnums=(0, 1))(x, head)
    for a, b in zip(g_mix, g_hand, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_routed_positions_take_their_own_teacher(loss):
    """One-hot weights (records routed): the loss equals one teacher's at every position,
    the teachers' outputs chosen position by position by hand, top-k teachers with
    different k; each teacher's divergence is over its own positions."""
    x, head, mask, lps = _case(seed=1)
    cfg = DistillLossConfig(loss=loss, temperature=1.0, alpha=0.7)
    route = np.array([[0, 0, 1, 1, 0, 1], [1, 1, 1, 0, 0, 0]])
    weights = jnp.asarray(np.eye(2, dtype=np.float32)[route])
    tops = [jax.lax.top_k(lp, k) for lp, k in zip(lps, (5, 7), strict=True)]
    outs = tuple(TeacherOutput(v, i) for v, i in tops)
    targets = jnp.argmax(x @ head, axis=-1).astype(jnp.int32)
    got_loss, got = kd_loss_chunked(x, head, TeacherMix(outs, weights), targets, mask, cfg, chunk=4)
    by_teacher, m = [], np.asarray(mask)
    for t in range(2):  # each teacher's loss with the other's positions masked out
        own = jnp.asarray(m * (route == t))
        _, alone = kd_loss_chunked(x, head, outs[t], targets, own, cfg, chunk=4)
        by_teacher.append((float(alone["kd_loss"]), float(own.sum())))
    kd = sum(v * n for v, n in by_teacher) / m.sum()
    assert float(got["kd_loss"]) == pytest.approx(kd, rel=1e-5)
    np.testing.assert_allclose(got["kd_loss_teachers"], [v for v, _ in by_teacher], rtol=1e-5)
    ce = float(got["ce_loss"])
    assert float(got_loss) == pytest.approx(0.7 * kd + 0.3 * ce, rel=1e-5)


def test_routed_rows_keep_each_teacher_s_rows_apart():
    from distill.data.corpus import PackedRows
    from distill.data.routed import RoutedRows

    a = PackedRows([np.arange(3, 40, dtype=np.int32)], 8, 1, 2)
    b = PackedRows([np.arange(100, 150, dtype=np.int32)], 8, 1, 2)
    rows = RoutedRows([a, b])
    assert len(rows) == len(a) + len(b)
    ask = np.array([len(a) + 1, 0, len(a), 2])
    batch = rows.gather(ask)
    assert batch.route[:, 0].tolist() == [1, 0, 1, 0] and (batch.route[:, 0] == batch.route.T).all()
    np.testing.assert_array_equal(batch.tokens[0], b.gather(np.array([1])).tokens[0])
    np.testing.assert_array_equal(batch.tokens[3], a.gather(np.array([2])).tokens[0])


def _corpus(path, n=480):
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            domain, words = ("greek", GREEK) if i % 2 == 0 else ("numbers", NUMBERS)
            text = " ".join(rng.choice(words) for _ in range(rng.randint(10, 24)))
            f.write(json.dumps({"text": text, "domain": domain}) + "\n")


def _teachers(tmp, tree, names=("greek", "numbers")):
    t = tree.pop("teacher")
    return [dict(t, name=n, checkpoint=str(tmp / f"teacher-{n}")) for n in names]


def _records(out):
    lines = (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())
    return [r for r in lines if "kd_loss" in r and r.get("phase") == "distill"]


def _kl_to(tmp, run_out, teacher_ckpt, data, name, capsys):
    """`distill eval` of the student in `run_out` against the teacher at `teacher_ckpt`
    on `data`'s held-out rows: KL(teacher || student)."""
    from pipelines.commands.cli import main

    tree = tiny_config(str(data), str(run_out))
    tree["teacher"].update(checkpoint=str(teacher_ckpt), pretrain_steps=0)
    tree["run"]["allow_teacher_change"] = True
    tree["data"] = {"source": str(data), "eval_batches": 2}
    capsys.readouterr()
    assert main(["eval", write_config(tmp, tree, f"eval-{name}.yaml")]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kl"]


def test_routed_teachers_each_teach_their_own_half(tmp_path, capsys):
    """Two teachers bootstrapped on their own halves of a corpus (Greek words, number
    words), records routed by `domain`: the student ends closer to each half's own teacher,
    on that half's held-out rows, than a student distilled from one teacher bootstrapped on
    the whole corpus; the records give each teacher's divergence."""
    from pipelines.commands.cli import main

    data = tmp_path / "data.jsonl"
    _corpus(data)
    halves = {}
    for name in ("greek", "numbers"):
        halves[name] = tmp_path / f"{name}.jsonl"
        kept = [x for x in data.read_text().splitlines() if json.loads(x)["domain"] == name]
        halves[name].write_text("\n".join(kept) + "\n")
    train = {"steps": 100, "log_every": 50, "eval_every": 100, "checkpoint_every": 100}
    loss = {"alpha": 0.9, "temperature": 1.0}
    routed = tiny_config(str(data), str(tmp_path / "routed"), train=train, distill=loss)
    routed["teacher"]["pretrain_steps"] = 100
    routed["teachers"] = _teachers(tmp_path, routed)
    routed["data"] = {"source": str(data), "teacher_field": "domain", "eval_batches": 1}
    assert main(["run", write_config(tmp_path, routed, "routed.yaml")]) == 0
    recs = _records(tmp_path / "routed")
    assert recs and set(recs[-1]["kd_loss_by_teacher"]) == {"greek", "numbers"}
    assert set(recs[-1]["teacher_ms_by_teacher"]) == {"greek", "numbers"}

    single = tiny_config(str(data), str(tmp_path / "single"), train=train, distill=loss)
    single["teacher"].update(pretrain_steps=100, checkpoint=str(tmp_path / "teacher-all"))
    single["data"] = {"source": str(data), "eval_batches": 1}
    assert main(["run", write_config(tmp_path, single, "single.yaml")]) == 0
    for name in ("greek", "numbers"):
        own = tmp_path / f"teacher-{name}"
        kl_routed = _kl_to(tmp_path, tmp_path / "routed", own, halves[name], f"r-{name}", capsys)
        kl_single = _kl_to(tmp_path, tmp_path / "single", own, halves[name], f"s-{name}", capsys)
        print(name, kl_routed, kl_single)
        assert kl_routed < kl_single, (name, kl_routed, kl_single)


def test_a_mixture_of_two_teachers_runs_and_reports_each(tmp_path, corpus_dir):
    """Without data.teacher_field every record goes to both (weights 1 and 3): the run
    trains, its records give each teacher's divergence, and the plan counts both."""
    from pipelines.commands.cli import main

    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    tree["teachers"] = _teachers(tmp_path, tree, ("first", "second"))
    tree["teachers"][1]["weight"] = 3.0
    tree["teachers"][1]["top_k"] = 4
    assert main(["run", write_config(tmp_path, tree)]) == 0
    rec = _records(tmp_path / "out")[-1]
    each = rec["kd_loss_by_teacher"]
    assert set(each) == {"first", "second"}
    assert rec["kd_loss"] == pytest.approx(0.25 * each["first"] + 0.75 * each["second"], rel=1e-4)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [t["name"] for t in summary["plan"]["teachers"]] == ["first", "second"]


def test_routed_conversations(tmp_path):
    """Chat records routed by `domain`: each teacher's conversations are held out and
    packed apart (every row one teacher's, the route of every position its row's), and a
    run over them trains with each teacher's divergence in the records."""
    from distill.config.load import load_config
    from pipelines.commands.cli import main
    from pipelines.preflight import preflight

    data = tmp_path / "chat.jsonl"
    rng = random.Random(1)
    with open(data, "w") as f:
        for i in range(160):
            domain, words = ("greek", GREEK) if i % 2 == 0 else ("numbers", NUMBERS)
            ask, say = (" ".join(rng.choice(words) for _ in range(4)) for _ in range(2))
            turns = [{"role": "user", "content": ask}, {"role": "assistant", "content": say}]
            f.write(json.dumps({"messages": turns, "domain": domain}) + "\n")
    tree = tiny_config(str(data), str(tmp_path / "out"))
    tree["train"].update(seq_len=128)
    tree["teachers"] = _teachers(tmp_path, tree)
    tree["data"] = {"source": str(data), "format": "chat", "teacher_field": "domain",
                    "eval_batches": 1}  # fmt: skip
    path = write_config(tmp_path, tree)
    corpus = preflight(load_config(path))
    for split in (corpus.train, corpus.eval):
        batch = split.gather(np.arange(len(split)))
        for row, route in zip(batch.tokens, batch.route[:, 0], strict=True):
            text = corpus.tokenizer.decode([int(t) for t in row])
            own = GREEK if route == 0 else NUMBERS
            other = NUMBERS if route == 0 else GREEK
            assert any(w in text for w in own) and not any(f" {w} " in text for w in other)
        assert set(batch.route[:, 0]) == {0, 1}
    assert main(["run", path]) == 0
    assert set(_records(tmp_path / "out")[-1]["kd_loss_by_teacher"]) == {"greek", "numbers"}


def _refusal(tmp_path, tree, capsys) -> str:
    from pipelines.commands.cli import main

    assert main(["validate", write_config(tmp_path, tree)]) == 2
    return capsys.readouterr().err.strip().splitlines()[-1].removeprefix("distill: error: ")


def test_validate_refuses_what_several_teachers_cannot_do(tmp_path, corpus_dir, capsys):
    data = tmp_path / "data.jsonl"
    _corpus(data, 80)

    def tree(**data_keys):
        t = tiny_config(str(data), str(tmp_path / "out"))
        t["teachers"] = _teachers(tmp_path, t)
        t["data"] = {"source": str(data), "eval_batches": 1, **data_keys}
        return t

    t = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    t["data"]["teacher_field"] = "domain"
    assert "data.teacher_field: routes records" in _refusal(tmp_path, t, capsys)
    t = tree()
    t["teachers"][1]["name"] = "greek"
    assert "the name 'greek' is given twice" in _refusal(tmp_path, t, capsys)
    t = tree()
    t["pipeline"] = {"mode": "ray"}
    assert _refusal(tmp_path, t, capsys).startswith(
        "pipeline.mode: not supported with several teachers"
    )
    t = tree()
    t["distill"] = {"on_policy": {"fraction": 0.5}}
    assert "distill.on_policy.fraction: not supported" in _refusal(tmp_path, t, capsys)
    t = tree()  # the gate needs every teacher's held-out figures: none from a server
    t["distill"] = {"alpha_gate": True}
    t["teachers"][1].update(source="endpoint", pretrain_steps=0,
                            endpoint={"url": "http://127.0.0.1:9", "api": "distill"})  # fmt: skip
    assert "distill.alpha_gate: not supported" in _refusal(tmp_path, t, capsys)
    t = tree(teacher_field="domain")
    t["teachers"][1]["top_k"] = 10_000
    assert _refusal(tmp_path, t, capsys).startswith("teachers[1].top_k: 10000 exceeds")
    t = tree()
    t["teachers"][0].update(top_k=None)
    t["teachers"][0]["model"] = {**t["teachers"][0]["model"], "vocab_size": 2**20}
    t["train"].update(seq_len=1024, grad_accum=2)
    assert _refusal(tmp_path, t, capsys).startswith("teachers[0].top_k: null makes a dense output")
    from pipelines.commands.cli import main

    for command in ("eval", "cache-teacher"):
        assert main([command, write_config(tmp_path, tree())]) == 2
        assert (
            capsys.readouterr()
            .err.strip()
            .startswith(f"distill: error: teachers: distill {command}")
        )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + json.dumps({"text": "x y", "domain": "code"}) + "\n")
    t = tree(teacher_field="domain")
    t["data"]["source"] = str(bad)
    line = _refusal(tmp_path, t, capsys)
    assert f"{bad} line 81: its 'domain' is 'code'" in line and "greek, numbers" in line


def test_prometheus_gives_each_teacher_s_divergence():
    from distill.observability.metrics import MetricsStore
    from distill.observability.server import create_app

    store = MetricsStore("m", total_steps=4, config={"data": {"source": "x"}}, stall_timeout_s=60)
    store.set_phase("distill")
    store.log({"step": 1, "loss": 1.0, "kd_loss_by_teacher": {"math": 0.5, "code": 0.25}})
    text = TestClient(create_app(store, token=None)).get("/metrics").text
    got = {
        s.labels["teacher"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "distill_teacher_kd_loss"
    }
    assert got == {"math": 0.5, "code": 0.25}


def test_auto_costs_every_teacher(tmp_path, corpus_dir):
    """`mesh.placement: auto` with two teachers of one shape: their forwards cost twice one
    teacher's, their weights are held together, and the student is compiled on both
    outputs; `distill plan` chooses a layout with them."""
    import jax

    from distill.config.load import load_config
    from distill.mesh import teacher_mesh
    from pipelines.commands.cli import main
    from pipelines.placement import costs
    from pipelines.plan import memory as plan_memory

    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    tree["teachers"] = _teachers(tmp_path, tree, ("first", "second"))
    tree["mesh"] = {"placement": "auto"}
    cfg = load_config(write_config(tmp_path, tree))
    cfg.resolve_dtypes("cpu")
    mesh = teacher_mesh(jax.devices()[:2], 1, 2, 1, 1, 1)
    one = cfg.each_teacher()[0]
    compiled, _ = plan_memory._teacher(one, mesh, None)
    alone = costs._teacher_cost(one, compiled, "cpu", costs.layers_factor(one.teacher.model, 32))
    both, out = costs._several_teachers(cfg, mesh, "cpu")
    assert both.seconds == pytest.approx(2 * alone.seconds)
    assert both.resident == 2 * alone.resident and both.temp == alone.temp
    assert isinstance(out, TeacherMix) and out.weights.shape == (4, 32, 2)
    assert main(["plan", write_config(tmp_path, tree)]) == 0


def test_a_stopped_run_of_two_teachers_resumes_with_the_uninterrupted_losses(tmp_path, corpus_dir):
    """A mixed run of two teachers stopped after step 3 (the dashboard's stop) resumes
    from its checkpoint: every step's loss is the uninterrupted run's (both teachers'
    sources restart at the checkpoint's data position, in step)."""
    from distill.config.load import load_config
    from pipelines.commands import run
    from pipelines.commands.cli import main
    from pipelines.hooks import Every
    from tests.conftest import train_by_step

    def tree(out):
        t = tiny_config(str(corpus_dir), str(tmp_path / out))
        t["teachers"] = _teachers(tmp_path, t, ("first", "second"))
        t["teachers"][1]["weight"] = 2.0
        t["train"].update(steps=6, log_every=1, checkpoint_every=1, eval_every=100)
        return t

    assert main(["run", write_config(tmp_path, tree("whole"), "whole.yaml")]) == 0
    path = write_config(tmp_path, tree("resumed"), "resumed.yaml")

    def stop(loop, step):
        if step == 3:
            loop.store.request_stop()

    summary = run.run(load_config(path), extra=[Every(stop, event="after_dispatch")])
    assert not summary["completed"] and summary["steps"] < 6
    assert main(["run", path]) == 0
    whole, resumed = train_by_step(tmp_path / "whole"), train_by_step(tmp_path / "resumed")
    assert sorted(resumed) == sorted(whole) == [1, 2, 3, 4, 5, 6]
    for step, want in whole.items():
        assert resumed[step]["loss"] == pytest.approx(want["loss"], abs=1e-6), step
        assert resumed[step]["kd_loss_by_teacher"] == pytest.approx(want["kd_loss_by_teacher"])


def test_grouped_batches_are_one_teacher_s_rows_in_proportion():
    from distill.data.corpus import PackedRows
    from distill.data.routed import RoutedRows

    a = PackedRows([np.arange(3, 400, dtype=np.int32)], 8, 1, 2)  # 49 rows: 12 batches of 4
    b = PackedRows([np.arange(3, 200, dtype=np.int32)], 8, 1, 2)  # 24 rows: 6 batches
    rows = RoutedRows([a, b], grouped=True)
    ids = rows.grouped_row_ids(4, seed=0)
    one_round = [np.asarray(ids[i]) for i in range(18)]
    teachers = [int(np.searchsorted(rows.offsets, r[0], side="right") - 1) for r in one_round]
    assert teachers.count(0) == 12 and teachers.count(1) == 6
    assert "0, 0, 0, 0" not in str(teachers)  # spread: b's batches among a's
    for r, t in zip(one_round, teachers, strict=True):
        assert ((r >= rows.offsets[t]) & (r < rows.offsets[t + 1])).all()
    for t in (0, 1):  # a round takes each row of a teacher once at most
        mine = np.concatenate([r for r, u in zip(one_round, teachers, strict=True) if u == t])
        assert len(set(mine.tolist())) == len(mine)
    again = [np.asarray(ids[i]) for i in range(18, 36)]
    assert any((x != y).any() for x, y in zip(one_round, again, strict=True))  # a new order


def test_grouped_batches_run_only_their_own_teacher(tmp_path, monkeypatch):
    """`data.teacher_batches: grouped`: each batch is one teacher's rows and only that
    teacher's forward runs on it; the other's divergence is absent (None) from a step's
    record where its weight is 0, and the run trains."""
    from distill.config.load import load_config
    from pipelines.commands import run
    from teacher.online import OnlineTeacher

    data = tmp_path / "data.jsonl"
    _corpus(data)
    tree = tiny_config(str(data), str(tmp_path / "out"))
    tree["teachers"] = _teachers(tmp_path, tree)
    tree["data"] = {"source": str(data), "teacher_field": "domain",
                    "teacher_batches": "grouped", "eval_batches": 1}  # fmt: skip
    tree["train"].update(steps=8, log_every=1, eval_every=100)
    calls = []
    output = OnlineTeacher.output

    def counted(self, batch):
        calls.append(sorted(set(np.asarray(batch.route)[:, 0].tolist())))
        return output(self, batch)

    monkeypatch.setattr(OnlineTeacher, "output", counted)
    run.run(load_config(write_config(tmp_path, tree)))
    assert calls and all(len(c) == 1 for c in calls), calls  # one teacher's rows a forward
    assert len(calls) <= 8 + 2  # a forward a batch (the loop reads ahead by its prefetch)
    recs = _records(tmp_path / "out")
    assert all(sum(v is None for v in r["kd_loss_by_teacher"].values()) == 1 for r in recs)


def test_one_teacher_of_several_logits():
    """Evaluation's teacher: routed, each position's own teacher's log-probs; mixed, the
    log of the weighted mixture of their distributions, both by hand."""
    from pipelines.teachers import _one_teacher

    keys = jax.random.split(jax.random.key(3), 2)
    z = tuple(jax.random.normal(k, (2, 5, 7)) for k in keys)
    route = np.array([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    lp = [np.asarray(jax.nn.log_softmax(x, -1)) for x in z]
    routed = np.asarray(_one_teacher(route, z, weights=None))
    np.testing.assert_allclose(routed, np.where((route == 1)[..., None], lp[1], lp[0]), rtol=1e-6)
    mixed = np.asarray(_one_teacher(None, z, weights=(0.25, 0.75)))
    want = np.log(0.25 * np.exp(lp[0]) + 0.75 * np.exp(lp[1]))
    np.testing.assert_allclose(mixed, want, rtol=1e-5, atol=1e-6)


def test_two_copies_of_one_teacher_evaluate_and_train_as_it(tmp_path, corpus_dir):
    """Mixed at weights 1 and 3, two teachers that are the same checkpoint are that
    teacher: every step's loss and every evaluation's figures (the teacher's held-out
    loss, KL, top-1) equal a run of the one teacher; with the alpha gate on, the run's
    evaluations drive it as one teacher's do."""
    from pipelines.commands.cli import main
    from tests.conftest import read_evals, train_by_step

    one = tiny_config(str(corpus_dir), str(tmp_path / "one"))
    one["teacher"]["checkpoint"] = str(tmp_path / "teacher")
    one["distill"] = {"alpha_gate": False}
    one["train"].update(log_every=1)
    assert main(["run", write_config(tmp_path, one, "one.yaml")]) == 0
    two = json.loads(json.dumps(one))
    two["run"]["output_dir"] = str(tmp_path / "two")
    t = two.pop("teacher")
    two["teachers"] = [dict(t, name="a"), dict(t, name="b", weight=3.0)]
    assert main(["run", write_config(tmp_path, two, "two.yaml")]) == 0
    want, got = train_by_step(tmp_path / "one"), train_by_step(tmp_path / "two")
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step
    evals = {r["step"]: r for r in read_evals(tmp_path / "two")}
    for r in read_evals(tmp_path / "one"):
        for key in ("teacher_loss", "kl", "top1_agreement", "student_loss"):
            assert evals[r["step"]][key] == pytest.approx(r[key], abs=1e-5), (r["step"], key)
    gated = json.loads(json.dumps(two))
    gated["run"]["output_dir"] = str(tmp_path / "gated")
    gated["distill"] = {"alpha_gate": True}
    assert main(["run", write_config(tmp_path, gated, "gated.yaml")]) == 0
