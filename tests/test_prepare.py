"""`distill prepare` and data.prepared_dir: the same batches as the raw corpus, read from
ArrayRecord shards; resume; mismatches with the config; the CLI end to end."""

import json

import numpy as np
import pytest
import yaml

from distill.config import Config
from distill.data.loader import load_corpus
from distill.data.prepared import StoredRows
from distill.errors import DistillError
from distill.identity import data_hash
from pipelines.commands.cli import main
from pipelines.commands.prepare import prepare
from tests.conftest import tiny_config


def _cfg(source, prepared, seq_len=16, **data) -> Config:
    return Config.model_validate(
        {
            "data": {"source": str(source), "prepared_dir": str(prepared), **data},
            "train": {"seq_len": seq_len},
        }
    )


def _raw(cfg: Config):
    return load_corpus(cfg.data.model_copy(update={"prepared_dir": None}), cfg.train.seq_len)


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if x is None:  # a field a plain corpus leaves empty (the cross-tokenizer teacher view)
            assert y is None
            continue
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("rows_per_shard", [None, 500])
def test_prepared_corpus_gives_the_same_batches(tmp_path, corpus_dir, rows_per_shard):
    cfg = _cfg(corpus_dir, tmp_path / "prep")
    summary = prepare(cfg, rows_per_shard)
    raw, stored = _raw(cfg), load_corpus(cfg.data, 16)
    assert isinstance(stored.train, StoredRows) and isinstance(stored.eval, StoredRows)
    assert (stored.train_rows, stored.eval_rows) == (raw.train_rows, raw.eval_rows)
    assert summary["train_rows"] == raw.train_rows
    n = rows_per_shard or raw.train_rows
    assert summary["shards"] == -(-raw.train_rows // n) + -(-raw.eval_rows // n)
    a, b = raw.train_iterator(8, seed=3), stored.train_iterator(8, seed=3)
    for _ in range(3 * raw.train_rows // 8):  # three epochs: reshuffled alike
        _assert_same(next(a), next(b))
    for x, y in zip(raw.eval_batches(8, 3), stored.eval_batches(8, 3), strict=True):
        _assert_same(x, y)
    _assert_same(raw.train[5], stored.train[5])
    assert data_hash(stored) == data_hash(raw)  # a teacher cache matches either
    manifest = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    assert manifest["seq_len"] == 16 and manifest["token_dtype"] == "<u2"
    assert manifest["tokenizer"]["kind"] == "bytes" and manifest["data"]["source"] == str(
        corpus_dir
    )
    assert manifest["train"]["rows"] == raw.train_rows


def test_prepared_iterator_state_resumes_exactly(tmp_path, corpus_dir):
    cfg = _cfg(corpus_dir, tmp_path / "prep")
    prepare(cfg, rows_per_shard=300)
    corpus = load_corpus(cfg.data, 16)
    it = corpus.train_iterator(batch_size=8, seed=1)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state == {"next_index": 7}
    want = [next(it) for _ in range(3)]
    fresh = load_corpus(cfg.data, 16).train_iterator(batch_size=8, seed=1)
    fresh.set_state(state)
    for w in want:
        _assert_same(next(fresh), w)


def test_prepare_from_parquet_and_token_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    src = tmp_path / "src"
    src.mkdir()
    texts = [f"record {i}: " + "xyz" * (i % 5 + 2) for i in range(30)]
    pq.write_table(pa.table({"text": texts[:20], "n": list(range(20))}), src / "a.parquet")
    writer = ArrayRecordWriter(str(src / "b.arrayrecord"), "group_size:1")
    for t in texts[20:]:
        writer.write((np.frombuffer(t.encode(), np.uint8).astype("<i4") + 3).tobytes())
    writer.close()
    cfg = _cfg(src, tmp_path / "prep", seq_len=8, eval_fraction=0.1)
    prepare(cfg)
    raw, stored = _raw(cfg), load_corpus(cfg.data, 8)
    _assert_same(
        raw.train.gather(np.arange(raw.train_rows)), stored.train.gather(np.arange(raw.train_rows))
    )
    _assert_same(
        raw.eval.gather(np.arange(raw.eval_rows)), stored.eval.gather(np.arange(raw.eval_rows))
    )


def _word_tokenizer(path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_prepared_corpus_must_match_the_config(tmp_path, corpus_dir):
    words = sorted({w for p in corpus_dir.glob("*.txt") for w in p.read_text().split()})
    tok = _word_tokenizer(tmp_path / "tokenizer.json", words)
    cfg = _cfg(corpus_dir, tmp_path / "prep", tokenizer=str(tok))
    prepare(cfg)
    load_corpus(cfg.data, 16)  # matches

    def fails(data: dict, seq_len=16, match=""):
        with pytest.raises(DistillError, match=match) as err:
            load_corpus(cfg.data.model_copy(update=data), seq_len)
        assert "\n" not in str(err.value)

    fails(
        {},
        seq_len=32,
        match=r"train\.seq_len: 32 differs from 16 in the prepared corpus .*manifest\.json",
    )
    fails({"eval_fraction": 0.1}, match=r"data\.eval_fraction: 0\.1 differs from 0\.02")
    fails({"include": ["*.md"]}, match=r"data\.include: \['\*\.md'\] differs")
    fails(
        {"tokenizer": "bytes"},
        match=r"data\.tokenizer: bytes is not the tokenizer the prepared corpus",
    )
    _word_tokenizer(tok, words[:-1])  # same path, other vocabulary
    fails({}, match=r"data\.tokenizer: .*tokenizer\.json is not the tokenizer .* vocab \d+, sha256")
    fails(
        {"prepared_dir": str(tmp_path / "nothing")},
        match=r"holds no prepared corpus .*distill prepare CONFIG first",
    )
    _word_tokenizer(tok, words)
    (tmp_path / "prep" / "eval-00000.arrayrecord").unlink()
    fails({}, match=r"data\.prepared_dir: .*prep lacks shard eval-00000\.arrayrecord")


def test_prepare_refuses_what_it_should_not_write(tmp_path, corpus_dir):
    with pytest.raises(DistillError, match=r"data\.prepared_dir: not set"):
        prepare(Config.model_validate({"data": {"source": str(corpus_dir)}}))
    with pytest.raises(
        DistillError, match=r"data\.prepared_dir: .* is not empty and holds no prepared corpus"
    ):
        prepare(_cfg(corpus_dir, corpus_dir))
    with pytest.raises(DistillError, match=r"data\.prepared_dir: gs://b/p: only a local"):
        prepare(_cfg(corpus_dir, "gs://b/p"))
    bad = tmp_path / "tiny.txt"
    bad.write_text("hi")
    with pytest.raises(DistillError, match=r"data\.source: .*need at least 17"):
        prepare(_cfg(bad, tmp_path / "prep"))
    assert not (tmp_path / "prep").exists()  # nothing written for bad data
    cfg = _cfg(corpus_dir, tmp_path / "again")
    prepare(cfg, rows_per_shard=300)
    prepare(cfg)  # a prepared corpus is replaced, its old shards removed
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == [
        "eval-00000.arrayrecord",
        "manifest.json",
        "train-00000.arrayrecord",
    ]


def test_cli_prepare_then_run(tmp_path, corpus_dir, capsys, tiny_run):
    """validate refuses an unprepared corpus; prepare, then a run reads the prepared rows (its
    teacher the session's `tiny_run` one, taken as it is: no bootstrap first)."""
    out = tmp_path / "out"
    cfg = tiny_config(str(corpus_dir), str(out), data={"prepared_dir": str(tmp_path / "prep")})
    cfg["train"]["steps"] = 3
    cfg["teacher"].update(checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["validate", str(path)]) == 2  # not prepared yet
    assert "run distill prepare CONFIG first" in capsys.readouterr().err
    assert main(["prepare", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["train_rows"] > 0 and summary["shards"] == 2
    assert main(["run", str(path)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if "loss" in r) == 3
    capsys.readouterr()
    assert main(["validate", str(path), "--set", "train.seq_len=64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.seq_len: 64 differs from 32" in err, err
