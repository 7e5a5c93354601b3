"""TensorBoard and W&B sinks of the metrics store, read back with their own readers."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distill.config.load import config_from_dict
from distill.errors import DistillError
from distill.observability.metrics import MetricsStore
from distill.observability.tracking import TensorBoardSink, metric_sinks, start_wandb
from tests.conftest import HAS_WANDB, tiny_config
from tests.test_cloud_paths import gcs  # noqa: F401 (the GCS emulator fixture)

TRAIN = ("loss", "kd_loss", "ce_loss", "lr", "grad_norm", "tokens_per_s")
EVAL = ("student_loss", "teacher_loss", "kl", "top1_agreement")


def _train(step: int, phase: str = "distill") -> dict:
    return {"step": step, "phase": phase, **{k: step + i / 10 for i, k in enumerate(TRAIN)}}


def _eval(step: int) -> dict:
    return {"step": step, **{k: step + i / 100 for i, k in enumerate(EVAL)}}


def _feed(store: MetricsStore, steps, evals=(), bootstrap=()) -> None:
    if bootstrap:
        store.set_phase("bootstrap", total_steps=max(bootstrap))
        for s in bootstrap:
            store.log(_train(s, "bootstrap"))
        store.set_phase("distill")
    for s in steps:
        store.log(_train(s))
        if s in evals:
            store.log_eval(_eval(s))


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a TensorBoard run directory: [(step, value)], as TensorBoard
    shows them (a resumed run's session start drops the steps it repeats)."""
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _next_second() -> None:
    """Event file names start with the creation second; keep two writers' files in order."""
    time.sleep(1.01 - time.time() % 1)


def test_store_writes_every_scalar_at_its_step(tmp_path):
    out = tmp_path / "run"
    store = MetricsStore("r", 6, {}, output_dir=str(out), sinks=[TensorBoardSink(out / "tb")])
    _feed(store, steps=(2, 4, 6), evals=(4, 6), bootstrap=(1, 2, 3))
    store.log({"step": 8, "loss": math.nan, "kd_loss": 1.0})  # NaN kept, absent keys skipped
    store.close()

    distill = _scalars(out / "tb" / "distill")
    assert set(distill) == {f"train/{k}" for k in TRAIN} | {f"eval/{k}" for k in EVAL}
    assert [s for s, _ in distill["train/loss"]] == [2, 4, 6, 8]
    assert math.isnan(distill["train/loss"][-1][1])
    assert [s for s, _ in distill["train/lr"]] == [2, 4, 6]
    assert distill["train/grad_norm"] == [(s, pytest.approx(s + 0.4)) for s in (2, 4, 6)]
    assert distill["eval/kl"] == [(s, pytest.approx(s + 0.02)) for s in (4, 6)]
    boot = _scalars(out / "tb" / "bootstrap")
    assert set(boot) == {f"bootstrap/{k}" for k in TRAIN}
    assert boot["bootstrap/loss"] == [(s, pytest.approx(s)) for s in (1, 2, 3)]


