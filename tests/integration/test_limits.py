"""Abuse limits in front of the API: failed-auth rate limiting, body size and JSON depth,
long-polls per worker and requests per token. Each limit is hit, then recovers.

Windows move on a fake clock, never by sleeping. Concurrent requests run on the app's own
event loop (the ``client`` fixture's portal) through httpx's ASGI transport, each wait
bounded in time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.server.json_depth import nesting_depth, too_deep
from gpufleet.server.limits import Limits
from gpufleet.server.polls import Poll
from gpufleet.store import SqlStore
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    asgi,
    assert_error,
    bearer,
    job_body,
    on_loop,
    register,
    until,
    worker_body,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX

MIB = 1 << 20
LIMIT = Limits().max_json_body  # the default limit of a JSON body (a submit...)
BATCH_LIMIT = Limits().max_body  # a worker's log batch
SMALL = Limits(max_json_body=MIB)
WRONG = bearer("gf_not-a-real-token")
LOGGER = "gpufleet.server.limits"
CLAIM_BODY = {"cpu_slots": 1, "wait": 10}


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def limits(clock: Clock) -> Limits:
    return Limits(clock=clock)


@pytest.fixture
def app(
    store: SqlStore,
    settings: QueueSettings,
    blob_settings: BlobSettings,
    tmp_path: Path,
    limits: Limits,
) -> FastAPI:
    blobs = BlobService(store, BlobFiles(tmp_path / "blobs"), blob_settings)
    return create_app(store, settings, blobs, limits)


def get_from(client: TestClient, address: str, path: str, headers: dict[str, str]) -> Any:
    async def go() -> httpx.Response:
        async with asgi(client.app, address) as c:  # type: ignore[arg-type]
            return await c.get(path, headers=headers)

    return on_loop(client, go)


def new_token(store: SqlStore, role: Role = Role.ADMIN) -> dict[str, str]:
    return bearer(Auth(store).create(f"t-{role.value}", role)[1])


def trip(client: TestClient, count: int = 21) -> None:
    """Send ``count`` wrong tokens (the default limit is 20 within a window)."""
    for _ in range(count):
        assert client.get("/v1/jobs", headers=WRONG).status_code == 401


# ---- failed-auth rate limiting ------------------------------------------------------------


def test_wrong_tokens_get_429_with_retry_after_until_the_window_passes(
    client: TestClient, store: SqlStore, clock: Clock
) -> None:
    trip(client, 20)
    assert_error(client.get("/v1/jobs", headers=WRONG), 401)  # 21st: still answered, trips
    refused = client.get("/v1/jobs", headers=WRONG)
    error = assert_error(refused, 429, "rate_limited", "testclient", "more than 20 in 60 s")
    assert refused.headers["retry-after"] == "60"
    assert error["detail"]["retry_after"] == 60
    # A valid token never seen before still works: it is checked, and holds.
    assert client.get("/v1/jobs", headers=new_token(store)).status_code == 200
    assert client.get("/v1/health").status_code == 200  # health stays reachable
    clock.now += 59.5
    assert client.get("/v1/jobs", headers=WRONG).headers["retry-after"] == "1"
    clock.now += 0.5
    assert_error(client.get("/v1/jobs", headers=WRONG), 401)  # the window passed


def test_a_failure_count_starts_again_after_a_quiet_window(
    client: TestClient, clock: Clock
) -> None:
    trip(client, 20)
    clock.now += 60
    trip(client, 20)  # a slow trickle never trips the limit
    assert_error(client.get("/v1/jobs", headers=WRONG), 401)


def test_a_token_that_worked_still_works_from_a_refused_address(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    """A worker behind the same NAT as a client stuck on a revoked token keeps working."""
    assert client.get("/v1/jobs", headers=admin).status_code == 200
    trip(client)
    assert client.get("/v1/jobs", headers=admin).status_code == 200
    assert client.post("/v1/jobs", json=job_body(), headers=admin).status_code == 201
    assert client.get("/v1/jobs", headers=new_token(store)).status_code == 200
    assert_error(client.get("/v1/jobs"), 429, "rate_limited")  # no token at all


def test_a_known_token_revoked_is_refused_from_then_on(
    app: FastAPI, client: TestClient, store: SqlStore
) -> None:
    row, secret = Auth(store).create("laptop", Role.ADMIN)
    assert client.get("/v1/jobs", headers=bearer(secret)).status_code == 200
    trip(client)
    app.state.gpufleet.auth.revoke(row.id)
    assert_error(client.get("/v1/jobs", headers=bearer(secret)), 429, "rate_limited")


def test_other_addresses_are_not_refused(client: TestClient, store: SqlStore) -> None:
    trip(client)
    fresh = new_token(store)
    assert get_from(client, "198.51.100.7", "/v1/jobs", fresh).status_code == 200
    assert get_from(client, "198.51.100.7", "/v1/jobs", WRONG).status_code == 401


@pytest.mark.parametrize("limits", [Limits(max_tracked=3)], ids=["3-addresses"])
def test_the_address_table_is_bounded(client: TestClient, store: SqlStore) -> None:
    trip(client)
    assert client.get("/v1/jobs", headers=WRONG).status_code == 429
    for i in range(3):  # three newer addresses push the oldest out
        assert get_from(client, f"198.51.100.{i}", "/v1/jobs", WRONG).status_code == 401
    assert client.get("/v1/jobs", headers=WRONG).status_code == 401


@pytest.mark.parametrize("limits", [Limits(failed_auth=0)], ids=["no-rate-limit"])
def test_every_v1_route_but_health_checks_the_token(app: FastAPI, client: TestClient) -> None:
    """The limiter trusts a token that got a 2xx from a /v1 route; that holds only while
    every such route refuses a request without a valid token."""
    paths = {p: ops for p, ops in app.openapi()["paths"].items() if p.startswith("/v1/")}
    assert len(paths) > 10
    for template, ops in paths.items():
        path = template.replace("{", "").replace("}", "")
        for method in ops:
            r = client.request(method, path, headers={"Authorization": "Bearer gf_wrong"})
            want = 200 if template == "/v1/health" else 401
            assert r.status_code == want, (method, template, r.status_code)


def test_refusals_are_logged_once_per_window_without_the_token(
    client: TestClient, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    trip(client)
    for _ in range(5):
        assert client.get("/v1/jobs", headers=WRONG).status_code == 429
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "testclient" in lines[0], lines
    clock.now += 61
    trip(client)
    assert client.get("/v1/jobs", headers=WRONG).status_code == 429
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2, lines
    assert not any("not-a-real-token" in line for line in caplog.text.splitlines())


# ---- body size ----------------------------------------------------------------------------


def padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON, padded with spaces to exactly ``size`` bytes."""
    raw = json.dumps(body).encode()
    return raw + b" " * (size - len(raw))


