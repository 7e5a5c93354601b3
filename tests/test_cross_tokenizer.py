"""Cross-tokenizer distillation: alignment by character offsets, the vocabulary map, the
mapped and ULD losses against dense references, and a short run across two tokenizers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from distill.config import DistillLossConfig
from distill.data.bpe import train_bpe
from distill.data.byte_paths import BytePaths
from distill.data.cross.rows import cross_splits
from distill.data.token_bytes import FirstBytes, VocabMap, byte_lengths, token_bytes
from distill.data.tokenizers import ByteTokenizer, load_tokenizer
from distill.models.cross import losses as xl
from distill.models.losses import kd_divergence
from distill.types import TeacherOutput

TEXTS = [
    "héllo wörld, naïve café — déjà vu 😀 over the lazy dog\n    return x + 1\n",
    "def f(x):\n\treturn x ** 2  # ünïcödé 🎉🎉 spaces   here\n",
    "the quick brown fox jumps over the lazy dog " * 3,
    "日本語のテキストと English mixed 中文 text.",
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A small byte-level BPE (GPT-2 style) trained on the hand-made texts."""
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return load_tokenizer(str(train_bpe(TEXTS * 20, 320, path)))


def train_metaspace(texts: list[str], vocab_size: int, specials: list[str]) -> Tokenizer:
    """A SentencePiece-style tokenizer.json (U+2581 for spaces, byte-fallback pieces) trained
    on `texts`, with "<unk>", `specials` and the 256 byte pieces first."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", *specials, *alphabet], show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def assert_grad_is_central_difference(distance, teacher, z) -> None:
    """The gradient of sum(distance(teacher, log_softmax(z))) in z, in float64, against
    central finite differences of each logit."""
    z64 = np.asarray(z, np.float64)
    with jax.enable_x64():
        t64 = jnp.asarray(np.asarray(teacher), jnp.float64)
        f = lambda z: jnp.sum(distance(t64, jax.nn.log_softmax(z)))  # noqa: E731
        g = np.asarray(jax.grad(f)(jnp.asarray(z64)))
        eps, num = 1e-6, np.zeros_like(z64)
        for idx in np.ndindex(z64.shape):
            d = np.zeros_like(z64)
            d[idx] = eps
            num[idx] = (f(jnp.asarray(z64 + d)) - f(jnp.asarray(z64 - d))) / (2 * eps)
    np.testing.assert_allclose(g, num, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory):
    """A SentencePiece-style tokenizer.json: U+2581 for spaces, byte fallback pieces."""
    tok = train_metaspace(TEXTS * 20, 600, ["<s>", "</s>"])
    path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    tok.save(str(path))
    return load_tokenizer(str(path))


def _rows(student, teacher, seq_len=16):
    enc = student.encode_offsets(TEXTS)
    split = (TEXTS, [e[0] for e in enc], [e[1] for e in enc])
    return cross_splits({"train": split}, seq_len, student, teacher)["train"]


def _prefix(tok, ids, upto) -> bytes:
    """The bytes of a row's tokens from its segment start through `upto`."""
    b = token_bytes(tok)
    return b"".join(b[i] for i in ids[: upto + 1] if b[i] is not None)


def _check_alignment(student, teacher, min_fraction):
    rows = _rows(student, teacher)
    batch = rows.gather(np.arange(len(rows)))
    t = batch.teacher.rows
    matched = 0
    for r in range(len(rows)):
        for j, i in enumerate(batch.teacher.align[r]):
            if i < 0:
                continue
            matched += 1
            assert batch.segment_ids[r, j] == t.segment_ids[r, i]
            s_seg = batch.tokens[r][batch.segment_ids[r] == batch.segment_ids[r, j]]
            t_seg = t.tokens[r][t.segment_ids[r] == t.segment_ids[r, i]]
            j0 = j - int(np.argmax(batch.segment_ids[r] == batch.segment_ids[r, j]))
            i0 = i - int(np.argmax(t.segment_ids[r] == t.segment_ids[r, i]))
            s_text, t_text = _prefix(student, s_seg, j0), _prefix(teacher, t_seg, i0)
            # equal, but for the tail of a character a row may open with (before the text)
            assert s_text.endswith(t_text) and len(s_text) - len(t_text) < 4, (r, j, i)
    assert matched > 0
    assert rows.aligned_fraction() >= min_fraction
    return rows, batch