def test_resumed_run_replaces_the_steps_it_repeats(tmp_path):
    """A second process resuming from step 3 repeats 4-6: TensorBoard shows its values there,
    the first process's elsewhere, and the bootstrap run untouched."""
    out, tb = tmp_path / "run", tmp_path / "run" / "tb"
    first = MetricsStore("r", 6, {}, output_dir=str(out), sinks=[TensorBoardSink(tb)])
    _feed(first, steps=(1, 2, 3, 4, 5), evals=(3,), bootstrap=(1, 2, 3, 4, 5, 6))
    first.close()
    _next_second()
    second = MetricsStore("r", 6, {}, output_dir=str(out), sinks=[TensorBoardSink(tb)])
    for s in (4, 5, 6):
        second.log({**_train(s), "loss": 100.0 + s})
    second.log_eval(_eval(6))
    second.close()

    distill = _scalars(tb / "distill")
    assert distill["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 104), (5, 105), (6, 106)]
    assert [s for s, _ in distill["eval/kl"]] == [3, 6]
    assert [s for s, _ in _scalars(tb / "bootstrap")["bootstrap/loss"]] == [1, 2, 3, 4, 5, 6]
    assert len(list((tb / "distill").iterdir())) == 2  # one event file per process


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("gcsfs", "gcp_storage_emulator")),
    reason="needs gcsfs and gcp-storage-emulator (pip install -e '.[test]')",
)
def test_a_bucket_gets_the_event_files(tmp_path, gcs):  # noqa: F811 (the fixture)
    """gs://: written locally, copied into the bucket at close; the temporary copy is gone."""
    from tests.test_cloud_paths import BUCKET

    logdir = f"gs://{BUCKET}/tracking/tensorboard"
    sink = TensorBoardSink(logdir)
    local = Path(sink._local)
    store = MetricsStore("r", 6, {}, sinks=[sink])
    _feed(store, steps=(2, 4, 6), evals=(6,), bootstrap=(1,))
    store.close()
    assert not local.exists()
    gcs.invalidate_cache()
    for run in ("distill", "bootstrap"):
        (name,) = gcs.ls(f"{logdir}/{run}")
        gcs.get_file(name, str(tmp_path / run / Path(name).name))
    distill = _scalars(tmp_path / "distill")
    assert [s for s, _ in distill["train/loss"]] == [2, 4, 6]
    assert [s for s, _ in distill["eval/kl"]] == [6]
    assert [s for s, _ in _scalars(tmp_path / "bootstrap")["bootstrap/loss"]] == [1]


def test_writes_happen_off_the_loop_thread(tmp_path):
    """`log` only queues: nothing is on disk until the sink's thread writes (here: at close),
    and a thousand records cost the loop well under a millisecond each."""
    sink = TensorBoardSink(tmp_path / "tb", interval_s=3600)
    store = MetricsStore("r", 1000, {}, sinks=[sink])
    t0 = time.perf_counter()
    _feed(store, steps=range(1, 1001))
    per_record = (time.perf_counter() - t0) / 1000
    assert not (tmp_path / "tb").exists()
    store.close()
    assert per_record < 1e-3
    assert len(_scalars(tmp_path / "tb" / "distill")["train/loss"]) == 1000


def test_tensorboard_can_be_turned_off(tmp_path, corpus_dir):
    cfg = config_from_dict(tiny_config(str(corpus_dir), str(tmp_path), run={"tensorboard": False}))
    assert metric_sinks(cfg) == []
    assert config_from_dict(tiny_config(str(corpus_dir), str(tmp_path))).run.tensorboard


