"""data.tokenizer: bytes, a Hugging Face tokenizer.json, a SentencePiece model; vocabulary
agreement with the model, padded-vocabulary masking, and export of the tokenizer."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from distill import collectives as cc
from distill.config import DataConfig, DistillLossConfig, ModelConfig, OptimConfig
from distill.data.loader import load_corpus
from distill.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer
from distill.errors import DistillError
from distill.mesh import teacher_mesh
from distill.models import losses, model
from distill.types import Batch, TeacherOutput
from pipelines.commands.cli import main
from teacher.forward import make_forward
from teacher.sharding import shard_params
from tests.conftest import WORDS, tiny_config

HF_VOCAB = 300  # 3 specials + 256 byte symbols + 41 merges
PADDED_VOCAB = 320  # the model's vocabulary, padded to a multiple of 64 as checkpoints do


def _texts(corpus_dir):
    return [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory, corpus_dir):
    """A byte-level BPE tokenizer.json trained here on the test corpus (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=HF_VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(corpus_dir), trainer)
    path = tmp_path_factory.mktemp("hf_tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, corpus_dir):
    """A tiny SentencePiece BPE model trained here (skipped without sentencepiece)."""
    prefix = tmp_path_factory.mktemp("spm") / "sp"
    lines = [line for t in _texts(corpus_dir) for line in t.splitlines() if line]
    return train_spm(prefix, lines, 96)


def train_spm(prefix, lines, vocab_size: int, **options):
    """A SentencePiece BPE model trained on `lines` at `prefix`.model (unk, bos, eos, pad =
    0..3; skipped without sentencepiece); `options`: more trainer settings."""
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
        **options,
    )
    return prefix.with_suffix(".model")


def _data(corpus_dir, tokenizer):
    return DataConfig(source=str(corpus_dir), include=["*.txt"], tokenizer=str(tokenizer))


def _check_corpus(corpus_dir, tokenizer_path, bos, eos):
    corpus = load_corpus(_data(corpus_dir, tokenizer_path), seq_len=32)
    tok = corpus.tokenizer
    assert (tok.bos_id, tok.eos_id) == (bos, eos)
    stream = corpus.train.stream
    assert stream.dtype == np.int32 and stream[0] == bos
    assert stream.min() >= 0 and stream.max() < tok.vocab_size
    assert (stream == bos).sum() == (stream == eos).sum() == corpus.train.num_documents
    batch = corpus.train.gather(np.arange(2))
    assert batch.tokens.dtype == np.int32 and batch.tokens.shape == (2, 32)
    text = " ".join(WORDS[:12])
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and tok.decode(ids).strip() == text
    # subword tokens: far fewer tokens than bytes
    assert corpus.train.num_tokens < 0.6 * sum(len(t) for t in _texts(corpus_dir))
    return corpus


def test_hf_tokenizer_json_corpus(corpus_dir, hf_json):
    corpus = _check_corpus(corpus_dir, hf_json, bos=1, eos=2)
    assert corpus.tokenizer.vocab_size == HF_VOCAB and corpus.tokenizer.pad_id == 0
    # a directory holding tokenizer.json works too
    assert load_tokenizer(str(hf_json.parent)).vocab_size == HF_VOCAB


def test_sentencepiece_corpus(corpus_dir, spm_model):
    corpus = _check_corpus(corpus_dir, spm_model, bos=1, eos=2)
    assert corpus.tokenizer.pad_id == 3


def test_bytes_is_the_default():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    assert DataConfig(source="x").tokenizer == "bytes"


def test_tokenizer_with_only_eos_uses_it_for_both(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {"a": 0, "b": 1, "<|endoftext|>": 2}
    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel(vocab, unk_token="a")).save(str(path))
    tok = HFTokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 2, None)

    vocab = {"a": 0, "b": 1}
    Tokenizer(models.WordLevel(vocab, unk_token="a")).save(str(path))
    with pytest.raises(DistillError, match="data.tokenizer: .*no BOS or EOS"):
        HFTokenizer(path)


def test_missing_and_broken_tokenizer_files(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(DistillError, match=r"data.tokenizer: no such file: .*nope/tokenizer.json"):
        load_tokenizer(str(missing))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DistillError, match="data.tokenizer: .*tokenizer.json is not a loadable"):
        load_tokenizer(str(bad))
    bad_sp = tmp_path / "bad.model"
    bad_sp.write_bytes(b"garbage")
    with pytest.raises(DistillError, match="data.tokenizer: .*bad.model") as info:
        load_tokenizer(str(bad_sp))
    assert len(str(info.value).splitlines()) == 1


