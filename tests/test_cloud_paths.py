"""`run.output_dir: gs://...` end to end, against a GCS emulator on localhost (no network).

The emulator is `gcp-storage-emulator` (a pure-Python server of the GCS JSON API) in a
subprocess, with the generation headers TensorStore needs added (tests/gcs_emulator.py;
it does not enforce write preconditions, which only concurrent writers need). Every client
is pointed at it: gcsfs (config.yaml, metrics.jsonl, summary.json, Orbax's metadata, the
export) through STORAGE_EMULATOR_HOST, and TensorStore's gcs driver (the checkpoint arrays
Orbax writes) through TENSORSTORE_GCS_HTTP_URL with a fixed test token, so nothing looks
for credentials or leaves this machine. One tiny run writes into the bucket; then the
dashboard's run-dir reader, `distill export` and `distill eval` read it back, and a rerun
without the last checkpoint resumes from the bucket and repeats the same steps exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from distill.observability.metrics import MetricsStore
from pipelines.commands.cli import main
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("gcsfs", "gcp_storage_emulator")),
    reason="needs gcsfs and gcp-storage-emulator (pip install -e '.[test]')",
)

BUCKET = "distill-test"
OUT = f"gs://{BUCKET}/run"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A GCS emulator with one bucket, every client pointed at it; yields a gcsfs handle."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("emulator") / "emulator.log"
    log = open(log_path, "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), str(port), BUCKET],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the GCS emulator did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
    env = {
        "STORAGE_EMULATOR_HOST": url,  # gcsfs
        "TENSORSTORE_GCS_HTTP_URL": url,  # TensorStore's gcs driver (Orbax's arrays)
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # TensorStore: no credential lookup
        "NO_GCE_CHECK": "true",  # google-auth: never probe a metadata server
        # gcsfs' default filesystem asks a gRPC control API for the bucket type first,
        # which the emulator does not serve (a 60 s timeout); the plain one is registered
        # below as well, in case gcsfs was imported before this fixture.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec
    import gcsfs.core

    for proto in ("gs", "gcs"):
        fsspec.register_implementation(proto, gcsfs.core.GCSFileSystem, clobber=True)
    saved_conf = {p: fsspec.config.conf.get(p) for p in ("gs", "gcs")}
    for proto in ("gs", "gcs"):  # anonymous: nothing looks for credentials
        fsspec.config.conf[proto] = {**(saved_conf[proto] or {}), "token": "anon"}
    # The instance epath (and so Orbax) uses: deleting through it also clears its listing
    # cache, which a resumed run, a new process in real life, would not have.
    fs = fsspec.filesystem("gcs", finalize_on_close=True)
    try:
        yield fs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for proto, conf in saved_conf.items():
            if conf is None:
                fsspec.config.conf.pop(proto, None)
            else:
                fsspec.config.conf[proto] = conf
        proc.terminate()
        proc.wait(10)
        log.close()


def _write(tmp_path, cfg: dict, name="cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _records(fs, path=f"{OUT}/metrics.jsonl") -> list[dict]:
    fs.invalidate_cache()
    return [json.loads(x) for x in fs.cat_file(path).decode().splitlines()]


def _train(records):
    return [r for r in records if r.get("phase") == "distill" and "loss" in r]


@pytest.fixture(scope="module")
def bucket_run(gcs, tmp_path_factory, corpus_dir):
    tmp = tmp_path_factory.mktemp("cloud")
    cfg_path = _write(tmp, tiny_config(str(corpus_dir), OUT))
    cwd_before = set(os.listdir())
    assert main(["run", cfg_path]) == 0
    # nothing went to a local directory named "gs:" (what a Path-mangled URI would make)
    assert not {"gs:", "gs"} & (set(os.listdir()) - cwd_before)
    assert not (tmp / "gs:").exists()
    return cfg_path, _records(gcs)


def test_run_writes_every_output_to_the_bucket(gcs, bucket_run):
    _, records = bucket_run
    gcs.invalidate_cache()
    config = yaml.safe_load(gcs.cat_file(f"{OUT}/config.yaml"))
    assert config["run"]["output_dir"] == OUT and config["train"]["steps"] == 6
    assert [r["step"] for r in _train(records)] == [2, 4, 6]
    assert [r["step"] for r in records if r.get("eval")] == [0, 3, 6]
    events = [r["event"] for r in records if "event" in r]
    assert events[0] == "start" and events[-1] == "done" and "checkpoint" in events
    summary = json.loads(gcs.cat_file(f"{OUT}/summary.json"))
    assert summary["completed"] and summary["steps"] == 6
    steps = sorted(p.rsplit("/", 1)[-1] for p in gcs.ls(f"{OUT}/checkpoints"))
    assert [s for s in steps if s.isdigit()] == ["3", "6"]
    # Orbax's arrays (TensorStore) and metadata (gcsfs) both landed in the bucket
    state = gcs.find(f"{OUT}/checkpoints/6")
    assert any("/state/" in p for p in state) and any("/data/" in p for p in state)
    assert gcs.find(f"{OUT}/teacher")  # the bootstrapped teacher


def test_dashboard_reads_the_run_from_the_bucket(bucket_run):
    from fastapi.testclient import TestClient

    from distill.observability.server.app import create_app

    store = MetricsStore.from_run_dir(OUT)
    st = store.status()
    assert (st["run_name"], st["phase"], st["step"], st["total_steps"]) == ("tiny", "done", 6, 6)
    assert st["last_checkpoint"]["step"] == 6 and st["summary"]["completed"]
    assert [r["step"] for r in store.history() if r.get("phase") == "distill"] == [2, 4, 6]
    with TestClient(create_app(store, token=None)) as client:
        assert client.get("/api/status").json()["phase"] == "done"
        assert client.get("/api/config").json()["run"]["output_dir"] == OUT


def test_export_and_eval_read_the_bucket(gcs, bucket_run, capsys):
    cfg_path, _ = bucket_run
    capsys.readouterr()
    assert main(["export", OUT]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["export"] == f"{OUT}/hf"
    gcs.invalidate_cache()
    names = {p.rsplit("/", 1)[-1] for p in gcs.ls(f"{OUT}/hf")}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert main(["eval", cfg_path]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 6 and 0 <= result["top1_agreement"] <= 1


def test_resume_from_the_bucket_repeats_the_steps_exactly(gcs, bucket_run):
    """Drop the last checkpoint and summary from the bucket and rerun: the run resumes at
    step 3 from the bucket's checkpoint, and metrics.jsonl keeps the first run in front."""
    cfg_path, first = bucket_run
    gcs.rm(f"{OUT}/checkpoints/6", recursive=True)
    gcs.rm(f"{OUT}/summary.json")
    assert main(["run", cfg_path]) == 0
    records = _records(gcs)
    assert records[: len(first)] == first  # rewritten whole, the old lines in front
    assert [r["event"] for r in records if r.get("event") == "start"] == ["start", "start"]
    before = {r["step"]: r for r in _train(first)}
    after = _train(records)[len(before) :]
    assert [r["step"] for r in after] == [4, 6]
    for r in after:
        for key in ("loss", "kd_loss", "ce_loss", "lr"):
            assert r[key] == pytest.approx(before[r["step"]][key], rel=1e-6), key
    assert json.loads(gcs.cat_file(f"{OUT}/summary.json"))["steps"] == 6
    store = MetricsStore.from_run_dir(OUT)
    assert store.status()["restarts"] == 1 and store.status()["phase"] == "done"


