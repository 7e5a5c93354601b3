"""distill.data.loader: tokenizer, document loading, packing, split, shuffling, iterator state."""

import json

import numpy as np
import pytest

from distill.config import DataConfig
from distill.data.corpus import PackedRows
from distill.data.loader import load_corpus, load_documents, split_documents
from distill.data.tokenizers import ByteTokenizer, build_tokenizer
from distill.errors import DistillError
from distill.types import Batch


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def corpus_dir(tmp_path):
    """40 distinct small documents in a directory."""
    for i in range(40):
        _write(tmp_path / "docs" / f"doc{i:02d}.txt", f"document {i}: " + "abcdefgh" * (i % 7 + 3))
    return tmp_path / "docs"


def test_tokenizer_round_trip():
    tok = build_tokenizer(DataConfig(source="x"))
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    text = "héllo, 世界 \n\t\x7f"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.min() >= 3 and ids.max() < 259
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.decode([3 + 0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def test_packing_element_by_element():
    # Documents of lengths 3, 1, 4 -> stream (B=BOS=1, E=EOS=2):
    #   B a a a E  B b E  B c c c c E      (14 tokens; doc ids 0x5, 1x3, 2x6)
    docs = [np.array([10, 11, 12]), np.array([20]), np.array([30, 31, 32, 33])]
    rows = PackedRows(docs, seq_len=4, bos_id=1, eos_id=2)
    stream = [1, 10, 11, 12, 2, 1, 20, 2, 1, 30, 31, 32, 33, 2]
    np.testing.assert_array_equal(rows.stream, stream)
    assert len(rows) == (14 - 1) // 4 == 3
    expect = [
        # row 0: stream[0:5] = B 10 11 12 | E
        dict(tok=[1, 10, 11, 12], tgt=[10, 11, 12, 2], seg=[1, 1, 1, 1], pos=[0, 1, 2, 3],
             mask=[1, 1, 1, 1]),
        # row 1: stream[4:9] = E B 20 E | B  (EOS ends doc 0; target BOS starts doc 2)
        dict(tok=[2, 1, 20, 2], tgt=[1, 20, 2, 1], seg=[1, 2, 2, 2], pos=[0, 0, 1, 2],
             mask=[0, 1, 1, 0]),
        # row 2: stream[8:13] = B 30 31 32 | 33  (doc 2 continues into the dropped tail)
        dict(tok=[1, 30, 31, 32], tgt=[30, 31, 32, 33], seg=[1, 1, 1, 1], pos=[0, 1, 2, 3],
             mask=[1, 1, 1, 1]),
    ]  # fmt: skip
    for i, e in enumerate(expect):
        row = rows[i]
        assert isinstance(row, Batch)
        np.testing.assert_array_equal(row.tokens, e["tok"])
        np.testing.assert_array_equal(row.targets, e["tgt"])
        np.testing.assert_array_equal(row.segment_ids, e["seg"])
        np.testing.assert_array_equal(row.positions, e["pos"])
        np.testing.assert_array_equal(row.mask, e["mask"])
        assert row.tokens.dtype == row.targets.dtype == row.segment_ids.dtype == np.int32
        assert row.positions.dtype == np.int32 and row.mask.dtype == np.float32
    with pytest.raises(IndexError):
        rows[3]


def test_packing_mid_document_row_restarts_positions():
    rows = PackedRows([np.arange(3, 13)], seq_len=3, bos_id=1, eos_id=2)
    row = rows[1]  # stream[3:7]: continues the document from its 3rd token
    np.testing.assert_array_equal(row.tokens, [5, 6, 7])
    np.testing.assert_array_equal(row.positions, [0, 1, 2])
    np.testing.assert_array_equal(row.segment_ids, [1, 1, 1])
    np.testing.assert_array_equal(row.mask, [1, 1, 1])


def test_gather_matches_rows_and_targets_are_shifted(corpus_dir):
    corpus = load_corpus(DataConfig(source=str(corpus_dir)), seq_len=16)
    batch = corpus.train.gather(np.array([2, 0, 5]))
    for b, r in enumerate([2, 0, 5]):
        for got, want in zip(batch, corpus.train[r], strict=True):
            if want is None:  # no teacher rows of its own (one tokenizer)
                assert got is None
                continue
            np.testing.assert_array_equal(got[b], want)
    np.testing.assert_array_equal(batch.tokens[:, 1:], batch.targets[:, :-1])
    # mask is 0 exactly where the target is a BOS (a new document begins)
    np.testing.assert_array_equal(batch.mask == 0, batch.targets == 1)


def test_split_is_disjoint_by_document(corpus_dir):
    cfg = DataConfig(source=str(corpus_dir), eval_fraction=0.1)
    tok = build_tokenizer(cfg)
    docs = [tok.encode(t) for t in load_documents(cfg)]
    train, held = split_documents(docs, cfg.eval_fraction, min_eval_tokens=9)
    assert len(train) + len(held) == len(docs) == 40
    assert len(held) == 4
    train_set = {d.tobytes() for d in train}
    assert not train_set & {d.tobytes() for d in held}
    again = split_documents(docs, cfg.eval_fraction, min_eval_tokens=9)
    assert [d.tobytes() for d in again[1]] == [d.tobytes() for d in held]

    corpus = load_corpus(cfg, seq_len=8)
    assert corpus.train.num_documents == 36 and corpus.eval.num_documents == 4
    eval_text = tok.decode(corpus.eval.stream)
    for d in train:
        assert tok.decode(d) not in eval_text


def test_single_small_file_splits_its_text(tmp_path):
    text = "one small file with some text in it, long enough for a few rows. " * 3
    f = _write(tmp_path / "one.txt", text)
    corpus = load_corpus(DataConfig(source=str(f)), seq_len=16)
    assert corpus.train_rows >= 1 and corpus.eval_rows >= 1
    tok = corpus.tokenizer
    assert tok.decode(corpus.train.stream) + tok.decode(corpus.eval.stream) == text


def test_shuffle_is_deterministic_and_covers_each_epoch(corpus_dir):
    corpus = load_corpus(DataConfig(source=str(corpus_dir)), seq_len=16)
    n = corpus.train_rows

    def first(seed, k):
        ds = corpus.train_dataset(batch_size=1, seed=seed)
        return [ds[i].tokens[0].tobytes() for i in range(k)]

    assert first(0, 10) == first(0, 10)
    assert first(0, 10) != first(1, 10)
    epoch0, epoch1 = first(0, 2 * n)[:n], first(0, 2 * n)[n:]
    every_row = sorted(corpus.train[i].tokens.tobytes() for i in range(n))
    assert sorted(epoch0) == every_row == sorted(epoch1)
    assert epoch0 != epoch1  # reshuffled per epoch

    batch = corpus.train_dataset(batch_size=4, seed=0)[0]
    assert isinstance(batch, Batch)
    assert all(x.shape == (4, 16) for x in batch if x is not None)


def test_iterator_state_resumes_exactly(corpus_dir):
    corpus = load_corpus(DataConfig(source=str(corpus_dir)), seq_len=16)
    it = corpus.train_iterator(batch_size=8, seed=3)  # 8 > rows per epoch: crosses epochs
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    fresh = corpus.train_iterator(batch_size=8, seed=3)
    fresh.set_state(state)
    got = [next(fresh) for _ in range(3)]
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, Batch)
        for a, b in zip(g, w, strict=True):
            np.testing.assert_array_equal(a, b)


def test_eval_batches_are_fixed_and_cycle(corpus_dir):
    corpus = load_corpus(DataConfig(source=str(corpus_dir), eval_fraction=0.05), seq_len=16)
    n = corpus.eval_rows
    batches = corpus.eval_batches(batch_size=n + 1, n_batches=2)
    assert len(batches) == 2 and batches[0].tokens.shape == (n + 1, 16)
    np.testing.assert_array_equal(batches[0].tokens[n], corpus.eval[0].tokens)
    np.testing.assert_array_equal(batches[1].tokens[0], corpus.eval[1 % n].tokens)
    again = corpus.eval_batches(batch_size=n + 1, n_batches=2)
    np.testing.assert_array_equal(again[1].mask, batches[1].mask)


def test_eval_rows_spread_over_the_held_out_split(corpus_dir):
    """Fewer eval rows than held out: evenly spaced over the whole split, in order, each
    once, the last ones from its last documents (not the split's first rows only)."""
    from distill.data.corpus import eval_row_ids

    corpus = load_corpus(DataConfig(source=str(corpus_dir), eval_fraction=0.2), seq_len=16)
    n = corpus.eval_rows
    assert n >= 8
    rows = eval_row_ids(n, 4)
    assert list(rows) == [0, n // 4, n // 2, 3 * n // 4]
    got = corpus.eval_batches(batch_size=2, n_batches=2)
    for batch, pair in zip(got, rows.reshape(2, 2), strict=True):
        for row, i in zip(batch.tokens, pair, strict=True):
            np.testing.assert_array_equal(row, corpus.eval[int(i)].tokens)
    spread = eval_row_ids(10**6, 999)
    assert len(set(spread)) == 999 and spread[-1] >= 10**6 - 10**6 // 999 - 1


def test_jsonl_text_field(tmp_path):
    lines = [json.dumps({"body": f"record {i}", "id": i}) for i in range(3)]
    _write(tmp_path / "a.jsonl", "\n".join(lines[:2]) + "\n\n")
    _write(tmp_path / "b.json", lines[2])
    _write(tmp_path / "c.txt", '{"body": "plain"}')
    docs = load_documents(DataConfig(source=str(tmp_path), text_field="body"))
    assert docs == ["record 0", "record 1", "record 2", '{"body": "plain"}']
    forced = load_documents(
        DataConfig(source=str(tmp_path / "c.txt"), format="jsonl", text_field="body")
    )
    assert forced == ["plain"]
    as_text = load_documents(DataConfig(source=str(tmp_path / "b.json"), format="text"))
    assert as_text == [lines[2]]


def test_directory_include_exclude_and_skips(tmp_path):
    root = tmp_path / "tree"
    for rel in ["a.py", "pkg/b.py", "pkg/sub/c.py", "pkg/tests/t.py", "notes.md", "pkg/d.txt"]:
        _write(root / rel, rel)
    _write(root / "empty.py", "")
    (root / "bin.py").write_bytes(b"\x00\x01binary")
    cfg = DataConfig(source=str(root), include=["**/*.py"], exclude=["**/tests/**"])
    assert load_documents(cfg) == ["a.py", "pkg/b.py", "pkg/sub/c.py"]
    top = DataConfig(source=str(root), include=["*.py", "*.md"], exclude=["a.*"])
    assert load_documents(top) == ["notes.md"]
    capped = DataConfig(source=str(root), include=["**/*.py"], max_bytes=10)
    assert load_documents(capped) == ["a.py", "pkg/b."]
    globbed = DataConfig(source=str(root / "pkg" / "**" / "*.py"))
    assert load_documents(globbed) == ["pkg/b.py", "pkg/sub/c.py", "pkg/tests/t.py"]


def test_stdlib_expansion_finds_python_files():
    cfg = DataConfig(source="{stdlib}", include=["json/*.py"], max_bytes=200_000)
    docs = load_documents(cfg)
    assert docs and any("import" in d for d in docs)


@pytest.mark.parametrize(
    "setup, kwargs, match",
    [
        (None, dict(source="{tmp}/missing.txt"), r"data\.source: no such file.*missing\.txt"),
        (None, dict(source="{tmp}/*.nothing"), r"data\.source: no files match .*\*\.nothing"),
        ({"d/a.txt": "x"}, dict(source="{tmp}/d", include=["*.py"]),
         r"data\.source: no files in .*data\.include \['\*\.py'\]"),
        ({"e/a.txt": "", "e/b.txt": ""}, dict(source="{tmp}/e"), r"data\.source: .*no text"),
        ({"bad.jsonl": '{"text": "ok"}\nnot json\n'}, dict(source="{tmp}/bad.jsonl"),
         r"data\.source: .*bad\.jsonl line 2: not valid JSON"),
        ({"nf.jsonl": '{"body": "x"}\n'}, dict(source="{tmp}/nf.jsonl"),
         r"nf\.jsonl line 1: .*'text' \(data\.text_field\)"),
        ({"tiny.txt": "hi"}, dict(source="{tmp}/tiny.txt"),
         r"data\.source: .* train tokens .*need at least 17"),
        ({"few/a.txt": "x" * 200, "few/b.txt": "y"}, dict(source="{tmp}/few"),
         r"data\.source: .*\d+ (train|eval) tokens.*need at least 17"),
    ],
)  # fmt: skip
def test_bad_inputs_raise_one_line(tmp_path, setup, kwargs, match):
    for rel, text in (setup or {}).items():
        _write(tmp_path / rel, text)
    kwargs = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v
              for k, v in kwargs.items()}  # fmt: skip
    with pytest.raises(DistillError, match=match) as err:
        load_corpus(DataConfig(**kwargs), seq_len=16)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- formats


def _parquet(path, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=2)
    return path


def _empty_strings():
    import pyarrow as pa

    return pa.array([], type=pa.string())


def _token_records(path, docs, options="group_size:1"):
    from array_record.python.array_record_module import ArrayRecordWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = ArrayRecordWriter(str(path), options)
    for d in docs:
        writer.write(d if isinstance(d, bytes) else np.asarray(d, dtype="<i4").tobytes())
    writer.close()
    return path


def test_parquet_text_column(tmp_path):
    texts = ["alpha", None, "", "delta", "epsilon"]
    _parquet(tmp_path / "a.parquet", id=list(range(5)), body=texts)
    _parquet(tmp_path / "b.parquet", body=["zeta"])
    docs = load_documents(DataConfig(source=str(tmp_path), text_field="body"))
    assert docs == ["alpha", "delta", "epsilon", "zeta"]  # nulls and empty texts skipped
    forced = DataConfig(source=str(tmp_path / "a.parquet"), format="parquet", text_field="body")
    assert load_documents(forced) == ["alpha", "delta", "epsilon"]


def test_arrayrecord_token_ids_pack_like_the_text_they_came_from(tmp_path, corpus_dir):
    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]
    tok = ByteTokenizer()
    _token_records(
        tmp_path / "tok" / "part.array_record-00000-of-00002", [tok.encode(t) for t in texts[:25]]
    )
    _token_records(
        tmp_path / "tok" / "part.array_record-00001-of-00002", [tok.encode(t) for t in texts[25:]]
    )
    from_ids = load_corpus(DataConfig(source=str(tmp_path / "tok")), seq_len=16)
    from_text = load_corpus(DataConfig(source=str(corpus_dir)), seq_len=16)
    for split in ("train", "eval"):
        np.testing.assert_array_equal(
            getattr(from_ids, split).stream, getattr(from_text, split).stream
        )
    capped = DataConfig(source=str(tmp_path / "tok"), max_bytes=4 * 30)  # 4 bytes per id
    assert sum(len(d) for d in load_documents(capped)) == 30