def test_alignment_bytes_teacher_bpe_student(bpe):
    """Every student position ending on a character boundary has the byte teacher's position
    of the same prefix; BOS and EOS align to the teacher's BOS and EOS."""
    rows, batch = _check_alignment(bpe, ByteTokenizer(), 0.8)
    t = batch.teacher.rows
    for r, j in np.argwhere((batch.teacher.align < 0) & (batch.mask > 0)):
        seg = batch.segment_ids[r] == batch.segment_ids[r, j]
        j0 = j - int(np.argmax(seg))
        with pytest.raises(UnicodeDecodeError):  # only a prefix ending mid-character misses
            _prefix(bpe, batch.tokens[r][seg], j0).decode("utf-8")
    bos = np.argwhere(batch.tokens == bpe.bos_id)
    assert len(bos)
    for r, j in bos:
        assert t.tokens[r, batch.teacher.align[r, j]] == ByteTokenizer.bos_id
    eos = np.argwhere((batch.tokens == bpe.eos_id) & (batch.mask > 0))
    for r, j in eos:
        i = batch.teacher.align[r, j]
        assert i < 0 or t.tokens[r, i] == ByteTokenizer.eos_id
    assert rows.teacher_len % 8 == 0 and rows.teacher_len >= 16


def test_alignment_bpe_teacher_bytes_student(bpe):
    """The other way round: a byte student's positions inside a multi-byte character, or
    inside a teacher token, have no match; the rest do."""
    rows, batch = _check_alignment(ByteTokenizer(), bpe, 0.2)
    assert rows.aligned_fraction() < 0.9


def test_alignment_sentencepiece_style_against_byte_level(bpe, metaspace):
    """U+2581 spaces and <0xNN> byte pieces against GPT-2 byte-level BPE."""
    assert token_bytes(metaspace)[metaspace._tok.token_to_id("<0xC3>")] == b"\xc3"
    _check_alignment(bpe, metaspace, 0.3)
    _check_alignment(metaspace, bpe, 0.3)


def test_teacher_rows_score_as_the_text_alone(bpe):
    """A byte-level teacher's NLL of each cross row (its rows, positions, segments and mask
    as the loss and eval read them) equals its NLL of the row's text rebuilt from the
    student's tokens, each document's stretch run alone from position 0 (rows cut inside a
    character, whose teacher rows hold the whole character or none of it, left out)."""
    from distill.config import ModelConfig
    from distill.models import model

    mc = ModelConfig(vocab_size=259, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    params = model.init_params(mc, 0)

    @jax.jit
    def nll(tokens, seg, pos, targets, mask):
        lp = jax.nn.log_softmax(model.apply(mc, params, tokens, seg, pos), axis=-1)
        got = -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(mask > 0, got, 0.0), axis=-1)

    rows, byte = _rows(bpe, ByteTokenizer()), ByteTokenizer()
    t = rows.gather(np.arange(len(rows))).teacher.rows
    got = np.asarray(nll(t.tokens, t.segment_ids, t.positions, t.targets, t.mask))
    special = {bpe.bos_id: [byte.bos_id], bpe.eos_id: [byte.eos_id]}
    sb, width = token_bytes(bpe), t.tokens.shape[1] + 1
    alone, owner = [], []  # each document's stretch of each whole-character row, its row
    for r in range(len(rows)):
        ids, starts = (a[0] for a in rows.student.windows(np.array([r])))
        text = b"".join(sb[i] or b"" for i in ids)
        if text.decode("utf-8", "replace").encode() != text:
            continue  # cut inside a character
        for part in np.split(ids, np.flatnonzero(starts[1:]) + 1):
            seq = np.concatenate([special.get(i, np.frombuffer(sb[i] or b"", np.uint8) + 3)
                                  for i in part]).astype(np.int32)  # fmt: skip
            alone.append(np.pad(seq, (0, width - len(seq)))), owner.append(r)
    seq, n = np.stack(alone), np.array([np.count_nonzero(a) for a in alone]) - 1
    live = np.arange(width - 1)[None] < n[:, None]
    pos = np.broadcast_to(np.arange(width - 1), live.shape)
    want = nll(seq[:, :-1], live.astype(np.int32), pos * live, seq[:, 1:], live)
    compared = np.unique(owner)
    assert len(compared) >= len(rows) // 2
    np.testing.assert_allclose(got[compared], np.bincount(owner, want)[compared], rtol=1e-5)


