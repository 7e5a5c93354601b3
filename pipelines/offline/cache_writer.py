"""`distill cache-teacher`: iterate the online teacher source and write each output.

The teacher runs over the training batches in exactly the order the online loop reads them
(`pipelines.sources.OnlineSource`, from the first batch not yet stored) and each (batch,
top-k output) becomes one ArrayRecord record in the format of `pipelines.offline.teacher_cache`.
A rerun checks the manifest against the config and continues after the last complete
shard.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

from distill.config import Config
from distill.errors import DistillError
from pipelines.evaluation import eval_batches, eval_cache_fits
from pipelines.offline.teacher_cache import (
    BATCHES_PER_SHARD,
    EVAL_FILE,
    WRITER_OPTIONS,
    batch_record,
    cache_dir,
    check_manifest,
    encode,
    expected_manifest,
    read_manifest,
    served_teacher,
    shard_name,
    small_int,
    teacher_hash,
    write_manifest,
)

log = logging.getLogger("distill")


def cache_teacher(cfg: Config, batches_per_shard: int = BATCHES_PER_SHARD) -> dict:
    """`distill cache-teacher`: write (or continue) the cache; returns the JSON summary."""
    from distill.mesh import build_meshes
    from distill.outputs import teacher_path
    from pipelines.bootstrap import ensure_teacher
    from pipelines.preflight import preflight
    from pipelines.sources import OnlineSource
    from teacher.online import OnlineTeacher

    if cfg.teachers:
        raise DistillError(
            "teachers: distill cache-teacher stores one teacher's outputs; give it a config "
            "whose teacher: is that one (a run of several teachers reads none from a cache)"
        )
    if not cfg.teacher.top_k:
        raise DistillError(
            "teacher.top_k: is null; distill cache-teacher stores the top-k teacher outputs, "
            "set teacher.top_k (e.g. --set teacher.top_k=32)"
        )
    if batches_per_shard < 1:
        raise DistillError(f"--batches-per-shard: {batches_per_shard} must be >= 1")
    root = cache_dir(cfg)  # local, or one line now, before any device work
    t0 = time.perf_counter()
    corpus = preflight(cfg)
    meshes = build_meshes(cfg)
    served = cfg.teacher.source == "endpoint"  # a server's answers, no teacher loaded here
    if not served:
        ensure_teacher(cfg, corpus)
    root.mkdir(parents=True, exist_ok=True)
    thash = served_teacher(cfg) if served else teacher_hash(teacher_path(cfg))
    expected = expected_manifest(cfg, corpus, thash, batches_per_shard)
    manifest = _continue_manifest(root, expected, cfg.train.steps)
    done, steps = manifest["steps_written"], cfg.train.steps
    teacher = None
    if not served and (done < steps or not _has_eval(root)):
        teacher = OnlineTeacher(cfg, meshes.teacher, corpus.teacher_tokenizer)
    if served and not _has_eval(root):
        (root / (EVAL_FILE + ".skipped")).write_text("a server gives no dense logits\n")
    elif teacher is not None and not _has_eval(root):
        _write_eval(cfg, corpus, teacher, root)
    written_now = 0
    if done < steps:
        log.info("cache-teacher: batches %d..%d into %s", done, steps, root)
        source = _served_source(cfg, corpus) if served else OnlineSource(cfg, corpus, teacher)
        written_now = _write_batches(cfg, source, root, manifest)
    vocab, seq, bsz = cfg.teacher.model.vocab_size, cfg.train.seq_len, cfg.train.batch_size
    on_disk = sum((root / s["file"]).stat().st_size for s in manifest["shards"])
    tokens = manifest["steps_written"] * bsz * seq
    k = cfg.teacher.top_k
    ids_bytes = small_int(vocab).itemsize
    return {
        "cache_dir": str(root),
        "steps_written": manifest["steps_written"],
        "written_now": written_now,
        "shards": len(manifest["shards"]),
        "bytes_on_disk": on_disk,
        "bytes_per_token": on_disk / max(tokens, 1),
        "teacher_bytes_per_token": k * (4 + ids_bytes),
        "dense_float32_bytes_per_token": vocab * 4,
        "compression_vs_dense": vocab * 4 / max(on_disk / max(tokens, 1), 1e-9),
        "teacher_hash": expected["teacher_hash"],
        "wall_time_s": time.perf_counter() - t0,
    }


def _served_source(cfg: Config, corpus):
    """The batches with their top-k asked of the server (`teacher.endpoint`)."""
    from pipelines.sources import EndpointSource
    from teacher.endpoint import EndpointTeacher

    vocab = min(corpus.tokenizer.vocab_size, *cfg.vocab_sizes())
    return EndpointSource(cfg, corpus, EndpointTeacher(cfg, corpus.tokenizer, vocab))


def _continue_manifest(root: Path, expected: dict, steps: int) -> dict:
    """The manifest a (re)run starts from: the complete shards of a matching cache, a short
    last shard dropped to be rewritten whole, stray temporary files removed."""
    manifest = read_manifest(root)
    shards = []
    if manifest is not None:
        check_manifest(manifest, expected, root)
        shards = list(manifest["shards"])
        short = shards and shards[-1]["batches"] < expected["batches_per_shard"]
        if short and manifest["steps_written"] < steps:
            shards.pop()
    for stale in root.glob("*.tmp"):
        stale.unlink()
    for extra in manifest["shards"][len(shards) :] if manifest else []:
        (root / extra["file"]).unlink(missing_ok=True)
    if manifest is not None and manifest.get("eval_rows") != expected["eval_rows"]:
        (root / EVAL_FILE).unlink(missing_ok=True)  # of other held-out rows: written again
    manifest = {**expected, "shards": shards, "steps_written": sum(s["batches"] for s in shards)}
    write_manifest(root, manifest)
    return manifest


def _has_eval(root: Path) -> bool:
    return (root / EVAL_FILE).is_file() or (root / (EVAL_FILE + ".skipped")).is_file()


def _write_batches(cfg: Config, source, root: Path, manifest: dict) -> int:
    """Iterate the online teacher source from the first batch not yet stored and write each
    (batch, top-k output) as one record; `pipeline.prefetch` forwards stay in flight, so
    the teacher works while the host writes. Returns the number of batches written."""
    import jax

    done, steps = manifest["steps_written"], cfg.train.steps
    vocab = max(cfg.teacher.model.vocab_size, cfg.student_model().vocab_size)  # both sides' ids
    seq = max(cfg.train.seq_len, manifest.get("teacher_len") or 0)
    writer = _ShardWriter(root, manifest, manifest["batches_per_shard"])
    source.start({"next_index": done})
    submitted = done
    try:
        for i in range(done, steps):
            while source.in_flight() < cfg.pipeline.prefetch and submitted < steps:
                source.submit()
                submitted += 1
            item = source.pop()
            record = batch_record(item.batch, jax.device_get(item.teacher_out), vocab, seq)
            writer.write(record, last=i == steps - 1)
            source.loads.clear()  # a cache write logs no expert load: keep none
    finally:
        source.close()
    return steps - done


class _ShardWriter:
    """Records into shards of `per_shard` under temporary names; each full (or last) shard
    is renamed into place and added to the manifest, which is then rewritten."""

    def __init__(self, root: Path, manifest: dict, per_shard: int):
        self._root, self._manifest, self._per_shard = root, manifest, per_shard
        self._writer, self._count, self._index = None, 0, len(manifest["shards"])

    def write(self, record: bytes, last: bool) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        name = shard_name(self._index)
        if self._writer is None:
            self._writer = ArrayRecordWriter(str(self._root / (name + ".tmp")), WRITER_OPTIONS)
        self._writer.write(record)
        self._count += 1
        if self._count == self._per_shard or last:
            self._writer.close()
            os.replace(self._root / (name + ".tmp"), self._root / name)
            self._manifest["shards"].append({"file": name, "batches": self._count})
            self._manifest["steps_written"] += self._count
            write_manifest(self._root, self._manifest)
            self._writer, self._count, self._index = None, 0, self._index + 1


def _write_eval(cfg: Config, corpus, teacher, root: Path) -> None:
    """Dense teacher logits of the held-out batches, as evaluation computes them."""
    import jax
    from array_record.python.array_record_module import ArrayRecordWriter

    if not eval_cache_fits(cfg):
        (root / (EVAL_FILE + ".skipped")).write_text("eval logits exceed the cache limit\n")
        return
    tmp = root / (EVAL_FILE + ".tmp")
    writer = ArrayRecordWriter(str(tmp), WRITER_OPTIONS)
    for logits in teacher.eval_logits(eval_batches(cfg, corpus)):
        writer.write(encode({"logits": np.asarray(jax.device_get(logits), dtype=np.float32)}))
    writer.close()
    os.replace(tmp, root / EVAL_FILE)
