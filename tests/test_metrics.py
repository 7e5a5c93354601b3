"""The metrics store: thread safety, metrics.jsonl, rebuilding a run, health, control."""

import json
import threading
import time

import numpy as np
import pytest

from distill.errors import DistillError
from distill.observability.metrics import MetricsStore, redact


def record(step: int, **extra) -> dict:
    return {
        "step": step,
        "loss": 3.0 / step,
        "kd_loss": 1.0 / step,
        "ce_loss": 2.0 / step,
        "lr": 1e-3,
        "tokens_per_s": 1000.0,
        "teacher_ms": 5.0,
        "student_ms": 9.0,
        **extra,
    }


def store(tmp_path=None, **kw) -> MetricsStore:
    out = None if tmp_path is None else str(tmp_path)
    return MetricsStore(
        "test", total_steps=100, config={"train": {"steps": 100}}, output_dir=out, **kw
    )


def lines(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_status_follows_the_loop():
    s = store()
    assert s.status()["phase"] == "starting"
    s.set_mesh(
        {"teacher": {"axis": "tp", "shape": {"tp": 2}, "devices": [{"id": 0, "kind": "cpu"}]}}
    )
    s.set_phase("distill")
    for step in range(1, 11):
        s.log(record(step, teacher_busy=0.5, time=1000.0 + step))
    s.update(in_flight=2, bytes_per_token=64.0, student_busy=np.float32(0.75))
    s.log_eval(
        {"step": 10, "teacher_loss": 1.0, "student_loss": 2.0, "kl": 0.3, "top1_agreement": 0.5}
    )
    s.set_checkpoint(10, 1234.5)
    st = s.status()
    assert (st["step"], st["total_steps"], st["progress"]) == (10, 100, 0.1)
    assert st["loss"] == pytest.approx(0.3) and st["kd_loss"] == pytest.approx(0.1)
    assert st["eta_s"] == pytest.approx(90.0)  # one step per second in the records' times
    assert (st["in_flight"], st["bytes_per_token"], st["teacher_busy"]) == (2, 64.0, 0.5)
    assert st["student_busy"] == 0.75 and type(st["student_busy"]) is float
    assert st["latest_eval"]["kl"] == 0.3 and st["last_checkpoint"] == {"step": 10, "time": 1234.5}
    assert st["mesh"]["teacher"]["shape"] == {"tp": 2}
    json.dumps(st, allow_nan=False)  # plain, strict JSON


def test_bootstrap_counts_its_own_steps():
    s = store()
    s.set_phase("bootstrap", total_steps=20)
    for step in range(1, 21):
        s.log({"step": step, "loss": 5.0})
    assert (s.status()["step"], s.status()["total_steps"]) == (20, 20)
    s.set_phase("distill")
    assert (s.status()["step"], s.status()["total_steps"]) == (0, 100)
    s.log(record(1))
    assert [r.get("phase") for r in s.history()][-2:] == ["bootstrap", "distill"]
    assert s.status()["step"] == 1
    s.set_phase("eval")
    assert (s.status()["step"], s.status()["total_steps"]) == (1, 100)


def test_non_finite_values_become_null_for_readers(tmp_path):
    s = store(tmp_path)
    s.log(record(1, loss=float("nan"), kd_loss=np.float64("inf")))
    assert s.status()["loss"] is None and s.history()[0]["kd_loss"] is None
    text = (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]
    line = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
    assert line["loss"] is None and line["kd_loss"] is None  # strict JSON, as jq reads it


def test_history_since_and_pages():
    s = store()
    for step in range(1, 6):
        s.log(record(step))
    s.log_eval(
        {"step": 5, "teacher_loss": 1.0, "student_loss": 2.0, "kl": 0.1, "top1_agreement": 0.9}
    )
    assert [r["step"] for r in s.history(since=3)] == [4, 5, 5]
    assert s.history(since=3)[-1]["eval"] is True
    page = s.history_page(after=-1)
    assert page["next"] == 5 and len(page["records"]) == 6
    s.log(record(6))
    assert [r["step"] for r in s.history_page(after=page["next"])["records"]] == [6]


def test_writer_and_readers_in_threads():
    s = store()
    s.set_phase("distill")
    errors: list[Exception] = []
    done = threading.Event()

    def write():
        for step in range(1, 2001):
            s.log(record(step))
            s.update(in_flight=step % 3, actors=[{"name": "a", "step": step}])
            if step % 100 == 0:
                s.log_eval(
                    {
                        "step": step,
                        "teacher_loss": 1,
                        "student_loss": 2,
                        "kl": 0,
                        "top1_agreement": 1,
                    }
                )
        done.set()

    def read():
        try:
            while not done.is_set():
                json.dumps(s.status(), allow_nan=False)
                steps = [r["step"] for r in s.history() if not r.get("eval")]
                assert steps == sorted(steps)
                s.health()
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert s.status()["step"] == 2000 and len(s.history()) == 2020


def test_jsonl_append_and_round_trip(tmp_path):
    cfg = {"run": {"name": "rt"}, "train": {"steps": 50}}
    s = MetricsStore("rt", 50, cfg, output_dir=str(tmp_path))
    s.set_mesh({"platform": "cpu"})
    s.set_phase("distill")
    for step in range(1, 11):
        s.log(record(step))
    s.log_eval(
        {"step": 10, "teacher_loss": 1.0, "student_loss": 2.0, "kl": 0.3, "top1_agreement": 0.5}
    )
    s.set_checkpoint(10, 99.0)
    s.finish({"final_loss": 0.3, "steps": 10})
    s.close()
    written = lines(tmp_path)
    train = [r for r in written if "event" not in r and not r.get("eval")]
    assert [r["step"] for r in train] == list(range(1, 11))
    assert all("time" in r and r["phase"] == "distill" for r in train)
    assert [r for r in written if r.get("eval")][0]["kl"] == 0.3

    back = MetricsStore.from_run_dir(str(tmp_path))
    st = back.status()
    assert (st["phase"], st["step"], st["total_steps"]) == ("done", 10, 50)
    assert st["mesh"] == {"platform": "cpu"} and st["last_checkpoint"]["step"] == 10
    assert st["latest_eval"]["top1_agreement"] == 0.5 and st["summary"]["final_loss"] == 0.3
    assert [r["step"] for r in back.history()] == [r["step"] for r in s.history()]
    assert back.health() == (True, "done")


def test_resumed_run_history_is_continuous(tmp_path):
    first = store(tmp_path)
    first.set_phase("distill")
    for step in range(1, 58):
        first.log(record(step, loss=1.0))
    first.close()  # died at step 57; the last checkpoint was at step 30
    resumed = store(tmp_path)
    resumed.set_phase("distill")
    for step in range(31, 41):
        resumed.log(record(step, loss=2.0))

    for live_or_rebuilt in (resumed, MetricsStore.from_run_dir(str(tmp_path))):
        hist = live_or_rebuilt.history()
        assert [r["step"] for r in hist] == list(range(1, 41))
        assert {r["loss"] for r in hist if r["step"] > 30} == {2.0}
        st = live_or_rebuilt.status()
        assert st["step"] == 40 and st["restarts"] == 1 and st["epoch"] >= 1
        assert st["phase"] == "distill" and st["total_steps"] == 100


def test_from_run_dir_follows_a_live_run(tmp_path):
    writer = store(tmp_path)
    writer.set_phase("distill")
    writer.log(record(1))
    reader = MetricsStore.from_run_dir(str(tmp_path))
    page = reader.history_page()
    assert reader.status()["step"] == 1
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "loss"')  # the writer is mid-line: not read yet
    assert reader.status()["step"] == 1
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(": 0.5}\nnot json\n")
    writer.log(record(3))
    assert [r["step"] for r in reader.history_page(after=page["next"])["records"]] == [2, 3]
    assert reader.status()["phase"] == "distill"
    (tmp_path / "summary.json").write_text(json.dumps({"final_loss": 0.5}))
    assert reader.status()["phase"] == "done"


def test_from_run_dir_errors_and_empty(tmp_path):
    with pytest.raises(DistillError, match="not found"):
        MetricsStore.from_run_dir(str(tmp_path / "missing"))
    empty = MetricsStore.from_run_dir(str(tmp_path))
    assert empty.status()["step"] == 0 and empty.history() == []


def test_secrets_are_redacted(tmp_path):
    cfg = {
        "server": {"token": "s3cret", "port": 8080},
        "hub": {"api_key": "k", "password": "p", "client_secret": "c", "keep": 3},
        "list": [{"access_token": "t"}],
        "teacher": {"top_k": 8, "token_count": 5},
        "data": {"tokenizer": "/data/tokenizer.json", "tokens_file": "x", "keys": "y"},
    }
    s = MetricsStore("r", 1, cfg)
    got = s.config
    assert got["server"] == {"token": "***", "port": 8080}
    assert got["hub"] == {"api_key": "***", "password": "***", "client_secret": "***", "keep": 3}
    assert got["list"] == [{"access_token": "***"}]
    assert got["teacher"] == {"top_k": 8, "token_count": 5}  # non-strings stay
    assert got["data"] == cfg["data"]  # whole words only: a tokenizer's path is no secret
    assert cfg["server"]["token"] == "s3cret"  # the caller's dict is untouched
    assert redact({"server": {"token": None}}) == {"server": {"token": None}}
    (tmp_path / "config.yaml").write_text("run: {name: y}\nserver: {token: s3cret}\n")
    assert MetricsStore.from_run_dir(str(tmp_path)).config["server"]["token"] == "***"


def test_health_and_stall():
    stall = 1.0  # long enough that a busy test machine does not trip the fresh checks
    s = store(stall_timeout_s=stall)
    assert s.health() == (True, "ok")
    time.sleep(stall + 0.1)
    ok, reason = s.health()
    assert not ok and "no progress" in reason
    s.heartbeat()
    assert s.health()[0]
    time.sleep(stall + 0.1)
    s.log(record(1))  # a record is progress
    assert s.health()[0]
    time.sleep(stall + 0.1)
    s.update(in_flight=1)  # so is a gauge update
    assert s.health()[0]
    s.finish({})
    time.sleep(stall + 0.1)
    assert s.health() == (True, "done")  # a finished run never stalls
    f = store()
    f.fail("teacher died")
    assert f.health() == (False, "run failed: teacher died")
    assert f.status()["phase"] == "failed"


def test_config_may_be_a_pydantic_model():
    from distill.config import Config

    cfg = Config.model_validate({"data": {"source": "x"}, "server": {"token": "abc"}})
    s = MetricsStore("p", 1, cfg)
    assert s.config["server"]["token"] == "***" and s.config["data"]["source"] == "x"


def test_control_flags():
    s = store()
    assert not s.take_checkpoint_request() and not s.stop_requested()
    s.request_checkpoint()
    s.request_checkpoint()
    assert s.take_checkpoint_request()
    assert not s.take_checkpoint_request()  # once per request
    s.request_stop()
    assert s.stop_requested() and s.stop_requested()


def test_unknown_phase_is_rejected():
    with pytest.raises(ValueError, match="unknown phase"):
        store().set_phase("warmup")


def test_status_names_the_bottleneck():
    store = MetricsStore("b", total_steps=10, config={})
    assert store.status()["bottleneck"] is None
    store.log({"step": 1, "loss": 1.0, "teacher_busy": 0.9, "student_busy": 0.4})
    assert store.status()["bottleneck"] == "teacher"
    store.update(teacher_busy=0.2)
    assert store.status()["bottleneck"] == "student"


def test_elapsed_stops_when_the_run_ends(tmp_path):
    store = MetricsStore("e", total_steps=1, config={}, output_dir=str(tmp_path))
    store.finish({"ok": True})
    first = store.status()["elapsed_s"]
    time.sleep(0.05)
    assert store.status()["elapsed_s"] == first
    store.close()
    replay = MetricsStore.from_run_dir(str(tmp_path))
    assert replay.status()["elapsed_s"] == pytest.approx(first, abs=0.01)
