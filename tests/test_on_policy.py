"""On-policy distillation end to end: the student's continuations scored by the teacher,
mixed with the data's rows, pipelined with bounded staleness, resumed exactly."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from jax.sharding import Mesh

from distill.config import DistillLossConfig, ModelConfig
from distill.mesh import DP, FSDP
from distill.models import model
from distill.types import Batch, Continuations, TeacherOutput
from pipelines.commands.cli import main
from pipelines.on_policy import is_on_policy
from student import train
from tests.conftest import read_evals as _evals
from tests.conftest import read_train as _train
from tests.conftest import tiny_config
from tests.conftest import write_config as _write

ON_POLICY = {"on_policy": {"fraction": 0.5, "max_new_tokens": 12}, "loss": "reverse_kl"}


@pytest.fixture(scope="module")
def on_policy_run(tmp_path_factory, corpus_dir):
    tmp = tmp_path_factory.mktemp("on_policy")
    cfg = tiny_config(str(corpus_dir), str(tmp / "out"), distill=ON_POLICY)
    assert main(["run", _write(tmp, cfg)]) == 0
    return tmp / "out", cfg


def test_on_policy_run_reports_its_figures_and_samples(on_policy_run):
    out, cfg = on_policy_run
    on = [s for s in range(1, 7) if is_on_policy(0, s, 0.5)]
    assert 0 < len(on) < 6  # the seed mixes both kinds of step
    train_records = _train(out)
    assert [r["step"] for r in train_records] == [2, 4, 6]
    for r in train_records:  # the share and staleness of exactly the record's two steps
        window = [s for s in (r["step"] - 1, r["step"]) if s in on]
        assert r["on_policy"] == len(window) / 2
        assert r["staleness"] == (np.mean([min(1, s - 1) for s in window]) if window else 0)
        assert np.isfinite(r["loss"])
    assert any(r["on_policy"] > 0 and r["staleness"] == 1.0 for r in train_records)
    assert any(r["generate_ms"] > 0 and r["gen_tokens_per_s"] > 0 for r in train_records)
    evals = _evals(out)
    assert [e["step"] for e in evals] == [0, 3, 6]
    for e in evals:
        assert e["sample_teacher_nll"] > 0 and 0 < e["sample_len"] <= 12
        kl = e["sample_teacher_nll"] - e["sample_student_nll"]
        assert e["sample_kl"] == pytest.approx(kl)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval"]["sample_teacher_nll"] == evals[-1]["sample_teacher_nll"]


@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_on_policy_resume_is_exact(on_policy_run, tmp_path, placement):
    """Drop the last checkpoint and rerun: steps 4-6 repeat exactly (the sampling keys are
    the step's, the parameters step 4 generates with are in checkpoint 3), also when the
    split run resumes colocated (those parameters restored onto the colocated mesh)."""
    out, cfg = on_policy_run
    resumed = tmp_path / "out"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    (resumed / "summary.json").unlink()
    assert (out / "checkpoints" / "3" / "extra").exists()
    cfg = {**cfg, "run": {**cfg["run"], "output_dir": str(resumed)}}
    cfg["mesh"] = {**cfg["mesh"], "placement": placement}
    assert main(["run", _write(tmp_path, cfg)]) == 0
    before = {r["step"]: r for r in _train(out)}
    after = _train(resumed)[len(before) :]
    assert [r["step"] for r in after] == [4, 6]
    for r in after:
        for key in ("loss", "kd_loss", "ce_loss"):
            assert r[key] == pytest.approx(before[r["step"]][key], rel=1e-5), key
    assert _evals(resumed)[-1]["sample_teacher_nll"] == pytest.approx(
        _evals(out)[-1]["sample_teacher_nll"], rel=1e-5
    )


def test_colocated_on_policy_gives_the_split_losses(on_policy_run, tmp_path):
    """Generation, teacher scoring and the step on the same two devices
    (`mesh.placement: colocated`, the run's teacher): the split run's losses."""
    out, cfg = on_policy_run
    cfg = json.loads(json.dumps(cfg))
    cfg["run"]["output_dir"] = str(tmp_path / "out")
    cfg["mesh"]["placement"] = "colocated"
    cfg["teacher"].update(checkpoint=str(out / "teacher"), pretrain_steps=0)
    cfg["train"].update(steps=4, eval_every=4, checkpoint_every=4)
    assert main(["run", _write(tmp_path, cfg)]) == 0
    split = {r["step"]: r for r in _train(out)}
    both = _train(tmp_path / "out")
    assert [r["step"] for r in both] == [2, 4]
    assert any(r["on_policy"] > 0 for r in both)
    for r in both:
        for key in ("loss", "kd_loss", "ce_loss"):
            assert abs(r[key] - split[r["step"]][key]) <= 1e-6, key


def test_fraction_zero_is_the_off_policy_run_bit_for_bit(tiny_run, tmp_path, corpus_dir):
    """On-policy keys at fraction 0 (and the evaluation's sampling) change nothing trained:
    the shared tiny run's records, from its teacher."""
    keys = {"on_policy": {"fraction": 0.0, "temperature": 0.7, "max_new_tokens": 5}}
    zero = tiny_config(str(corpus_dir), str(tmp_path / "b"), distill=keys)
    zero["teacher"]["checkpoint"] = str(tiny_run.out / "teacher")
    assert main(["run", _write(tmp_path, zero, "b.yaml")]) == 0
    a, b = _train(tiny_run.out), _train(tmp_path / "b")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    assert "on_policy" not in a[0]


def test_which_steps_are_on_policy():
    assert [is_on_policy(0, s, 1.0, start_step=3) for s in range(1, 6)] == [False] * 3 + [True] * 2
    assert not any(is_on_policy(0, s, 0.0) for s in range(1, 50))
    mixed = [is_on_policy(0, s, 0.5, start_step=10) for s in range(1, 400)]
    assert not any(mixed[:10]) and 0.4 < sum(mixed[10:]) / 389 < 0.6
    assert mixed == [is_on_policy(0, s, 0.5, start_step=10) for s in range(1, 400)]


def test_strictly_on_policy_generates_with_the_latest_parameters(tmp_path, corpus_dir):
    """max_staleness 0 (prefetch 1): every step on-policy, staleness 0."""
    cfg = tiny_config(
        str(corpus_dir), str(tmp_path / "out"), train={"steps": 4},
        distill={"on_policy": {"fraction": 1.0, "max_new_tokens": 6}},
        pipeline={"prefetch": 1, "max_staleness": 0},
    )  # fmt: skip
    assert main(["run", _write(tmp_path, cfg)]) == 0
    records = _train(tmp_path / "out")
    assert [(r["on_policy"], r["staleness"]) for r in records] == [(1.0, 0.0)] * 2
    for r in records:  # T^2 * KD, no CE on its own samples (the default T is 2)
        assert r["loss"] == pytest.approx(4 * r["kd_loss"], rel=1e-6)


def test_the_loss_on_continuations_is_the_divergence_on_generated_tokens():
    """alpha is 1 on the student's own rows, and only masked (generated) targets count."""
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), (DP, FSDP))
    loss_cfg = DistillLossConfig(loss="reverse_kl", temperature=1.0, alpha=0.5)
    loss_fn = jax.jit(train.make_loss_fn(cfg, loss_cfg, "float32", None, "none", mesh))
    params = model.init_params(cfg, 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, (2, 8)).astype(np.int32)
    mask = np.zeros((2, 8), np.float32)
    mask[:, 4:7] = 1
    fields = dict(
        tokens=tokens, targets=np.roll(tokens, -1, 1), segment_ids=np.ones((2, 8), np.int32),
        positions=np.tile(np.arange(8, dtype=np.int32), (2, 1)), mask=mask,
    )  # fmt: skip
    teacher = TeacherOutput(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 8, 32)))), None)
    moved = TeacherOutput(teacher.logprobs.at[:, :4].set(-np.log(32.0)), None)
    data_loss, data_m = loss_fn(params, Batch(**fields), teacher)
    own_loss, own_m = loss_fn(params, Continuations(**fields), teacher)
    assert float(data_loss) == pytest.approx(
        0.5 * float(data_m["kd_loss"]) + 0.5 * float(data_m["ce_loss"])
    )
    assert float(own_loss) == pytest.approx(float(own_m["kd_loss"]))
    assert float(loss_fn(params, Continuations(**fields), moved)[0]) == float(own_loss)
    grads = jax.grad(lambda p: loss_fn(p, Continuations(**fields), teacher)[0])(params)
    assert optax.tree.norm(grads) > 0