def test_vocab_map_spells_the_same_bytes(bpe):
    vmap = VocabMap.between(ByteTokenizer(), bpe, 259, 320)
    sb, tb = token_bytes(bpe), token_bytes(ByteTokenizer())
    for t, s in enumerate(vmap.student_of):
        if s >= 0 and tb[t] is not None:
            assert sb[s] == tb[t]
    assert vmap.student_of[ByteTokenizer.bos_id] == bpe.bos_id
    assert vmap.coverage()[0] == 1.0  # every byte is a byte-level BPE token
    assert VocabMap.between(ByteTokenizer(), ByteTokenizer(), 259, 259).identity
    assert byte_lengths(bpe, 330)[sb.index(b" the")] == 4


LOSSES = [
    DistillLossConfig(loss="forward_kl", temperature=1.0),
    DistillLossConfig(loss="reverse_kl", temperature=2.0),
    DistillLossConfig(loss="jsd", temperature=1.5, beta=0.3),
]


def _logits(key, shape, scale=3.0):
    return scale * jax.random.normal(jax.random.key(key), shape)


@pytest.mark.parametrize("cfg", LOSSES, ids=lambda c: c.loss)
def test_mapped_loss_is_todays_loss_for_one_tokenizer(cfg):
    """The identity map: no tail, the same divergence bit for bit."""
    z, t = _logits(0, (2, 5, 259)), _logits(1, (2, 5, 259))
    lp = jax.nn.log_softmax(t / cfg.temperature)
    vmap = VocabMap.between(ByteTokenizer(), ByteTokenizer(), 259, 259)
    got = xl.cross_divergence(z, lp, cfg, vmap, "mapped")
    want = kd_divergence(z, TeacherOutput(lp), cfg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _dense_mapped(z, lp_t, vmap, cfg):
    """Reference: both distributions projected by explicit 0/1 matrices onto the student's
    mapped ids plus one tail column, then the divergence of `kd_divergence` over them."""
    vt, vs = len(vmap.student_of), len(vmap.teacher_of)
    to_t = np.zeros((vt, vs + 1), np.float32)
    to_t[np.arange(vt), np.where(vmap.student_of >= 0, vmap.student_of, vs)] = 1
    to_s = np.zeros((vs, vs + 1), np.float32)
    to_s[np.arange(vs), np.where(vmap.teacher_of >= 0, np.arange(vs), vs)] = 1
    q = jax.nn.softmax(z / cfg.temperature) @ to_s
    p = jnp.exp(lp_t) @ to_t
    if (vmap.teacher_of >= 0).all():  # no student tail: the teacher conditioned on the map
        q, p = q[..., :vs], p[..., :vs] / jnp.sum(p[..., :vs], axis=-1, keepdims=True)
    else:
        p = p.at[..., vs].set(jnp.maximum(p[..., vs], np.finfo(np.float32).eps))
    logit = lambda x: jnp.log(jnp.maximum(x, 1e-30))  # noqa: E731
    return kd_divergence(logit(q) * cfg.temperature, TeacherOutput(logit(p)), cfg)


@pytest.mark.parametrize("cfg", LOSSES, ids=lambda c: c.loss)
def test_mapped_loss_and_gradient_match_a_dense_projection(cfg, bpe):
    vmap = VocabMap.between(ByteTokenizer(), bpe, 259, 320)
    vmap_back = VocabMap.between(bpe, ByteTokenizer(), 320, 259)
    for m, (vt, vs) in ((vmap, (259, 320)), (vmap_back, (320, 259))):
        z, t = _logits(2, (3, 4, vs)), _logits(3, (3, 4, vt))
        lp = jax.nn.log_softmax(t / cfg.temperature)
        f = lambda z, m=m, lp=lp: jnp.sum(xl.cross_divergence(z, lp, cfg, m, "mapped"))  # noqa: E731
        ref = lambda z, m=m, lp=lp: jnp.sum(_dense_mapped(z, lp, m, cfg))  # noqa: E731
        np.testing.assert_allclose(f(z), ref(z), rtol=2e-5)
        g, g_ref = jax.grad(f)(z), jax.grad(ref)(z)
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, g_ref, rtol=2e-4, atol=1e-6)


