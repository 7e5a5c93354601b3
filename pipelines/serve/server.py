"""`distill serve`'s server: the config's teacher on its inference mesh, behind uvicorn.

The socket is bound before uvicorn starts, so port 0 (any free one) is known at once and
said on startup. `TeacherServer.start()` serves from a thread (tests, benchmarks);
`serve_forever()` blocks until Ctrl-C or SIGTERM (the command).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from distill.checkpoint import params_exist
from distill.config import Config
from distill.data.tokenizers import load_tokenizer
from distill.errors import DistillError
from distill.mesh import role_mesh
from distill.outputs import teacher_path
from pipelines.serve.app import Service, create_app
from pipelines.serve.batcher import Batcher
from pipelines.serve.scorer import Scorer, check_servable

log = logging.getLogger("distill")


def load_service(
    cfg: Config, rows: int | None = None, wait_ms: float = 5.0, longest: int | None = None
) -> Service:
    """The teacher of `cfg` on its mesh (this host's first devices) with its batcher:
    `rows` per forward (default `train.batch_size`), the first request of a batch waiting
    `wait_ms` for others, prompts of up to `longest` tokens (default `max_len`)."""
    check_servable(cfg)
    if not params_exist(teacher_path(cfg)):
        raise DistillError(f"teacher.checkpoint: {teacher_path(cfg)} has no weights to serve")
    mesh = role_mesh(cfg, "teacher")
    cfg.resolve_dtypes(mesh.devices.flat[0].platform)
    tok = load_tokenizer(cfg.teacher.tokenizer or cfg.data.tokenizer, "data.tokenizer")
    scorer = Scorer(cfg, mesh, tok, rows or cfg.train.batch_size)
    svc = Service(cfg.run.name, tok, scorer.vocab, scorer.top_k, max_len=longest or max_len(cfg))
    svc.batcher = Batcher(scorer.score, scorer.rows, wait_ms / 1000, svc.on_batch)
    return svc


def max_len(cfg: Config) -> int:
    """The longest prompt served by default: 4096 tokens, or a row of the config's and its
    next token (each length bucket compiles once, when first asked for)."""
    return max(4096, cfg.train.seq_len + 1)


class TeacherServer:
    """A `Service` served on `host:port` (0: a free port, read back as `self.port`)."""

    def __init__(self, svc: Service, host: str = "127.0.0.1", port: int = 0):
        self.svc, self.host = svc, host
        self._sock = _bind(host, port)
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(svc),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://{host}:{self.port}"

    def start(self) -> TeacherServer:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"distill serve did not start on {self.url}")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5)
        self.close()

    def close(self) -> None:
        self._sock.close()
        if self.svc.batcher is not None:
            self.svc.batcher.close()


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(256)
    except OSError as e:
        raise DistillError(f"--port: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
