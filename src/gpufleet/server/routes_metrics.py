"""``GET /metrics``: Prometheus's text format (see :mod:`gpufleet.server.metrics`).

It needs an operator or admin token, unless the server runs with ``--metrics-public``
(for a scraper on a trusted network that holds no token)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from gpufleet.server import deps
from gpufleet.server.deps import state

router = APIRouter(tags=["meta"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    """Queue, fleet and server metrics in Prometheus's text format: an operator's or
    admin's token, unless the server runs with --metrics-public."""
    st = state(request)
    if not st.metrics_public:
        await deps.operator(request)
    body = await run_in_threadpool(generate_latest, st.services.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