def test_uld_loss_and_gradient():
    """ULD against a numpy reference, and its gradient against central finite differences."""
    z, t = _logits(4, (2, 3, 12), 2.0), _logits(5, (2, 3, 9), 2.0)
    lp = jax.nn.log_softmax(t)
    cfg = DistillLossConfig(temperature=1.0)
    got = xl.cross_divergence(z, lp, cfg, None, "uld")
    p = -np.sort(-np.exp(np.asarray(lp)), axis=-1)
    q = -np.sort(-np.asarray(jax.nn.softmax(z)), axis=-1)
    p = np.concatenate([p, np.zeros((2, 3, 3))], axis=-1)
    np.testing.assert_allclose(got, np.abs(p - q).sum(-1), rtol=1e-5)
    assert_grad_is_central_difference(xl.uld_distance, lp, z)


@pytest.mark.parametrize("method", ["mapped", "uld", "first_byte", "byte_path"])
def test_chunked_cross_loss_matches_the_whole_logits(method, bpe):
    """`cross_kd_loss_chunked` over chunks of 3 positions equals the per-token formula on
    the whole logits, unaligned positions out of the divergence but in the CE (weighed 1,
    or 1 - alpha: `distill.cross_ce`); first_byte and byte_path read the input tokens (the
    teacher conditioned on the boundary)."""
    b, s, t_len, d, vs, vt = 2, 7, 11, 8, 320, 259
    x = jax.random.normal(jax.random.key(6), (b, s, d))
    head = jax.random.normal(jax.random.key(7), (d, vs))
    lp_t = jax.nn.log_softmax(_logits(8, (b, t_len, vt)))
    align = jnp.array([[0, 2, -1, 3, 5, 6, 9], [1, -1, -1, 4, 4, 8, 10]], jnp.int32)
    targets = jax.random.randint(jax.random.key(9), (b, s), 0, vs)
    mask = jnp.ones((b, s)).at[1, 6].set(0.0)
    cfg = DistillLossConfig(temperature=1.0, alpha=0.7)
    kinds = {"mapped": VocabMap, "first_byte": FirstBytes, "byte_path": BytePaths}
    vmap = kinds[method].between(ByteTokenizer(), bpe, vt, vs) if method in kinds else None
    inputs = None
    if method in ("first_byte", "byte_path"):
        rows = _rows(bpe, ByteTokenizer())
        vmap = vmap.after_tokens(rows.stream, rows.doc_start)
        inputs = jnp.asarray(rows.stream[: b * s].reshape(b, s))
    loss, m = xl.cross_kd_loss_chunked(
        x, head, TeacherOutput(lp_t), align, targets, mask, cfg, vmap=vmap, method=method,
        chunk=3, inputs_bs=inputs,
    )  # fmt: skip
    z = x @ head
    lp_s = xl.at_student_positions(lp_t, align)
    if method == "byte_path":  # the teacher's bytes at the positions after the aligned one
        ins = xl.byte_path_inputs(lp_t, align, vmap)
        np.testing.assert_array_equal(ins["path"][0, 1, 2], lp_t[0, 2 + 3, 3:])
        assert ins["deep_ok"][0].tolist() == [True, False, True, True, True, True, False]
        flat = [a.reshape(b * s, *a.shape[2:]) for a in (lp_s, jax.nn.log_softmax(z), ins["path"])]
        kd = xl.byte_path_divergence(
            *flat, targets.reshape(-1), ins["deep_ok"].reshape(-1), cfg, vmap, inputs.reshape(-1)
        ).reshape(b, s)
    else:
        kd = xl.cross_divergence(z, lp_s, cfg, vmap, method, inputs)
    w = mask * (align >= 0)
    want_kd = jnp.sum(kd * w) / jnp.sum(w)
    ce = jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, targets[..., None], -1)[..., 0]
    want_ce = jnp.sum(ce * mask) / jnp.sum(mask)
    np.testing.assert_allclose(m["kd_loss"], want_kd, rtol=1e-5)
    np.testing.assert_allclose(m["ce_loss"], want_ce, rtol=1e-5)
    np.testing.assert_allclose(m["aligned_fraction"], jnp.sum(w) / jnp.sum(mask), rtol=1e-6)
    np.testing.assert_allclose(loss, 0.7 * want_kd + want_ce, rtol=1e-5)  # distill.cross_ce: full
    mixed = cfg.model_copy(update={"cross_ce": "one_minus_alpha"})
    loss, _ = xl.cross_kd_loss_chunked(
        x, head, TeacherOutput(lp_t), align, targets, mask, mixed, vmap=vmap, method=method,
        chunk=3, inputs_bs=inputs,
    )  # fmt: skip
    np.testing.assert_allclose(loss, 0.7 * want_kd + 0.3 * want_ce, rtol=1e-5)