def test_formats_mix_in_one_directory(tmp_path):
    _write(tmp_path / "a.txt", "plain text")
    _write(tmp_path / "b.jsonl", json.dumps({"text": "json text"}))
    _parquet(tmp_path / "c.parquet", text=["parquet text"])
    _token_records(tmp_path / "d.arrayrecord", [[10, 11, 12]])
    docs = load_documents(DataConfig(source=str(tmp_path)))
    assert docs[:3] == ["plain text", "json text", "parquet text"]
    np.testing.assert_array_equal(docs[3], [10, 11, 12])
    assert docs[3].dtype == np.int32


@pytest.mark.parametrize(
    "name, make, kwargs, match",
    [
        ("nf.parquet", lambda p: _parquet(p, body=["x"]), {},
         r"nf\.parquet has no column 'text' \(data\.text_field\); its columns: body"),
        ("num.parquet", lambda p: _parquet(p, text=[1, 2]), {},
         r"num\.parquet column 'text' \(data\.text_field\) holds int64, not strings"),
        ("empty.parquet", lambda p: _parquet(p, text=_empty_strings()), {},
         r"data\.source: the 1 file\(s\) of .*empty\.parquet' hold no text"),
        ("broken.parquet", lambda p: _write(p, "not parquet"), {},
         r"broken\.parquet is not a readable Parquet file"),
        ("big.arrayrecord", lambda p: _token_records(p, [[5, 6], [7, 259, 8]]), {},
         r"big\.arrayrecord record 1: token id 259 is outside data\.tokenizer=bytes's"
         r" vocabulary \[0, 259\)"),
        ("neg.arrayrecord", lambda p: _token_records(p, [[-1]]), {}, r"neg\.arrayrecord record 0"),
        ("odd.arrayrecord", lambda p: _token_records(p, [b"\x05\x00\x00"]), {},
         r"odd\.arrayrecord record 0: 3 bytes is not a whole number of int32 token ids"),
        ("junk.arrayrecord", lambda p: _write(p, "junk"), {},
         r"junk\.arrayrecord is not a readable ArrayRecord file"),
        ("t.txt", lambda p: _write(p, "text"), {"format": "arrayrecord"},
         r"t\.txt is not a readable ArrayRecord file"),
    ],
)  # fmt: skip
def test_bad_format_inputs_raise_one_line(tmp_path, name, make, kwargs, match):
    make(tmp_path / name)
    with pytest.raises(DistillError, match=match) as err:
        load_corpus(DataConfig(source=str(tmp_path / name), **kwargs), seq_len=16)
    assert "\n" not in str(err.value)
