"""`distill serve CONFIG`: the config's teacher behind the completions API and distill's
binary top-k API, until Ctrl-C (`pipelines.serve`)."""

from __future__ import annotations

from distill.config import Config
from pipelines.serve.server import TeacherServer, load_service


def serve(cfg: Config, host: str, port: int, rows: int | None, wait_ms: float, longest) -> None:
    server = TeacherServer(load_service(cfg, rows, wait_ms, longest), host, port)
    svc = server.svc
    print(
        f"distill serve: {svc.model} (top-k {svc.top_k}, {svc.batcher.max_rows} rows a "
        f"forward) on {server.url} port {server.port}: POST /v1/completions, /generate, "
        "/v1/distill/topk; GET /status, /metrics",
        flush=True,
    )
    server.serve_forever()
