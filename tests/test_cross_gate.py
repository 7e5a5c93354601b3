"""`distill.cross_gate`: the cross-tokenizer divergence weighed by alpha only where the
teacher gives the target's first byte more probability than the student does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.config import DistillLossConfig
from distill.data.bpe import train_bpe
from distill.data.cross_rows import cross_splits
from distill.data.token_bytes import FirstBytes
from distill.data.tokenizers import ByteTokenizer, load_tokenizer
from distill.models import cross_losses as xl
from distill.types import TeacherOutput

TEXTS = ["the quick brown fox jumps over the lazy dog\n    return x + 1\n" * 4,
         "def f(x):\n\treturn x ** 2  # spaces   here\n" * 4]  # fmt: skip


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_gated_loss_and_gradient_match_a_reference(tmp_path, temperature):
    """The loss is alpha T^2 times the divergence over the gated aligned positions (the
    mean over every aligned one), plus the cross-entropy, less alpha times the gated
    positions' cross-entropy: at a gated position alpha KD + (1 - alpha) CE, elsewhere CE
    alone. The gate is read from explicit first-byte sums of both distributions over the
    buckets that follow each input token."""
    bpe = load_tokenizer(str(train_bpe(TEXTS * 5, 300, tmp_path / "bpe.json")))
    enc = bpe.encode_offsets(TEXTS)
    rows = cross_splits({"t": (TEXTS, [e[0] for e in enc], [e[1] for e in enc])}, 16, bpe,
                        ByteTokenizer())["t"]  # fmt: skip
    vs, vt, b, s, t_len, d = 300, 259, 2, 7, 11, 8
    fb = FirstBytes.between(ByteTokenizer(), bpe, vt, vs).after_tokens(rows.stream, rows.doc_start)
    inputs = jnp.asarray(rows.stream[: b * s].reshape(b, s))
    targets = jnp.asarray(rows.stream[1 : b * s + 1].reshape(b, s))
    x = jax.random.normal(jax.random.key(1), (b, s, d))
    head = 2.0 * jax.random.normal(jax.random.key(2), (d, vs))
    lp_t = jax.nn.log_softmax(3.0 * jax.random.normal(jax.random.key(3), (b, t_len, vt)))
    align = jnp.array([[0, 2, -1, 3, 5, 6, 9], [1, -1, 4, 4, 7, 8, 10]], jnp.int32)
    mask = jnp.ones((b, s)).at[1, 6].set(0.0)
    cfg = DistillLossConfig(temperature=temperature, alpha=0.7, cross_gate=True)

    def loss(x):
        return xl.cross_kd_loss_chunked(
            x, head, TeacherOutput(lp_t), align, targets, mask, cfg, vmap=fb,
            method="first_byte", chunk=3, inputs_bs=inputs,
        )[0]  # fmt: skip

    keep = np.intersect1d(fb.teacher[fb.teacher >= 0], fb.student[fb.student >= 0])
    allowed = fb.follows[:, keep] | ~fb.follows[:, keep].any(-1, keepdims=True)
    allowed = allowed[np.asarray(inputs)]
    first = fb.student[np.asarray(targets)]  # the target's first-byte bucket
    lp_s = xl.at_student_positions(lp_t, align)

    def reference(x):
        z = x @ head
        onto = lambda bucket: (bucket[:, None] == keep[None, :]).astype(np.float32)  # noqa: E731
        p = jnp.exp(lp_s) @ onto(fb.teacher) * allowed
        q = jax.nn.softmax(z / temperature) @ onto(fb.student) * allowed
        p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
        hit = jnp.asarray(first[..., None] == keep)  # [b, s, buckets]
        log = lambda a: jnp.log(jnp.maximum(jnp.sum(a * hit, -1), 1e-30))  # noqa: E731
        better = log(p) - log(q) > xl.GATE_MARGIN  # a tie (one bucket left) is not better
        gate = jax.lax.stop_gradient(better & (align >= 0)).astype(jnp.float32) * mask
        kd = xl.cross_divergence(z, lp_s, cfg, fb, "first_byte", inputs)
        ce = jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, targets[..., None], -1)[..., 0]
        aligned = jnp.sum(mask * (align >= 0))
        want = cfg.alpha * temperature**2 * jnp.sum(gate * kd) / aligned
        return want + jnp.sum(mask * ce) / mask.sum() - cfg.alpha * jnp.sum(
            gate * ce
        ) / mask.sum(), gate

    (want, gate), g_ref = jax.value_and_grad(reference, has_aux=True)(x)
    assert 0 < float(gate.sum()) < float((mask * (align >= 0)).sum())  # some gated, some not
    got, g = jax.value_and_grad(loss)(x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g, g_ref, rtol=2e-4, atol=1e-6)
    ungated = DistillLossConfig(temperature=temperature, alpha=0.7)
    plain = xl.cross_kd_loss_chunked(
        x, head, TeacherOutput(lp_t), align, targets, mask, ungated, vmap=fb,
        method="first_byte", chunk=3, inputs_bs=inputs,
    )[0]  # fmt: skip
    assert abs(float(plain) - float(got)) > 1e-3


def test_gate_needs_first_byte_and_a_dense_teacher(tmp_path, corpus_dir, capsys):
    """Refused with one line naming the key, before any device work: with a top-k teacher,
    another method, or one tokenizer."""
    from pipelines.commands.cli import main
    from tests.conftest import tiny_config, write_config

    cfg = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    cfg["distill"] = {"cross_gate": True}
    assert main(["validate", write_config(tmp_path, cfg)]) == 2
    assert (
        "distill.cross_gate: for a teacher with a tokenizer of its own" in capsys.readouterr().err
    )
    bpe = train_bpe([p.read_text() for p in sorted(corpus_dir.glob("*.txt"))], 300,
                    tmp_path / "bpe.json")  # fmt: skip
    cfg["teacher"].update(tokenizer="bytes", pretrain_steps=0, top_k=8)
    cfg["student"]["model"]["vocab_size"] = 320
    cfg["data"]["tokenizer"] = str(bpe)
    assert main(["validate", write_config(tmp_path, cfg)]) == 2
    assert "distill.cross_gate: not supported" in capsys.readouterr().err