def test_a_body_at_the_limit_passes_one_byte_more_is_413(
    client: TestClient, admin: dict[str, str]
) -> None:
    json_headers = {**admin, "Content-Type": "application/json"}
    r = client.post("/v1/jobs", content=padded(job_body(), LIMIT), headers=json_headers)
    assert r.status_code == 201, r.text
    r = client.post("/v1/jobs", content=padded(job_body(), LIMIT + 1), headers=json_headers)
    error = assert_error(r, 413, "too_large", str(LIMIT + 1), str(LIMIT), "blobs")
    assert error["detail"]["limit"] == LIMIT


def test_a_worker_log_batch_of_2m_escaped_characters_fits(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """The worker sends up to 2,000,000 characters of output a request; escaped as JSON
    (control characters take 6 bytes each) that is 12 MB, under the default limit."""
    wid = register(client, worker, "w1")["id"]
    client.post("/v1/jobs", json=job_body(), headers=admin)
    lease = client.post(
        f"/v1/workers/{wid}/claim", json={"cpu_slots": 1, "wait": 0}, headers=worker
    ).json()
    lines = [{"stream": "stdout", "line": "\x01" * 400_000} for _ in range(5)]
    batch = {"attempt": lease["attempt"], "secret": lease["secret"], "lines": lines}
    body = json.dumps(batch).encode()
    assert 12_000_000 < len(body) <= BATCH_LIMIT
    r = client.post(
        f"/v1/jobs/{lease['job_id']}/output",
        content=body,
        headers={**worker, "Content-Type": "application/json"},
    )
    assert r.status_code == 204, r.text


@pytest.mark.parametrize("limits", [SMALL], ids=["1-MiB"])
def test_a_chunked_body_over_the_limit_is_413_and_not_read_to_the_end(
    client: TestClient, admin: dict[str, str]
) -> None:
    pulled = []

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"name": "x", "command": ["true"], "pad": "'
        for _ in range(64):  # 4 MiB in all
            pulled.append(1)
            yield b"a" * (64 << 10)
        yield b'"}'

    async def go() -> httpx.Response:
        async with asgi(client.app) as c:  # type: ignore[arg-type]
            return await c.post("/v1/jobs", content=chunks(), headers=admin)

    r = on_loop(client, go)
    assert "content-length" not in r.request.headers  # sent chunked
    assert_error(r, 413, "too_large", str(MIB))
    assert len(pulled) <= 17  # stopped just past 1 MiB


@pytest.mark.parametrize("limits", [SMALL], ids=["1-MiB"])
def test_blob_uploads_over_the_json_limit_are_accepted(
    client: TestClient, admin: dict[str, str]
) -> None:
    data = b"\x00" * (3 * MIB)
    sha = hashlib.sha256(data).hexdigest()
    r = client.put(f"/v1/blobs/{sha}", content=data, headers=admin)
    assert r.status_code == 201, r.text
    other = data + b"!"
    up = client.post(
        "/v1/uploads",
        json={"sha256": hashlib.sha256(other).hexdigest(), "size": len(other)},
        headers=admin,
    )
    assert up.status_code == 201, up.text
    r = client.patch(
        f"/v1/uploads/{up.json()['id']}", content=other, headers={**admin, "Upload-Offset": "0"}
    )
    assert r.status_code == 200 and r.json()["complete"], r.text


# ---- JSON depth ---------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "body",
    [nested(33), nested(200_000), nested(40).decode().encode("utf-16")],
    ids=["33-levels", "200000-levels", "utf-16"],
)
def test_json_nested_deeper_than_32_is_a_validation_error(
    client: TestClient, admin: dict[str, str], body: bytes
) -> None:
    headers = {**admin, "Content-Type": "application/json"}
    error = assert_error(
        client.post("/v1/jobs", content=body, headers=headers),
        422,
        "validation_error",
        "body: JSON nested deeper than 32 levels",
    )
    assert error["detail"] == [
        {"field": "body", "problem": "JSON nested deeper than 32 levels (arrays and objects)"}
    ]