@pytest.fixture(scope="module")
def cross_run(tiny_run, corpus_dir, tmp_path_factory):
    """`distill run` with the tiny run's byte-level teacher and a BPE student tokenizer
    trained on the same corpus, half its steps on-policy (the student's samples
    re-tokenised for the teacher; metrics at steps 2, 4, 6; evaluations at 0, 3, 6;
    checkpoints 3 and 6): its output dir and config tree."""
    from pipelines.commands.cli import main
    from tests.conftest import tiny_config, write_config

    tmp = tmp_path_factory.mktemp("cross_run")
    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]
    bpe_path = train_bpe(texts, 300, tmp / "bpe" / "tokenizer.json")
    out = tmp / "out"
    cfg = tiny_config(str(corpus_dir), str(out))
    cfg["teacher"].update(
        checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0, top_k=None, tokenizer="bytes"
    )
    cfg["student"]["model"]["vocab_size"] = 320
    cfg["data"]["tokenizer"] = str(bpe_path)
    # the byte-level teacher predicts the text worse than the student (bits per byte): the
    # gate would make every on-policy step a data step (tests/test_alpha_gate.py)
    on_policy = {"fraction": 0.5, "max_new_tokens": 12}
    cfg["distill"] = {"on_policy": on_policy, "alpha_gate": False}
    assert main(["run", write_config(tmp, cfg)]) == 0
    return out, cfg


def test_short_run_byte_teacher_bpe_student(tiny_run, cross_run):
    """The cross-tokenizer run trains, reports the aligned share, and evaluates in bits per
    byte; the same teacher's bits per byte as the one-tokenizer run's."""
    from tests.conftest import read_evals, read_train

    out, _ = cross_run
    train, evals = read_train(out), read_evals(out)
    assert [r["step"] for r in train] == [2, 4, 6]
    assert any(r["on_policy"] > 0 for r in train)  # steps trained on re-tokenised samples
    for r in train:
        assert np.isfinite(r["loss"]) and r["kd_loss"] > 0
        assert 0.8 < r["aligned_fraction"] <= 1.0
    for e in evals:
        assert 0 < e["student_bpb"] < 12 and 0 < e["teacher_bpb"] < 12
        assert 0.8 < e["aligned_fraction"] <= 1.0
    same = [e for e in read_evals(tiny_run.out)]
    assert evals[0]["teacher_bpb"] == pytest.approx(same[0]["teacher_bpb"], rel=0.1)