def test_remote_log_uploads_while_open_and_all_at_close(gcs):
    from distill.storage import RemoteLog

    path = f"gs://{BUCKET}/log/metrics.jsonl"
    f = RemoteLog(path, interval_s=0.2)
    f.write('{"step": 1}\n')
    deadline = time.monotonic() + 10
    while not gcs.exists(path.removeprefix("gs://")) and time.monotonic() < deadline:
        time.sleep(0.1)
        gcs.invalidate_cache()
    assert gcs.cat_file(path) == b'{"step": 1}\n'  # uploaded by the thread, still open
    f.write('{"step": 2}\n')
    f.close()
    again = RemoteLog(path)  # reopened (a resumed run): the old lines stay in front
    again.write('{"step": 3}\n')
    again.close()
    gcs.invalidate_cache()
    assert gcs.cat_file(path).decode().splitlines() == [f'{{"step": {i}}}' for i in (1, 2, 3)]


def test_dashboard_follows_a_live_run_in_the_bucket(gcs, monkeypatch):
    """A writer's uploads reach a reader polling the bucket, new lines read incrementally."""
    from distill import storage
    from distill.observability import metrics_log

    monkeypatch.setattr(storage, "FLUSH_S", 0.1)
    monkeypatch.setattr(metrics_log, "_REMOTE_POLL_S", 0.0)
    out = f"gs://{BUCKET}/live"
    gcs.pipe_file(f"{out}/config.yaml", b"run: {name: live}\n")  # as `distill run` does first
    writer = MetricsStore("live", 10, {}, output_dir=out)
    writer.set_phase("distill")
    reader = MetricsStore.from_run_dir(out)

    def seen(n: int) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if len(reader.history()) == n:
                return True
            time.sleep(0.05)
        return False

    for step in (1, 2):
        writer.log({"step": step, "loss": 1.0 / step})
    assert seen(2) and reader.status()["phase"] == "distill"
    writer.log({"step": 3, "loss": 0.3})
    writer.finish({"completed": True})
    writer.close()
    assert seen(3) and reader.status()["phase"] == "done"
    assert [r["step"] for r in reader.history()] == [1, 2, 3]


# ------------------------------------------------------------ one-line errors, no bucket used


def _error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_missing_gcsfs_is_one_line(monkeypatch):
    from distill import storage
    from distill.errors import DistillError

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    with pytest.raises(DistillError, match=r"^run\.output_dir: gs://b/r needs gcsfs.*\[gcs\]"):
        storage.check("gs://b/r", "run.output_dir")


def test_unsupported_scheme_is_one_line(tmp_path, corpus_dir, capsys):
    cfg = tiny_config(str(corpus_dir), "s3://bucket/run")
    cfg["teacher"]["checkpoint"] = str(tmp_path / "teacher")
    line = _error(capsys, ["validate", _write(tmp_path, cfg)])
    assert "run.output_dir" in line and "gs://" in line


def test_teacher_cache_in_a_bucket_is_one_line(tmp_path, corpus_dir, capsys):
    cfg = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    cfg["teacher"]["cache_dir"] = f"gs://{BUCKET}/cache"
    line = _error(capsys, ["cache-teacher", _write(tmp_path, cfg)])
    assert line.startswith("distill: error: teacher.cache_dir:") and "local" in line
    cfg = tiny_config(str(corpus_dir), f"gs://{BUCKET}/other")  # the default, under it
    line = _error(capsys, ["cache-teacher", _write(tmp_path, cfg)])
    assert "teacher.cache_dir" in line and "default" in line
