"""The status service: a FastAPI app over the run's MetricsStore, served by uvicorn.

``start_server`` runs it in a daemon thread of the process that drives the run;
``serve_dashboard`` serves a run directory's metrics.jsonl (``distill dashboard``).
"""

from distill.observability.server.app import create_app
from distill.observability.server.runner import ServerHandle, serve_dashboard, start_server

__all__ = ["ServerHandle", "create_app", "serve_dashboard", "start_server"]