@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_cross_run_resume_is_exact(cross_run, tmp_path, placement):
    """Drop the last checkpoint and rerun: steps 4-6 repeat exactly (the student rows, the
    teacher's rows of their text and the alignment come back with the data iterator's
    state), and so does the last evaluation; also rerun colocated (both roles on two
    devices: the re-tokenised on-policy samples, the alignment and the teacher's scores
    there)."""
    import shutil

    from pipelines.commands.cli import main
    from tests.conftest import read_evals, read_train, write_config

    out, cfg = cross_run
    resumed = tmp_path / "out"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    (resumed / "summary.json").unlink()
    cfg = {**cfg, "run": {**cfg["run"], "output_dir": str(resumed)}}
    cfg["mesh"] = {**cfg["mesh"], "placement": placement}
    assert main(["run", write_config(tmp_path, cfg)]) == 0
    before = {r["step"]: r for r in read_train(out)}
    after = read_train(resumed)[len(before) :]
    assert [r["step"] for r in after] == [4, 6]
    for r in after:
        for key in ("loss", "kd_loss", "ce_loss", "grad_norm", "aligned_fraction"):
            assert r[key] == pytest.approx(before[r["step"]][key], rel=1e-5), key
    last, again = read_evals(out)[-1], read_evals(resumed)[-1]
    assert again["step"] == last["step"] == 6
    for key in ("student_loss", "student_bpb", "teacher_bpb", "aligned_fraction"):
        assert again[key] == pytest.approx(last[key], rel=1e-5), key


def test_first_byte_loss_and_gradient_match_a_dense_projection(bpe):
    """Both distributions summed by first byte (explicit 0/1 matrices as the reference),
    over the buckets both reach; for two byte tokenizers, today's divergence."""
    cfg = DistillLossConfig(loss="jsd", temperature=1.0)
    fb = FirstBytes.between(ByteTokenizer(), bpe, 259, 320)
    z, t = _logits(10, (2, 3, 320)), _logits(11, (2, 3, 259))
    lp = jax.nn.log_softmax(t)
    keep = np.intersect1d(fb.teacher[fb.teacher >= 0], fb.student[fb.student >= 0])

    def onto(bucket):
        m = (bucket[:, None] == keep[None, :]).astype(np.float32)
        return m

    def ref(z):
        p, q = jnp.exp(lp) @ onto(fb.teacher), jax.nn.softmax(z) @ onto(fb.student)
        p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
        return jnp.sum(kd_divergence(jnp.log(q), TeacherOutput(jnp.log(p)), cfg))

    f = lambda z: jnp.sum(xl.cross_divergence(z, lp, cfg, fb, "first_byte"))  # noqa: E731
    np.testing.assert_allclose(f(z), ref(z), rtol=2e-5)
    np.testing.assert_allclose(jax.grad(f)(z), jax.grad(ref)(z), rtol=2e-4, atol=1e-6)
    same = FirstBytes.between(ByteTokenizer(), ByteTokenizer(), 259, 259)
    zb = _logits(12, (2, 3, 259))
    got = xl.cross_divergence(zb, lp, cfg, same, "first_byte")
    np.testing.assert_allclose(got, kd_divergence(zb, TeacherOutput(lp), cfg), rtol=1e-5)


def _boundary_table(bpe, vs=320):
    """`FirstBytes` of the byte teacher and `bpe` with `follows` read from the hand-made
    texts packed as a student stream, and that stream."""
    rows = _rows(bpe, ByteTokenizer())
    fb = FirstBytes.between(ByteTokenizer(), bpe, 259, vs)
    return fb.after_tokens(rows.stream, rows.doc_start), rows


def test_first_byte_follows_are_the_successors_in_the_text(bpe):
    """`follows` holds exactly the first-byte buckets of each token's successors within a
    document (EOS included, the next document's BOS not)."""
    fb, rows = _boundary_table(bpe)
    want = np.zeros_like(fb.follows)
    stream, starts = rows.stream, rows.doc_start
    for i in range(len(stream) - 1):
        if not starts[i + 1]:
            want[stream[i], fb.student[stream[i + 1]]] = True
    np.testing.assert_array_equal(fb.follows, want)
    spaces = token_bytes(bpe).index(b"  ")  # a run of spaces is followed by " word"
    assert fb.follows[spaces].nonzero()[0].tolist() == [ord(" ")]
    assert not fb.follows[:, 256].any()  # BOS never follows within a document


