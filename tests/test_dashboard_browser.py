"""The dashboard in a real browser: headless Chromium loads it from a live server, the
charts draw with data, and the step shown is the step /api/status reports.

Set DISTILL_SCREENSHOT=path to keep the screenshot (docs/dashboard.png is made this way).
"""

import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from distill.config import ServerConfig
from distill.observability.metrics import MetricsStore
from distill.observability.server import start_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=5000",
]
CHARTS = ("chart-loss", "chart-eval", "chart-samples", "chart-tps", "chart-util")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium"),
]

CONFIG = {
    "run": {"name": "tiny-kd", "output_dir": "runs/tiny-kd", "seed": 0},
    "mesh": {"teacher": {"dp": 2, "tp": 2}, "student": {"dp": 4}, "platform": "cpu"},
    "teacher": {"model": {"d_model": 256, "n_layers": 4, "n_heads": 8}, "top_k": 32},
    "student": {"model": {"d_model": 128, "n_layers": 2}},
    "distill": {"loss": "forward_kl", "temperature": 2.0, "alpha": 0.5},
    "train": {"steps": 200, "batch_size": 16, "seq_len": 128, "log_every": 2},
    "server": {"host": "127.0.0.1", "port": 0, "token": "do-not-show-me"},
}


def mesh_layout() -> dict:
    def devices(ids):
        return [{"id": i, "kind": "cpu"} for i in ids]

    return {
        "teacher": {"axis": "tp", "shape": {"dp": 2, "tp": 2}, "devices": devices(range(4))},
        "student": {"axis": "dp", "shape": {"dp": 4, "fsdp": 1}, "devices": devices(range(4, 8))},
        "platform": "cpu",
    }


def feed(store: MetricsStore, steps: int = 120, total: int = 200) -> None:
    """A synthetic run: a short teacher bootstrap, then distillation with evals."""
    store.set_mesh(mesh_layout())
    store.set_phase("bootstrap", total_steps=40)
    for step in range(2, 41, 2):
        store.log({"step": step, "loss": 5.5 * math.exp(-step / 25) + 1.6, "lr": 3e-3})
    store.set_phase("distill")
    t0 = time.time() - steps * 0.25
    for step in range(2, steps + 1, 2):
        ce = 2.2 * math.exp(-step / 60) + 1.9 + 0.04 * math.sin(step / 3)
        kd = 1.4 * math.exp(-step / 45) + 0.25 + 0.03 * math.cos(step / 4)
        store.log(
            {
                "step": step,
                "loss": 0.5 * 4 * kd + 0.5 * ce,
                "kd_loss": kd,
                "ce_loss": ce,
                "lr": 3e-3 * min(1.0, step / 20),
                "tokens_per_s": 41000 + 3000 * math.sin(step / 7) + 40 * step,
                "teacher_ms": 9.5,
                "student_ms": 21.0,
                "teacher_busy": 0.42 + 0.08 * math.sin(step / 5),
                "student_busy": 0.9 - 0.05 * math.cos(step / 6),
                "in_flight": 2,
                "bytes_per_token": 256.0,
                "on_policy": 0.5,
                "generate_ms": 14.0,
                "gen_tokens_per_s": 9000.0,
                "staleness": 1.0,
                "expert_load": [0.3, 0.3, 0.2, 0.2],
                "expert_load_max_mean": 1.2 + 0.1 * math.sin(step / 9),
                "expert_dropped": 0.01,
                "time": t0 + step * 0.25,
            }
        )
        if step % 40 == 0:
            store.set_phase("eval")
            store.log_eval(
                {
                    "step": step,
                    "teacher_loss": 1.62,
                    "student_loss": 2.9 * math.exp(-step / 80) + 1.95,
                    "kl": 0.9 * math.exp(-step / 70) + 0.2,
                    "top1_agreement": 0.45 + step / 500,
                    "sample_teacher_nll": 2.5 * math.exp(-step / 90) + 1.7,
                    "sample_student_nll": 1.5,
                    "sample_kl": 2.5 * math.exp(-step / 90) + 0.2,
                    "sample_len": 48.0,
                }
            )
            if step == 80:  # the student caught up: the gate turns the teacher off
                store.alpha_gate(81, 0.0, "the student has caught up with the teacher")
                store.update(alpha=0.0, teacher_off_steps=40)
            store.set_phase("checkpoint")
            store.set_checkpoint(step, time.time())
            store.set_phase("distill")
    store.update(in_flight=2, bytes_per_token=256.0)


