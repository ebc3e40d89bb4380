"""``/metrics`` for Prometheus: open like ``/health`` (it shows job ids and counts, no data or secrets)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["monitoring"])


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus text format: job progress, rates, ETA, shards, workers, queue, free space."""
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