def test_first_byte_at_the_boundary_matches_a_dense_reference(bpe):
    """With `follows`, both next-byte distributions renormalised over the buckets that
    follow each input token (explicit 0/1 matrices and masks as the reference), its
    gradient too; a token never seen followed keeps every bucket. JSD at T=1.5 reads both
    directions of the divergence and the temperature."""
    cfg = LOSSES[-1]
    fb, _ = _boundary_table(bpe)
    sb = token_bytes(bpe)
    unseen = int(np.flatnonzero(~fb.follows.any(axis=-1))[-1])  # never followed in the text
    inputs = jnp.array([[sb.index(b"  "), sb.index(b" the")], [bpe.bos_id, unseen]])
    z, lp = _logits(16, (2, 2, 320)), jax.nn.log_softmax(_logits(17, (2, 2, 259)))
    keep = np.intersect1d(fb.teacher[fb.teacher >= 0], fb.student[fb.student >= 0])
    allowed = fb.follows[:, keep][np.asarray(inputs)]
    allowed[1, 1] = True

    def ref(z):
        onto = lambda b: (b[:, None] == keep[None, :]).astype(np.float32)  # noqa: E731
        p = jnp.exp(lp) @ onto(fb.teacher) * allowed
        q = jax.nn.softmax(z / cfg.temperature) @ onto(fb.student) * allowed
        p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
        logit = lambda x: jnp.log(jnp.maximum(x, 1e-30))  # noqa: E731
        return jnp.sum(kd_divergence(logit(q) * cfg.temperature, TeacherOutput(logit(p)), cfg))

    f = lambda z: jnp.sum(xl.cross_divergence(z, lp, cfg, fb, "first_byte", inputs))  # noqa: E731
    (got, g), (want, g_ref) = (jax.jit(jax.value_and_grad(h))(z) for h in (f, ref))
    np.testing.assert_allclose(got, want, rtol=2e-5)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, g_ref, rtol=2e-4, atol=1e-6)
    plain = xl.cross_divergence(z, lp, cfg, fb, "first_byte")  # no inputs: every bucket
    assert abs(float(got) - float(jnp.sum(plain))) > 1e-3


def _dense_byte_path(z, lp, lp_path, targets, deep_ok, cfg, bpe):
    """Reference: each depth's buckets summed by explicit 0/1 matrices built from the
    tokens' bytes (no trie), the divergence of `kd_divergence` over them, summed."""
    from distill.models.losses import _divergence

    sb = token_bytes(bpe)[: z.shape[-1]]
    fb = FirstBytes.between(ByteTokenizer(), bpe, 259, z.shape[-1])
    total = xl.cross_divergence(z, lp, cfg, fb, "first_byte")
    q = jax.nn.softmax(z / cfg.temperature)
    for n, y in enumerate(np.asarray(targets)):
        y_bytes = sb[y] or b""
        for d in range(1, len(y_bytes) + 1):
            if d == len(y_bytes) and not deep_ok[n]:
                continue
            prefix = y_bytes[:d]
            kids = sorted({b[d] for b in sb if b and len(b) > d and b.startswith(prefix)})
            end = [i for i, b in enumerate(sb) if b == prefix][:1]
            m = np.zeros((len(sb), len(kids) + len(end)), np.float32)
            for i, b in enumerate(sb):
                if b and len(b) > d and b.startswith(prefix):
                    m[i, kids.index(b[d])] = 1
            if end:
                m[end[0], -1] = 1
            p_kids = jnp.exp(lp_path[n, d - 1, np.array(kids, int)])
            p = jnp.concatenate([p_kids, jnp.array([1.0]) - p_kids.sum()])[: m.shape[1]]
            qb = q[n] @ m
            lp_b, lq_b = jnp.log(p / p.sum()), jnp.log(qb / qb.sum())
            total = total.at[n].add(_divergence(lp_b, lq_b, cfg))
    return total


