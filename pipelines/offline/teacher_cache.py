"""Offline distillation: run the teacher once, store its top-k outputs, train from them.

This module is the cache's format and its reading; `pipelines.offline.cache_writer` writes it.

`distill cache-teacher CONFIG` runs the teacher over the training batches in exactly the
order `corpus.train_iterator(train.batch_size, seed=run.seed)` yields them and writes one
ArrayRecord record per batch (the Batch fields and the top-k TeacherOutput) to shards of
`batches_per_shard` records under `teacher.cache_dir`, plus `manifest.json`. A shard is
written under a temporary name and renamed when closed, and the manifest is replaced
after each shard, so a rerun continues after the last complete shard.

`teacher.source: cache` reads the records back in order through a Grain MapDataset whose
iterator state is the same `{"next_index": n}` as online mode's, so checkpoints resume
alike; `pipelines.local` places them on the training mesh and runs the same train step.
No teacher is loaded on any device.

On disk, per token: tokens/targets as uint16 when the vocabulary fits (else int32),
segment_ids/positions as uint16 when seq_len fits, mask as uint8, top-k ids as uint16 when
the vocabulary fits, top-k log-probs as float32. float32 and not float16: float16 saves
2*k bytes per token (k=32: 128 instead of 192 teacher bytes per token, against 512 KiB of
dense float32 logits for a 128k vocabulary) but, measured on the tiny test config with
top_k=8, it moves the step-1 KD term by 3.5e-4 relative (the total loss by under 1e-5): not
the exact parity with online training that makes a cache trustworthy.

Measured (tiny config, vocab 260, batch 8 x 128, 16 batches): top_k=8: 64 bytes per token
on disk (48 of them teacher outputs) vs 1040 dense, 16x smaller; top_k=32: 208 (192) vs
1040, 5x. ArrayRecord pads each record's chunk a little (<= 7 bytes/token here, well under
1% for real batches of megabytes).

The held-out split's dense teacher logits (what evaluation compares against) are stored
too, in `eval.arrayrecord`, when they fit in the evaluator's own in-memory cache limit;
otherwise periodic evaluation is skipped in cache mode.

The teacher hash is a sha256 over every file of the teacher checkpoint directory (sorted
relative paths, sizes and all bytes): exact, at the cost of reading the checkpoint once
per `cache-teacher` and once per run preflight (when the checkpoint is present there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import numpy as np

from distill.config import Config
from distill.data.tokenizers import vocab_limit
from distill.errors import DistillError
from distill.identity import data_hash, same
from distill.observability.metrics_log import dumps
from distill.types import Batch, TeacherOutput, TeacherView

log = logging.getLogger("distill")

FORMAT = 1
BATCHES_PER_SHARD = 64
LOGPROBS_DTYPE = np.dtype(np.float32)  # see the module docstring for float16
WRITER_OPTIONS = "group_size:1,uncompressed"  # one batch per chunk: random access is cheap
_MANIFEST = "manifest.json"
EVAL_FILE = "eval.arrayrecord"
# which held-out rows `eval.arrayrecord` holds (`distill.data.corpus.eval_row_ids`); a cache
# without it holds the split's first rows, which evaluation no longer reads
EVAL_ROWS = "spread"
# manifest key -> the config key (or option) it must agree with
_CHECKED = {
    "teacher_hash": "teacher.checkpoint",
    "top_k": "teacher.top_k",
    "temperature": "distill.temperature",
    "teacher_dtype": "teacher.dtype",
    "vocab_size": "teacher.model.vocab_size",
    "seq_len": "train.seq_len",
    "batch_size": "train.batch_size",
    "seed": "run.seed",
    "data_hash": "data",
    "eval_batches": "data.eval_batches",
    "batches_per_shard": "--batches-per-shard",
}


def cache_dir(cfg: Config) -> Path:
    """The cache directory, which must be local: ArrayRecord files are written and read
    through local file descriptors (a `gs://` path would fail, or land in a directory named
    `gs:`), and shards are committed by rename."""
    path = cfg.teacher.cache_dir or f"{cfg.run.output_dir.rstrip('/')}/teacher_cache"
    if "://" in path:
        unset = "" if cfg.teacher.cache_dir else " (the default under run.output_dir)"
        raise DistillError(
            f"teacher.cache_dir: {path}{unset} is not local; the teacher cache is ArrayRecord "
            "files on local disk: set teacher.cache_dir to a local directory"
        )
    return Path(path)


# ----------------------------------------------------------------------------- records


def encode(arrays: dict[str, np.ndarray]) -> bytes:
    """One record: a 4-byte header length, a JSON header {name: [dtype, shape]}, raw bytes."""
    header = dumps({k: [v.dtype.str, list(v.shape)] for k, v in arrays.items()}).encode()
    body = b"".join(np.ascontiguousarray(v).tobytes() for v in arrays.values())
    return struct.pack("<I", len(header)) + header + body


def decode(record: bytes) -> dict[str, np.ndarray]:
    (n,) = struct.unpack_from("<I", record)
    header = json.loads(record[4 : 4 + n])
    out, offset = {}, 4 + n
    for name, (dtype, shape) in header.items():
        dt = np.dtype(dtype)
        count = int(np.prod(shape))
        out[name] = np.frombuffer(record, dt, count, offset).reshape(shape)
        offset += count * dt.itemsize
    return out


def small_int(limit: int) -> np.dtype:
    return np.dtype(np.uint16) if limit <= 2**16 else np.dtype(np.int32)


def _rows(batch: Batch, prefix: str, vocab_t: np.dtype, pos_t: np.dtype) -> dict:
    return {
        prefix + "tokens": np.asarray(batch.tokens).astype(vocab_t),
        prefix + "targets": np.asarray(batch.targets).astype(vocab_t),
        prefix + "segment_ids": np.asarray(batch.segment_ids).astype(pos_t),
        prefix + "positions": np.asarray(batch.positions).astype(pos_t),
        prefix + "mask": np.asarray(batch.mask).astype(np.uint8),
    }


def batch_record(batch: Batch, out: TeacherOutput, vocab_size: int, seq_len: int) -> bytes:
    """One batch's record. A cross-tokenizer batch also stores the teacher's rows
    ("teacher_" fields, [B, T]) and the alignment ("align", [B, S]); the top-k are at the
    teacher's rows. `vocab_size`, `seq_len`: the largest vocabulary and row of both sides."""
    vocab_t, pos_t = small_int(vocab_size), small_int(seq_len + 1)
    arrays = _rows(batch, "", vocab_t, pos_t)
    if batch.teacher is not None:
        arrays.update(_rows(batch.teacher.rows, "teacher_", vocab_t, pos_t))
        arrays["align"] = np.asarray(batch.teacher.align).astype(np.int32)
    arrays["logprobs"] = np.asarray(out.logprobs).astype(LOGPROBS_DTYPE)
    arrays["ids"] = np.asarray(out.ids).astype(vocab_t)
    return encode(arrays)


