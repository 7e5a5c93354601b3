"""Cross-tokenizer distillation from a top-k teacher: each method's top-k buckets against
explicit references, a top-k holding every id equal to the dense loss, and one tokenizer
on both sides equal to the one-vocabulary top-k loss bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.config import DistillLossConfig
from distill.data.byte_paths import BytePaths
from distill.data.token_bytes import FirstBytes, VocabMap
from distill.data.tokenizers import ByteTokenizer
from distill.models.cross import losses as xl
from distill.models.cross.topk import cross_topk_divergence, uld_topk_distance
from distill.models.losses import kd_divergence
from distill.types import TeacherOutput
from tests.test_cross_tokenizer import (  # noqa: F401  (bpe: the fixture)
    LOSSES,
    _logits,
    assert_grad_is_central_difference,
    bpe,
)

EPS = float(np.finfo(np.float32).eps)


def _topk(lp, k):
    values, ids = jax.lax.top_k(lp, k)
    return values, ids


@pytest.mark.parametrize("cfg", LOSSES, ids=lambda c: c.loss)
def test_mapped_topk_is_todays_topk_loss_for_one_tokenizer(cfg):
    """The identity map: the same k + 1 buckets as the one-vocabulary top-k, bit for bit."""
    z = _logits(20, (2, 5, 259))
    lp = jax.nn.log_softmax(_logits(21, (2, 5, 259)) / cfg.temperature)
    vals, ids = _topk(lp, 8)
    vmap = VocabMap.between(ByteTokenizer(), ByteTokenizer(), 259, 259)
    got = cross_topk_divergence(z, vals, ids, cfg, vmap, "mapped")
    want = kd_divergence(z, TeacherOutput(vals, ids), cfg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _log(x):
    return jnp.log(jnp.maximum(x, 1e-30))


def _div(p, q, cfg):
    """The divergence of `kd_divergence` between bucket probabilities p and q."""
    return kd_divergence(_log(q) * cfg.temperature, TeacherOutput(_log(p)), cfg)


def _ref_mapped(z, vals, ids, vmap, cfg):
    """Per position, explicit 0/1 matrices: student id -> the top-k slot spelling it, else
    the tail; the teacher's unmapped top-k mass and its mass outside the top-k in the tail."""
    out = []
    q_all = jax.nn.softmax(z / cfg.temperature)
    vs = z.shape[-1]
    for n in range(z.shape[0]):
        s_ids = vmap.student_of[np.asarray(ids[n])]
        m = np.zeros((vs, len(s_ids) + 1), np.float32)
        m[:, -1] = 1
        for j, s in enumerate(s_ids):
            if s >= 0:
                m[s], m[s, j] = 0, 1
        p = jnp.where(s_ids >= 0, jnp.exp(vals[n]), 0.0)
        p = jnp.concatenate([p, jnp.maximum(1 - jnp.sum(p), EPS)[None]])
        out.append(_div(p, q_all[n] @ m, cfg))
    return jnp.stack(out)


def _ref_first_byte(z, vals, ids, fb, cfg, inputs=None):
    """Per position: the first bytes both reach that a top-k id starts with, then a tail
    (the teacher's mass outside the top-k, the student's on the other kept bytes); with
    the student's `inputs`, only the bytes seen after that input token in `fb.follows`."""
    both = list(np.intersect1d(fb.teacher[fb.teacher >= 0], fb.student[fb.student >= 0]))
    q_all = jax.nn.softmax(z / cfg.temperature)
    out = []
    for n in range(z.shape[0]):
        keep = both
        if inputs is not None and fb.follows[inputs[n], both].any():
            keep = [b for b in both if fb.follows[inputs[n], b]]
        first = fb.teacher[np.asarray(ids[n])]
        seen = sorted({int(b) for b in first if b in keep})
        to_t = np.array([[f == b for b in seen] for f in first], np.float32)
        p = jnp.concatenate(
            [jnp.exp(vals[n]) @ to_t, jnp.maximum(1 - jnp.exp(vals[n]).sum(), EPS)[None]]
        )
        cols = [[f == b for b in seen] + [f in keep and f not in seen] for f in fb.student]
        q = q_all[n] @ np.array(cols, np.float32)
        out.append(_div(p / p.sum(), q / q.sum(), cfg))
    return jnp.stack(out)


@pytest.mark.slow
def test_topk_mapped_and_first_byte_match_explicit_buckets(bpe):  # noqa: F811
    """Values and gradients against per-position 0/1 projections, both directions."""
    cfg = DistillLossConfig(loss="jsd", temperature=1.5, beta=0.3)
    cases = [
        ("mapped", VocabMap.between(ByteTokenizer(), bpe, 259, 320), (259, 320), _ref_mapped),
        ("mapped", VocabMap.between(bpe, ByteTokenizer(), 320, 259), (320, 259), _ref_mapped),
        ("first_byte", FirstBytes.between(bpe, ByteTokenizer(), 320, 259), (320, 259),
         _ref_first_byte),
        ("first_byte", FirstBytes.between(ByteTokenizer(), bpe, 259, 320), (259, 320),
         _ref_first_byte),
    ]  # fmt: skip
    for method, table, (vt, vs), ref in cases:
        z = _logits(22, (4, vs))
        vals, ids = _topk(jax.nn.log_softmax(_logits(23, (4, vt)) / cfg.temperature), 12)

        def f(z, t=table, m=method, vals=vals, ids=ids):
            return jnp.sum(cross_topk_divergence(z, vals, ids, cfg, t, m))

        def r(z, t=table, ref=ref, vals=vals, ids=ids):
            return jnp.sum(ref(z, vals, ids, t, cfg))

        np.testing.assert_allclose(f(z), r(z), rtol=2e-5, err_msg=method)
        g = jax.grad(f)(z)
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, jax.grad(r)(z), rtol=2e-4, atol=1e-6, err_msg=method)