@pytest.mark.parametrize("cfg", LOSSES[::2], ids=lambda c: c.loss)
def test_byte_path_loss_and_gradient_match_a_dense_reference(cfg, bpe):
    """The byte-path divergence (trie tables) against explicit bucket sums per depth, its
    gradient too; depth 0 is first_byte, and a target's last depth counts only when the
    position after it has a teacher."""
    bp = BytePaths.between(ByteTokenizer(), bpe, 259, 320)
    sb = token_bytes(bpe)
    longest = sorted((i for i, b in enumerate(sb) if b), key=lambda i: -len(sb[i]))
    targets = jnp.array([longest[0], longest[5], longest[40], sb.index(b" the"), bpe.eos_id, 70])
    n = len(targets)
    z = _logits(13, (n, 320))
    lp = jax.nn.log_softmax(_logits(14, (n, 259)) / cfg.temperature)
    lp_path = jax.nn.log_softmax(_logits(15, (n, bp.depth, 256)))
    deep_ok = np.array([True, False, True, True, True, False])
    f = lambda z: jnp.sum(  # noqa: E731
        xl.byte_path_divergence(lp, jax.nn.log_softmax(z / cfg.temperature), lp_path,
                                targets, deep_ok, cfg, bp)
    )  # fmt: skip
    ref = lambda z: jnp.sum(_dense_byte_path(z, lp, lp_path, targets, deep_ok, cfg, bpe))  # noqa: E731
    # jitted: one program each (eagerly, every small op of every depth compiles its own)
    (value, g), (want, want_g) = (jax.jit(jax.value_and_grad(h))(z) for h in (f, ref))
    np.testing.assert_allclose(value, want, rtol=2e-5)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, want_g, rtol=2e-4, atol=1e-6)
    first = xl.cross_divergence(z, lp, cfg, bp.first, "first_byte")
    assert float(value) > float(jnp.sum(first))  # the deeper bytes add to depth 0


def test_byte_path_needs_a_byte_level_teacher(bpe, corpus_dir, tmp_path, capsys):
    """byte_path reads the teacher's positions inside a student token: a BPE teacher is one
    line naming the key, before any device work."""
    from pipelines.commands.cli import main
    from tests.conftest import tiny_config, write_config

    cfg = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    cfg["teacher"].update(tokenizer=str(bpe.files[0]), top_k=None, pretrain_steps=0)
    cfg["teacher"]["model"]["vocab_size"] = 320
    cfg["distill"] = {"cross_tokenizer": "byte_path"}
    assert main(["validate", write_config(tmp_path, cfg)]) == 2
    assert "distill.cross_tokenizer: byte_path" in capsys.readouterr().err


@pytest.mark.slow
def test_a_staged_teacher_across_tokenizers_gives_the_runs_losses(cross_run, tmp_path):
    """The cross-tokenizer run (dense teacher outputs at the student's positions, on-policy
    samples re-tokenised and scored) with its byte-level teacher in two stages of one layer
    (tp=2 inside each), one-row microbatches: the same losses and evaluation."""
    import json

    from pipelines.commands.cli import main
    from tests.conftest import read_evals, train_by_step, write_config

    want_out, cfg = cross_run
    tree = json.loads(json.dumps(cfg))
    tree["run"]["output_dir"] = str(tmp_path / "out")
    tree["mesh"]["teacher"]["pp"] = 2
    tree["teacher"]["microbatch"] = 1
    assert main(["run", write_config(tmp_path, tree)]) == 0
    want, got = train_by_step(want_out), train_by_step(tmp_path / "out")
    assert sorted(got) == sorted(want) == [2, 4, 6]
    for step, r in want.items():
        for key in ("loss", "kd_loss", "ce_loss", "aligned_fraction"):
            assert got[step][key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), (step, key)
    for e, w in zip(read_evals(tmp_path / "out"), read_evals(want_out), strict=True):
        assert e["student_bpb"] == pytest.approx(w["student_bpb"], rel=1e-5)
        assert e["teacher_bpb"] == pytest.approx(w["teacher_bpb"], rel=1e-5)