def read_batch(record: bytes) -> tuple[Batch, TeacherOutput]:
    """A record back as host arrays with the dtypes of online mode (int32, float32)."""
    a = decode(record)
    i32 = lambda k: a[k].astype(np.int32)  # noqa: E731

    def rows(prefix: str) -> Batch:
        return Batch(
            i32(prefix + "tokens"), i32(prefix + "targets"), i32(prefix + "segment_ids"),
            i32(prefix + "positions"), a[prefix + "mask"].astype(np.float32),
        )  # fmt: skip

    batch = rows("")
    if "align" in a:
        batch = batch._replace(teacher=TeacherView(rows("teacher_"), i32("align")))
    return batch, TeacherOutput(a["logprobs"].astype(np.float32), i32("ids"))


# ----------------------------------------------------------------------------- manifest


def teacher_hash(path: str) -> str:
    """sha256 over the sorted relative paths, sizes and bytes of every checkpoint file."""
    if "://" in path:
        return f"remote:{path}"  # not read here; the path stands for the weights
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(root).as_posix()}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def served_teacher(cfg: Config) -> str:
    """The teacher hash of a cache written from a server (`teacher.source: endpoint`): the
    server and the model it names, not weights read here."""
    ep = cfg.teacher.endpoint
    return f"endpoint:{ep.url} {ep.api} {ep.model or ''}".strip()