def test_topk_first_byte_conditioned_on_the_boundary_matches_explicit_buckets(bpe):  # noqa: F811
    """With the student's input tokens, the top-k first-byte buckets keep only the bytes
    that follow each input token (`FirstBytes.after_tokens`); values and gradients against
    per-position 0/1 projections, one input token never seen followed (every byte)."""
    cfg = DistillLossConfig(loss="jsd", temperature=1.5, beta=0.3)
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 300, 4000).astype(np.int32)  # ids 300-319 never seen
    fb = FirstBytes.between(ByteTokenizer(), bpe, 259, 320)
    fb = fb.after_tokens(stream, rng.random(4000) < 0.01)
    inputs = np.array([int(stream[5]), int(stream[9]), 310, int(stream[40])])
    z = _logits(22, (4, 320))
    vals, ids = _topk(jax.nn.log_softmax(_logits(23, (4, 259)) / cfg.temperature), 12)
    f = lambda z: jnp.sum(  # noqa: E731
        cross_topk_divergence(z, vals, ids, cfg, fb, "first_byte", inputs=jnp.asarray(inputs))
    )
    r = lambda z: jnp.sum(_ref_first_byte(z, vals, np.asarray(ids), fb, cfg, inputs))  # noqa: E731
    (value, g), (want, want_g) = (jax.jit(jax.value_and_grad(h))(z) for h in (f, r))
    np.testing.assert_allclose(value, want, rtol=2e-5)
    np.testing.assert_allclose(g, want_g, rtol=2e-4, atol=1e-6)
    plain = cross_topk_divergence(z, vals, ids, cfg, fb, "first_byte")
    assert not np.allclose(f(z), jnp.sum(plain))  # the condition changes the loss


def test_topk_uld_against_sorted_reference():
    """ULD from the top-k: the sorted masses coarse-grained past rank k (numpy), and the
    gradient against central finite differences."""
    z, lp = _logits(24, (1, 2, 10), 2.0), jax.nn.log_softmax(_logits(25, (1, 2, 9), 2.0))
    vals, ids = _topk(lp, 4)
    cfg = DistillLossConfig(temperature=1.0)
    got = cross_topk_divergence(z, vals, ids, cfg, None, "uld")
    p = np.exp(np.asarray(vals))
    q = -np.sort(-np.asarray(jax.nn.softmax(z)), axis=-1)
    want = np.abs(p - q[..., :4]).sum(-1) + np.abs((1 - p.sum(-1)) - q[..., 4:].sum(-1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_grad_is_central_difference(uld_topk_distance, vals, z)


def _chunked(method, table, teacher, vs, live, x, head, align, targets, mask):
    cfg = DistillLossConfig(loss="jsd", temperature=1.5, alpha=0.7)
    return xl.cross_kd_loss_chunked(
        x, head, teacher, align, targets, mask, cfg, vmap=table, method=method,
        teacher_live=live, chunk=3,
    )  # fmt: skip


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=SLOW) for m in ("mapped", "byte_path", "uld")] + ["first_byte"],
)
def test_topk_of_every_id_is_the_dense_loss(method, bpe):  # noqa: F811
    """k = the teacher's vocabulary: the chunked cross loss and its gradient equal the
    dense teacher's; with k < it, the gradient matches a central finite difference along a
    random direction (ULD's is checked in float64 above)."""
    b, s, t_len, d, vs, vt = 2, 7, 11, 8, 320, 259
    x = jax.random.normal(jax.random.key(27), (b, s, d))
    head = jax.random.normal(jax.random.key(28), (d, vs))
    lp = jax.nn.log_softmax(_logits(29, (b, t_len, vt)) / 1.5)
    align = jnp.array([[0, 2, -1, 3, 5, 6, 9], [1, -1, -1, 4, 4, 8, 10]], jnp.int32)
    targets = jax.random.randint(jax.random.key(30), (b, s), 0, vs)
    mask = jnp.ones((b, s)).at[1, 6].set(0.0)
    kinds = {"mapped": VocabMap, "first_byte": FirstBytes, "byte_path": BytePaths}
    table = kinds[method].between(ByteTokenizer(), bpe, vt, vs) if method in kinds else None
    args = (align, targets, mask)

    def loss(teacher, x, head):
        return _chunked(method, table, teacher, vs, vt, x, head, *args)[0]

    dense = TeacherOutput(lp)
    whole = TeacherOutput(*_topk(lp, vt))
    np.testing.assert_allclose(loss(whole, x, head), loss(dense, x, head), rtol=1e-5)
    g, g_dense = jax.grad(loss, 2)(whole, x, head), jax.grad(loss, 2)(dense, x, head)
    np.testing.assert_allclose(g, g_dense, rtol=1e-4, atol=1e-6)
    part = TeacherOutput(*_topk(lp, 16))
    g = jax.grad(loss, 2)(part, x, head)
    assert np.all(np.isfinite(g))
    if method == "uld":  # L1 of sorted masses: kinks a finite difference may cross
        return
    v = jax.random.normal(jax.random.key(31), head.shape)
    num = (loss(part, x, head + 1e-2 * v) - loss(part, x, head - 1e-2 * v)) / 2e-2
    np.testing.assert_allclose(jnp.sum(g * v), num, rtol=1e-2)


