"""The HTTP API and dashboard over a MetricsStore.

Handlers only read the store's plain Python data (never device arrays), so a request
costs the training loop one short lock hold at most. Everything a client can send is
validated here: bad input gets a 4xx JSON answer and never reaches the run.

    GET  /healthz          200 {"ok": true, ...} or 503 {"ok": false, "reason": ...}
    GET  /api/status       MetricsStore.status()
    GET  /api/history      ?since=STEP&after=SEQ -> {"epoch", "next", "records"}
    GET  /api/config       the resolved config, secrets redacted
    GET  /metrics          Prometheus text format
    GET  /                 the dashboard (static/, served from here: no CDN)
    POST /api/checkpoint   with a token only: Authorization: Bearer <token>
    POST /api/stop         with a token only: save, then exit cleanly
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, StateSetMetricFamily

from distill.observability.metrics import PHASES, MetricsStore

STATIC_DIR = Path(__file__).parent / "static"
_NO_STORE = {"Cache-Control": "no-store"}


def create_app(store: MetricsStore, token: str | None) -> FastAPI:
    """The app for one run. With a ``token`` it also has the POST control endpoints."""
    app = FastAPI(title="distill", docs_url=None, redoc_url=None, openapi_url=None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StoreCollector(store))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": "internal error"}, status_code=500)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ok, reason = store.health()
        return _json({"ok": ok, "reason": reason}, 200 if ok else 503)

    @app.get("/api/status")
    async def status() -> JSONResponse:
        return _json(store.status())

    @app.get("/api/history")
    async def history(
        since: int = Query(-1, ge=-1, description="Only records with step > since."),
        after: int = Query(-1, ge=-1, description="Only records with seq > after."),
    ) -> JSONResponse:
        return _json(store.history_page(since=since, after=after))

    @app.get("/api/config")
    async def config() -> JSONResponse:
        return _json(store.config)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=_NO_STORE)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    if token:
        expected = token.encode()

        def authorize(request: Request) -> None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), expected
            ):
                raise HTTPException(
                    401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
                )

        @app.post("/api/checkpoint")
        async def checkpoint(request: Request) -> JSONResponse:
            authorize(request)
            store.request_checkpoint()
            return _json({"ok": True, "checkpoint_requested": True})

        @app.post("/api/stop")
        async def stop(request: Request) -> JSONResponse:
            authorize(request)
            store.request_stop()
            return _json({"ok": True, "stop_requested": True})

    return app


def _json(content: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(content, status_code=status_code, headers=_NO_STORE)


class _StoreCollector:
    """Prometheus figures read from the store at scrape time (the same as /api/status)."""

    _GAUGES = (
        ("step", "distill_step", "Current step of the phase's counter."),
        ("total_steps", "distill_total_steps", "Total steps of the phase's counter."),
        ("loss", "distill_loss", "Latest training loss."),
        ("kd_loss", "distill_kd_loss", "Latest distillation (KD) loss."),
        ("ce_loss", "distill_ce_loss", "Latest cross-entropy loss."),
        ("lr", "distill_learning_rate", "Latest learning rate."),
        ("alpha", "distill_alpha", "The divergence's weight of the next steps (0: no teacher)."),
        ("teacher_off_steps", "distill_teacher_off_steps", "Steps the alpha gate ran without KD."),
        ("tokens_per_s", "distill_tokens_per_second", "Training throughput."),
        ("eta_s", "distill_eta_seconds", "Estimated time to the end of the phase."),
        ("in_flight", "distill_teacher_outputs_in_flight", "Teacher outputs in flight."),
        ("bytes_per_token", "distill_bytes_per_token", "Bytes per token between meshes."),
        ("restarts", "distill_restarts", "Restarts of the run or its actors."),
        ("on_policy", "distill_on_policy_ratio", "Share of recent steps trained on-policy."),
        ("generate_ms", "distill_generate_ms", "Student generation ms per on-policy batch."),
        ("gen_tokens_per_s", "distill_generated_tokens_per_second", "Generation throughput."),
        ("staleness", "distill_staleness_steps", "Steps between sampling and training params."),
        ("expert_load_max_mean", "distill_expert_load_max_mean", "MoE teacher: max/mean load."),
        ("expert_dropped", "distill_expert_dropped_ratio", "MoE teacher: assignments dropped."),
    )
    _EVAL = (
        "teacher_loss", "student_loss", "kl", "top1_agreement", "sample_teacher_nll",
        "sample_student_nll", "sample_kl", "sample_len",
    )  # fmt: skip

    def __init__(self, store: MetricsStore) -> None:
        self.store = store

    def collect(self):
        s = self.store.status()
        yield InfoMetricFamily("distill_run", "The run.", value={"run_name": s["run_name"]})
        yield StateSetMetricFamily(
            "distill_phase", "Phase of the run.", {p: p == s["phase"] for p in PHASES}
        )
        yield _gauge("distill_healthy", "1 while /healthz is 200.", float(s["healthy"]))
        for key, name, doc in self._GAUGES:
            yield from _maybe_gauge(name, doc, s[key])
        busy = GaugeMetricFamily(
            "distill_busy_ratio", "Fraction of time each mesh is busy.", labels=["mesh"]
        )
        for mesh in ("teacher", "student"):
            if isinstance(s[f"{mesh}_busy"], int | float):
                busy.add_metric([mesh], s[f"{mesh}_busy"])
        yield busy
        if isinstance(s["kd_loss_by_teacher"], dict):  # several teachers
            kd = GaugeMetricFamily(
                "distill_teacher_kd_loss",
                "Several teachers: the latest divergence to each.",
                labels=["teacher"],
            )
            for name, value in s["kd_loss_by_teacher"].items():
                if isinstance(value, int | float):
                    kd.add_metric([name], value)
            yield kd
        if isinstance(s["expert_load"], list):
            load = GaugeMetricFamily(
                "distill_expert_load_ratio",
                "MoE teacher: each expert's share of the routed assignments.",
                labels=["expert"],
            )
            for e, share in enumerate(s["expert_load"]):
                if isinstance(share, int | float):
                    load.add_metric([str(e)], share)
            yield load
        ev = s["latest_eval"] or {}
        for key in self._EVAL:
            yield from _maybe_gauge(f"distill_eval_{key}", f"Latest eval {key}.", ev.get(key))
        if ev:
            yield from _maybe_gauge("distill_eval_step", "Step of the latest eval.", ev["step"])
        yield _gauge(
            "distill_alpha_gate_changes", "Changes of the alpha gate.", len(s["alpha_gate"])
        )
        ckpt = s["last_checkpoint"] or {}
        yield from _maybe_gauge(
            "distill_last_checkpoint_step", "Step of the last checkpoint.", ckpt.get("step")
        )
        yield from _maybe_gauge(
            "distill_last_checkpoint_timestamp_seconds",
            "Unix time of the last checkpoint.",
            ckpt.get("time"),
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _maybe_gauge(name: str, doc: str, value: Any):
    if isinstance(value, int | float) and not isinstance(value, bool):
        yield _gauge(name, doc, float(value))