def expected_manifest(cfg: Config, corpus, thash: str | None, batches_per_shard: int) -> dict:
    return {
        "format": FORMAT,
        "teacher_hash": thash,
        "top_k": cfg.teacher.top_k,
        "temperature": cfg.distill.temperature,
        "teacher_dtype": cfg.teacher.dtype,
        "vocab_size": cfg.teacher.model.vocab_size,
        "vocab_limit": vocab_limit(corpus.teacher_tokenizer, cfg.teacher.model.vocab_size),
        "seq_len": cfg.train.seq_len,
        "batch_size": cfg.train.batch_size,
        "seed": cfg.run.seed,
        "data_hash": data_hash(corpus),
        "eval_batches": cfg.data.eval_batches,
        "eval_rows": EVAL_ROWS,
        "batches_per_shard": batches_per_shard,
        "teacher_tokenizer": teacher_tokenizer_id(cfg, corpus),
        "teacher_len": getattr(corpus.train, "teacher_len", None) if corpus.teacher else None,
    }


def teacher_tokenizer_id(cfg: Config, corpus) -> dict | None:
    """The identity of a teacher tokenizer of its own (`distill.identity.tokenizer_id`'s
    fields), None for one vocabulary: the teacher's outputs are in its ids, at its rows."""
    from distill.data.prepared import tokenizer_identity

    if corpus.teacher is None:
        return None
    return {"path": cfg.teacher.tokenizer, **tokenizer_identity(corpus.teacher)}


def read_manifest(root: Path) -> dict | None:
    path = root / _MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise DistillError(f"teacher cache: {path} is not valid JSON") from None


def check_manifest(manifest: dict, expected: dict, root: Path) -> None:
    """One-line DistillError naming the first field where the cache and the config differ."""
    if manifest.get("format") != FORMAT:
        raise DistillError(
            f"teacher cache: {root / _MANIFEST} has format {manifest.get('format')}, "
            f"this version reads {FORMAT}; rerun distill cache-teacher into a new teacher.cache_dir"
        )
    for key, field in _CHECKED.items():
        want = expected.get(key)
        if want is None:  # e.g. the teacher checkpoint is absent when training from the cache
            continue
        if manifest.get(key) != want:
            raise DistillError(
                f"{field}: {key} {want} differs from {manifest.get(key)} in the teacher cache "
                f"manifest {root / _MANIFEST}; use another teacher.cache_dir or the same settings"
            )
    _check_teacher_rows(manifest, expected, root)


def _check_teacher_rows(manifest: dict, expected: dict, root: Path) -> None:
    """The teacher's tokenizer and row length T: a one-vocabulary cache (neither recorded)
    is read by one-vocabulary runs only, a cross-tokenizer one by runs of its tokenizer."""

    def describe(ident: dict | None) -> str:
        if ident is None:
            return "none (one vocabulary: the teacher in data.tokenizer's ids)"
        return f"{ident['path']} ({str(ident.get('sha256') or ident.get('kind'))[:12]})"

    was, now = manifest.get("teacher_tokenizer"), expected.get("teacher_tokenizer")
    if (was is None) != (now is None) or (now is not None and not same(was, now)):
        raise DistillError(
            f"teacher.tokenizer: {describe(now)} differs from {describe(was)} in the teacher "
            f"cache manifest {root / _MANIFEST}; use another teacher.cache_dir or the same settings"
        )
    if manifest.get("teacher_len") != expected.get("teacher_len"):
        raise DistillError(
            f"teacher.tokenizer: teacher rows of {expected.get('teacher_len')} tokens differ "
            f"from {manifest.get('teacher_len')} in the teacher cache manifest "
            f"{root / _MANIFEST}; use another teacher.cache_dir or the same settings"
        )


