"""Start and finish reports sent together (``POST /v1/reports``): each applied in order as
its own call would be, with its own answer and audit record; the worker's reporter sends
the reports that come while one call is on its way together, and talks to a server from
before the path one report at a time."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from gpufleet.client import AsyncClient
from gpufleet.domain.models import Role
from gpufleet.errors import Conflict
from gpufleet.server.auth import Auth
from gpufleet.server.leases import Leases
from gpufleet.store import SqlStore
from gpufleet.wire import FinishRequest, StartRequest
from gpufleet.worker import reports as reports_module
from gpufleet.worker.reports import Reports
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    bearer,
    claim,
    on_loop,
    register,
    submit,
)

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from gpufleet.server.notices import Notices

pytestmark = TESTCLIENT_ON_HTTPX
URL = "http://gpufleet.test"


def _status(client: TestClient, admin: dict[str, str], job: str) -> str:
    status: str = client.get(f"/v1/jobs/{job}", headers=admin).json()["status"]
    return status


def _calls(client: TestClient, admin: dict[str, str]) -> list[tuple[str, int]]:
    rows = client.get("/v1/audit", headers=admin).json()
    return [(a["path"], a["status"]) for a in rows if not a["event"]]


SECRETS: dict[str, str] = {}  # each claimed job's attempt secret, as its worker keeps it


def _claimed(
    client: TestClient, admin: dict[str, str], worker: dict[str, str], n: int
) -> list[str]:
    """``n`` jobs, each claimed by one worker with ``n`` slots."""
    w = register(client, worker, "box", cpu_slots=n)
    jobs = [submit(client, admin, name=f"j{i}") for i in range(n)]
    for _ in jobs:
        lease = claim(client, worker, w["id"])
        SECRETS[lease["job_id"]] = lease["secret"]
    return jobs


def _notices(client: TestClient) -> Notices:
    return client.app.state.gpufleet.services.notices  # type: ignore[attr-defined,no-any-return]


def test_reports_are_applied_in_order_each_with_its_own_answer_and_record(
    client: TestClient, store: SqlStore, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box", cpu_slots=2)
    a, b = submit(client, admin, name="a"), submit(client, admin, name="b")
    claim(client, worker, w["id"]), claim(client, worker, w["id"])
    stranger = bearer(Auth(store).create("other", Role.WORKER)[1])
    reports = [
        {"kind": "start", "job_id": a, "attempt": 1, "pid": 10},
        {"kind": "finish", "job_id": a, "attempt": 1, "exit_code": 0},
        {"kind": "start", "job_id": b, "attempt": 2},  # not its lease
        {"kind": "finish", "job_id": "j-nope", "attempt": 1, "exit_code": 0},
    ]
    r = client.post("/v1/reports", json={"reports": reports}, headers=worker)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [(x["job_id"], x["status"]) for x in results] == [
        (a, 204),
        (a, 200),
        (b, 409),
        ("j-nope", 404),
    ]
    assert results[1]["job"]["status"] == "succeeded" and results[1]["error"] is None
    assert "stale lease" in results[2]["error"]["message"]
    assert results[3]["error"]["code"] == "not_found"
    assert (_status(client, admin, a), _status(client, admin, b)) == ("succeeded", "claimed")

    # Another token's worker holds b: refused, and b is as it was.
    theirs = {"reports": [{"kind": "start", "job_id": b, "attempt": 1}]}
    r = client.post("/v1/reports", json=theirs, headers=stranger)
    assert [(x["status"], x["error"]["code"]) for x in r.json()["results"]] == [(403, "forbidden")]
    assert _status(client, admin, b) == "claimed"

    calls = _calls(client, admin)
    assert (f"/v1/jobs/{a}/start", 204) in calls and (f"/v1/jobs/{a}/finish", 200) in calls
    assert (f"/v1/jobs/{b}/start", 409) in calls and (f"/v1/jobs/{b}/start", 403) in calls
    assert not any(path == "/v1/reports" for path, _ in calls)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"reports": []}, "reports"),
        ({"reports": [{"kind": "begin", "job_id": "j-1", "attempt": 1}]}, "reports"),
        ({"reports": [{"kind": "start", "attempt": 1}]}, "job_id"),
        ({"reports": [{"kind": "start", "job_id": "j-1", "attempt": 1}] * 65}, "reports"),
    ],
)
def test_a_bad_batch_is_refused_by_name_and_changes_nothing(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    body: dict[str, Any],
    field: str,
) -> None:
    w = register(client, worker, "box")
    job = submit(client, admin)
    claim(client, worker, w["id"])
    assert_error(client.post("/v1/reports", json=body, headers=worker), 422, None, field)
    assert _status(client, admin, job) == "claimed"


class _Counting(httpx.AsyncBaseTransport):
    """The app in-process, counting the calls by path (the calls a server would see);
    ``older``: answer for a server from before ``/v1/reports``, which has no such path."""

    def __init__(self, app: FastAPI, older: bool) -> None:
        self.inner = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        self.paths: Counter[str] = Counter()
        self.older = older

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths[request.url.path] += 1
        await asyncio.sleep(0.05)  # a call takes a while: the next reports queue up
        if self.older and request.url.path == "/v1/reports":
            error = {"code": "not_found", "message": "Not Found", "detail": None}
            return httpx.Response(404, json={"error": error})
        return await self.inner.handle_async_request(request)


def _reporter(
    app: FastAPI, token: str, older: bool = False
) -> tuple[Reports, AsyncClient, _Counting]:
    counting = _Counting(app, older)
    client = AsyncClient(URL, token)
    client._to[URL] = httpx.AsyncClient(transport=counting, base_url=URL, headers=bearer(token))

    async def retrying(what: str, call: Any) -> Any:
        return await call()

    return Reports(client, retrying), client, counting


def test_reports_that_come_while_one_is_on_its_way_go_together(
    client: TestClient, admin: dict[str, str], worker: dict[str, str], worker_token: str
) -> None:
    jobs = _claimed(client, admin, worker, 4)

    async def scenario() -> tuple[Counter[str], list[Any]]:
        reports, sdk, counting = _reporter(client.app, worker_token)  # type: ignore[arg-type]
        async with sdk:
            start = StartRequest(attempt=1, secret=SECRETS[jobs[0]])
            first = asyncio.create_task(reports.start(jobs[0], start))
            await asyncio.sleep(0.02)  # its call is on its way
            rest = (reports.start(j, StartRequest(attempt=1, secret=SECRETS[j])) for j in jobs[1:])
            await asyncio.gather(first, *rest)
            ends = [
                FinishRequest(attempt=1, exit_code=code, secret=SECRETS[j])
                for code, j in zip((0, 1, 3), jobs[:3], strict=True)
            ]
            stale = FinishRequest(attempt=2, exit_code=0, secret=SECRETS[jobs[3]])
            ends.append(stale)  # a stale lease
            outs = await asyncio.gather(
                *(reports.finish(j, end) for j, end in zip(jobs, ends, strict=True)),
                return_exceptions=True,
            )
            return counting.paths, outs

    paths, outs = on_loop(client, scenario)
    # The first start went alone, the three that came meanwhile in one call, and the
    # four finishes, sent at once, in one.
    assert paths == {"/v1/reports": 3}, paths
    assert [o.status if not isinstance(o, Exception) else o for o in outs[:3]] == [
        "succeeded",
        "pending",  # exit code 1 and 3: retried
        "pending",
    ]
    assert isinstance(outs[3], Conflict)
    assert _status(client, admin, jobs[3]) == "running"


def test_a_server_from_before_batches_gets_each_report_alone_for_a_while(
    app: FastAPI,
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    worker_token: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As during an upgrade of the servers: after a while, batches are tried again."""
    monkeypatch.setattr(reports_module, "ALONE_FOR", 0.5)
    w = register(client, worker, "box", cpu_slots=2)
    job, later = submit(client, admin, name="a"), submit(client, admin, name="b")
    leases = [claim(client, worker, w["id"]) for _ in range(2)]
    held = {lease["job_id"]: lease["secret"] for lease in leases}

    async def scenario() -> tuple[Counter[str], Any, bool, Counter[str]]:
        reports, sdk, counting = _reporter(app, worker_token, older=True)
        async with sdk:
            await reports.start(job, StartRequest(attempt=1, pid=5, secret=held[job]))
            end = FinishRequest(attempt=1, exit_code=0, secret=held[job])
            out = await reports.finish(job, end)
            with pytest.raises(Conflict):  # its own call's error, as before batches
                await reports.finish(job, end)
            batched, alone = reports.batched, Counter(counting.paths)
            counting.older = False  # the servers were upgraded
            await asyncio.sleep(0.6)
            await reports.start(later, StartRequest(attempt=1, secret=held[later]))
            return alone, out, batched, counting.paths - alone

    alone, out, batched, then = on_loop(client, scenario)
    assert not batched and out.status == "succeeded"
    assert alone == {
        "/v1/reports": 1,
        f"/v1/jobs/{job}/start": 1,
        f"/v1/jobs/{job}/finish": 2,
    }, alone
    assert then == {"/v1/reports": 1}, then
    assert _status(client, admin, later) == "running"


