"""``GET /metrics``: Prometheus's text format (see :mod:`gpufleet.server.metrics`).

It needs an admin's token or an operator's of every pool, unless the server runs with
``--metrics-public`` (for a scraper on a trusted network that holds no token). An operator
scoped to some pools is refused: the metrics count the whole fleet (every pool's queue,
workers and GPU use), and what they would show of other pools is what its scope hides."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from gpufleet.errors import Forbidden
from gpufleet.server import deps
from gpufleet.server.deps import state

router = APIRouter(tags=["meta"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    """Queue, fleet and server metrics in Prometheus's text format: an admin's token or an
    operator's of every pool, unless the server runs with --metrics-public."""
    st = state(request)
    if not st.metrics_public:
        caller = await deps.operator(request)
        if caller.pools is not None:
            raise Forbidden(
                "/metrics counts every pool of the fleet: it needs an admin's token or an "
                f"operator's of every pool (this one is scoped to {', '.join(caller.pools)})",
                detail={"pools": list(caller.pools)},
            )
    body = await run_in_threadpool(generate_latest, st.services.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