def write_manifest(root: Path, manifest: dict) -> None:
    tmp = root / (_MANIFEST + ".tmp")
    tmp.write_text(dumps(manifest, indent=1))
    os.replace(tmp, root / _MANIFEST)


def shard_name(i: int) -> str:
    return f"train-{i:05d}.arrayrecord"


# ----------------------------------------------------------------------------- writing


# ----------------------------------------------------------------------------- reading


def check_cache(cfg: Config, corpus) -> dict:
    """Preflight for `teacher.source: cache`: the cache exists, matches, and is long enough."""
    from distill.outputs import teacher_path

    if cfg.pipeline.mode != "local":
        raise DistillError("teacher.source: cache is read by pipeline.mode local only")
    root = cache_dir(cfg)
    manifest = read_manifest(root)
    if manifest is None:
        raise DistillError(
            f"teacher.cache_dir: no teacher cache at {root} (no {_MANIFEST}); "
            "write it first with distill cache-teacher CONFIG"
        )
    path = teacher_path(cfg)
    thash = teacher_hash(path) if Path(path).is_dir() or "://" in path else None
    if str(manifest.get("teacher_hash", "")).startswith("endpoint:"):
        thash = None  # written from a server's answers: no weights here made it
    expected = expected_manifest(cfg, corpus, thash, manifest.get("batches_per_shard"))
    check_manifest(manifest, expected, root)
    missing = [s["file"] for s in manifest["shards"] if not (root / s["file"]).is_file()]
    if missing:
        raise DistillError(f"teacher.cache_dir: {root} lacks shard {missing[0]}")
    if manifest["steps_written"] < cfg.train.steps:
        raise DistillError(
            f"train.steps: {cfg.train.steps} batches needed, the teacher cache at {root} holds "
            f"{manifest['steps_written']}; rerun distill cache-teacher CONFIG to extend it"
        )
    return manifest


def train_iterator(cfg: Config):
    """Iterator of (Batch, TeacherOutput) host arrays in training order; its state is
    `{"next_index": n}`, as for `Corpus.train_iterator`."""
    import grain

    from distill.data.corpus import READ_OPTIONS

    root = cache_dir(cfg)
    manifest = read_manifest(root)
    paths = [str(root / s["file"]) for s in manifest["shards"]]
    source = grain.sources.ArrayRecordDataSource(paths)
    # Repeated: the loop's look-ahead (pipeline.prefetch) reads a batch or two past the
    # last step; those are never trained on.
    ds = grain.MapDataset.source(source).repeat(None).map(read_batch)
    return iter(ds.to_iter_dataset(READ_OPTIONS))


def eval_logits(cfg: Config) -> list[np.ndarray] | None:
    """The stored dense teacher logits of the eval batches, or None if not stored (or
    stored for other rows than evaluation reads: a cache written before `EVAL_ROWS`)."""
    path = cache_dir(cfg) / EVAL_FILE
    if not path.is_file():
        return None
    if (read_manifest(cache_dir(cfg)) or {}).get("eval_rows") != EVAL_ROWS:
        log.warning(
            "teacher cache %s: its evaluation logits are of other held-out rows than "
            "evaluation reads now (written by an older distill); periodic evaluation is "
            "skipped; rerun distill cache-teacher into a new teacher.cache_dir to store them",
            cache_dir(cfg),
        )
        return None
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(path))
    try:
        records = reader.read_all()
    finally:
        reader.close()
    return [decode(r)["logits"] for r in records]
