"""A corpus tokenised and packed once by `distill prepare`, read back row by row.

`distill prepare CONFIG` (``pipelines.commands.prepare``) runs the same reading, tokenising, split
and packing as ``distill.data.loader.tokenize_corpus`` and writes every packed row to ArrayRecord
shards in ``data.prepared_dir``: ``train-00000.arrayrecord``, ... and
``eval-00000.arrayrecord``, ..., then ``manifest.json`` last. A run with
``data.prepared_dir`` set reads rows from there by index (Grain's ArrayRecordDataSource),
through the same shuffle as rows in memory, so it sees exactly the same batches and its
iterator state is the same ``{"next_index": n}``; no token stream is held in memory.

One record is one packed row ``i``: the S+1 token ids ``stream[i*S : i*S + S + 1]`` (as
``token_dtype``: little-endian uint16 when the tokenizer's vocabulary fits, else int32),
then the S+1 doc-start flags of the same positions packed 8 to a byte
(``np.packbits(bitorder="little")``), so ``record_bytes = (S+1) * itemsize + ceil((S+1)/8)``.
Rows of conversations or prompt/completion pairs (``distill.data.packing.ExampleRows``)
store two more such planes, the loss flags and the real-token flags (``planes: 3`` in the
manifest), so the loss masks are written with the rows. The rest of a row (targets,
segment ids, positions, mask) is derived on reading, exactly as for rows in memory
(``distill.data.corpus.rows_batch``, ``distill.data.packing.flagged_batch``).

``manifest.json`` holds ``kind`` and ``format``, ``seq_len``, ``token_dtype``,
``record_bytes``, the tokenizer's identity (kind, sha256 of its file, vocab size, BOS and
EOS ids), the ``data`` config it was made from, ``data_hash`` (what a teacher cache built
from the raw corpus records, so such a cache matches the prepared corpus too), and per split
its rows, tokens, documents and shards, and ``packing`` (its efficiency, as the run logs it).
A run checks ``train.seq_len``, the tokenizer and
the data settings that shape the rows against it before any device work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from distill.config import DataConfig
from distill.data.corpus import Corpus, row_at, rows_batch
from distill.data.packing import flagged_batch
from distill.data.tokenizers import Tokenizer, build_tokenizer
from distill.errors import DistillError
from distill.observability.metrics_log import dumps
from distill.types import Batch

log = logging.getLogger("distill")

KIND = "distill prepared corpus"
FORMAT = 1
MANIFEST = "manifest.json"
WRITER_OPTIONS = "group_size:1,uncompressed"  # one row per chunk: random reads stay cheap
# data.* keys whose value changes the rows (prepared_dir and eval_batches do not)
DATA_KEYS = ("source", "include", "exclude", "format", "text_field", "max_bytes", "eval_fraction")
# and those of conversations and pairs (compared only for such data, so that corpora
# prepared before these keys existed still match)
EXAMPLE_KEYS = (
    "messages_field",
    "tools_field",
    "prompt_field",
    "completion_field",
    "chat_template",
    "chat_template_kwargs",
    "train_on",
    "long_conversations",
)


def root_of(cfg: DataConfig) -> Path:
    if "://" in cfg.prepared_dir:
        raise DistillError(
            f"data.prepared_dir: {cfg.prepared_dir}: only a local directory is supported"
        )
    return Path(cfg.prepared_dir).expanduser()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<i4")


def record_bytes(seq_len: int, dtype: np.dtype, planes: int = 1) -> int:
    return (seq_len + 1) * dtype.itemsize + planes * ((seq_len + 8) // 8)


def encode_rows(windows: tuple[np.ndarray, ...], dtype: np.dtype) -> np.ndarray:
    """Records [B, record_bytes] uint8 of rows given as ids [B, S+1] and flag planes
    [B, S+1] bool (the doc-start flags, then for example rows the loss and real flags)."""
    ids, *flags = windows
    body = np.ascontiguousarray(ids.astype(dtype)).view(np.uint8).reshape(len(ids), -1)
    bits = [np.packbits(f, axis=1, bitorder="little") for f in flags]
    return np.concatenate([body, *bits], axis=1)


def decode_rows(records: list[bytes], seq_len: int, dtype: np.dtype, where: Path, planes=1):
    """Token ids [B, S+1] int32 and the ``planes`` flag planes [B, S+1] bool of ``records``."""
    size = record_bytes(seq_len, dtype, planes)
    buf = np.frombuffer(b"".join(records), dtype=np.uint8)
    if buf.size != len(records) * size:
        raise DistillError(
            f"data.prepared_dir: {where} holds records of other than {size} bytes; "
            "run distill prepare again"
        )
    buf = buf.reshape(len(records), size)
    n_ids = (seq_len + 1) * dtype.itemsize
    ids = np.ascontiguousarray(buf[:, :n_ids]).view(dtype).astype(np.int32)
    width = (seq_len + 8) // 8
    flags = [
        np.unpackbits(
            buf[:, n_ids + p * width : n_ids + (p + 1) * width],
            axis=1,
            count=seq_len + 1,
            bitorder="little",
        ).astype(bool)
        for p in range(planes)
    ]
    return (ids, *flags)


def tokenizer_identity(tok: Tokenizer) -> dict:
    """What makes two tokenizers the same here: kind, file bytes, size and delimiters."""
    h = hashlib.sha256()
    for f in tok.files:
        h.update(Path(f).read_bytes())
    return {
        "kind": tok.kind,
        "sha256": h.hexdigest() if tok.files else None,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
    }


def data_settings(cfg: DataConfig) -> dict:
    keys = DATA_KEYS + (EXAMPLE_KEYS if cfg.is_examples else ())
    return {k: v for k, v in cfg.model_dump(mode="json").items() if k in keys}


def read_manifest(root: Path) -> dict | None:
    """The manifest of a prepared corpus in ``root``, None if there is none."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        raise DistillError(f"data.prepared_dir: {path} is not valid JSON") from None
    return manifest if isinstance(manifest, dict) and manifest.get("kind") == KIND else None


