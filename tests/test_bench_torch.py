"""`distill bench --torch`: the PyTorch baseline's loss is the KD loss it claims to be, and
the baseline runs on a config's shapes; `--role ... --torch`: each role's peer computes what
distill's role does."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from distill.config import DistillLossConfig  # noqa: E402
from distill.config.load import config_from_dict  # noqa: E402
from distill.mesh import role_mesh  # noqa: E402
from distill.models import losses, model  # noqa: E402
from distill.types import Batch, TeacherOutput  # noqa: E402
from pipelines.bench import torch_role  # noqa: E402
from pipelines.bench.role import bench_role, format_role  # noqa: E402
from pipelines.bench.torch_ref import hf_model, kd_loss, random_ids, torch_kd_bench  # noqa: E402
from pipelines.commands.cli import main  # noqa: E402
from student import train  # noqa: E402
from student.export import hf_tensors  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.weights import random_teacher  # noqa: E402
from tests.conftest import tiny_config, write_config  # noqa: E402


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("live", [None, 9])
def test_kd_loss_matches_numpy(live):
    rng = np.random.default_rng(0)
    b, s, v, alpha, temp = 2, 5, 11, 0.3, 2.0
    zs, zt = rng.normal(0, 3, (b, s, v)), rng.normal(0, 3, (b, s, v))
    targets = rng.integers(0, live or v, (b, s))
    got = kd_loss(
        torch.tensor(zs, dtype=torch.float32),
        torch.tensor(zt, dtype=torch.float32),
        torch.tensor(targets),
        alpha,
        temp,
        live,
    )
    zs, zt = zs[..., :live], zt[..., :live]
    lq, lp = _log_softmax(zs / temp), _log_softmax(zt / temp)
    kl = (np.exp(lp) * (lp - lq)).sum(-1).mean()
    ce = -np.take_along_axis(_log_softmax(zs), targets[..., None], -1).mean()
    want = alpha * temp**2 * kl + (1 - alpha) * ce
    np.testing.assert_allclose(got.item(), want, rtol=1e-5)


def test_torch_kd_bench_on_the_tiny_config(corpus_dir, tmp_path):
    cfg = config_from_dict(tiny_config(str(corpus_dir), str(tmp_path / "run")))
    r = torch_kd_bench(cfg, repeats=1)
    assert set(r) == {"torch_step_ms", "torch_tokens_per_s", "torch_threads", "torch_version"}
    assert r["torch_step_ms"] > 0 and r["torch_tokens_per_s"] > 0 and r["torch_threads"] > 0
    assert r["torch_version"] == torch.__version__


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize(
    "kind, live",
    [("dense", None), ("dense", 9), ("topk", None), ("topk", 9), ("topk_every_live_id", 9)],
)
def test_peer_kd_loss_is_distills(loss, kind, live):
    """torch_role.kd_loss against `distill.models.losses.kd_loss` on the same logits, teacher
    output and mask: the divergence, dense or over the top-k's k + 1 buckets (the tail exactly
    empty when the top-k hold every live id), alpha, T^2 and the masked cross-entropy."""
    rng = np.random.default_rng(1)
    b, s, v = 2, 5, 11
    zs, zt = rng.normal(0, 3, (b, s, v)), rng.normal(0, 3, (b, s, v))
    targets = rng.integers(0, live or v, (b, s))
    mask = (rng.random((b, s)) > 0.3).astype(np.float32)
    lcfg = DistillLossConfig(loss=loss, alpha=0.3, temperature=2.0)
    lp = torch_role.teacher_logprobs(torch, torch.tensor(zt), live, lcfg.temperature)
    if kind == "dense":
        out = (lp, None)
    else:
        out = tuple(torch.topk(lp, live if kind == "topk_every_live_id" else 4, dim=-1))
    got = torch_role.kd_loss(
        torch, torch.tensor(zs), out, torch.tensor(targets), torch.tensor(mask), lcfg, live
    )
    teacher = TeacherOutput(
        jnp.asarray(out[0].numpy()), None if out[1] is None else jnp.asarray(out[1].numpy())
    )
    want, _ = losses.kd_loss(
        jnp.asarray(zs, jnp.float32), teacher, jnp.asarray(targets), jnp.asarray(mask), lcfg,
        vocab_limit=live,
    )  # fmt: skip
    np.testing.assert_allclose(got.item(), float(want), rtol=1e-5)


def _tiny(corpus_dir, tmp_path, **train):
    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"), train=train)
    cfg = config_from_dict(tree)
    cfg.resolve_dtypes("cpu")
    return cfg, tree


def _ones_batch(tokens, targets) -> Batch:
    b, s = tokens.shape
    ones = np.ones((b, s), np.int32)
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    return Batch(
        tokens.int().numpy(), targets.int().numpy(), ones, positions, ones.astype(np.float32)
    )


def _torch_model(transformers, mcfg, seq, params):
    m = hf_model(transformers, mcfg, seq)
    m.load_state_dict({k: torch.tensor(v) for k, v in hf_tensors(mcfg, params).items()})
    return m


@pytest.mark.parametrize("top_k", [8, None])
def test_teacher_peer_gives_distills_teacher_output(corpus_dir, tmp_path, top_k):
    """The same random weights in both: the peer's top-k (values and ids) or dense log-probs,
    made 2 rows at a time, equal distill's sharded teacher forward's (tp = 2)."""
    cfg, _ = _tiny(corpus_dir, tmp_path)
    cfg.teacher.top_k, cfg.teacher.microbatch = top_k, 2
    mesh = role_mesh(cfg, "teacher")
    params = random_teacher(cfg, mesh)
    teacher = _torch_model(transformers, cfg.teacher.model, cfg.train.seq_len, params).eval()
    ids = random_ids(torch, cfg, 259)
    got_lp, got_ids = torch_role.teacher_peer(torch, cfg, teacher, 259, ids[:, :-1])()
    fwd = make_forward(
        cfg.teacher.model, mesh, mode="topk" if top_k else "dense", top_k=top_k,
        temperature=cfg.distill.temperature, vocab_limit=259, microbatch=2,
    )  # fmt: skip
    want = fwd(params, _ones_batch(ids[:, :-1], ids[:, 1:]))
    np.testing.assert_allclose(got_lp.numpy(), np.asarray(want.logprobs), rtol=1e-4, atol=1e-4)
    if top_k:
        np.testing.assert_array_equal(got_ids.numpy(), np.asarray(want.ids))
    else:
        assert got_ids is None and np.all(np.isneginf(got_lp.numpy()[..., 259:]))


def test_student_peer_first_loss_is_distills_step(corpus_dir, tmp_path):
    """The same student weights, batch and top-k teacher output: the peer's first step
    (2 accumulated microbatches, gradient checkpointing) reports distill's step's loss."""
    cfg, _ = _tiny(corpus_dir, tmp_path, grad_accum=2, remat="block")
    mesh = role_mesh(cfg, "student")
    scfg = cfg.student_model()
    params = model.init_params(scfg, 0)
    student = _torch_model(transformers, scfg, cfg.train.seq_len, params).train()
    ids = random_ids(torch, cfg, 259)
    out = torch_role.random_teacher_out(torch, cfg, 259, torch.device("cpu"))
    mask = torch.ones(ids[:, 1:].shape)
    step = torch_role.student_peer(torch, cfg, student, 259, ids[:, :-1], ids[:, 1:], mask, out)
    got = step().item()
    tx, distill_step = train.distill_step_for(cfg, mesh, 259)
    state = train.init_state(scfg, tx, 0, mesh, params=params)
    teacher = TeacherOutput(jnp.asarray(out[0].numpy()), jnp.asarray(out[1].int().numpy()))
    _, metrics = distill_step(state, _ones_batch(ids[:, :-1], ids[:, 1:]), teacher)
    np.testing.assert_allclose(got, float(metrics["loss"]), rtol=1e-5)
    assert step().item() != got  # the peer's step updated its weights


def test_bench_role_torch_prints_both_figures(corpus_dir, tmp_path, capsys):
    """`distill bench --role teacher --torch`: distill's figures, the peer's and their ratio."""
    _, tree = _tiny(corpus_dir, tmp_path)
    code = main(
        ["bench", write_config(tmp_path, tree), "--role", "teacher", "--torch", "--repeats", "1"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.strip().splitlines()
    r = json.loads(lines[-1])
    assert (
        r["torch_teacher_ms"] > 0 and r["torch_device"] == "cpu" and r["torch_peak_bytes"] is None
    )
    assert r["distill_over_torch"] == pytest.approx(
        r["teacher_tokens_per_s"] / r["torch_teacher_tokens_per_s"], rel=1e-3
    )
    assert lines[0].startswith("teacher alone on")
    assert lines[-2].startswith(f"PyTorch {torch.__version__} + transformers peer (cpu")
    assert f"distill {r['distill_over_torch']:.2f}x its tokens/s" in lines[-2]


def test_student_alone_on_a_device_of_known_memory_with_its_peer(corpus_dir, tmp_path):
    """The accelerator's branch on CPU (a device memory given): the plan checked against it,
    the dense variant timed where it fits, the memory printed; and the student's peer."""
    cfg, _ = _tiny(corpus_dir, tmp_path)
    r = bench_role(cfg, "student", repeats=1, device_memory=lambda mesh: 2**34, torch_mode=True)
    assert r["device_memory_bytes"] == 2**34 and r["student_kd_dense_ms"] > 0
    assert r["torch_student_ms"] > 0 and r["torch_threads"] > 0
    text = format_role(r).splitlines()
    assert text[-2].endswith("of 16.00 GiB") and text[-1].startswith("PyTorch")
