"""Losses against direct float64 numpy formulas, plus the properties the trainer relies on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.config import DistillLossConfig
from distill.models.losses import ce_loss, eval_metrics, kd_divergence, kd_loss
from distill.types import TeacherOutput

B, S, V = 2, 5, 32
K = 4  # one top-k size for most tests: fewer shapes, fewer compilations
LOSSES = ["forward_kl", "reverse_kl", "jsd"]
SETTINGS = [(1.0, 0.5), (2.0, 0.0), (0.5, 1.0), (4.0, 0.3)]  # (temperature, alpha)


# ---- float64 reference, written out independently -----------------------------------


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_kl(a, b):
    return sum(ai * np.log(ai / bi) for ai, bi in zip(a, b, strict=True) if ai > 0)


def np_div(p, q, loss, beta):
    if loss == "forward_kl":
        return np_kl(p, q)
    if loss == "reverse_kl":
        return np_kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * np_kl(p, m) + (1 - beta) * np_kl(q, m)


def np_kd_loss(student, teacher_lp, ids, targets, mask, loss, T, alpha, beta):
    """Per-token loops; a top-k teacher gets k buckets plus the tail 1 - sum."""
    lq_full = np_log_softmax(np.asarray(student, np.float64) / T)
    lq1 = np_log_softmax(student)
    lp_all = np.asarray(teacher_lp, np.float64)
    kd = ce = 0.0
    for b in range(student.shape[0]):
        for s in range(student.shape[1]):
            q = np.exp(lq_full[b, s])
            p = np.exp(lp_all[b, s])
            if ids is not None:
                q = q[ids[b, s]]
                p = np.append(p, 1.0 - p.sum())
                q = np.append(q, 1.0 - q.sum())
            kd += mask[b, s] * np_div(p, q, loss, beta)
            ce += mask[b, s] * -lq1[b, s, targets[b, s]]
    n = max(mask.sum(), 1.0)
    kd, ce = kd / n, ce / n
    return alpha * T**2 * kd + (1 - alpha) * ce, kd, ce


# ---- fixtures ---------------------------------------------------------------------------


def make_batch(seed, scale=3.0):
    rng = np.random.default_rng(seed)
    student = (rng.normal(size=(B, S, V)) * scale).astype(np.float32)
    teacher_z = (rng.normal(size=(B, S, V)) * scale).astype(np.float32)
    targets = rng.integers(0, V, size=(B, S)).astype(np.int32)
    mask = np.ones((B, S), np.float32)
    mask[0, 3:] = 0.0
    mask[1, 0] = 0.0
    return student, teacher_z, targets, mask


def teacher_at(teacher_z, T, k=None):
    """TeacherOutput at temperature T: dense, or the top-k (exact, not renormalised)."""
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(teacher_z) / T, axis=-1))
    if k is None:
        return TeacherOutput(lp)
    ids = np.argsort(-lp, axis=-1)[..., :k].astype(np.int32)
    return TeacherOutput(np.take_along_axis(lp, ids, axis=-1), ids)


def cfg_of(loss, T=2.0, alpha=0.5, beta=0.5):
    return DistillLossConfig(loss=loss, temperature=T, alpha=alpha, beta=beta)


def token_kd(student, teacher, cfg):
    """The per-token divergence [B, S] that kd_loss averages, as float64 numpy."""
    return np.asarray(kd_divergence(student, teacher, cfg), np.float64)


# ---- tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [None, K])
@pytest.mark.parametrize("T,alpha", SETTINGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_kd_loss_matches_numpy(loss, T, alpha, k):
    student, teacher_z, targets, mask = make_batch(seed=len(loss) * 7 + int(T * 10) + (k or 0))
    teacher = teacher_at(teacher_z, T, k)
    beta = 0.3 if loss == "jsd" else 0.5
    total, metrics = kd_loss(student, teacher, targets, mask, cfg_of(loss, T, alpha, beta))
    ref_total, ref_kd, ref_ce = np_kd_loss(
        student, teacher.logprobs, teacher.ids, targets, mask, loss, T, alpha, beta
    )
    # A top-k tail is known only to float32 resolution (~1e-7 absolute) of the sum of the
    # top-k probabilities; a tail of 1e-4 is then 1e-3 relative, which reverse KL sees.
    rtol = 1e-5 if k is None else 1e-4
    np.testing.assert_allclose(metrics["kd_loss"], ref_kd, rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(metrics["ce_loss"], ref_ce, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(total, ref_total, rtol=rtol, atol=1e-6)
    assert metrics["loss"] is total
    assert float(metrics["tokens"]) == mask.sum()
    assert total.dtype == jnp.float32


@pytest.mark.parametrize("loss", LOSSES)
def test_topk_with_k_equal_vocab_is_dense(loss):
    student, teacher_z, targets, mask = make_batch(seed=1)
    cfg = cfg_of(loss, T=1.5)
    dense = kd_loss(student, teacher_at(teacher_z, 1.5), targets, mask, cfg)[1]["kd_loss"]
    full = kd_loss(student, teacher_at(teacher_z, 1.5, V), targets, mask, cfg)[1]["kd_loss"]
    np.testing.assert_allclose(full, dense, rtol=1e-6, atol=1e-7)
    # k = V - 1 leaves one token in the tail, where the student trivially matches the shape.
    near = kd_loss(student, teacher_at(teacher_z, 1.5, V - 1), targets, mask, cfg)[1]
    np.testing.assert_allclose(near["kd_loss"], dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [None, K])
@pytest.mark.parametrize("loss", LOSSES)
def test_divergence_vanishes_when_student_is_teacher(loss, k):
    _, teacher_z, _, _ = make_batch(seed=2)
    kd = token_kd(teacher_z, teacher_at(teacher_z, 2.0, k), cfg_of(loss, T=2.0))
    np.testing.assert_allclose(kd, 0.0, atol=2e-6)


@pytest.mark.parametrize("loss", LOSSES)
def test_divergence_nonnegative_and_topk_is_lower_bound(loss):
    for seed, scale in [(3, 1.0), (4, 5.0), (5, 20.0)]:
        student, teacher_z, _, _ = make_batch(seed, scale)
        cfg = cfg_of(loss, T=1.0, beta=0.7)
        dense = token_kd(student, teacher_at(teacher_z, 1.0), cfg)
        assert (dense >= -1e-6).all()
        for k in (1, K, 16):
            topk = token_kd(student, teacher_at(teacher_z, 1.0, k), cfg)
            assert (topk >= -1e-6).all()
            assert (topk <= dense + 1e-5 * (1 + dense)).all()


def _grad_of_kd(student, teacher, cfg):
    tgt = jnp.zeros(student.shape[:2], jnp.int32)
    mask = jnp.ones(student.shape[:2], jnp.float32)
    f = lambda s: kd_loss(s, teacher, tgt, mask, cfg)[0]
    return jax.value_and_grad(f)(jnp.asarray(student))


@pytest.mark.parametrize("loss", LOSSES)
def test_finite_when_teacher_topk_holds_all_mass(loss):
    student, _, _, _ = make_batch(seed=6)
    k = K
    # A confident teacher: the tail underflows (1 - sum rounds to 0), and one where the
    # top-k log-probs sum to slightly more than 1 through rounding.
    z = np.full((B, S, V), -60.0, np.float32)
    z[..., :k] = 60.0
    confident = teacher_at(z, 1.0, k)
    ids = np.broadcast_to(np.arange(k, dtype=np.int32), (B, S, k))
    over = TeacherOutput(np.full((B, S, k), np.log(1.0 / k) + 1e-6, np.float32), ids)
    for teacher in (confident, over):
        for student_logits in (student, z):  # a student that also puts no mass in the tail
            value, grad = _grad_of_kd(student_logits, teacher, cfg_of(loss, T=1.0, alpha=1.0))
            assert np.isfinite(value) and np.isfinite(grad).all()


@pytest.mark.parametrize("loss", LOSSES)
def test_finite_when_probabilities_underflow(loss):
    student, teacher_z, _, _ = make_batch(seed=7)
    teacher_z = teacher_z.copy()
    teacher_z[..., :5] = -2000.0  # exp underflows to exactly 0 in float32
    student = student.copy()
    student[..., 5:9] = -2000.0
    for k in (None, K):
        teacher = teacher_at(teacher_z, 1.0, k)
        value, grad = _grad_of_kd(student, teacher, cfg_of(loss, T=1.0))
        assert np.isfinite(value) and np.isfinite(grad).all()
    if loss != "reverse_kl":  # KL(q || p) is truly infinite where p = 0 < q
        lp = teacher_at(teacher_z, 1.0).logprobs.copy()
        lp[..., :5] = -np.inf  # e.g. a teacher that masks unused vocabulary entries
        value, grad = _grad_of_kd(student, TeacherOutput(lp), cfg_of(loss, T=1.0))
        assert np.isfinite(value) and np.isfinite(grad).all()


def test_bfloat16_student_gives_float32():
    student, teacher_z, targets, mask = make_batch(seed=8)
    low = jnp.asarray(student, jnp.bfloat16)
    cfg = cfg_of("jsd", T=2.0)
    for k in (None, K):
        teacher = teacher_at(teacher_z, 2.0, k)
        got, metrics = kd_loss(low, teacher, targets, mask, cfg)
        want, _ = kd_loss(low.astype(jnp.float32), teacher, targets, mask, cfg)
        assert got.dtype == jnp.float32
        assert all(v.dtype == jnp.float32 for v in metrics.values())
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert kd_divergence(low, teacher, cfg).dtype == jnp.float32


def test_jit_and_empty_mask():
    student, teacher_z, targets, mask = make_batch(seed=9)
    teacher = teacher_at(teacher_z, 2.0, K)
    cfg = cfg_of("forward_kl")
    f = jax.jit(functools.partial(kd_loss, cfg=cfg))
    np.testing.assert_allclose(
        f(student, teacher, targets, mask)[0], kd_loss(student, teacher, targets, mask, cfg)[0]
    )
    total, metrics = f(student, teacher, targets, np.zeros_like(mask))
    assert float(total) == 0.0 and float(metrics["tokens"]) == 0.0


def test_ce_loss_matches_numpy():
    student, _, targets, mask = make_batch(seed=10)
    loss, metrics = ce_loss(jnp.asarray(student, jnp.bfloat16), targets, mask)
    lq = np_log_softmax(np.asarray(jnp.asarray(student, jnp.bfloat16).astype(jnp.float32)))
    ref = -(np.take_along_axis(lq, targets[..., None], -1)[..., 0] * mask).sum() / mask.sum()
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert loss.dtype == jnp.float32 and float(metrics["tokens"]) == mask.sum()


def test_eval_metrics_matches_numpy():
    student, teacher_z, targets, mask = make_batch(seed=11)
    student[0, 0] = teacher_z[0, 0]  # make at least one argmax agree
    got = eval_metrics(student, teacher_z, targets, mask)
    ls, lt = np_log_softmax(student), np_log_softmax(teacher_z)
    n = mask.sum()
    pick = lambda lp: np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    kl = (np.exp(lt) * (lt - ls)).sum(-1)
    agree = (student.argmax(-1) == teacher_z.argmax(-1)).astype(np.float64)
    want = {
        "teacher_loss": -(pick(lt) * mask).sum() / n,
        "student_loss": -(pick(ls) * mask).sum() / n,
        "kl": (kl * mask).sum() / n,
        "top1_agreement": (agree * mask).sum() / n,
        "tokens": n,
    }
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("v_teacher", [12, 16])
def test_dense_teacher_of_another_padding_gives_the_same_divergence(v_teacher):
    """Teacher and student vocabularies padded differently past 10 live ids (12 vs 14, 16 vs
    14): the divergence equals the one with the teacher at the student's width."""
    live, v_student = 10, 14
    rng = np.random.default_rng(0)
    zt = rng.normal(size=(2, 3, v_teacher)).astype(np.float32)
    zt[..., live:] = -np.inf
    lp = jax.nn.log_softmax(jnp.asarray(zt), axis=-1)
    same = np.full((2, 3, v_student), -np.inf, np.float32)
    same[..., :live] = np.asarray(lp)[..., :live]
    zs = jnp.asarray(rng.normal(size=(2, 3, v_student)).astype(np.float32))
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        cfg = DistillLossConfig(loss=loss)
        got = kd_divergence(zs, TeacherOutput(lp, None), cfg, vocab_limit=live)
        want = kd_divergence(zs, TeacherOutput(jnp.asarray(same), None), cfg, vocab_limit=live)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert np.isfinite(np.asarray(got)).all()
