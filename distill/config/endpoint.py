"""The `teacher.endpoint` section: a teacher behind an HTTP server (`teacher.source:
endpoint`), and what a run with one cannot do yet (`check_endpoint`, before any device work).

The client is `teacher.endpoint`; the APIs' formats are `teacher.endpoint_apis`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from distill.config.model import Section
from distill.errors import DistillError

API_DOC = (
    "The server's API. openai: /v1/completions with echo and logprobs (vLLM); llamacpp: "
    "llama-cpp-python's server (python -m llama_cpp.server), its /v1/completions with echo "
    "and logprobs on text prompts; vllm: /v1/completions with vLLM's prompt_logprobs; "
    "sglang: SGLang's /generate with return_logprob, logprob_start_len 0 and "
    "top_logprobs_num; distill: `distill serve`'s binary top-k rows (/v1/distill/topk), the "
    "only one at the run's distill.temperature (the others give log-probs at temperature 1)."
)


log = logging.getLogger("distill")


class EndpointConfig(Section):
    """Where the teacher is served and how it is asked (docs/guides/teacher-endpoint.md)."""

    url: str = Field(
        description="The server's base URL, http:// or https:// (e.g. http://teacher:8000); "
        "the API's path is added to it."
    )
    api: Literal["openai", "vllm", "sglang", "llamacpp", "distill"] = Field(description=API_DOC)
    model: str | None = Field(
        None,
        description="The served model's name, sent as the request's model (vLLM's "
        "--served-model-name); None: not sent (a server with one model answers with it).",
    )
    top_k: int | None = Field(
        None,
        ge=1,
        description="Log-probs asked for at each position; None: teacher.top_k. At least "
        "teacher.top_k, of which the run keeps the largest. Servers cap it (vLLM's "
        "--max-logprobs, 20 by default; distill serve's teacher.top_k).",
    )
    concurrency: int = Field(
        4, ge=1, description="Requests in flight at most, over every batch in flight."
    )
    rows_per_request: int = Field(
        1,
        ge=1,
        description="Batch rows per request (the JSON APIs: each row's documents as a list "
        "of prompts; distill: rows of the binary wire).",
    )
    timeout_s: float = Field(120.0, gt=0, description="Seconds a request may take.")
    retries: int = Field(
        20,
        ge=0,
        description="Retries of a request that failed transiently (connection refused or "
        "reset, a timeout, HTTP 408, 429 or 5xx) before the run stops; the run waits meanwhile "
        "(by default about 8 minutes in all, time for a server to restart).",
    )
    backoff_s: float = Field(
        1.0,
        gt=0,
        description="Wait before the first retry, doubled after each (at most max_backoff_s).",
    )
    max_backoff_s: float = Field(30.0, gt=0, description="The longest wait between retries.")
    api_key_env: str | None = Field(
        None,
        description="Name of an environment variable holding the server's API key, sent as "
        "'Authorization: Bearer <key>'; None: no key.",
    )
    tls_verify: bool = Field(True, description="Verify an https:// server's certificate.")
    ca_file: str | None = Field(
        None, description="A PEM file of the certificate authorities to verify it with."
    )

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
            raise ValueError(f"{url!r}: an http:// or https:// URL")
        return url.rstrip("/")

    def api_key(self) -> str | None:
        """The key read from `api_key_env`, or None when no variable is named."""
        if self.api_key_env is None:
            return None
        return os.environ.get(self.api_key_env)


# What an endpoint teacher cannot do yet (key, is it asked for, why), refused by validate.
def _refused(cfg) -> list[tuple[str, bool, str]]:
    return [
        ("pipeline.mode", cfg.pipeline.mode == "ray",
         "ray mode runs its teacher in its own actors; use pipeline.mode: local"),
        ("teacher.tokenizer", cfg.cross_tokenizer(),
         "the server must share data.tokenizer (cross-tokenizer through an endpoint is not "
         "built yet)"),
        ("distill.on_policy.fraction", cfg.distill.on_policy.fraction > 0,
         "scoring the student's samples through an endpoint is not built yet"),
        ("teacher.pretrain_steps",
         cfg.teacher.pretrain_steps > 0 and cfg.student.init == "random",
         "the server's teacher is not bootstrapped here; set teacher.pretrain_steps: 0"),
        ("distill.alpha_gate", cfg.distill.alpha_gate,
         "the gate follows the teacher's held-out figures, which need the dense logits a "
         "server does not give; set distill.alpha_gate: false"),
    ]  # fmt: skip


def check_endpoint(cfg) -> None:
    """`teacher.source: endpoint` and `teacher.endpoint` agree with the rest of the config
    (`cfg`, a `distill.config.Config`, whose module imports this one); one DistillError
    naming the field otherwise. No request is made."""
    t, ep = cfg.teacher, cfg.teacher.endpoint
    if t.source != "endpoint":
        if ep is not None:
            raise DistillError(
                f"teacher.endpoint: read only with teacher.source: endpoint (it is "
                f"{t.source}); remove it or set teacher.source: endpoint"
            )
        return
    if ep is None:
        raise DistillError(
            "teacher.endpoint: required with teacher.source: endpoint (at least url and api)"
        )
    if t.top_k is None:
        raise DistillError(
            "teacher.top_k: a served teacher answers top-k log-probs; set teacher.top_k "
            "(servers cap k, vLLM at 20 by default)"
        )
    if ep.top_k is not None and ep.top_k < t.top_k:
        raise DistillError(
            f"teacher.endpoint.top_k: {ep.top_k} is below teacher.top_k ({t.top_k}), the k "
            "the run trains on"
        )
    if ep.api != "distill" and cfg.distill.temperature != 1.0:
        raise DistillError(
            f"distill.temperature: {cfg.distill.temperature}, but teacher.endpoint.api "
            f"{ep.api} returns log-probs at temperature 1; set distill.temperature: 1, or "
            "serve the teacher with distill serve (api: distill)"
        )
    for key, bad, why in _refused(cfg):
        if bad:
            raise DistillError(f"{key}: not supported with teacher.source: endpoint; {why}")
    _check_access(ep)
    _warn_unread(cfg)


def _warn_unread(cfg) -> None:
    """One warning naming the keys set for a local teacher that a served one leaves unread:
    how the teacher runs is the server's (its model still gives the student's defaults)."""
    t = cfg.teacher
    unread = [f"teacher.{k}" for k in ("microbatch", "moe_capacity_factor")
              if k in t.model_fields_set]  # fmt: skip
    local = any(one.loaded() for one in cfg.teachers)  # several: the mesh is theirs too
    if not local:
        unread += [f"mesh.teacher.{k}" for k in sorted(cfg.mesh.teacher.model_fields_set)]
    if unread:
        log.warning(
            "teacher.source: endpoint: %s set but not read (the server runs the teacher)",
            ", ".join(unread),
        )


def _check_access(ep: EndpointConfig) -> None:
    if ep.api_key_env is not None and not os.environ.get(ep.api_key_env):
        raise DistillError(
            f"teacher.endpoint.api_key_env: the environment variable {ep.api_key_env} is "
            "not set (or empty)"
        )
    if ep.ca_file is not None:
        if not ep.url.startswith("https://"):
            raise DistillError(
                f"teacher.endpoint.ca_file: read only for an https:// url ({ep.url})"
            )
        if not Path(ep.ca_file).is_file():
            raise DistillError(f"teacher.endpoint.ca_file: {ep.ca_file} is not a file")