def chromium(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    cmd = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def live_server():
    store = MetricsStore("tiny-kd", total_steps=200, config=CONFIG, stall_timeout_s=60)
    writer = threading.Thread(target=feed, args=(store,), daemon=True)
    handle = start_server(store, ServerConfig(port=0))
    writer.start()  # the run's loop thread, writing while the server serves
    writer.join(timeout=30)
    assert not writer.is_alive()
    yield handle
    handle.stop()


def test_dashboard_renders_live_run(live_server, tmp_path):
    dom = chromium(live_server.url, tmp_path, "--dump-dom").stdout
    with urllib.request.urlopen(live_server.url + "api/status") as r:
        status = json.load(r)

    for chart in CHARTS:
        m = re.search(rf'id="{chart}"[^>]*data-points="(\d+)"', dom) or re.search(
            rf'data-points="(\d+)"[^>]*id="{chart}"', dom
        )
        assert m, f"{chart} missing from the rendered page"
        assert int(m.group(1)) > 0, f"{chart} drew no points"

    shown = re.search(r'id="step"[^>]*>(\d+)<', dom)
    assert shown and int(shown.group(1)) == status["step"] == 120
    assert re.search(r'id="phase"[^>]*>distill<', dom)
    assert re.search(r'id="staleness"[^>]*>1<', dom) and re.search(r'id="on-policy"[^>]*>50%<', dom)
    assert re.search(r'id="eval-sample-len"[^>]*>48<', dom)
    gate = "off from step 81: the student has caught up with the teacher · 40 steps off"
    assert re.search(rf'id="alpha-gate"[^>]*>{gate}<', dom), "the alpha gate's change"
    assert re.search(r'id="chart-experts"[^>]*data-points="120"', dom)  # 60 steps x 2 series
    assert dom.count('class="device"') == 8
    labels = re.findall(r'class="device"[^>]*><b>([^<]*)</b>', dom)  # mesh coordinates
    assert labels == ["dp0 tp0", "dp0 tp1", "dp1 tp0", "dp1 tp1", "dp0", "dp1", "dp2", "dp3"]
    assert "do-not-show-me" not in dom


def test_dashboard_screenshot(live_server, tmp_path):
    shot = tmp_path / "dashboard.png"
    chromium(live_server.url, tmp_path, f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.is_file() and shot.stat().st_size > 10_000
    keep = os.environ.get("DISTILL_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)


def test_dashboard_starts_over_when_a_resumed_run_rewinds(tmp_path):
    """A run resumed from step 30 repeats steps 31..: the page drops the old run's later
    points instead of mixing the two."""
    store = MetricsStore("resumed", total_steps=100, config={})
    store.set_phase("distill")

    def rec(step: int, loss: float) -> dict:
        return {"step": step, "loss": loss, "kd_loss": loss, "ce_loss": loss, "tokens_per_s": 1.0}

    for step in range(1, 58):
        store.log(rec(step, 1.0))
    pages = []
    history_page = store.history_page

    def resuming_history_page(**kw):
        # The page's second poll: it has drawn the first run's history by now. The resumed
        # run logs before this answer goes out, so every later poll sees it whole (the
        # browser's virtual time may run its polls only milliseconds apart in real time).
        pages.append(kw)
        if len(pages) == 2:
            for step in range(31, 41):
                store.log(rec(step, 2.0))
        return history_page(**kw)

    store.history_page = resuming_history_page
    handle = start_server(store, ServerConfig(port=0))
    try:
        dom = chromium(handle.url, tmp_path, "--dump-dom").stdout
    finally:
        handle.stop()
    assert re.search(r'id="chart-loss"[^>]*data-points="120"', dom)  # 40 steps x 3 series
    assert re.search(r'id="step"[^>]*>40<', dom)


def test_dashboard_shows_colocated_roles_on_the_same_devices(tmp_path):
    """A colocated layout (teacher dp=2 x tp=2 and student dp=4 over devices 0-3): each
    device appears once under each role with that role's coordinates, and the page says
    the roles share the devices."""
    store = MetricsStore("colocated", total_steps=10, config=CONFIG, stall_timeout_s=60)
    layout = mesh_layout()
    layout["placement"] = "colocated"
    layout["student"]["devices"] = layout["teacher"]["devices"]
    store.set_mesh(layout)
    store.set_phase("distill")
    store.update(in_flight=2, bytes_per_token=64.0)
    handle = start_server(store, ServerConfig(port=0))
    try:
        dom = chromium(handle.url, tmp_path, "--dump-dom").stdout
    finally:
        handle.stop()
    boxes = re.findall(r'class="device"[^>]*id="device-(\d+)-(\w+)"[^>]*><b>([^<]*)</b>', dom)
    boxes += re.findall(r'id="device-(\d+)-(\w+)"[^>]*class="device"[^>]*><b>([^<]*)</b>', dom)
    teacher = ["dp0 tp0", "dp0 tp1", "dp1 tp0", "dp1 tp1"]
    want = [(str(i), "teacher", at) for i, at in enumerate(teacher)]
    assert sorted(boxes) == sorted(want + [(str(i), "student", f"dp{i}") for i in range(4)])
    assert re.search(r'id="platform"[^>]*>[^<]*colocated \(both roles on the same devices', dom)
    assert "teacher outputs, same devices" in dom


def test_dashboard_shows_each_teacher_s_divergence(tmp_path):
    """Several teachers: the Training panel's "KD by teacher" row names each teacher with
    its latest divergence; a run of one teacher keeps the row hidden."""
    store = MetricsStore("several", total_steps=10, config=CONFIG, stall_timeout_s=60)
    store.set_mesh(mesh_layout())
    store.set_phase("distill")
    store.log({"step": 2, "loss": 1.0, "kd_loss": 0.3, "ce_loss": 2.0,
               "kd_loss_by_teacher": {"math": 0.25, "code": 0.5}})  # fmt: skip
    handle = start_server(store, ServerConfig(port=0))
    try:
        dom = chromium(handle.url, tmp_path, "--dump-dom").stdout
    finally:
        handle.stop()
    row = re.search(r'<dd id="kd-by-teacher"([^>]*)>([^<]*)<', dom)
    assert row and "hidden" not in row.group(1) and row.group(2) == "math 0.25 · code 0.5", row
    single = MetricsStore("one", total_steps=10, config=CONFIG, stall_timeout_s=60)
    single.set_phase("distill")
    single.log({"step": 2, "loss": 1.0, "kd_loss": 0.3, "ce_loss": 2.0})
    handle = start_server(single, ServerConfig(port=0))
    try:
        dom = chromium(handle.url, tmp_path, "--dump-dom").stdout
    finally:
        handle.stop()
    assert re.search(r'<dd id="kd-by-teacher"[^>]*hidden', dom)
