"""Serving the status app with uvicorn: in a daemon thread beside a run, or blocking for
``distill dashboard``.

A run's server writes ``server.json`` (its URL, host and pid) into the run directory while
it is up, so ``distill dashboard`` on that directory points at it instead of starting a
second server on the same port.

We bind the listening socket ourselves and hand it to uvicorn, so port 0 (any free port)
is known before uvicorn starts, and a port already taken fails at once with one clear line.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from etils import epath

from distill.config import ServerConfig
from distill.errors import DistillError
from distill.observability.metrics import MetricsStore
from distill.observability.metrics_log import dumps
from distill.observability.server.app import create_app

log = logging.getLogger(__name__)

TOKEN_ENV = "DISTILL_SERVER_TOKEN"
SERVER_RECORD = "server.json"  # in the run directory while the run's server is up
DASHBOARD_PORT = 8080  # `distill dashboard`'s port when free, else any free one
_START_TIMEOUT_S = 15.0


@dataclass
class ServerHandle:
    """A running server: ``url`` reaches it from this machine; ``stop()`` shuts it down."""

    url: str
    host: str
    port: int
    _server: uvicorn.Server = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _sock: socket.socket = field(repr=False)
    _record: epath.Path | None = field(default=None, repr=False)

    def announce(self, run_dir) -> None:
        """Write ``server.json`` into ``run_dir`` (removed by ``stop``)."""
        record = epath.Path(run_dir) / SERVER_RECORD
        record.parent.mkdir(parents=True, exist_ok=True)
        info = {"url": self.url, "host": self.host, "port": self.port, "pid": os.getpid()}
        record.write_text(dumps({**info, "hostname": socket.gethostname()}) + "\n")
        self._record = record

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and wait for the thread; safe to call twice."""
        if self._record is not None:
            self._record.unlink(missing_ok=True)
            self._record = None
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(1.0)
        self._sock.close()


def start_server(store: MetricsStore, cfg: ServerConfig) -> ServerHandle:
    """Serve ``store`` on ``cfg.host:cfg.port`` from a daemon thread; return once it
    accepts connections. The token is ``cfg.token`` or $DISTILL_SERVER_TOKEN."""
    token = cfg.token or os.environ.get(TOKEN_ENV) or None
    _warn_if_exposed(cfg.host, token)
    sock = _bind(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(_uvicorn_config(create_app(store, token)))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="distill-server", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the status server did not start on {cfg.host}:{port}")
        time.sleep(0.01)
    url = _url(cfg.host, port)
    _wait_accepting(_local_host(cfg.host), port, deadline)
    return ServerHandle(url, cfg.host, port, server, thread, sock)


def serve_dashboard(output_dir: str, host: str = "127.0.0.1", port: int | None = None) -> None:
    """Serve the dashboard and API of the run in ``output_dir`` until Ctrl-C. It follows
    metrics.jsonl, so it also shows a run going on in another process; where that run's
    own server is up (its ``server.json``), it prints that server's URL and starts none.
    ``port`` None: 8080 where free, else any free port (the line printed says which)."""
    live = running_server(output_dir)
    if live is not None:
        print(f"dashboard of {output_dir}: {live} (the run's own server)", flush=True)
        return
    store = MetricsStore.from_run_dir(output_dir)
    _warn_if_exposed(host, None)
    note = ""
    if port is None:
        try:
            sock = _bind(host, DASHBOARD_PORT)
        except DistillError:
            sock, note = _bind(host, 0), f"; port {DASHBOARD_PORT} is taken"
    else:
        sock = _bind(host, port)
    server = uvicorn.Server(_uvicorn_config(create_app(store, token=None)))
    url = _url(host, sock.getsockname()[1])
    print(f"dashboard of {output_dir}: {url} (Ctrl-C stops{note})", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled
        pass
    finally:
        sock.close()


def running_server(run_dir) -> str | None:
    """The URL in ``run_dir``'s ``server.json`` when that server accepts connections (a
    record left by a killed run, or one written on another host, is ignored)."""
    record = epath.Path(run_dir) / SERVER_RECORD
    try:
        info = json.loads(record.read_text())
        host, port, url = _local_host(info["host"]), int(info["port"]), str(info["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if info.get("hostname") != socket.gethostname():
        return None
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return None
    return url


def _uvicorn_config(app) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_config=None,  # leave the run's logging setup alone
        log_level="warning",
        access_log=False,
        lifespan="off",
        server_header=False,
        limit_concurrency=64,  # beyond this, 503 at once rather than queueing
        timeout_keep_alive=5,
        timeout_graceful_shutdown=2,
    )


def _bind(host: str, port: int) -> socket.socket:
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = info[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise DistillError(f"server: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _warn_if_exposed(host: str, token: str | None) -> None:
    if not token and not _is_loopback(host):
        log.warning(
            "status server on non-loopback %s without a token: anyone who can reach it sees "
            "the run (set server.token or %s to guard it)",
            host,
            TOKEN_ENV,
        )


def _local_host(host: str) -> str:
    """An address of this machine that reaches a server bound to ``host``."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _url(host: str, port: int) -> str:
    h = _local_host(host)
    return f"http://[{h}]:{port}/" if ":" in h else f"http://{h}:{port}/"


def _wait_accepting(host: str, port: int, deadline: float) -> None:
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the status server does not accept on {host}:{port}") from None
            time.sleep(0.02)