def test_wandb_not_installed_is_one_clear_line(tmp_path, corpus_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = config_from_dict(tiny_config(str(corpus_dir), str(tmp_path), wandb={"enabled": True}))
    with pytest.raises(DistillError, match=r"wandb.enabled: .*pip install 'distill\[wandb\]'"):
        metric_sinks(cfg)


def test_wandb_that_cannot_start_is_one_clear_line(tmp_path, corpus_dir, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def no_key(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)\ncall wandb.login()")

    monkeypatch.setattr(wandb, "init", no_key)
    cfg = config_from_dict(tiny_config(str(corpus_dir), str(tmp_path), wandb={"enabled": True}))
    with pytest.raises(
        DistillError, match=r"^wandb: cannot start the W&B run: api_key not configured \(no-tty\)$"
    ):
        metric_sinks(cfg)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode, every file it writes under tmp_path."""
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-home" / "data"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _wandb_history(output_dir: Path, timeout_s: float = 60.0) -> list[dict]:
    """The history rows of the one offline W&B run under ``output_dir``, read from its
    ``.wandb`` file once that holds the run's exit record (W&B's service process writes it
    shortly after ``finish`` returns)."""
    (path,) = output_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path.read_bytes())
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    rows = []
    for rec in records:
        if rec.HasField("history"):
            row = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            rows.append({k: json.loads(v) for k, v in row.items()})
    return rows


def _wandb_records(data: bytes) -> list:
    """The protobuf records of a ``.wandb`` file: a 7-byte header, then a LevelDB-style log
    (32 KiB blocks of chunks, each with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B"
    pos, block, buf, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if pos + 7 + length > len(data):  # still being written
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


def _series(rows: list[dict], tag: str) -> list[tuple[int, float]]:
    family = tag.split("/")[0]
    return [(r[f"{family}/step"], r[tag]) for r in rows if tag in r]


def test_wandb_offline_logs_the_same_scalars(tmp_path, corpus_dir, wandb_offline):
    out = tmp_path / "run"
    tree = tiny_config(str(corpus_dir), str(out), wandb={"enabled": True, "project": "t"})
    tree["run"]["tensorboard"] = False
    store = MetricsStore("r", 6, {}, sinks=[start_wandb(config_from_dict(tree))])
    _feed(store, steps=(2, 4, 6), evals=(4, 6), bootstrap=(1, 2))
    store.close()

    rows = _wandb_history(out)
    assert _series(rows, "train/loss") == [(2, 2.0), (4, 4.0), (6, 6.0)]
    assert _series(rows, "train/tokens_per_s") == [(s, pytest.approx(s + 0.5)) for s in (2, 4, 6)]
    assert _series(rows, "eval/top1_agreement") == [(4, 4.03), (6, 6.03)]
    assert _series(rows, "bootstrap/ce_loss") == [(1, 1.2), (2, 2.2)]
    for k in TRAIN:
        assert len(_series(rows, f"train/{k}")) == 3, k


def test_a_failed_run_ends_failed_in_wandb(tmp_path, corpus_dir, wandb_offline):
    """The store's failure reaches W&B as the run's exit code (W&B shows it failed)."""
    out = tmp_path / "run"
    tree = tiny_config(str(corpus_dir), str(out), wandb={"enabled": True, "project": "t"})
    store = MetricsStore("r", 6, {}, sinks=[start_wandb(config_from_dict(tree))])
    _feed(store, steps=(2,))
    store.fail("RuntimeError: boom")
    store.close()
    assert _series(_wandb_history(out), "train/loss") == [(2, 2.0)]
    (path,) = out.glob("wandb/offline-run-*/run-*.wandb")
    (exit_record,) = [r.exit for r in _wandb_records(path.read_bytes()) if r.HasField("exit")]
    assert exit_record.exit_code == 1


def test_tiny_run_through_the_cli(tiny_run):
    """One real run (the session's `tiny_run`, tests/conftest.py): TensorBoard always, and
    W&B offline where wandb is installed."""
    out = tiny_run.out
    assert yaml.safe_load(Path(tiny_run.cfg_path).read_text())["wandb"]["enabled"] is HAS_WANDB
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("phase") == "distill" and "loss" in r]
    evals = [r for r in records if r.get("eval")]
    distill = _scalars(out / "tensorboard" / "distill")
    for k in TRAIN:
        assert [s for s, _ in distill[f"train/{k}"]] == [2, 4, 6], k
    for k in EVAL:
        assert [s for s, _ in distill[f"eval/{k}"]] == [r["step"] for r in evals], k
    assert [s for s, _ in distill["eval/kl"]] == [0, 3, 6]
    assert [v for _, v in distill["train/kd_loss"]] == pytest.approx([r["kd_loss"] for r in train])
    boot = _scalars(out / "tensorboard" / "bootstrap")
    assert [s for s, _ in boot["bootstrap/loss"]] == [2, 4, 6]
    if HAS_WANDB:
        rows = _wandb_history(out)
        assert [s for s, _ in _series(rows, "train/loss")] == [2, 4, 6]
        assert [s for s, _ in _series(rows, "eval/kl")] == [0, 3, 6]
        assert [s for s, _ in _series(rows, "bootstrap/loss")] == [2, 4, 6]