def test_json_32_levels_deep_gets_the_usual_validation(
    client: TestClient, admin: dict[str, str]
) -> None:
    headers = {**admin, "Content-Type": "application/json"}
    r = client.post("/v1/jobs", content=nested(32), headers=headers)
    assert "deeper" not in assert_error(r, 422, "validation_error")["message"]


def test_brackets_inside_strings_do_not_count(client: TestClient, admin: dict[str, str]) -> None:
    command = ["python", "-c", "print(" + "[" * 50 + '"\\"{' + "]" * 50 + ")"]
    r = client.post("/v1/jobs", json=job_body(command=command), headers=admin)
    assert r.status_code == 201, r.text


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('[]{}"\\/ ab\u00e9\u4e2d\U0001f600\n\t'))
    | st.text()
)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)


values = st.recursive(scalars, _containers, max_leaves=25)


@st.composite
def json_documents(draw: st.DrawFn) -> tuple[bytes, int]:
    value = draw(values)
    for _ in range(draw(st.integers(0, 40))):  # deeper than the recursion alone reaches
        value = draw(st.sampled_from([[value], {"k[": value}, [1, value, "]"]]))
    text = json.dumps(
        value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 0, 2]))
    )
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-16", "utf-16-be", "utf-32-le"]))
    return text.encode(encoding), depth_of(json.loads(text))


@settings(max_examples=200, deadline=None)
@given(json_documents(), st.integers(0, 50))
def test_the_bracket_scan_agrees_with_json_loads(doc: tuple[bytes, int], limit: int) -> None:
    body, depth = doc
    assert nesting_depth(body) == depth
    assert too_deep(body, limit) == (depth > limit)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_the_bracket_scan_never_fails_on_garbage(body: bytes) -> None:
    assert nesting_depth(body) >= 0
    too_deep(body, 3)


# ---- long-polls per worker, requests per token --------------------------------------------


