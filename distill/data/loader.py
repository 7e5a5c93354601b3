"""The Grain loader: read documents, tokenize, pack into rows, serve shuffled batches.

Documents come from plain text files, JSONL records and Parquet rows (``data.text_field``),
or arrive already tokenised in ArrayRecord files (one document's ids per record, see
``_token_docs``). Everything is in memory and deterministic: the same config and seed give
the same batches on every host, and the train iterator's state is a small JSON dict
(checkpointed with the student) from which it resumes at exactly the next batch. A corpus
prepared once by `distill prepare` (``data.prepared_dir``, see ``distill.data.prepared``) serves
the very same rows from disk instead, through the same shuffle and the same iterator state.

Documents are packed into rows (``distill.data.corpus.PackedRows``, concat-then-split) and served
as batches by ``distill.data.corpus.Corpus``; ``load_corpus`` here is the one way a command gets
a corpus, from memory or from ``data.prepared_dir``.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import re
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from distill.config import DataConfig
from distill.data import stdlib_chat
from distill.data.corpus import Corpus, PackedRows
from distill.data.examples import load_examples
from distill.data.packing import ExampleRows, packing_stats
from distill.data.prepared import load_prepared
from distill.data.tokenizers import Tokenizer, build_tokenizer
from distill.errors import DistillError

log = logging.getLogger("distill")

_GLOB_CHARS = "*?["
_SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
# name.array_record, name.arrayrecord, and sharded name.array_record-00000-of-00008
_ARRAYRECORD_NAME = re.compile(r"\.array_?record(-\d+-of-\d+)?\Z", re.IGNORECASE)
_PARQUET_BATCH_ROWS = 1024
_RECORDS_PER_READ = 4096
_ENCODE_CHUNK = 1024  # documents per tokenizer call: bounds the progress bar's granularity


# ----------------------------------------------------------------------------- tokenizers


# The byte tokenizer, tokenizer.json and SentencePiece: distill.data.tokenizers.


# ----------------------------------------------------------------------------- documents


def _glob_regex(pattern: str) -> re.Pattern:
    """Compile a path glob: ``*`` and ``?`` stay within one directory, ``**`` spans any."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append("(?:/.*)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2 :]:
            j = pattern.index("]", i + 2)
            body = pattern[i + 1 : j]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = j + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _walk(root: Path, cfg: DataConfig) -> list[Path]:
    """Files under ``root`` whose relative path matches an include and no exclude glob.

    An exclude that matches a directory (``site-packages/**``, ``**/tests``) prunes it.
    """
    include = [_glob_regex(p) for p in cfg.include]
    exclude = [_glob_regex(p) for p in cfg.exclude]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if not any(r.match(prefix + d) for r in exclude)]
        for name in filenames:
            rel = prefix + name
            if any(r.match(rel) for r in include) and not any(r.match(rel) for r in exclude):
                found.append(root / rel)
    return sorted(found, key=lambda p: p.as_posix())


def resolve_paths(cfg: DataConfig) -> list[Path]:
    """The files of ``data.source`` (file, directory or glob), in sorted, stable order."""
    if cfg.source == stdlib_chat.PLACEHOLDER:  # written once to a cache file, then read
        return [stdlib_chat.corpus_path()]
    source = os.path.expanduser(cfg.source.replace("{stdlib}", sysconfig.get_paths()["stdlib"]))
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = _walk(path, cfg)
        if not files:
            raise DistillError(
                f"data.source: no files in '{path}' match data.include {cfg.include}"
                f" and data.exclude {cfg.exclude}"
            )
        return files
    if any(c in source for c in _GLOB_CHARS):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not files:
            raise DistillError(f"data.source: no files match '{source}'")
        return files
    raise DistillError(f"data.source: no such file or directory: '{source}'")


def _format(path: Path, cfg: DataConfig) -> str:
    if cfg.format != "auto" and not cfg.is_examples:  # examples: records of either kind
        return cfg.format
    if _ARRAYRECORD_NAME.search(path.name):
        return "arrayrecord"
    return _SUFFIX_FORMATS.get(path.suffix.lower(), "text")


def _file_docs(path: Path, cfg: DataConfig, get_vocab):
    """Yield the documents of one file: texts (str), or token ids ([n] int32) of ArrayRecord
    (checked against the vocabulary size ``get_vocab()``)."""
    fmt = _format(path, cfg)
    if fmt == "parquet":
        yield from _parquet_texts(path, cfg.text_field)
        return
    if fmt == "arrayrecord":
        yield from _token_docs(path, cfg, get_vocab())
        return
    data = path.read_bytes()
    if b"\x00" in data:  # binary (images, archives, bytecode): not text, skip it
        return
    if fmt == "text":
        yield data.decode("utf-8", errors="replace")
        return
    yield from _jsonl_texts(path, data, cfg.text_field, "data.text_field")


