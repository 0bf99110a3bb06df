"""The server's own /openapi.json: every route is documented, and so is the error shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from gpufleet.server.routes import (
    blobs,
    dashboard,
    environments,
    events,
    hooks,
    jobs,
    metrics,
    sharing,
    workers,
)
from tests.integration.helpers import TESTCLIENT_ON_HTTPX

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX

# What the CLI, SDK and worker rely on; a route that vanishes from here breaks them.
EXPECTED = {
    ("GET", "/v1/health"),
    ("POST", "/v1/workers/{worker_id}/leave"),
    ("POST", "/v1/jobs/{ref}/stop"),
    ("DELETE", "/v1/workers/{ref}"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/{ref}"),
    ("POST", "/v1/jobs/{ref}/cancel"),
    ("POST", "/v1/jobs/{ref}/requeue"),
    ("GET", "/v1/jobs/{ref}/why"),
    ("GET", "/v1/jobs/{ref}/logs"),
    ("POST", "/v1/manifests"),
    ("GET", "/v1/status"),
    ("POST", "/v1/tokens"),
    ("POST", "/v1/webhooks"),
    ("GET", "/v1/webhooks"),
    ("DELETE", "/v1/webhooks/{hook_id}"),
    ("GET", "/v1/tokens"),
    ("DELETE", "/v1/tokens/{token_id}"),
    ("POST", "/v1/tokens/{token_id}/rotate"),
    ("GET", "/v1/whoami"),
    ("GET", "/v1/audit"),
    ("POST", "/v1/workers/select"),
    ("GET", "/v1/workers"),
    ("GET", "/v1/hosts"),
    ("GET", "/v1/workers/{ref}"),
    ("POST", "/v1/workers/{ref}/drain"),
    ("POST", "/v1/workers"),
    ("POST", "/v1/workers/{worker_id}/claim"),
    ("POST", "/v1/workers/{worker_id}/heartbeat"),
    ("POST", "/v1/jobs/{job_id}/start"),
    ("POST", "/v1/jobs/{job_id}/output"),
    ("POST", "/v1/jobs/{job_id}/finish"),
    ("POST", "/v1/reports"),
    ("POST", "/v1/jobs/{job_id}/release"),
    ("POST", "/v1/jobs/{job_id}/artifact"),
    ("GET", "/v1/jobs/{ref}/artifact"),
    ("POST", "/v1/jobs/{job_id}/checkpoints"),
    ("POST", "/v1/jobs/{ref}/pause"),
    ("POST", "/v1/jobs/{ref}/resume"),
    ("GET", "/v1/jobs/{ref}/checkpoints"),
    ("HEAD", "/v1/blobs/{sha256}"),
    ("GET", "/v1/blobs/{sha256}"),
    ("PUT", "/v1/blobs/{sha256}"),
    ("GET", "/v1/blobs"),
    ("POST", "/v1/uploads"),
    ("GET", "/v1/uploads/{upload_id}"),
    ("PATCH", "/v1/uploads/{upload_id}"),
    ("DELETE", "/v1/uploads/{upload_id}"),
    ("GET", "/v1/jobs/{ref}/events"),
    ("GET", "/v1/events"),
    ("GET", "/metrics"),
    ("POST", "/v1/session"),
    ("GET", "/v1/session"),
    ("DELETE", "/v1/session"),
    ("GET", "/v1/usage"),
    ("GET", "/v1/environments/locks/{key}"),
    ("PUT", "/v1/environments/locks/{key}"),
}


def _api_routes(routes: list[Any]) -> list[APIRoute]:
    """The APIRoutes under ``routes``, looking inside included routers.

    FastAPI 0.16x keeps an included router as one wrapper entry (``original_router``) in
    ``app.routes`` instead of copying its routes; older versions copy them.
    """
    out: list[APIRoute] = []
    for route in routes:
        if isinstance(route, APIRoute):
            if route.include_in_schema:  # the dashboard's page is not part of the API
                out.append(route)
        elif (inner := getattr(route, "original_router", None)) is not None:
            out.extend(_api_routes(list(inner.routes)))
    return out


def _operations(routes: list[APIRoute]) -> set[tuple[str, str]]:
    """(method, path) served; HEAD only where it is a route of its own (not GET's echo)."""
    return {(m, r.path) for r in routes for m in r.methods if m != "HEAD" or r.methods == {"HEAD"}}


def _spec(client: TestClient) -> dict[str, Any]:
    r = client.get("/openapi.json")  # no token: the schema is public
    assert r.status_code == 200, r.text
    spec: dict[str, Any] = r.json()
    return spec


def _documented(spec: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}


def test_app_serves_every_router(app: FastAPI) -> None:
    served = _operations(_api_routes(list(app.routes)))
    routers = _operations(
        _api_routes(
            list(jobs.router.routes)
            + list(workers.router.routes)
            + list(blobs.router.routes)
            + list(environments.router.routes)
            + list(events.router.routes)
            + list(sharing.router.routes)
            + list(hooks.router.routes)
            + list(metrics.router.routes)
            + list(dashboard.router.routes)
        )
    )
    assert served == routers
    assert served == EXPECTED


def test_openapi_lists_every_route(client: TestClient, app: FastAPI) -> None:
    spec = _spec(client)
    assert spec["info"]["title"] == "gpufleet"
    documented = _documented(spec)
    served = _operations(_api_routes(list(app.routes)))
    assert served - documented == set()
    assert documented - served == set()
    assert {p for p in spec["paths"]} == {p for _, p in EXPECTED}


def test_openapi_documents_every_request_and_response_model(client: TestClient) -> None:
    spec = _spec(client)
    schemas = set(spec["components"]["schemas"])
    for name in (
        "JobSpecModel",
        "SubmitResult",
        "ManifestApply",
        "ApplyResult",
        "WorkerRegister",
        "ClaimRequest",
        "Lease",
        "HeartbeatRequest",
        "WhyOut",
        "TokenCreated",
    ):
        assert name in schemas, name
    submit = spec["paths"]["/v1/jobs"]["post"]
    body = submit["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/JobSpecModel"}
    stale = spec["paths"]["/v1/jobs/{job_id}/finish"]["post"]["responses"]
    assert "409" in stale and "stale lease" in stale["409"]["description"]


def test_openapi_documents_the_error_shape(client: TestClient) -> None:
    """Every error is ``ErrorBody`` on the wire, so the schema should say so.

    src bug today: ``ErrorBody`` is not in the schema at all, and every 422 is documented as
    FastAPI's ``HTTPValidationError`` (``{"detail": [...]}``), a shape the server never sends;
    a client generated from /openapi.json would mis-read every validation error.
    """
    spec = _spec(client)
    assert "ErrorBody" in sorted(spec["components"]["schemas"])
    wrong = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status, response in op["responses"].items():
                if not status.startswith(("4", "5")):
                    continue
                schema = response.get("content", {}).get("application/json", {}).get("schema")
                if schema != {"$ref": "#/components/schemas/ErrorBody"}:
                    wrong.append(f"{method.upper()} {path} {status}: {schema}")
    assert wrong == []