def _write(tmp_path, cfg, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_cli_errors_name_the_tokenizer(tmp_path, corpus_dir, hf_json, capsys):
    out = str(tmp_path / "out")
    cfg = tiny_config(str(corpus_dir), out, data={"tokenizer": str(tmp_path / "missing.json")})
    assert main(["validate", _write(tmp_path, cfg)]) == 2
    err = _one_line_error(capsys)
    assert "data.tokenizer" in err and "missing.json" in err

    cfg = tiny_config(str(corpus_dir), out, data={"tokenizer": str(hf_json)})  # vocab 260 < 300
    assert main(["validate", _write(tmp_path, cfg)]) == 2
    err = _one_line_error(capsys)
    assert "teacher.model.vocab_size: 260" in err and f"({HF_VOCAB}," in err


# ----------------------------------------------------------------------------- masking


def _batch(b=2, s=12, vocab=HF_VOCAB, seed=0):
    tokens = np.random.default_rng(seed).integers(0, vocab, (b, s)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    return Batch(tokens, tokens, seg, pos, np.ones((b, s), np.float32))


@pytest.mark.parametrize("tp,limit", [(2, HF_VOCAB), (4, HF_VOCAB), (4, 100), (1, HF_VOCAB)])
def test_padded_vocab_is_masked_on_every_shard(tp, limit):
    cfg = ModelConfig(
        vocab_size=PADDED_VOCAB, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48
    )
    mesh = teacher_mesh(jax.devices()[:tp], 1, tp)
    params, batch = model.init_params(cfg, 0), _batch(vocab=limit)
    sharded = shard_params(params, cfg, mesh)
    t = 2.0
    dense = make_forward(cfg, mesh, mode="dense", temperature=t, vocab_limit=limit)
    lp = np.asarray(dense(sharded, batch).logprobs)
    assert lp.shape[-1] == PADDED_VOCAB
    np.testing.assert_allclose(np.exp(lp[..., :limit]).sum(-1), 1.0, atol=1e-5)
    assert np.all(np.isneginf(lp[..., limit:]))
    # equals the log-softmax of the unpadded logits
    ref = np.asarray(model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions))
    np.testing.assert_allclose(
        lp[..., :limit], np.asarray(jax.nn.log_softmax(ref[..., :limit] / t)), atol=2e-5
    )
    top = make_forward(cfg, mesh, mode="topk", temperature=t, top_k=8, vocab_limit=limit)
    out = top(sharded, batch)
    assert np.asarray(out.ids).max() < limit and np.all(np.isfinite(np.asarray(out.logprobs)))
    logits = np.asarray(make_forward(cfg, mesh, mode="logits", vocab_limit=limit)(sharded, batch))
    assert np.all(np.isneginf(logits[..., limit:])) and np.all(np.isfinite(logits[..., :limit]))


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("top_k", [None, 4])
def test_kd_loss_with_masked_teacher_and_student(loss, top_k):
    """With the teacher masked, forward KL (and any top-k loss) stays finite even for an
    unmasked student; masking the student too (finite fill) makes every divergence finite."""
    v, limit = 16, 12
    rng = np.random.default_rng(0)
    zt = cc.mask_vocab(jnp.asarray(rng.normal(size=(2, 3, v)), jnp.float32), limit, None)
    lp = jax.nn.log_softmax(zt / 2.0)
    teacher = TeacherOutput(lp, None) if top_k is None else TeacherOutput(*jax.lax.top_k(lp, top_k))
    cfg = DistillLossConfig(loss=loss, temperature=2.0)
    targets = jnp.asarray(rng.integers(0, limit, (2, 3)), jnp.int32)
    mask = jnp.ones((2, 3))

    def f(z, student_mask):
        z = cc.mask_vocab(z, limit, None, fill=-1e30) if student_mask else z
        return losses.kd_loss(z, teacher, targets, mask, cfg)[0]

    zs = jnp.asarray(rng.normal(size=(2, 3, v)), jnp.float32)
    for student_mask in (True, False):
        value, grad = jax.value_and_grad(f)(zs, student_mask)
        finite = bool(jnp.isfinite(value)) and bool(jnp.all(jnp.isfinite(grad)))
        assert finite or (not student_mask and top_k is None and loss == "reverse_kl")


@pytest.mark.parametrize(
    "top_k,loss", [(None, "reverse_kl"), (None, "jsd"), (8, "forward_kl")], ids=str
)
def test_padded_and_masked_equals_unpadded(loss, top_k):
    """The pipeline's masking (teacher forward on a tp=4 mesh, student step on a dp=2 mesh,
    both given `vocab_limit`) computes exactly what a model of the unpadded vocabulary
    computes (single-device reference): same loss, same update of every live parameter.

    Each padding path once: the dense teacher (-inf log-probs on the padded ids) with the
    two divergences that weigh them by the student's probabilities (reverse KL, JSD's
    mixture), and the top-k teacher (the tail bucket over the live ids only) with the
    default forward KL. Every divergence with either teacher on a padded vocabulary:
    tests/test_vocab_loss.py (test_kd_chunked_matches_whole, vocab_limit < vocab) and
    test_kd_loss_with_masked_teacher_and_student above."""
    from student import optim, train

    limit = 50
    padded = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48)
    unpadded = padded.model_copy(update={"vocab_size": limit})
    params = jax.tree.map(np.asarray, model.init_params(padded, 0))
    trimmed = dict(params, embed=params["embed"][:limit], lm_head=params["lm_head"][:, :limit])
    lcfg = DistillLossConfig(loss=loss, temperature=2.0, alpha=0.7)
    ocfg = OptimConfig(weight_decay=0.0)
    tx, sched = optim.make_optimizer(ocfg, 10), optim.schedule(ocfg, 10)
    mesh = lambda axis, ids: Mesh(np.array([jax.devices()[i] for i in ids]), (axis,))
    batch = _batch(b=4, vocab=limit)
    results = []
    for cfg, p, lim, t_mesh, s_mesh in (
        (padded, params, limit, teacher_mesh(jax.devices()[:4], 1, 4), mesh("dp", [4, 5])),
        (unpadded, trimmed, None, teacher_mesh(jax.devices()[:1], 1, 1), mesh("dp", [1])),
    ):
        mode = "topk" if top_k else "dense"
        fwd = make_forward(cfg, t_mesh, mode=mode, temperature=2.0, top_k=top_k, vocab_limit=lim)
        t_out = jax.device_get(fwd(shard_params(p, cfg, t_mesh), batch))
        if top_k is None and lim is not None:  # the dense teacher's padded ids carry no mass
            assert np.all(np.isneginf(t_out.logprobs[..., lim:]))
        step = train.make_train_step(
            cfg, tx, s_mesh, loss_cfg=lcfg, lr_schedule=sched, vocab_limit=lim
        )
        state = jax.device_put(
            train.TrainState(jnp.zeros((), jnp.int32), p, tx.init(p), train.no_skips()),
            NamedSharding(s_mesh, PartitionSpec()),
        )
        new, metrics = step(state, batch, t_out)
        results.append((jax.device_get(new.params), jax.device_get(metrics)))
    (p_pad, m_pad), (p_ref, m_ref) = results
    for key in ("loss", "kd_loss", "ce_loss", "grad_norm"):
        assert np.isfinite(m_pad[key])
        np.testing.assert_allclose(m_pad[key], m_ref[key], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(p_pad["embed"][:limit], p_ref["embed"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p_pad["lm_head"][:, :limit], p_ref["lm_head"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p_pad["embed"][limit:], params["embed"][limit:])  # never touched


# ----------------------------------------------------------------------------- end to end


def test_run_and_export_with_tokenizer_json_and_padded_vocab(tmp_path, corpus_dir, hf_json):
    out = tmp_path / "out"
    cfg = tiny_config(
        str(corpus_dir), str(out), data={"tokenizer": str(hf_json)}, train={"steps": 4}
    )
    cfg["teacher"]["model"]["vocab_size"] = PADDED_VOCAB
    path = _write(tmp_path, cfg)
    assert main(["run", path]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses_ = [r["loss"] for r in records if r.get("phase") == "distill" and "loss" in r]
    assert losses_ and all(np.isfinite(losses_))

    assert main(["export", str(out)]) == 0
    hf_dir = out / "hf"
    assert (hf_dir / "tokenizer.json").read_bytes() == hf_json.read_bytes()
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["vocab_size"] == HF_VOCAB  # the padded ids are trimmed on export
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<s>",
        "</s>",
        "<pad>",
    )
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    text = " ".join(WORDS[:10])
    ours = load_tokenizer(str(hf_json)).encode(text).tolist()
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours
    assert hf_tok.bos_token_id == 1 and hf_tok.eos_token_id == 2


def test_export_sentencepiece(tmp_path, spm_model):
    from student.export import write_hf

    cfg = ModelConfig(vocab_size=128, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    out = write_hf(
        tmp_path / "hf",
        cfg,
        model.init_params(cfg, 0),
        max_position_embeddings=32,
        tokenizer=str(spm_model),
    )
    assert (out / "tokenizer.model").read_bytes() == spm_model.read_bytes()
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["bos_token"] == "<s>" and tok_cfg["tokenizer_class"] == "LlamaTokenizer"
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 3)