@pytest.fixture
def entered_polls(app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Worker ids of the claims that got past the limits into the queue, in order."""
    queue = app.state.gpufleet.services.dispatch
    real = queue.poll
    seen: list[str] = []

    def poll(worker_id: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(worker_id)
        return real(worker_id, *args, **kwargs)

    monkeypatch.setattr(queue, "poll", poll)
    # A newer poll of a worker ends its older one at once (the worker's slots changed);
    # here both must stay open, to test the cap on what piles up before that.
    polls = app.state.gpufleet.polls
    monkeypatch.setattr(polls, "begin", lambda worker_id: Poll())
    monkeypatch.setattr(polls, "end", lambda worker_id, poll: True)
    return seen


@pytest.mark.parametrize("limits", [Limits(requests_per_token=1)], ids=["1-per-token"])
def test_a_worker_gets_two_long_polls_a_third_is_429_and_slots_come_back(
    client: TestClient, admin: dict[str, str], worker: dict[str, str], entered_polls: list[str]
) -> None:
    wid = register(client, worker, "w1")["id"]
    url = f"/v1/workers/{wid}/claim"

    async def scenario() -> None:
        async with asgi(client.app) as c:  # type: ignore[arg-type]

            async def poll() -> httpx.Response:
                return await c.post(url, json=CLAIM_BODY, headers=worker)

            polls = [asyncio.create_task(poll()) for _ in range(2)]
            await until(lambda: len(entered_polls) == 2, "two polls to wait")
            third = await c.post(url, json={**CLAIM_BODY, "wait": 0}, headers=worker)
            assert_error(third, 429, "rate_limited", wid, "2 claims waiting")
            assert third.headers["retry-after"] == "1"
            # claims do not count against the token's limit of 1: the same token registers
            again = await c.post("/v1/workers", json=worker_body("w2"), headers=worker)
            assert again.status_code == 201, again.text
            # a job ends one poll (a lease): its slot is free again
            await c.post("/v1/jobs", json=job_body(), headers=admin)
            done, pending = await asyncio.wait(polls, return_when=asyncio.FIRST_COMPLETED)
            assert [t.result().status_code for t in done] == [200]
            freed = await c.post(url, json={**CLAIM_BODY, "wait": 0}, headers=worker)
            assert freed.status_code == 204, freed.text
            # a poll cancelled mid-wait (the server's task torn down) gives its slot back
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            polls = [asyncio.create_task(poll()) for _ in range(2)]
            await until(lambda: len(entered_polls) == 5, "two new polls to wait")
            third = await c.post(url, json={**CLAIM_BODY, "wait": 0}, headers=worker)
            assert third.status_code == 429
            assert not any(t.done() for t in polls)
            for task in polls:
                task.cancel()
            await asyncio.gather(*polls, return_exceptions=True)

    on_loop(client, scenario)


def http_scope(method: str, path: str, headers: dict[str, str]) -> dict[str, Any]:
    """An ASGI request's scope, for a call the test drives message by message."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 40000),
        "server": ("gpufleet.test", 80),
        "state": {},
    }