def write_manifest(root: Path, manifest: dict) -> None:
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(dumps(manifest, indent=1))
    os.replace(tmp, root / MANIFEST)


class StoredRows:
    """Packed rows read from ArrayRecord shards on demand, like ``PackedRows`` (same
    ``len``, ``gather`` and rows) but holding no tokens in memory."""

    def __init__(self, root: Path, split: dict, seq_len: int, dtype: np.dtype, planes: int = 1):
        import grain

        self._where = root
        self._source = grain.sources.ArrayRecordDataSource(
            [str(root / s["file"]) for s in split["shards"]]
        )
        self.seq_len, self.dtype, self.planes = seq_len, dtype, planes
        self.num_tokens, self.num_documents = split["tokens"], split["documents"]

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Batch:
        return row_at(self, index)

    def gather(self, rows: np.ndarray) -> Batch:
        """The Batch of rows ``rows`` [B]: every field [B, S]."""
        records = self._source.__getitems__([int(r) for r in np.asarray(rows).reshape(-1)])
        rows = decode_rows(records, self.seq_len, self.dtype, self._where, self.planes)
        return rows_batch(*rows) if self.planes == 1 else flagged_batch(*rows)


def load_prepared(cfg: DataConfig, seq_len: int) -> Corpus:
    """The prepared corpus of ``data.prepared_dir``; one-line DistillError where it does not
    match ``cfg`` and ``seq_len`` (nothing of ``data.source`` is read)."""
    root = root_of(cfg)
    manifest = read_manifest(root)
    path = root / MANIFEST
    if manifest is None:
        raise DistillError(
            f"data.prepared_dir: {root} holds no prepared corpus ({MANIFEST}); "
            "run distill prepare CONFIG first"
        )
    again = "run distill prepare again with this config, or use another data.prepared_dir"
    if manifest.get("format") != FORMAT:
        raise DistillError(
            f"data.prepared_dir: {path} has format {manifest.get('format')}, this version "
            f"reads {FORMAT}; {again}"
        )
    if manifest["seq_len"] != seq_len:
        raise DistillError(
            f"train.seq_len: {seq_len} differs from {manifest['seq_len']} in the prepared "
            f"corpus {path}; {again}"
        )
    tok = build_tokenizer(cfg)
    made_with = manifest["tokenizer"]
    if tokenizer_identity(tok) != made_with:
        digest = f", sha256 {made_with['sha256'][:12]}" if made_with["sha256"] else ""
        raise DistillError(
            f"data.tokenizer: {cfg.tokenizer} is not the tokenizer the prepared corpus {path} "
            f"was made with ({manifest['data'].get('tokenizer')}: {made_with['kind']}, vocab "
            f"{made_with['vocab_size']}{digest}); {again}"
        )
    for key, want in data_settings(cfg).items():
        if manifest["data"].get(key) != want:
            raise DistillError(
                f"data.{key}: {want!r} differs from {manifest['data'].get(key)!r} in the "
                f"prepared corpus {path}; {again}"
            )
    for split in ("train", "eval"):
        for shard in manifest[split]["shards"]:
            if not (root / shard["file"]).is_file():
                raise DistillError(
                    f"data.prepared_dir: {root} lacks shard {shard['file']}; {again}"
                )
    if cfg.format == "chat" and manifest.get("chat_template_sha256") != template_sha(cfg, tok):
        raise DistillError(
            f"data.chat_template: the chat template differs from the one the prepared corpus "
            f"{path} was rendered with; {again}"
        )
    dtype, planes = np.dtype(manifest["token_dtype"]), manifest.get("planes", 1)
    packing = manifest.get("packing")
    if packing:
        log.info(
            "data: prepared corpus %s: %d train rows, %.1f%% of row tokens real, %.1f%% of "
            "those trained on",
            root,
            packing["rows"],
            100 * packing["real_fraction"],
            100 * packing["trained_fraction"],
        )
    return Corpus(
        tokenizer=tok,
        train=StoredRows(root, manifest["train"], seq_len, dtype, planes),
        eval=StoredRows(root, manifest["eval"], seq_len, dtype, planes),
        fingerprint=manifest["data_hash"],
    )


def template_sha(cfg: DataConfig, tok: Tokenizer) -> str | None:
    """The sha256 of the chat template chat data is rendered with (None for other data)."""
    if cfg.format != "chat":
        return None
    from distill.data.chat import load_template

    return load_template(cfg, tok).sha256
