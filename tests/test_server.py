"""The status API: every endpoint and error through FastAPI's test client, Prometheus
output, and the real server on a real socket."""

import json
import logging
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from distill.config import ServerConfig
from distill.errors import DistillError
from distill.observability.metrics import MetricsStore
from distill.observability.server import create_app, start_server

TOKEN = "tok-123"
CONFIG = {"run": {"name": "api"}, "server": {"token": TOKEN, "port": 0}, "data": {"source": "x"}}


@pytest.fixture
def store() -> MetricsStore:
    s = MetricsStore("api", total_steps=50, config=CONFIG, stall_timeout_s=60)
    s.set_mesh(
        {"teacher": {"axis": "tp", "shape": {"tp": 2}, "devices": [{"id": 0, "kind": "cpu"}]}}
    )
    s.set_phase("distill")
    for step in range(1, 11):
        s.log(
            {
                "step": step,
                "loss": 4.0 - 0.1 * step,
                "kd_loss": 1.0,
                "ce_loss": 2.0,
                "lr": 1e-3,
                "tokens_per_s": 5000.0,
                "teacher_ms": 3.0,
                "student_ms": 7.0,
                "teacher_busy": 0.4,
                "student_busy": 0.9,
                "in_flight": 2,
                "bytes_per_token": 64.0,
            }
        )
    s.log_eval(
        {"step": 10, "teacher_loss": 1.5, "student_loss": 2.5, "kl": 0.4, "top1_agreement": 0.6}
    )
    s.set_checkpoint(10, 1700000000.0)
    return s


@pytest.fixture
def client(store) -> TestClient:
    return TestClient(create_app(store, token=None))


@pytest.fixture
def guarded(store) -> TestClient:
    return TestClient(create_app(store, token=TOKEN))


def test_healthz(client, store):
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["ok"] is True
    store.fail("out of memory")
    r = client.get("/healthz")
    assert r.status_code == 503
    assert r.json() == {"ok": False, "reason": "run failed: out of memory"}


def test_healthz_stalled():
    s = MetricsStore("stall", 10, {}, stall_timeout_s=0.001)
    time.sleep(0.01)
    r = TestClient(create_app(s, None)).get("/healthz")
    assert r.status_code == 503 and "no progress" in r.json()["reason"]


def test_status(client):
    r = client.get("/api/status")
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    st = r.json()
    assert st["run_name"] == "api" and st["phase"] == "distill"
    assert (st["step"], st["total_steps"]) == (10, 50)
    assert st["loss"] == pytest.approx(3.0) and st["tokens_per_s"] == 5000.0
    assert (st["teacher_busy"], st["student_busy"], st["in_flight"]) == (0.4, 0.9, 2)
    assert st["bytes_per_token"] == 64.0
    assert st["mesh"]["teacher"]["axis"] == "tp"
    assert st["last_checkpoint"] == {"step": 10, "time": 1700000000.0}
    assert st["latest_eval"]["top1_agreement"] == 0.6
    assert TOKEN not in r.text


def test_history(client, store):
    page = client.get("/api/history").json()
    assert [r["step"] for r in page["records"]] == list(range(1, 11)) + [10]
    assert page["epoch"] == 0 and page["next"] == 10
    assert [r["step"] for r in client.get("/api/history?since=8").json()["records"]] == [9, 10, 10]
    store.log({"step": 11, "loss": 1.0})
    newer = client.get(f"/api/history?after={page['next']}").json()
    assert [r["step"] for r in newer["records"]] == [11]


@pytest.mark.parametrize(
    "query", ["since=abc", "since=-2", "since=1.5", "after=x", "after=-7", "since="]
)
def test_history_bad_query(client, query):
    r = client.get(f"/api/history?{query}")
    assert r.status_code == 422
    assert r.headers["content-type"].startswith("application/json") and "detail" in r.json()


def test_config_is_redacted(client):
    r = client.get("/api/config")
    assert r.status_code == 200
    assert r.json()["server"]["token"] == "***" and TOKEN not in r.text
    assert r.json()["data"] == {"source": "x"}


def test_prometheus_metrics(client):
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("distill_step", ())] == 10
    assert samples[("distill_loss", ())] == pytest.approx(3.0)
    assert samples[("distill_kd_loss", ())] == 1.0 and samples[("distill_ce_loss", ())] == 2.0
    assert samples[("distill_learning_rate", ())] == 1e-3
    assert samples[("distill_tokens_per_second", ())] == 5000.0
    assert samples[("distill_busy_ratio", (("mesh", "teacher"),))] == 0.4
    assert samples[("distill_busy_ratio", (("mesh", "student"),))] == 0.9
    assert samples[("distill_teacher_outputs_in_flight", ())] == 2
    assert samples[("distill_eval_kl", ())] == 0.4
    assert samples[("distill_eval_top1_agreement", ())] == 0.6
    assert samples[("distill_last_checkpoint_step", ())] == 10
    assert samples[("distill_phase", (("distill_phase", "distill"),))] == 1
    assert samples[("distill_healthy", ())] == 1


