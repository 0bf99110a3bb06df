"""Small helpers shared by the integration tests: headers, request bodies, error checks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

# starlette 1.x warns once, when `starlette.testclient` is first imported, that it runs on
# `httpx` rather than `httpx2`. Every integration module ignores exactly that warning.
TESTCLIENT_ON_HTTPX = pytest.mark.filterwarnings(
    "ignore:Using `httpx` with `starlette.testclient` is deprecated"
    ":starlette.exceptions.StarletteDeprecationWarning"
)

GIB = 1024  # MiB


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def job_body(name: str = "train", **extra: Any) -> dict[str, Any]:
    """A minimal valid POST /v1/jobs body."""
    return {"name": name, "command": ["python", "train.py"], **extra}


def gpu(index: int = 0, gib: int = 8, name: str = "NVIDIA RTX 4070") -> dict[str, Any]:
    return {"index": index, "name": name, "total_mib": gib * GIB, "free_mib": gib * GIB}


def worker_body(
    name: str, gpus: list[dict[str, Any]] | None = None, **extra: Any
) -> dict[str, Any]:
    """A POST /v1/workers body: a CPU-only host unless ``gpus`` is given."""
    capability = {"hostname": name, "cores": 8, "ram_mib": 32 * GIB, "gpus": gpus or []}
    return {"name": name, "capability": capability, **extra}


def assert_error(
    response: httpx.Response, status: int, code: str | None = None, *mentions: str
) -> dict[str, Any]:
    """The response is an error with ``status`` in the one JSON error shape.

    ``mentions`` must each appear in the message (what a user reads). Returns the ``error``.
    """
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"code", "message", "detail"}, error
    assert isinstance(error["code"], str) and error["code"], error
    assert isinstance(error["message"], str) and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    for text in mentions:
        assert text in error["message"], (text, error["message"])
    return error


def submit(client: TestClient, headers: dict[str, str], **body: Any) -> str:
    """Submit a job (``job_body`` with ``body`` over it) and return its id."""
    r = client.post("/v1/jobs", json=job_body(**body), headers=headers)
    assert r.status_code == 201, r.text
    job_id: str = r.json()["job"]["id"]
    return job_id


def register(client: TestClient, headers: dict[str, str], name: str, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/workers", json=worker_body(name, **body), headers=headers)
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def claim(client: TestClient, headers: dict[str, str], worker: str) -> dict[str, Any]:
    """Claim one job on a CPU slot without waiting; the lease."""
    r = client.post(
        f"/v1/workers/{worker}/claim", json={"cpu_slots": 1, "wait": 0}, headers=headers
    )
    assert r.status_code == 200, (r.status_code, r.text)
    lease: dict[str, Any] = r.json()
    return lease


# ---- calls on the app's own event loop (concurrent requests in one test) -----------------


def on_loop(client: TestClient, fn: Callable[[], Awaitable[Any]], timeout: float = 20) -> Any:
    """Run ``fn`` on the app's event loop (where its lifespan runs), bounded in time."""

    async def bounded() -> Any:
        return await asyncio.wait_for(fn(), timeout)

    assert client.portal is not None
    return client.portal.call(bounded)


def asgi(app: FastAPI, address: str = "127.0.0.1") -> httpx.AsyncClient:
    """An async client calling ``app`` in-process as if from ``address``."""
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://gpufleet.test")


async def until(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
