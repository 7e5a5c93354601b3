"""`distill prepare CONFIG`: tokenise and pack ``data.source`` once into ArrayRecord shards.

The rows are those ``distill.data.loader.tokenize_corpus`` makes for the same config (same
tokenizer, split and packing), written in order to ``data.prepared_dir`` in the record
format of ``distill.data.prepared``; runs with ``data.prepared_dir`` set then read them by index
instead of re-tokenising the corpus. Preparing holds the token stream in memory once (about
5 bytes per token, as a run from the raw corpus does); runs from the prepared corpus do not.

Shards are written under a temporary name and renamed when closed; the old manifest is
removed first and the new one written last, so an interrupted prepare leaves a directory
that runs refuse (no manifest), never a mix of old and new rows.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from distill.config import Config
from distill.data import prepared
from distill.data.corpus import PackedRows
from distill.data.loader import tokenize_corpus
from distill.data.packing import packing_stats
from distill.errors import DistillError
from distill.identity import data_hash

log = logging.getLogger("distill")

SHARD_BYTES = 256 * 2**20  # default shard size
_WRITE_ROWS = 4096  # rows encoded at once


def _bar(total: int, desc: str, unit: str):
    """A tqdm bar on a terminal (the same sizing as `pipelines.progress`), silent otherwise."""
    size = shutil.get_terminal_size((100, 24))
    return tqdm(
        total=total,
        desc=f"prepare: {desc}",
        unit=unit,
        disable=not sys.stderr.isatty(),
        ncols=size.columns,
        nrows=size.lines,
    )


def _check_target(root: Path) -> None:
    """Refuse to write into anything but a new, empty or prepared-corpus directory."""
    if root.exists() and not root.is_dir():
        raise DistillError(f"data.prepared_dir: {root} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()) and prepared.read_manifest(root) is None:
        raise DistillError(
            f"data.prepared_dir: {root} is not empty and holds no prepared corpus; "
            "choose a new or empty directory"
        )


def _clear(root: Path) -> None:
    """Remove an old prepared corpus: its manifest first, then its shards."""
    root.mkdir(parents=True, exist_ok=True)
    (root / prepared.MANIFEST).unlink(missing_ok=True)
    for old in [*root.glob("train-*.arrayrecord*"), *root.glob("eval-*.arrayrecord*")]:
        old.unlink()


def _write_split(root: Path, split: str, rows: PackedRows, per_shard: int, dtype, bar) -> list:
    from array_record.python.array_record_module import ArrayRecordWriter

    shards = []
    for index, lo in enumerate(range(0, len(rows), per_shard)):
        hi = min(lo + per_shard, len(rows))
        name = f"{split}-{index:05d}.arrayrecord"
        writer = ArrayRecordWriter(str(root / (name + ".tmp")), prepared.WRITER_OPTIONS)
        for start in range(lo, hi, _WRITE_ROWS):
            chunk = np.arange(start, min(start + _WRITE_ROWS, hi))
            for record in prepared.encode_rows(rows.windows(chunk), dtype):
                writer.write(record.tobytes())
            bar.update(len(chunk))
        writer.close()
        (root / (name + ".tmp")).rename(root / name)
        shards.append({"file": name, "rows": hi - lo})
    return shards


def prepare(cfg: Config, rows_per_shard: int | None = None) -> dict:
    """Write the prepared corpus of ``cfg`` to ``data.prepared_dir``; returns the summary."""
    if cfg.data.prepared_dir is None:
        raise DistillError(
            "data.prepared_dir: not set; it is where distill prepare writes the corpus "
            "(e.g. --set data.prepared_dir=data/prepared) and where runs then read it"
        )
    if rows_per_shard is not None and rows_per_shard < 1:
        raise DistillError(f"--rows-per-shard: {rows_per_shard} must be >= 1")
    t0 = time.perf_counter()
    root = prepared.root_of(cfg.data)
    _check_target(root)
    seq = cfg.train.seq_len
    corpus = tokenize_corpus(cfg.data, seq, progress=_bar)  # bad data fails before any write
    _clear(root)
    dtype = prepared.token_dtype(corpus.tokenizer.vocab_size)
    planes = getattr(corpus.train, "planes", 1)
    size = prepared.record_bytes(seq, dtype, planes)
    per_shard = rows_per_shard or max(1, SHARD_BYTES // size)
    n_rows = corpus.train_rows + corpus.eval_rows
    packing = packing_stats(corpus.train)
    log.info(
        "prepare: %d documents -> %d train and %d eval rows of %d tokens; writing %s",
        corpus.train.num_documents + corpus.eval.num_documents,
        corpus.train_rows,
        corpus.eval_rows,
        seq,
        root,
    )
    bar = _bar(n_rows, "write", "row")
    splits = {}
    try:
        for split, rows in (("train", corpus.train), ("eval", corpus.eval)):
            splits[split] = {
                "rows": len(rows),
                "tokens": rows.num_tokens,
                "documents": rows.num_documents,
                "shards": _write_split(root, split, rows, per_shard, dtype, bar),
            }
    finally:
        bar.close()
    manifest = {
        "kind": prepared.KIND,
        "format": prepared.FORMAT,
        "seq_len": seq,
        "token_dtype": dtype.str,
        "record_bytes": size,
        "planes": planes,
        "tokenizer": prepared.tokenizer_identity(corpus.tokenizer),
        "chat_template_sha256": prepared.template_sha(cfg.data, corpus.tokenizer),
        "data": cfg.data.model_dump(mode="json"),
        "data_hash": data_hash(corpus),
        "packing": packing,
        **splits,
    }
    prepared.write_manifest(root, manifest)
    files = [s["file"] for split in splits.values() for s in split["shards"]]
    on_disk = sum((root / f).stat().st_size for f in files)
    return {
        "prepared_dir": str(root),
        "train_rows": corpus.train_rows,
        "eval_rows": corpus.eval_rows,
        "tokens": corpus.train.num_tokens + corpus.eval.num_tokens,
        "shards": len(files),
        "bytes_on_disk": on_disk,
        "bytes_per_row": on_disk / max(n_rows, 1),
        "packing": packing,
        "wall_time_s": time.perf_counter() - t0,
    }