@pytest.mark.parametrize(
    "sets, key",
    [
        (["distill.on_policy.fraction=1", "pipeline.prefetch=3"], "pipeline.prefetch:"),
        (["distill.on_policy.max_new_tokens=40"], "distill.on_policy.max_new_tokens:"),
        (["distill.on_policy.fraction=1", "teacher.source=cache"], "distill.on_policy.fraction:"),
    ],
)
def test_bad_on_policy_settings_are_one_line(tmp_path, corpus_dir, capsys, sets, key):
    cfg = _write(tmp_path, tiny_config(str(corpus_dir), str(tmp_path / "out")))
    assert main(["validate", cfg, *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err


def test_generate_prints_samples_of_the_student_and_the_teacher(on_policy_run, capsys):
    out, _ = on_policy_run
    args = ["generate", str(out), "--prompt", "the teacher", "--prompt", "a", "--json"]
    assert main([*args, "--max-new-tokens", "7", "--seed", "3"]) == 0
    first = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["prompt"] for s in first] == ["the teacher", "a"]
    assert all(s["model"] == "student step 6" and 1 <= s["tokens"] <= 7 for s in first)
    assert main([*args, "--max-new-tokens", "7", "--seed", "3"]) == 0  # same seed, same text
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == first
    assert main([*args, "--teacher", "--temperature", "0", "--max-new-tokens", "5"]) == 0
    teacher = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(s["model"] == "teacher" for s in teacher)
    assert main(["generate", str(out), "--prompt", "x", "--temperature", "-1"]) == 2


def test_generate_without_a_checkpoint_is_one_line(tmp_path, corpus_dir, capsys):
    cfg = tiny_config(str(corpus_dir), str(tmp_path))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no student checkpoint" in err[0]


@pytest.mark.ray
@pytest.mark.slow
def test_ray_mode_matches_local_on_policy(on_policy_run, tmp_path):
    """The same on-policy run in ray mode (the student actor samples, the teacher actor
    scores its rows) gives the local run's losses and sample metrics. Slow: the default run
    covers ray-mode on-policy steps with groups of 2 processes (tests/test_multihost.py);
    this is the one-process case."""
    out, cfg = on_policy_run
    ray_out = tmp_path / "out"
    cfg = {
        **cfg,
        "run": {**cfg["run"], "output_dir": str(ray_out)},
        "pipeline": {"mode": "ray"},
        "teacher": {**cfg["teacher"], "checkpoint": str(out / "teacher")},
    }
    assert main(["run", _write(tmp_path, cfg)]) == 0
    local, ray_records = _train(out), _train(ray_out)
    assert [r["step"] for r in ray_records] == [r["step"] for r in local]
    for a, b in zip(local, ray_records, strict=True):
        for key in ("loss", "kd_loss", "ce_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    assert any(r["on_policy"] > 0 and r["generate_ms"] > 0 for r in ray_records)
    for a, b in zip(_evals(out), _evals(ray_out), strict=True):
        for key in ("sample_teacher_nll", "sample_student_nll", "sample_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
        assert b["sample_len"] == a["sample_len"]


def test_prompts_from_a_field_are_cut_to_their_end_and_left_padded(tmp_path):
    from distill.config import DataConfig
    from distill.data.prompts import PromptSet, load_prompts
    from distill.data.tokenizers import ByteTokenizer

    rows = [{"text": "body", "prompt": p} for p in ("ab", "abcdefgh", "xyz")]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    texts = load_prompts(DataConfig(source=str(tmp_path), prompt_field="prompt"))
    assert texts == ["ab", "abcdefgh", "xyz"]
    ps = PromptSet(texts, ByteTokenizer(), prompt_len=5, seed=0)
    tok = ByteTokenizer()
    np.testing.assert_array_equal(ps.tokens[0], [0, 0, tok.bos_id, *tok.encode("ab")])
    np.testing.assert_array_equal(ps.segment_ids[0], [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(ps.tokens[1], tok.encode("defgh"))  # the end is kept
    np.testing.assert_array_equal(ps.positions[1], [4, 5, 6, 7, 8])
    a, b = ps.batch(2, 2), ps.batch(2, 2)
    np.testing.assert_array_equal(a.tokens, b.tokens)  # a function of the step
    both = np.concatenate([ps.batch(1, 2).tokens, ps.batch(2, 2).tokens])[:3]
    assert sorted(map(tuple, both)) == sorted(map(tuple, ps.tokens))  # one pass covers all
    with pytest.raises(Exception, match="data.prompt_field"):
        load_prompts(DataConfig(source=str(tmp_path), prompt_field="missing"))


def test_on_policy_run_on_prompts_from_a_field(tmp_path, corpus_dir):
    data = tmp_path / "data"
    data.mkdir()
    lines = (corpus_dir / "doc00.txt").read_text().splitlines()
    records = [{"text": line, "prompt": " ".join(line.split()[:3])} for line in lines]
    (data / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    cfg = tiny_config(
        str(data), str(tmp_path / "out"), train={"steps": 2, "eval_every": 2},
        data={"include": ["*.jsonl"], "prompt_field": "prompt"},
        distill={"on_policy": {"fraction": 1.0, "max_new_tokens": 6}},
    )  # fmt: skip
    assert main(["run", _write(tmp_path, cfg)]) == 0
    assert [r["on_policy"] for r in _train(tmp_path / "out")] == [1.0]