def test_prometheus_expert_load(store):
    """An MoE teacher's records: per-expert load gauges labelled by expert, the max/mean
    ratio and the dropped share; none of them for a dense teacher's."""
    dense = TestClient(create_app(store, token=None)).get("/metrics").text
    assert "distill_expert" not in dense
    store.log({"step": 11, "loss": 1.0, "expert_load": [0.5, 0.25, 0.25, 0.0]})
    store.log(
        {
            "step": 12,
            "loss": 1.0,
            "expert_load": [0.4, 0.3, 0.2, 0.1],
            "expert_load_max_mean": 1.6,
            "expert_dropped": 0.02,
        }
    )
    samples = {}
    text = TestClient(create_app(store, token=None)).get("/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    loads = {k[1][0][1]: v for k, v in samples.items() if k[0] == "distill_expert_load_ratio"}
    assert loads == {"0": 0.4, "1": 0.3, "2": 0.2, "3": 0.1}
    assert samples[("distill_expert_load_max_mean", ())] == 1.6
    assert samples[("distill_expert_dropped_ratio", ())] == 0.02


def test_metrics_registries_are_per_app(store):
    other = MetricsStore("other", 5, {})
    a = TestClient(create_app(store, None)).get("/metrics").text
    b = TestClient(create_app(other, None)).get("/metrics").text
    assert 'run_name="api"' in a and 'run_name="other"' in b and 'run_name="api"' not in b


def test_dashboard_and_static_files(client):
    r = client.get("/")
    assert r.status_code == 200 and 'id="step"' in r.text and "<canvas" in r.text
    assert "http://" not in r.text and "https://" not in r.text  # nothing from the internet
    for path, kind in [("/static/dashboard.js", "javascript"), ("/static/dashboard.css", "css")]:
        r = client.get(path)
        assert r.status_code == 200 and kind in r.headers["content-type"]
        assert "https://" not in r.text


@pytest.mark.parametrize(
    "path", ["/nope", "/api", "/api/statuss", "/static/missing.js", "/static/../app.py", "/docs"]
)
def test_unknown_paths_are_json_404(client, path):
    r = client.get(path)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json") and "detail" in r.json()


def test_wrong_method_is_json_405(client):
    r = client.post("/api/status")
    assert r.status_code == 405 and "detail" in r.json()


@pytest.mark.parametrize("path", ["/api/checkpoint", "/api/stop"])
def test_control_absent_without_token(client, store, path):
    r = client.post(path, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and "detail" in r.json()
    assert not store.take_checkpoint_request() and not store.stop_requested()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer "},
        {"Authorization": "Bearer tök-123".encode("latin-1")},  # not ASCII
    ],
)
@pytest.mark.parametrize("path", ["/api/checkpoint", "/api/stop"])
def test_control_rejects_bad_tokens(guarded, store, path, headers):
    r = guarded.post(path, headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "detail" in r.json()
    assert not store.take_checkpoint_request() and not store.stop_requested()


def test_control_with_token(guarded, store):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = guarded.post("/api/checkpoint", headers=auth)
    assert r.status_code == 200 and r.json()["checkpoint_requested"] is True
    assert store.take_checkpoint_request() and not store.take_checkpoint_request()
    assert not store.stop_requested()
    r = guarded.post("/api/stop", headers=auth)
    assert r.status_code == 200 and r.json()["stop_requested"] is True
    assert store.stop_requested()
    assert guarded.get("/api/checkpoint").status_code == 405


def test_real_socket_on_port_zero(store):
    handle = start_server(store, ServerConfig(port=0))
    try:
        assert handle.port > 0 and handle.url == f"http://127.0.0.1:{handle.port}/"
        with urllib.request.urlopen(handle.url + "api/status", timeout=5) as r:
            assert r.status == 200 and json.load(r)["step"] == 10
        with urllib.request.urlopen(handle.url + "healthz", timeout=5) as r:
            assert json.load(r)["ok"] is True
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(handle.url + "nope", timeout=5)
        assert e.value.code == 404
    finally:
        handle.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(handle.url + "healthz", timeout=2)
    handle.stop()  # twice is fine


def test_token_from_environment(store, monkeypatch):
    monkeypatch.setenv("DISTILL_SERVER_TOKEN", "from-env")
    handle = start_server(store, ServerConfig(port=0))
    try:
        req = urllib.request.Request(
            handle.url + "api/checkpoint",
            method="POST",
            headers={"Authorization": "Bearer from-env"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
        assert store.take_checkpoint_request()
    finally:
        handle.stop()


def test_port_in_use_is_one_clear_error(store):
    handle = start_server(store, ServerConfig(port=0))
    try:
        with pytest.raises(DistillError, match=f"cannot listen on 127.0.0.1:{handle.port}"):
            start_server(store, ServerConfig(port=handle.port))
    finally:
        handle.stop()


def test_warns_when_exposed_without_token(store, caplog, monkeypatch):
    monkeypatch.delenv("DISTILL_SERVER_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING, logger="distill.observability.server.runner"):
        handle = start_server(store, ServerConfig(host="0.0.0.0", port=0))
    try:
        assert any("without a token" in rec.message for rec in caplog.records)
        with urllib.request.urlopen(handle.url + "healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        handle.stop()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distill.observability.server.runner"):
        start_server(store, ServerConfig(port=0)).stop()
        start_server(store, ServerConfig(host="0.0.0.0", port=0, token="t")).stop()
    assert not caplog.records


def test_internal_errors_are_json_500(store, monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(store, "status", broken)
    r = TestClient(create_app(store, None), raise_server_exceptions=False).get("/api/status")
    assert r.status_code == 500 and r.json() == {"detail": "internal error"}


def test_serve_dashboard_until_ctrl_c(store, tmp_path):
    run = MetricsStore("done-run", 50, CONFIG, output_dir=str(tmp_path))
    run.set_phase("distill")
    for step in range(1, 6):
        run.log({"step": step, "loss": 1.0 / step})
    run.finish({"final_loss": 0.2})
    run.close()
    code = (
        "import sys; from distill.observability.server import serve_dashboard as s; "
        "s(sys.argv[1], port=0)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = line.split(": ", 1)[1].split()[0]
        with urllib.request.urlopen(url + "api/status", timeout=5) as r:
            st = json.load(r)
        assert (st["run_name"], st["phase"], st["step"]) == ("done-run", "done", 5)
        with urllib.request.urlopen(url + "api/history", timeout=5) as r:
            assert [x["step"] for x in json.load(r)["records"]] == [1, 2, 3, 4, 5]
        with urllib.request.urlopen(url, timeout=5) as r:
            assert 'id="step"' in r.read().decode()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0, proc.stderr.read()
    finally:
        proc.kill()


def test_dashboard_on_a_running_run_names_its_server(store, tmp_path, capsys):
    """A run's server writes server.json while it is up: `distill dashboard` on that
    directory prints the run's URL and starts nothing (it used to fail on the port both
    took); once the server stops the record is gone and the dashboard serves by itself."""
    from distill.observability.server.runner import SERVER_RECORD, serve_dashboard

    handle = start_server(store, ServerConfig(port=0))
    handle.announce(tmp_path)
    try:
        assert json.loads((tmp_path / SERVER_RECORD).read_text())["url"] == handle.url
        serve_dashboard(str(tmp_path))  # returns at once: nothing to serve
        assert capsys.readouterr().out.strip().endswith(f"{handle.url} (the run's own server)")
    finally:
        handle.stop()
    assert not (tmp_path / SERVER_RECORD).exists()


def test_dashboard_takes_a_free_port_when_8080_is_taken(store, tmp_path, monkeypatch):
    """With no --port, the dashboard takes 8080 where free, else any free port, and its
    first line says which; a stale server.json (a killed run) is ignored."""
    from distill.observability.server import runner

    taken = start_server(store, ServerConfig(port=0))
    monkeypatch.setattr(runner, "DASHBOARD_PORT", taken.port)
    (tmp_path / runner.SERVER_RECORD).write_text(json.dumps({"host": "127.0.0.1", "port": 1}))
    MetricsStore("r", 5, CONFIG, output_dir=str(tmp_path)).close()
    code = (
        "import sys; from distill.observability.server import runner; "
        f"runner.DASHBOARD_PORT = {taken.port}; runner.serve_dashboard(sys.argv[1])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert f"port {taken.port} is taken" in line, line
        url = line.split(": ", 1)[1].split()[0]
        assert f":{taken.port}/" not in url
        with urllib.request.urlopen(url + "api/status", timeout=5) as r:
            assert json.load(r)["run_name"] == "r"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        taken.stop()


def test_status_shows_colocated_roles_on_the_same_devices(tmp_path):
    """The layout a colocated run gives the store (`distill.mesh.Meshes.layout`, as
    `distill run` sets it): /api/status names the placement and lists each device under
    both roles, each role with its own mesh axes."""
    from distill.config.load import config_from_dict
    from distill.mesh import build_meshes
    from tests.conftest import tiny_config

    tree = tiny_config("corpus", str(tmp_path))
    tree["mesh"] = {"placement": "colocated", "teacher": {"dp": 2, "tp": 2}, "student": {"dp": 4}}
    s = MetricsStore("colocated", total_steps=10, config={})
    s.set_mesh(build_meshes(config_from_dict(tree)).layout())
    mesh = TestClient(create_app(s, token=None)).get("/api/status").json()["mesh"]
    assert mesh["placement"] == "colocated"
    ids = {role: [d["id"] for d in mesh[role]["devices"]] for role in ("teacher", "student")}
    assert ids == {"teacher": [0, 1, 2, 3], "student": [0, 1, 2, 3]}
    assert mesh["teacher"]["shape"] == {"dp": 2, "ep": 1, "tp": 2}
    assert mesh["student"]["shape"] == {"dp": 4, "fsdp": 1}
