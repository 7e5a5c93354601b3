"""What a student was distilled from: the teacher's identity and the tokenizer's.

`run_identity(cfg)` is stored beside every student checkpoint (the `meta` item of
`distill.checkpoint.Checkpointer`); resuming, `distill eval` and `distill export` compare it
with the run's own (`check_pinned`) and refuse another teacher or tokenizer in one line,
unless `run.allow_teacher_change` is set.

`checkpoint_identity` must be cheap for an 8B teacher (16 GB of safetensors), so it does not
read every byte: it is a sha256 over the sorted relative paths and sizes of every file, the
whole bytes of each file up to `SMALL_FILE` (configs, the safetensors index, Orbax's
metadata and manifests, the bootstrap's provenance record) and, of each larger file,
`SAMPLES` blocks of `BLOCK` bytes spread evenly from its first byte to its last (the first
block holds a safetensors header: every tensor's name, dtype, shape and offset). About
1 MiB is read per large file.

It detects: a file added, removed, renamed or resized; any change to a small file, hence any
re-save of an Orbax checkpoint (its `_CHECKPOINT_METADATA` holds the save time) and any
other bootstrap (its provenance record); different weights of the same shapes, such as a
fine-tune, which change essentially every block. It does not detect an edit inside a large
file that keeps its size and touches none of the sampled blocks (a few hand-patched
bytes). It does not depend on where the teacher lies: a copied or moved teacher is the same.
`pipelines.offline.teacher_cache.teacher_hash` reads every byte, for the teacher cache.
"""

from __future__ import annotations

import hashlib

import numpy as np

from distill.config import Config
from distill.errors import DistillError
from distill.outputs import checkpoint_dir, teacher_path

SMALL_FILE = 1 << 20  # files up to this size are hashed whole
BLOCK = 1 << 16
SAMPLES = 16


def checkpoint_identity(path: str | None) -> dict | None:
    """{"path", "sha256", "files", "bytes"} of the directory `path` (local or gs://), read
    as the module docstring says; None when it holds no files."""
    import fsspec

    if not path:
        return None
    fs, root = fsspec.core.url_to_fs(path)
    try:
        found = fs.find(root, detail=True) if fs.isdir(root) else {}
    except (FileNotFoundError, NotADirectoryError):
        found = {}
    files = sorted((p, int(info["size"])) for p, info in found.items() if info["type"] == "file")
    if not files:
        return None
    h = hashlib.sha256()
    base = root.rstrip("/") + "/"
    for p, size in files:
        h.update(f"{p.removeprefix(base)}\0{size}\0".encode())
        with fs.open(p, "rb") as f:
            if size <= SMALL_FILE:
                h.update(f.read())
                continue
            for i in range(SAMPLES):
                f.seek((size - BLOCK) * i // (SAMPLES - 1))
                h.update(f.read(BLOCK))
    return {
        "path": str(path),
        "sha256": h.hexdigest(),
        "files": len(files),
        "bytes": sum(s for _, s in files),
    }


def tokenizer_id(spec: str) -> dict:
    """The identity of `data.tokenizer`: `distill.data.prepared.tokenizer_identity` and the spec."""
    from distill.data.prepared import tokenizer_identity
    from distill.data.tokenizers import load_tokenizer

    return {"path": spec, **tokenizer_identity(load_tokenizer(spec))}


def run_identity(cfg: Config) -> dict:
    """{"teacher": checkpoint identity or None (no weights there), "tokenizer": ...}. A
    teacher behind a server (`teacher.source: endpoint`) is its API and served model's
    name, wherever it is served from."""
    teacher = checkpoint_identity(teacher_path(cfg))
    if cfg.teacher.source == "endpoint":
        ep = cfg.teacher.endpoint
        teacher = {"path": ep.url, "kind": f"endpoint {ep.api} {ep.model}", "model": ep.model}
    return {"teacher": teacher, "tokenizer": tokenizer_id(cfg.data.tokenizer)}


def data_hash(corpus) -> str:
    """sha256 of the packed train and eval token streams (what the teacher cache and a
    teacher's provenance record pin). A prepared corpus carries the value `distill prepare`
    computed from its streams. In `distill/` so that every layer can name the data."""
    if getattr(corpus, "fingerprint", None):
        return corpus.fingerprint
    h = hashlib.sha256()
    splits = (corpus.train, corpus.eval)
    # records routed to several teachers (`distill.data.routed`): each teacher's rows
    every = [part for rows in splits for part in getattr(rows, "parts", [rows])]
    for rows in every:
        h.update(str(len(rows)).encode())
        if hasattr(rows, "stream"):
            h.update(rows.stream.tobytes())
        if hasattr(rows, "train"):  # rows of examples: what the loss counts is data too
            h.update(np.packbits(rows.train & rows.real).tobytes())
        else:
            h.update(rows.gather(np.arange(min(len(rows), 256))).tokens.tobytes())
    return "sha256:" + h.hexdigest()


_FIELDS = {"teacher": "teacher.checkpoint", "tokenizer": "data.tokenizer"}


def _describe(ident: dict) -> str:
    if ident.get("note"):
        return f"{ident['path']} ({ident['note']})"
    digest = ident.get("sha256") or ident.get("kind", "?")
    return f"{ident['path']} ({str(digest)[:12]})"


def same(a: dict, b: dict) -> bool:
    """Two identities agree on everything but where the thing lies."""
    return {k: v for k, v in a.items() if k != "path"} == {
        k: v for k, v in b.items() if k != "path"
    }


def check_pinned(cfg: Config, stored: dict | None, current: dict, how: str) -> None:
    """One-line DistillError, ending in `how` (what the user can do), when the student
    checkpoint's `stored` identity (None: a checkpoint from before identities, allowed)
    names another teacher or tokenizer than `current`, unless `run.allow_teacher_change`.
    An unknown side (None) is allowed."""
    if not stored or cfg.run.allow_teacher_change:
        return
    for key, field in _FIELDS.items():
        was, now = stored.get(key), current.get(key)
        if was is None or now is None or same(was, now):
            continue
        if key == "teacher" and cfg.teacher.source == "endpoint":
            field = "teacher.endpoint"
        raise DistillError(
            f"{field}: {_describe(now)} is not the {key} the student in {checkpoint_dir(cfg)} "
            f"was distilled with ({_describe(was)}); {how}"
        )
