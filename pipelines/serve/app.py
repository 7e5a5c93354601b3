"""The HTTP side of `distill serve`: the routes over one `Service` (the teacher's batcher).

    POST /v1/completions    OpenAI completions: echo, logprobs: k, vLLM's prompt_logprobs: k
    POST /generate          SGLang's: return_logprob, logprob_start_len 0, top_logprobs_num
    POST /v1/distill/topk   the binary top-k rows of distill clients (`pipelines.serve.wire`)
    GET  /v1/models         the one served model
    GET  /status            JSON: the model, k, the vocabulary, requests, tokens, batches
    GET  /metrics           Prometheus text format
    GET  /healthz           200 {"ok": true}

A bad request gets a 400 with the reason (OpenAI's error shape); a forward that fails, a
500; neither stops the server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from distill.data.tokenizers import Tokenizer
from pipelines.serve import apis
from pipelines.serve.batcher import Batcher
from pipelines.serve.scorer import Row
from teacher import wire

_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Service:
    """What the routes serve: the model's name, its tokenizer, vocabulary and k, the
    batcher, and the counters behind /status and /metrics."""

    model: str
    tokenizer: Tokenizer
    vocab: int
    top_k: int
    max_len: int
    batcher: Batcher | None = None
    started: float = field(default_factory=time.time)
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry())
    counts: dict = field(default_factory=lambda: {"requests": 0, "tokens": 0, "batches": 0,
                                                  "rows": 0, "errors": 0})  # fmt: skip

    def __post_init__(self):
        r = self.registry
        self.requests = Counter("distill_serve_requests", "Requests answered", ["api"], registry=r)
        self.errors = Counter("distill_serve_errors", "Requests refused or failed", ["api"],
                              registry=r)  # fmt: skip
        self.tokens = Counter("distill_serve_tokens", "Prompt tokens scored", registry=r)
        self.latency = Histogram("distill_serve_latency_seconds", "Request latency", ["api"],
                                 registry=r)  # fmt: skip
        self.batch_rows = Histogram("distill_serve_batch_rows", "Rows per teacher forward",
                                    buckets=_ROWS_BUCKETS, registry=r)  # fmt: skip
        self.forward = Histogram("distill_serve_forward_seconds", "Teacher forward time",
                                 registry=r)  # fmt: skip

    def on_batch(self, rows: int, seconds: float) -> None:
        self.counts["batches"] += 1
        self.counts["rows"] += rows
        self.batch_rows.observe(rows)
        self.forward.observe(seconds)

    def status(self) -> dict:
        c = self.counts
        return {
            "model": self.model,
            "top_k": self.top_k,
            "vocab_size": self.vocab,
            "max_len": self.max_len,
            "batch_rows": self.batcher.max_rows if self.batcher else None,
            "uptime_s": time.time() - self.started,
            **c,
            "mean_batch_rows": c["rows"] / c["batches"] if c["batches"] else None,
        }

    async def score(self, rows: list[Row], targets: bool, temperature: float = 1.0) -> list:
        for row in rows:
            if len(row.tokens) > self.max_len:
                raise apis.BadRequest(f"a prompt of {len(row.tokens)} tokens; at most "
                                      f"{self.max_len} are served")  # fmt: skip
        return await asyncio.wrap_future(self.batcher.submit(rows, targets, temperature))

    def answered(self, api: str, t0: float, tokens: int) -> None:
        self.counts["requests"] += 1
        self.counts["tokens"] += tokens
        self.requests.labels(api).inc()
        self.tokens.inc(tokens)
        self.latency.labels(api).observe(time.perf_counter() - t0)

    def refused(self, api: str, why: str, status: int = 400) -> JSONResponse:
        self.counts["errors"] += 1
        self.errors.labels(api).inc()
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": why, "type": kind}}, status_code=status)


def create_app(svc: Service) -> FastAPI:
    app = FastAPI(title="distill serve", docs_url=None, redoc_url=None, openapi_url=None)

    for path, api, handler in (
        ("/v1/completions", "openai", _completions),
        ("/generate", "sglang", _generate),
        ("/v1/distill/topk", "distill", _topk),
    ):
        app.add_api_route(path, _route(svc, api, handler), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model, "object": "model",
                                            "owned_by": "distill"}]}  # fmt: skip

    @app.get("/status")
    async def status():
        return svc.status()

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(svc.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _route(svc: Service, api: str, handler):
    async def route(request: Request):
        return await _guarded(svc, api, handler, request)

    return route


async def _json_body(svc: Service, request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise apis.BadRequest("the body is not JSON") from None
    if not isinstance(body, dict):
        raise apis.BadRequest("the body is not a JSON object")
    if body.get("model") not in (None, svc.model):
        raise apis.BadRequest(f"model: {body['model']!r} is not served (only {svc.model!r})")
    return body


async def _guarded(svc: Service, api: str, handler, request: Request):
    t0 = time.perf_counter()
    try:
        response, tokens = await handler(svc, request)
    except (apis.BadRequest, wire.WireError) as e:
        return svc.refused(api, str(e))
    except Exception as e:  # a failed forward: this request only
        return svc.refused(api, f"{type(e).__name__}: {e}", 500)
    svc.answered(api, t0, tokens)
    return response


async def _completions(svc: Service, request: Request):
    body = await _json_body(svc, request)
    prompts = apis.prompts_of(body, svc.tokenizer, svc.vocab)
    k = apis.int_field(body, "logprobs", None, 0, svc.top_k)
    pk = apis.int_field(body, "prompt_logprobs", None, 0, svc.top_k)
    new = apis.int_field(body, "max_tokens", 16, 0, 10**9)
    if new > 1:
        raise apis.BadRequest("max_tokens: 0 or 1; distill serve scores prompts")
    if body.get("n", 1) != 1 or body.get("stream"):
        raise apis.BadRequest("n: 1 and stream: false only")
    body["prompt_logprobs"] = pk
    scored = await svc.score([Row.prompt(p) for p in prompts], targets=True)
    full = apis.extended(prompts, scored, new)
    choices = [
        apis.openai_choice(svc.tokenizer, s, ids, len(p), body, k, j)
        for j, (p, s, ids) in enumerate(zip(prompts, scored, full, strict=True))
    ]
    n = sum(len(p) for p in prompts)
    resp = apis.completion_response(svc.model, choices, n, new * len(prompts))
    return JSONResponse(resp), n


async def _generate(svc: Service, request: Request):
    body = await _json_body(svc, request)
    key = "input_ids" if body.get("input_ids") is not None else "text"
    prompts = apis.prompts_of(body, svc.tokenizer, svc.vocab, key)
    params = body.get("sampling_params") or {}
    if params.get("max_new_tokens", 0) != 0:
        raise apis.BadRequest("sampling_params.max_new_tokens: 0; distill serve scores")
    if not body.get("return_logprob") or body.get("logprob_start_len", -1) != 0:
        raise apis.BadRequest("return_logprob: true and logprob_start_len: 0 only")
    k = apis.int_field(body, "top_logprobs_num", 0, 0, svc.top_k)
    scored = await svc.score([Row.prompt(p) for p in prompts], targets=True)
    text = bool(body.get("return_text_in_logprobs"))
    out = [
        apis.sglang_result(svc.tokenizer, s, p, k, text)
        for p, s in zip(prompts, scored, strict=True)
    ]
    single = (
        key == "text"
        and isinstance(body[key], str)
        or (key == "input_ids" and apis._is_ids(body[key]))
    )
    return JSONResponse(out[0] if single else out), sum(len(p) for p in prompts)


async def _topk(svc: Service, request: Request):
    tokens, segments, positions, k, temperature = wire.decode_request(await request.body())
    if not 1 <= k <= svc.top_k:
        raise apis.BadRequest(f"k: {k}; between 1 and {svc.top_k}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= svc.vocab):
        raise apis.BadRequest(f"tokens: ids must lie in [0, {svc.vocab})")
    rows = [Row(*r) for r in zip(tokens, segments, positions, strict=True)]
    scored = await svc.score(rows, targets=False, temperature=temperature)
    lp = np.stack([s.logprobs[:, :k] for s in scored]) if scored else np.zeros((0, 0, k))
    ids = np.stack([s.ids[:, :k] for s in scored]) if scored else np.zeros((0, 0, k))
    body = wire.encode_response(tokens, lp, ids, temperature)
    return Response(body, media_type=wire.CONTENT_TYPE), int(tokens.size)
