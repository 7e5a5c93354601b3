"""The status service on a real socket during a real tiny run, and the dashboard of that
run in headless Chromium."""

import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from distill.config.load import config_from_dict
from pipelines.commands.run import run
from tests.conftest import tiny_config
from tests.test_dashboard_browser import CHARTS, CHROMIUM, chromium


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_status_api_and_dashboard_during_a_real_run(tmp_path, corpus_dir, monkeypatch):
    port = _free_port()
    base = f"http://127.0.0.1:{port}/"
    cfg = config_from_dict(
        tiny_config(
            str(corpus_dir),
            str(tmp_path / "out"),
            server={"enabled": True, "port": port},
            train={
                "steps": 12,
                "batch_size": 4,
                "seq_len": 32,
                "log_every": 2,
                "eval_every": 6,
                "checkpoint_every": 6,
            },
        )
    )
    monkeypatch.setenv("DISTILL_HOLD_SERVER_S", "60")  # keep the server up after the run
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(run(cfg)), daemon=True)
    worker.start()

    phases, statuses = set(), []
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            code, body = _get(base + "api/status")
        except OSError:
            time.sleep(0.1)
            continue
        assert code == 200
        status = json.loads(body)
        phases.add(status["phase"])
        statuses.append(status)
        if status["phase"] == "done":
            break
        assert _get(base + "healthz")[0] == 200
        time.sleep(0.2)
    assert status["phase"] == "done", status
    assert {"bootstrap", "distill"} <= phases
    assert status["step"] == 12 and status["total_steps"] == 12
    assert status["latest_eval"]["step"] == 12
    assert status["last_checkpoint"]["step"] == 12
    assert [d["id"] for d in status["mesh"]["teacher"]["devices"]] == [0, 1]

    code, text = _get(base + "metrics")
    assert code == 200 and "distill_step" in text
    code, body = _get(base + "api/history?since=-1")
    assert code == 200 and any(r.get("step") == 12 for r in json.loads(body)["records"])
    assert _get(base + "api/history?since=abc")[0] in (400, 422)
    assert _get(base + "api/config")[0] == 200

    if os.path.exists(CHROMIUM):
        dom = chromium(base, tmp_path, "--dump-dom").stdout
        for chart in ("chart-loss", "chart-eval", "chart-tps"):
            assert chart in CHARTS
            m = re.search(rf'id="{chart}"[^>]*data-points="(\d+)"', dom) or re.search(
                rf'data-points="(\d+)"[^>]*id="{chart}"', dom
            )
            assert m and int(m.group(1)) > 0, chart
        shown = re.search(r'id="step"[^>]*>(\d+)<', dom)
        assert shown and int(shown.group(1)) == status["step"]
    else:
        pytest.skip("chromium not installed: the browser half of this test did not run")


def test_post_stop_saves_and_ends_a_real_run(tmp_path, corpus_dir, tiny_run):
    """POST /api/stop with the bearer token: the loop saves a checkpoint and returns early.
    (With the session's `tiny_run` teacher: no bootstrap before the distillation.)"""
    port = _free_port()
    base = f"http://127.0.0.1:{port}/"
    out = tmp_path / "out"
    tree = tiny_config(
        str(corpus_dir),
        str(out),
        server={"enabled": True, "port": port, "token": "s3cret"},
        train={
            "steps": 100000,
            "log_every": 1,
            "eval_every": 100000,
            "checkpoint_every": 100000,
        },
    )
    tree["teacher"]["checkpoint"] = str(tiny_run.out / "teacher")
    cfg = config_from_dict(tree)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(run(cfg)), daemon=True)
    worker.start()
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            status = json.loads(_get(base + "api/status")[1])
        except OSError:
            time.sleep(0.1)
            continue
        if status["phase"] == "distill" and (status["step"] or 0) >= 2:
            break
        time.sleep(0.2)
    unauthorized = urllib.request.Request(base + "api/stop", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(unauthorized, timeout=5)
    assert e.value.code == 401
    stop = urllib.request.Request(
        base + "api/stop", method="POST", headers={"Authorization": "Bearer s3cret"}
    )
    assert urllib.request.urlopen(stop, timeout=5).status == 200
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert result["completed"] is False and 2 <= result["steps"] < 100000
    saved = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved == [result["steps"]]