def test_a_server_failure_in_one_report_is_that_reports_500_and_the_others_apply(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A database error in one report fails that report alone, as its own call would have
    failed, and undoes what it had written; the reports before and after it are applied,
    answered and audited."""
    jobs = _claimed(client, admin, worker, 3)
    real = Leases.start

    def start(self: Leases, job_id: str, *args: Any) -> None:
        real(self, job_id, *args)  # the leases bound to the batch's transaction
        if job_id == jobs[1]:  # after its write: the report's part is undone
            raise RuntimeError("database is locked")

    monkeypatch.setattr(Leases, "start", start)
    batch = {"reports": [{"kind": "start", "job_id": j, "attempt": 1} for j in jobs]}
    r = client.post("/v1/reports", json=batch, headers=worker)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["status"] for x in results] == [204, 500, 204]
    assert results[1]["error"]["code"] == "internal_error"
    assert "database is locked" not in r.text  # the log has it, not the client
    assert [_status(client, admin, j) for j in jobs] == ["running", "claimed", "running"]
    calls = _calls(client, admin)
    assert [(f"/v1/jobs/{j}/start", s) for j, s in zip(jobs, (204, 500, 204), strict=True)] == [
        c for c in calls if c[0].endswith("/start")
    ]


def test_followers_of_a_batchs_jobs_are_told_once_its_writes_can_be_read(
    client: TestClient,
    store: SqlStore,
    admin: dict[str, str],
    worker: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch is one transaction: a job's followers (and waiting polls) are told after it
    commits, so what they read on their own connections already holds the change (told
    earlier, they would read the old status and wait for a record already passed)."""
    jobs = _claimed(client, admin, worker, 2)
    notices = _notices(client)
    seen: list[tuple[str, str]] = []

    def read_elsewhere(job_id: str) -> None:  # as a follower's thread reads
        row = store.get_job(job_id)
        seen.append((job_id, row.status.value if row else "?"))

    def told(job_id: str) -> None:
        reader = threading.Thread(target=read_elsewhere, args=(job_id,))
        reader.start()
        reader.join(10)

    monkeypatch.setattr(notices, "_on_written", told)
    reports: list[dict[str, Any]] = [
        {"kind": "start", "job_id": jobs[0], "attempt": 1},
        {"kind": "start", "job_id": jobs[1], "attempt": 1},
        {"kind": "finish", "job_id": jobs[0], "attempt": 1, "exit_code": 0},
    ]
    r = client.post("/v1/reports", json={"reports": reports}, headers=worker)
    assert [x["status"] for x in r.json()["results"]] == [204, 204, 200]
    assert seen == [(jobs[0], "succeeded"), (jobs[1], "running"), (jobs[0], "succeeded")]


def test_a_failure_to_tell_of_a_committed_batch_leaves_its_answers_and_the_others_told(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch has committed when its followers are told: one that cannot be told (a
    database blip while notifying) is logged, the others are still told, and the worker
    gets every report's answer, not a 500 for writes that were made."""
    jobs = _claimed(client, admin, worker, 2)
    notices = _notices(client)
    told: list[str] = []

    def tell(job_id: str) -> None:
        if job_id == jobs[0]:
            raise RuntimeError("connection lost")
        told.append(job_id)

    monkeypatch.setattr(notices, "_on_written", tell)
    batch = {"reports": [{"kind": "start", "job_id": j, "attempt": 1} for j in jobs]}
    r = client.post("/v1/reports", json=batch, headers=worker)
    assert r.status_code == 200, r.text
    assert [x["status"] for x in r.json()["results"]] == [204, 204]
    assert told == [jobs[1]]
    assert [_status(client, admin, j) for j in jobs] == ["running", "running"]


def test_a_start_sent_again_in_a_batch_keeps_the_first_time(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """A batch resent after its answer was lost: the start is taken once, dated by the
    worker's first report."""
    w = register(client, worker, "box")
    job = submit(client, admin)
    claim(client, worker, w["id"])
    time.sleep(0.05)
    first = datetime.now(UTC)
    for when in (first, first + timedelta(seconds=0.02)):
        report = {"kind": "start", "job_id": job, "attempt": 1, "started_at": when.isoformat()}
        r = client.post("/v1/reports", json={"reports": [report]}, headers=worker)
        assert [x["status"] for x in r.json()["results"]] == [204]
    started = client.get(f"/v1/jobs/{job}", headers=admin).json()["started_at"]
    assert abs(datetime.fromisoformat(started) - first) < timedelta(milliseconds=1)