def test_cache_record_keeps_the_teacher_rows(bpe):  # noqa: F811
    """A cross-tokenizer batch's record holds its teacher rows and alignment; read back,
    the batch and the top-k at the teacher's rows are the ones written."""
    from pipelines.offline.teacher_cache import batch_record, read_batch
    from tests.test_cross_tokenizer import _rows

    rows = _rows(bpe, ByteTokenizer())
    batch = rows.gather(np.arange(2))
    t = rows.teacher_len
    ids = np.arange(2 * t * 4).reshape(2, t, 4) % 259
    out = TeacherOutput(np.asarray(_logits(32, (2, t, 4))), ids)
    back, got = read_batch(batch_record(batch, out, 320, t))
    assert back.teacher.rows.tokens.shape == (2, t) and back.teacher.align.shape == (2, 16)
    for a, b in zip(jax.tree.leaves((batch, out)), jax.tree.leaves((back, got)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cache_manifest_names_the_teacher_tokenizer(tmp_path):
    """A one-vocabulary cache in a cross run, a cross cache in a one-vocabulary run,
    another teacher tokenizer or another T: one line naming teacher.tokenizer; the same
    tokenizer elsewhere on disk is the same."""
    from distill.errors import DistillError
    from pipelines.offline.teacher_cache import FORMAT, check_manifest

    ident = {"path": "a.json", "kind": "hf", "sha256": "ab" * 32, "vocab_size": 300}
    cross = {"format": FORMAT, "teacher_tokenizer": ident, "teacher_len": 64}
    one = {"format": FORMAT}
    check_manifest(cross, {**cross, "teacher_tokenizer": {**ident, "path": "b.json"}}, tmp_path)
    check_manifest(one, {**one, "teacher_tokenizer": None, "teacher_len": None}, tmp_path)
    other = {**ident, "sha256": "cd" * 32}
    for cache, run in [(one, cross), (cross, one), (cross, {**cross, "teacher_tokenizer": other}),
                       (cross, {**cross, "teacher_len": 72})]:  # fmt: skip
        with pytest.raises(DistillError, match=r"^teacher\.tokenizer: .* teacher cache manifest"):
            check_manifest(cache, run, tmp_path)


@pytest.mark.slow
def test_cached_cross_run_matches_the_online_one(tiny_run, corpus_dir, tmp_path):
    """A byte-level top-k teacher for a BPE student: `distill cache-teacher` then a run from
    the cache gives the online top-k run's losses; so does one from the same cache with the
    student on dp = 2 x cp = 2 (the records gathered at its positions on the host)."""
    from distill.data.bpe import train_bpe
    from pipelines.commands.cli import main
    from tests.conftest import read_train, tiny_config, write_config

    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]
    bpe_path = train_bpe(texts, 300, tmp_path / "bpe" / "tokenizer.json")

    def config(name, student_cp=1, **teacher):
        cfg = tiny_config(str(corpus_dir), str(tmp_path / name))
        cfg["mesh"]["student"]["cp"] = student_cp
        cfg["teacher"].update(
            checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0, top_k=16,
            tokenizer="bytes", cache_dir=str(tmp_path / "cache"), **teacher,
        )  # fmt: skip
        cfg["student"]["model"]["vocab_size"] = 320
        cfg["data"]["tokenizer"] = str(bpe_path)
        # a weak teacher the student soon passes: without the gate every step compares
        cfg["distill"] = {**cfg.get("distill", {}), "alpha_gate": False}
        return write_config(tmp_path / name, cfg)

    for name in ("online", "cached", "cached_cp"):
        (tmp_path / name).mkdir()
    assert main(["run", config("online")]) == 0
    assert main(["cache-teacher", config("cached")]) == 0
    assert main(["run", config("cached", source="cache")]) == 0
    assert main(["run", config("cached_cp", student_cp=2, source="cache")]) == 0
    online = read_train(tmp_path / "online")
    for run in ("cached", "cached_cp"):
        cached = read_train(tmp_path / run)
        assert [r["step"] for r in cached] == [r["step"] for r in online]
        for a, b in zip(online, cached, strict=True):
            for key in ("loss", "kd_loss", "ce_loss", "aligned_fraction"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (run, key)