async def disconnected_claim(app: FastAPI, path: str, headers: dict[str, str]) -> int:
    """A claim whose client hangs up right after sending it, as the server reports it."""
    messages = [{"type": "http.request", "body": json.dumps(CLAIM_BODY).encode()}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    json_body = {"Content-Type": "application/json", "Content-Length": "30"}
    await app(http_scope("POST", path, {**headers, **json_body}), receive, send)
    status: int = sent[0]["status"]
    return status


def test_disconnected_and_failing_claims_give_their_slots_back(
    client: TestClient, app: FastAPI, worker: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wid = register(client, worker, "w1")["id"]
    url = f"/v1/workers/{wid}/claim"

    async def hang_ups() -> list[int]:
        return [await disconnected_claim(app, url, worker) for _ in range(3)]

    assert on_loop(client, hang_ups) == [204, 204, 204]

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("the store fell over")

    monkeypatch.setattr(app.state.gpufleet.services.dispatch, "poll", broken)
    statuses = [client.post(url, json=CLAIM_BODY, headers=worker).status_code for _ in range(3)]
    assert statuses == [500, 500, 500]
    monkeypatch.undo()
    r = client.post(url, json={**CLAIM_BODY, "wait": 0}, headers=worker)
    assert r.status_code == 204, r.text


@pytest.mark.parametrize("limits", [Limits(requests_per_token=2)], ids=["2-per-token"])
def test_requests_in_flight_per_token_are_capped(
    client: TestClient, store: SqlStore, admin: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    inside: list[int] = []
    real = store.list_workers

    def slow(*args: Any, **kwargs: Any) -> Any:
        inside.append(1)
        if len(inside) <= 2:  # the two held requests; later ones (GET /v1/jobs too) go on
            release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "list_workers", slow)
    other = new_token(store)

    async def scenario() -> None:
        async with asgi(client.app) as c:  # type: ignore[arg-type]
            held = [asyncio.create_task(c.get("/v1/workers", headers=admin)) for _ in range(2)]
            await until(lambda: len(inside) == 2, "two requests in flight")
            busy = await c.get("/v1/jobs", headers=admin)
            assert_error(busy, 429, "rate_limited", "2 requests with this token")
            assert busy.headers["retry-after"] == "1"
            assert (await c.get("/v1/jobs", headers=other)).status_code == 200
            release.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
            assert (await c.get("/v1/jobs", headers=admin)).status_code == 200

    try:
        on_loop(client, scenario)
    finally:
        release.set()


# ---- the credential before the body -------------------------------------------------------


def test_a_body_without_a_valid_token_is_never_read(client: TestClient) -> None:
    """A stranger's 16 MiB costs the server nothing: it is answered 401 from the headers,
    the connection is closed, and not one chunk of the body is pulled."""
    for headers in ({}, WRONG):
        pulled: list[int] = []

        async def chunks(pulled: list[int] = pulled) -> AsyncIterator[bytes]:
            for _ in range(256):  # 16 MiB in all
                pulled.append(1)
                yield b"a" * (64 << 10)

        async def go(headers: dict[str, str] = headers) -> httpx.Response:
            async with asgi(client.app) as c:  # type: ignore[arg-type]
                return await c.post("/v1/jobs", content=chunks(), headers=headers)

        r = on_loop(client, go)
        assert_error(r, 401, "unauthorized")
        assert r.headers["connection"] == "close"
        assert len(pulled) <= 1, len(pulled)  # httpx's first chunk at most: none read


def test_each_route_has_a_body_limit_fitted_to_it(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """A submit takes 1 MiB, a worker's log batch 16 MiB, a sign-in 8 KiB; more is 413."""
    json_headers = {**admin, "Content-Type": "application/json"}
    big = padded(job_body(), 2 * MIB)
    r = client.post("/v1/jobs", content=big, headers=json_headers)
    assert_error(r, 413, "too_large", str(MIB))
    sign_in = padded({"token": "gf_x"}, (8 << 10) + 1)
    r = client.post("/v1/session", content=sign_in, headers={"Content-Type": "application/json"})
    assert_error(r, 413, "too_large", str(8 << 10))
    wid = register(client, worker, "w1")["id"]
    client.post("/v1/jobs", json=job_body(), headers=admin)
    lease = client.post(
        f"/v1/workers/{wid}/claim", json={"cpu_slots": 1, "wait": 0}, headers=worker
    ).json()
    batch = {
        "attempt": lease["attempt"],
        "lines": [{"stream": "stdout", "line": "x" * 900_000}] * 3,
    }
    r = client.post(f"/v1/jobs/{lease['job_id']}/output", json=batch, headers=worker)
    assert r.status_code == 204, r.text


def test_a_burst_of_sign_ins_is_counted_as_it_arrives(client: TestClient) -> None:
    """Thirty wrong sign-ins at once: past the limit (more than 20) they are refused (429),
    though none had been answered when the rest arrived."""

    async def burst() -> list[int]:
        async with asgi(client.app) as c:  # type: ignore[arg-type]
            tries = [c.post("/v1/session", json={"token": f"gf_wrong{i}"}) for i in range(30)]
            return [r.status_code for r in await asyncio.gather(*tries)]

    codes = on_loop(client, burst)
    assert codes.count(401) == 21 and codes.count(429) == 9, codes


def test_a_lockout_does_not_lock_out_a_valid_session(client: TestClient, store: SqlStore) -> None:
    """Someone's wrong tokens from a shared address do not sign a dashboard user out."""
    secret = Auth(store).create("alice", Role.OPERATOR)[1]
    r = client.post("/v1/session", json={"token": secret})
    assert r.status_code == 200, r.text
    trip(client)
    assert_error(client.get("/v1/jobs", headers=WRONG), 429, "rate_limited")
    assert client.get("/v1/jobs").status_code == 200  # the session cookie: still signed in
    assert_error(client.post("/v1/session", json={"token": secret}), 429, "rate_limited")


@pytest.mark.parametrize("limits", [Limits(streams_per_token=1)], ids=["1-stream"])
def test_stream_limits_hold_however_the_token_is_sent(client: TestClient, store: SqlStore) -> None:
    """Extra spaces after ``Bearer``, or the same token's dashboard session, are the same
    token: its second stream is refused."""
    secret = Auth(store).create("alice", Role.OPERATOR)[1]
    cookie = client.post("/v1/session", json={"token": secret}).cookies["gpufleet_session"]
    client.cookies.clear()

    started = asyncio.Event()
    hang_up = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message
            started.set()

    async def scenario() -> None:
        scope = http_scope("GET", "/v1/events", {"Authorization": f"Bearer {secret}"})
        first = asyncio.create_task(client.app(scope, receive, send))  # type: ignore[arg-type]
        await asyncio.wait_for(started.wait(), 10)
        async with asgi(client.app) as c:  # type: ignore[arg-type]
            for headers in (
                {"Authorization": f"Bearer    {secret}"},
                {"Cookie": f"gpufleet_session={cookie}"},
            ):
                second = await c.get("/v1/events", headers=headers)
                assert_error(second, 429, "rate_limited", "event streams")
        hang_up.set()
        await asyncio.wait_for(first, 10)

    on_loop(client, scenario)


# ---- what the review of issue 30 found ----------------------------------------------------


def test_the_bracket_scan_of_an_unterminated_string_is_linear() -> None:
    """A quote left open, then escaped quotes without end: each quote was tried as a
    string's start and each try scanned to the end (64 KiB took 11 s, 1 MiB would take
    most of an hour, with the event loop held). Now it is one pass."""
    body = b"[" * 40 + b'"' + b'\\"' * (512 << 10)  # 1 MiB
    began = time.monotonic()
    assert nesting_depth(body) == 40
    assert time.monotonic() - began < 5  # minutes before; milliseconds now


def test_a_body_on_a_route_without_a_token_is_not_read(client: TestClient) -> None:
    """The dashboard's page and files take no body: one sent there is never read, let
    alone scanned (a stranger's 64 KiB held the event loop for 11 s there)."""
    body = b"[" * 40 + b'"' + b'\\"' * (32 << 10)
    for path in ("/", "/nothing"):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code in (404, 405), r.text


def test_a_refused_scheme_does_not_refuse_the_same_token_sent_right(
    client: TestClient, admin_token: str
) -> None:
    """``Token X`` is refused as malformed; ``Bearer X`` still works after it."""
    for scheme in ("Token", "Basic"):
        wrong = client.get("/v1/jobs", headers={"Authorization": f"{scheme} {admin_token}"})
        assert_error(wrong, 401, "unauthorized", "Bearer")
    assert client.get("/v1/jobs", headers=bearer(admin_token)).status_code == 200


def test_only_workers_may_send_a_log_batchs_16_mib(
    client: TestClient, store: SqlStore, worker: dict[str, str], admin: dict[str, str]
) -> None:
    """A log batch may be 16 MiB; anyone else's body on those routes is held to the JSON
    limit, from its Content-Length (a submitter's 16 MiB of ``[{},...]`` had cost 423 MiB
    of server memory to parse before its 403)."""
    submitter = bearer(Auth(store).create("alice", Role.SUBMITTER)[1])
    body = b'{"reports": [' + b"{}," * (1 << 20) + b"{}]}"  # 3 MiB
    headers = {**submitter, "Content-Type": "application/json"}
    r = client.post("/v1/reports", content=body, headers=headers)
    assert_error(r, 413, "too_large", str(LIMIT))
    r = client.post(
        "/v1/reports", content=body, headers={**worker, "Content-Type": "application/json"}
    )
    assert r.status_code == 422, r.text  # a worker's is read, and found wrong


def test_an_ipv6_client_counts_as_its_64() -> None:
    """Whoever holds one address of an IPv6 /64 usually holds all of it: the per-address
    limits count the /64, or one client would get 2^64 addresses' worth."""
    from gpufleet.server.limits import address_key, trusts

    assert address_key("2001:db8:1:2::7") == address_key("2001:db8:1:2:ffff::1")
    assert address_key("2001:db8:1:2::7") != address_key("2001:db8:1:3::7")
    assert address_key("192.0.2.7") == "192.0.2.7"
    assert trusts(("10.0.0.0/8", "127.0.0.1"), "10.1.2.3") and trusts(("127.0.0.1",), "127.0.0.1")
    assert not trusts((), "127.0.0.1") and not trusts(("10.0.0.0/8",), "192.0.2.7")
