"""Where a run's outputs live: a local directory or a ``gs://`` bucket, behind one small API.

`run.output_dir` (and the paths under it: checkpoints, the bootstrapped teacher, an export)
may be a local path or a ``gs://bucket/prefix`` URI, because pods keep their state in
buckets. Files go through `etils.epath` (which uses gcsfs for ``gs://`` when TensorFlow is
absent), checkpoints through Orbax, whose arrays TensorStore writes with its own GCS driver.
Orbax writes arrays natively to local paths and ``gs://`` only, so no other scheme is
accepted; ``gs://`` needs gcsfs (``pip install 'distill[gcs]'``).

Object stores cannot append. `open_log` gives metrics.jsonl an append-mode file locally
(flushed per line, as always) and, on a bucket, a `RemoteLog`: the lines are kept in memory
and the whole object is rewritten by a background thread at most every `FLUSH_S` seconds,
and at close. An object is replaced whole, so a reader always sees whole lines, each version
a prefix of the next: the dashboard's follower reads from its last offset on either kind
of storage. A process killed without closing loses at most the last `FLUSH_S` seconds of
lines (checkpoints are Orbax's and unaffected).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
import time
from pathlib import Path
from typing import IO, NamedTuple

from distill.errors import DistillError

log = logging.getLogger("distill")

FLUSH_S = 5.0  # at most one rewrite of a remote log per this many seconds (GCS: <= 1/s/object)
SCHEMES = ("gs",)


def cache_dir() -> Path:
    """Where distill keeps what it computes once per machine (placement costs, the stdlib
    chat corpus): `$DISTILL_CACHE_DIR`, else `$XDG_CACHE_HOME/distill` (~/.cache/distill)."""
    if os.environ.get("DISTILL_CACHE_DIR"):
        return Path(os.environ["DISTILL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "distill"


def is_remote(path: str | os.PathLike) -> bool:
    return "://" in str(path)


def check(path: str | None, field: str) -> None:
    """One-line DistillError, naming ``field``, unless ``path`` is local or a URI this
    installation can write: ``gs://`` with gcsfs installed."""
    if not path or not is_remote(path):
        return
    scheme = str(path).split("://", 1)[0]
    if scheme not in SCHEMES:
        raise DistillError(
            f"{field}: {path}: only local paths and gs:// URIs are supported (Orbax writes "
            "checkpoint arrays to those alone)"
        )
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        raise DistillError(
            f"{field}: {path} needs gcsfs to reach the bucket: pip install 'distill[gcs]'"
        ) from None


class FileStat(NamedTuple):
    size: int
    mtime: float  # seconds since the epoch
    ident: int | None  # the inode of a local file (a replaced file gets another); None remote


def stat(path: str | os.PathLike) -> FileStat | None:
    """Size, mtime and identity of a file, read fresh (not from a listing cache); None when
    it does not exist or cannot be read."""
    if not is_remote(path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return FileStat(st.st_size, st.st_mtime, st.st_ino)
    fs, key = _fs(path)
    fs.invalidate_cache(key)
    try:
        info = fs.info(key)
    except (OSError, ValueError):
        return None
    if info.get("type") != "file":
        return None
    mtime = info.get("mtime")
    if isinstance(mtime, datetime.datetime):
        mtime = mtime.timestamp()
    return FileStat(int(info.get("size") or 0), float(mtime or 0.0), None)


def read(path: str | os.PathLike, offset: int = 0) -> bytes:
    """The bytes of a file from ``offset`` on (the current version, never a cached one)."""
    if not is_remote(path):
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    fs, key = _fs(path)
    fs.invalidate_cache(key)
    return fs.cat_file(key, start=offset or None)


def open_log(path: str | os.PathLike) -> IO[str]:
    """A text file to append lines to: local append mode, or a `RemoteLog` on a bucket."""
    if is_remote(path):
        return RemoteLog(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 (the caller closes it)


def upload_dir(src: str | os.PathLike, dest: str) -> None:
    """Copy the files of the local directory ``src`` (recursively) under the URI ``dest``."""
    fs, key = _fs(dest)
    root = Path(src)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        fs.put_file(str(f), f"{key.rstrip('/')}/{f.relative_to(root).as_posix()}")


class RemoteLog:
    """An append-only text file on an object store (see the module docstring): ``write``
    buffers, a daemon thread rewrites the whole object when there is something new, at most
    every `FLUSH_S` seconds (longer if an upload is slow), and ``close`` writes the rest.
    What the object held already (a resumed run) is kept in front."""

    def __init__(self, path: str | os.PathLike, interval_s: float | None = None):
        self.name = str(path)
        self._fs, self._key = _fs(path)
        old = read(path) if stat(path) is not None else b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        self._data = bytearray(old)
        self._sent = len(old)
        self._min_interval = self._interval = interval_s or FLUSH_S
        self._lock = threading.Lock()  # guards _data
        self._upload_lock = threading.Lock()  # one upload at a time: the newest lands last
        self._closing = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._loop, name="distill-log-upload", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def write(self, text: str) -> int:
        with self._lock:
            self._data += text.encode("utf-8")
        return len(text)

    def flush(self) -> None:
        """Nothing to do at once: the upload thread writes what is new on its schedule."""

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join()
        self._upload(final=True)
        atexit.unregister(self.close)

    def _loop(self) -> None:
        while not self._closing.wait(self._interval):
            self._upload(final=False)

    def _upload(self, final: bool) -> None:
        with self._upload_lock:
            with self._lock:
                if len(self._data) == self._sent:
                    return
                data = bytes(self._data)
            t0 = time.monotonic()
            try:
                self._fs.pipe_file(self._key, data)
            except Exception as e:  # noqa: BLE001 (a metrics upload must not end the run)
                if final or not self._failed:
                    then = "lines since the last upload are lost" if final else "will retry"
                    log.warning("cannot write %s (%s); %s", self.name, e, then)
                self._failed = True
                return
            self._sent, self._failed = len(data), False
            self._interval = max(self._min_interval, 2 * (time.monotonic() - t0))


def _fs(path: str | os.PathLike):
    """(fsspec filesystem, path within it) of a URI."""
    import fsspec

    return fsspec.core.url_to_fs(str(path))