def _jsonl_texts(path: Path, data: bytes, field: str, key: str):
    """The string ``field`` (config key ``key``) of every JSONL record of ``data``."""
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise DistillError(f"data.source: {path} line {lineno}: not valid JSON") from None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DistillError(
                f"data.source: {path} line {lineno}: no string field '{field}' ({key})"
            )
        yield text


def record_texts(path: Path, cfg: DataConfig, field: str, key: str):
    """The string ``field`` (config key ``key``) of a JSONL or Parquet file's records;
    any other format is one DistillError naming ``key``."""
    fmt = _format(path, cfg)
    if fmt == "parquet":
        yield from _parquet_texts(path, field, key)
    elif fmt == "jsonl":
        yield from _jsonl_texts(path, path.read_bytes(), field, key)
    else:
        raise DistillError(f"{key}: needs JSONL or Parquet records; {path} is {fmt}")


def _parquet_texts(path: Path, field: str, key: str = "data.text_field"):
    """The ``field`` column (config key ``key``) of a Parquet file, one record batch at a time
    (no other column is read). Null texts are skipped, like empty ones."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DistillError(
            f"data.source: {path} is Parquet and needs pyarrow (pip install pyarrow)"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DistillError(
            f"data.source: {path} is not a readable Parquet file ({first})"
        ) from None
    schema = pf.schema_arrow
    if schema.get_field_index(field) < 0:
        raise DistillError(
            f"data.source: {path} has no column '{field}' ({key}); its columns:"
            f" {', '.join(schema.names)}"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DistillError(
            f"data.source: {path} column '{field}' ({key}) holds {kind}, not strings"
        )
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field]):
        yield from (t for t in batch.column(0).to_pylist() if t)


def _token_docs(path: Path, cfg: DataConfig, vocab_size: int):
    """Pre-tokenised documents of an ArrayRecord file: each record is one document's token
    ids as little-endian int32 (4 bytes per id, no header, no BOS/EOS: packing adds them),
    made with ``data.tokenizer``; an id outside its vocabulary is an error naming the record.
    """
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(path))
    if not reader.ok():  # (closing a reader that is not ok raises)
        raise DistillError(f"data.source: {path} is not a readable ArrayRecord file")
    try:
        n = reader.num_records()
        for lo in range(0, n, _RECORDS_PER_READ):
            records = reader.read(lo, min(lo + _RECORDS_PER_READ, n))
            bad = next((i for i, r in enumerate(records) if len(r) % 4), None)
            if bad is not None:
                raise DistillError(
                    f"data.source: {path} record {lo + bad}: {len(records[bad])} bytes is not"
                    " a whole number of int32 token ids"
                )
            docs = [np.frombuffer(r, dtype="<i4").astype(np.int32) for r in records]
            flat = np.concatenate(docs) if docs else np.zeros(0, np.int32)
            out = np.flatnonzero((flat < 0) | (flat >= vocab_size))
            if out.size:
                ends = np.cumsum([len(d) for d in docs])
                rec = lo + int(np.searchsorted(ends, out[0], side="right"))
                raise DistillError(
                    f"data.source: {path} record {rec}: token id {flat[out[0]]} is outside"
                    f" data.tokenizer={cfg.tokenizer}'s vocabulary [0, {vocab_size}); the ids"
                    " must come from the same tokenizer"
                )
            yield from docs
    finally:
        reader.close()


def load_documents(cfg: DataConfig, vocab_size: int | None = None, progress=None) -> list:
    """Non-empty documents of ``data.source`` in sorted path order, at most ``data.max_bytes``:
    texts (str), and token ids ([n] int32) from ArrayRecord files, checked against
    ``vocab_size`` (default: data.tokenizer's).

    ``max_bytes`` counts UTF-8 bytes of texts and 4 bytes per pre-tokenised id; the last
    document is cut to fit and reading stops. ``progress(total=, desc=, unit=)`` may return
    a tqdm-like bar advanced per file.
    """
    paths = resolve_paths(cfg)
    # the tokenizer is loaded only if an ArrayRecord file needs its vocabulary size
    get_vocab = functools.cache(lambda: vocab_size or build_tokenizer(cfg).vocab_size)

    bar = (progress or _NoProgress)(total=len(paths), desc="read", unit="file")
    docs: list = []
    budget = cfg.max_bytes
    try:
        for path in paths:
            for doc in _file_docs(path, cfg, get_vocab):
                if not len(doc):
                    continue
                if budget is not None:
                    nbytes = len(doc.encode("utf-8")) if isinstance(doc, str) else 4 * len(doc)
                    if nbytes >= budget:
                        docs.append(_cut(doc, budget))
                        return [d for d in docs if len(d)]
                    budget -= nbytes
                docs.append(doc)
            bar.update(1)
    finally:
        bar.close()
    if not docs:
        raise DistillError(
            f"data.source: the {len(paths)} file(s) of '{cfg.source}' hold no text"
            " (all empty or binary)"
        )
    return docs


def _cut(doc, nbytes: int):
    """The first ``nbytes`` of a document: UTF-8 bytes of a text, 4 per token id."""
    if isinstance(doc, str):
        return doc.encode("utf-8")[:nbytes].decode("utf-8", errors="ignore")
    return doc[: nbytes // 4]


class _NoProgress:
    def __init__(self, **_):
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- split


def split_documents(
    docs: list[np.ndarray], eval_fraction: float, min_eval_tokens: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Hold out whole documents for eval: (train, eval), each in corpus order.

    Documents are ranked by a CRC32 of their tokens, so a document's side does not depend
    on its neighbours; the lowest ``eval_fraction`` go to eval, extended until eval holds
    ``min_eval_tokens`` (one row) when the corpus allows, always leaving one for train.
    A single document is split instead: its tail is the eval text.
    """
    if len(docs) == 1:
        (doc,) = docs
        k = max(int(np.ceil(eval_fraction * len(doc))), min_eval_tokens - 2)
        k = min(max(k, 1), max(len(doc) - 1, 0))
        return [doc[: len(doc) - k]], [doc[len(doc) - k :]]
    is_eval = held_out(docs, eval_fraction, min_eval_tokens, extra=2)
    return [docs[i] for i in np.flatnonzero(~is_eval)], [docs[i] for i in np.flatnonzero(is_eval)]


def held_out(
    docs: list[np.ndarray], eval_fraction: float, min_tokens: int, extra: int
) -> np.ndarray:
    """[n] bool: the documents held out for eval, ranked by a CRC32 of their tokens (see
    ``split_documents``); each counts ``len + extra`` tokens towards ``min_tokens``."""
    n = len(docs)
    keys = np.array([zlib.crc32(d.tobytes()) for d in docs], dtype=np.int64)
    order = np.lexsort((np.arange(n), keys))
    cum = np.cumsum(np.array([len(docs[i]) + extra for i in order]))
    n_eval = max(1, round(eval_fraction * n), int(np.searchsorted(cum, min_tokens)) + 1)
    is_eval = np.zeros(n, dtype=bool)
    is_eval[order[: min(n_eval, n - 1)]] = True
    return is_eval


def held_out_records(ids: list[np.ndarray], records: np.ndarray, cfg: DataConfig) -> np.ndarray:
    """[n] bool: the examples (token ids ``ids``, from ``records`` [n]) held out for eval,
    whole records at a time (a conversation may make one example per answer), ranked as
    ``held_out`` ranks the records' tokens; refused when fewer than 2 records are usable."""
    n = int(records.max()) + 1 if len(records) else 0
    if n < 2:
        raise DistillError(
            f"data.source: '{cfg.source}' holds {n} usable {cfg.format} record(s);"
            " need at least 2 (one for train, one for eval)"
        )
    bounds = np.flatnonzero(np.diff(records)) + 1
    ends = [*bounds, len(ids)]
    whole = [np.concatenate(ids[a:b]) for a, b in zip([0, *bounds], ends, strict=True)]
    return held_out(whole, cfg.eval_fraction, 1, extra=0)[records]


# ----------------------------------------------------------------------------- corpus


def load_corpus(cfg: DataConfig, seq_len: int) -> Corpus:
    """The corpus of ``cfg`` in rows of ``seq_len`` tokens: from ``data.prepared_dir`` when
    set (checked against ``cfg``, nothing tokenised), else read and tokenised here."""
    if cfg.prepared_dir is not None:
        return load_prepared(cfg, seq_len)
    return tokenize_corpus(cfg, seq_len)


def tokenize_corpus(cfg: DataConfig, seq_len: int, progress=None) -> Corpus:
    """Read, tokenize, split and pack ``data.source`` into rows of ``seq_len`` tokens.
    ``progress`` as for ``load_documents``: bars per file read and per document tokenised."""
    tokenizer = build_tokenizer(cfg)
    if cfg.is_examples:
        return example_corpus(cfg, seq_len, tokenizer)
    docs = _encode(load_documents(cfg, tokenizer.vocab_size, progress), tokenizer, progress)
    train, held = pack_splits(docs, cfg, seq_len, tokenizer, f"data.source: '{cfg.source}'")
    corpus = Corpus(tokenizer=tokenizer, train=train, eval=held)
    log_packing(corpus, cfg)
    return corpus


def pack_splits(
    docs: list[np.ndarray], cfg: DataConfig, seq_len: int, tokenizer: Tokenizer, what: str
) -> tuple[PackedRows, PackedRows]:
    """(train, eval) rows of ``docs``, held out as ``split_documents`` holds out; a split
    without one row is one DistillError opening with ``what`` (the documents it names)."""
    need = seq_len + 1
    packed = []
    for split, part in zip(
        ("train", "eval"), split_documents(docs, cfg.eval_fraction, need), strict=True
    ):
        rows = PackedRows(part, seq_len, tokenizer.bos_id, tokenizer.eos_id)
        if len(rows) < 1:
            raise DistillError(
                f"{what} gives {rows.num_tokens} {split} tokens ({len(part)} documents of"
                f" {len(docs)}), need at least {need} for one {split} row of"
                f" train.seq_len={seq_len}; add data or lower train.seq_len"
            )
        packed.append(rows)
    return packed[0], packed[1]


def example_corpus(cfg: DataConfig, seq_len: int, tokenizer: Tokenizer) -> Corpus:
    """Conversations or prompt/completion pairs, whole ones held out for eval, each split
    packed best-fit (``distill.data.packing``)."""
    examples, records = load_examples(cfg, resolve_paths(cfg), tokenizer)
    is_eval = held_out_records([ids for ids, _ in examples], records, cfg)
    split_long = cfg.long_conversations == "split"
    packed = {
        split: ExampleRows.pack(
            [e for e, ev in zip(examples, is_eval, strict=True) if ev == want], seq_len, split_long
        )
        for split, want in (("train", False), ("eval", True))
    }
    for split, rows in packed.items():
        if len(rows) < 1:
            raise DistillError(
                f"data.source: no {split} row of train.seq_len={seq_len} tokens holds an answer"
                f" to learn ({rows.num_documents} {split} records, {rows.num_long} longer than a"
                " row); raise train.seq_len or set data.long_conversations: split"
            )
    corpus = Corpus(tokenizer=tokenizer, train=packed["train"], eval=packed["eval"])
    log_packing(corpus, cfg)
    return corpus


def log_packing(corpus: Corpus, cfg: DataConfig) -> None:
    """The packing efficiency of the train rows, and a counted warning for long examples."""
    stats = packing_stats(corpus.train)
    log.info(
        "data: %d %sdocuments packed into %d train rows: %.1f%% of row tokens real, %.1f%% of"
        " those trained on",
        stats["documents"],
        "" if cfg.format == "auto" else f"{cfg.format} ",  # auto: each file's own
        stats["rows"],
        100 * stats["real_fraction"],
        100 * stats["trained_fraction"],
    )
    long = stats["longer_than_row"] + getattr(corpus.eval, "num_long", 0)
    if long:
        how = (
            "split over rows"
            if cfg.long_conversations == "split"
            else "cut to one row (left out where the cut kept no answer)"
        )
        log.warning(
            "data: %d record(s) longer than a row (train.seq_len + 1 tokens) were %s "
            "(data.long_conversations)",
            long,
            how,
        )


def _encode(docs: list, tokenizer: Tokenizer, progress=None) -> list[np.ndarray]:
    """Token ids [n] int32 of every document; texts are tokenised in chunks, in order."""
    out = list(docs)
    texts = [i for i, d in enumerate(docs) if isinstance(d, str)]
    bar = (progress or _NoProgress)(total=len(texts), desc="tokenize", unit="doc")
    try:
        for lo in range(0, len(texts), _ENCODE_CHUNK):
            chunk = texts[lo : lo + _ENCODE_CHUNK]
            for i, ids in zip(chunk, tokenizer.encode_batch([docs[i] for i in chunk]), strict=True):
                out[i] = ids
            bar.update(len(chunk))
    finally:
        bar.close()
    return out
