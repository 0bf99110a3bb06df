"""Webhooks through the API, in-process, with a real HTTP receiver on loopback: who sets
which, the destinations refused (422 naming ``url``), what a list shows (never the URL or
the secret), and deliveries of a job's end, failure and preemption, signed, retried with
backoff while the server's other calls keep their pace."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest

from gpufleet.client import verify_webhook
from gpufleet.domain import lifecycle
from gpufleet.domain.models import Role
from gpufleet.domain.sharing import Sharing
from gpufleet.server import QueueSettings
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
from tests.hook_receiver import Receiver, receiver
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    bearer,
    claim,
    register,
    submit,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX
SECRET = "a-receiver-secret-of-32-chars-ok"
OWN_PORT = 18099


@pytest.fixture
def settings() -> QueueSettings:
    return QueueSettings(
        lease_timeout=120.0, retry_backoff=0.1, webhook_allow=("127.0.0.1",), own_ports=(OWN_PORT,)
    )


@pytest.fixture
def alice(store: SqlStore) -> dict[str, str]:
    return bearer(Auth(store).create("alice", Role.SUBMITTER, ["default"])[1])


def _hook(client: TestClient, who: dict[str, str], **body: Any) -> Any:
    return client.post("/v1/webhooks", json=body, headers=who)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://169.254.10.10/x", "link-local"),
        ("http://169.254.169.254/latest/meta-data", "metadata"),
        ("http://[fd00:ec2::254]/", "metadata"),
        ("http://metadata.google.internal/computeMetadata/v1/", "metadata"),
        ("http://[fe80::1]/", "link-local"),
        (f"http://127.0.0.1:{OWN_PORT}/v1/jobs", "own"),
        ("http://10.1.2.3/hook", "operator may allow"),
        ("http://[::1]:9/hook", "loopback"),
        ("ftp://example.org/x", "http"),
        ("file:///etc/passwd", "http"),
        ("http://user:pw@example.org/x", "password"),
        ("http:///nohost", "host"),
    ],
)
def test_refused_destinations_are_422_naming_url(
    client: TestClient, alice: dict[str, str], url: str, why: str
) -> None:
    r = _hook(client, alice, url=url, secret=SECRET)
    assert_error(r, 422)
    assert r.json()["error"]["message"].startswith("url: ")
    assert why in r.json()["error"]["message"]
    assert url not in r.text  # not even the refused URL is echoed


def test_loopback_is_refused_unless_allowed(
    client: TestClient, alice: dict[str, str], app: Any
) -> None:
    services = app.state.gpufleet.services
    services.webhooks.settings = replace(services.webhooks.settings, webhook_allow=())
    r = _hook(client, alice, url="http://127.0.0.1:9/hook", secret=SECRET)
    assert_error(r, 422)
    assert "loopback" in r.json()["error"]["message"]
    assert r.json()["error"]["detail"]["field"] == "url"
    services.sharing.set(Sharing(webhook_allow=("127.0.0.0/8",)))  # the sharing file's
    assert _hook(client, alice, url="http://127.0.0.1:9/hook").status_code == 201


def test_a_list_shows_the_host_never_the_url_or_secret(
    client: TestClient, alice: dict[str, str], admin: dict[str, str]
) -> None:
    url = "http://127.0.0.1:9/services/T000/B000/XXXXSECRETPATH"
    made = _hook(client, alice, url=url)
    assert made.status_code == 201, made.text
    secret = made.json()["secret"]
    assert secret.startswith("gw_") and len(secret) > 30
    given = _hook(client, alice, url=url, secret=SECRET, events=["failed", "cancelled"])
    assert given.json()["secret"] is None and "XXXX" not in given.text
    listed = client.get("/v1/webhooks", headers=alice)
    assert listed.status_code == 200
    assert [h["host"] for h in listed.json()] == ["127.0.0.1", "127.0.0.1"]
    assert listed.json()[1]["events"] == ["failed", "cancelled"]
    assert listed.json()[0]["scope"] == "user" and listed.json()[0]["target"] == "alice"
    for text in (listed.text, client.get("/v1/webhooks", headers=admin).text):
        assert "XXXXSECRETPATH" not in text and secret not in text and SECRET not in text
    audit = client.get("/v1/audit", headers=admin).text
    assert "XXXXSECRETPATH" not in audit and secret not in audit
    hook_id = listed.json()[0]["id"]
    assert client.delete(f"/v1/webhooks/{hook_id}", headers=admin).status_code == 204
    assert len(client.get("/v1/webhooks", headers=alice).json()) == 1


def test_who_sets_which(
    client: TestClient, alice: dict[str, str], admin: dict[str, str], store: SqlStore
) -> None:
    bob = bearer(Auth(store).create("bob", Role.SUBMITTER, ["default"])[1])
    r = _hook(client, alice, url="http://127.0.0.1:9/", secret=SECRET, pool="default")
    assert_error(r, 403)
    job = submit(client, alice, name="mine")
    assert _hook(client, bob, url="http://127.0.0.1:9/", secret=SECRET, job=job).status_code == 403
    assert _hook(client, alice, url="http://127.0.0.1:9/", job=job).status_code == 201
    assert _hook(client, admin, url="http://127.0.0.1:9/", pool="default").status_code == 201
    assert client.get("/v1/webhooks", headers=bob).json() == []
    mine = client.get("/v1/webhooks", headers=alice).json()
    assert [h["scope"] for h in mine] == ["job"]
    assert client.delete(f"/v1/webhooks/{mine[0]['id']}", headers=bob).status_code == 404
    bad = _hook(client, alice, url="http://127.0.0.1:9/", events=["exploded"])
    assert_error(bad, 422)
    assert "events" in bad.json()["error"]["message"]


def _end(client: TestClient, worker: dict[str, str], wid: str, code: int) -> str:
    lease = claim(client, worker, wid)
    job, attempt = lease["job_id"], lease["attempt"]
    client.post(f"/v1/jobs/{job}/start", json={"attempt": attempt}, headers=worker)
    body = {"attempt": attempt, "exit_code": code}
    r = client.post(f"/v1/jobs/{job}/finish", json=body, headers=worker)
    assert r.status_code in (200, 204), r.text
    return str(job)


def _preempt(store: SqlStore, client: TestClient, worker: dict[str, str], wid: str) -> str:
    """End a running attempt with the cause ``preempted`` through the store operation a
    preemption applies (``release``): the preemption code of issue 35 is another branch's."""
    lease = claim(client, worker, wid)
    job_id = lease["job_id"]
    client.post(f"/v1/jobs/{job_id}/start", json={"attempt": lease["attempt"]}, headers=worker)
    job = store.get_job(job_id)
    assert job is not None
    change = lifecycle.release(job, time.time(), "preempted by a job of priority 10")
    assert change.record is not None
    assert store.release(replace(change, record={**change.record, "cause": "preempted"}))
    return str(job_id)


def _signed(r: Receiver, secret: str) -> None:
    for got in r.got:
        assert verify_webhook(secret, got.headers, got.body), got.headers
        assert not verify_webhook(secret, got.headers, got.body + b" ")
        assert got.headers["Content-Type"] == "application/json"


def test_end_failure_and_preemption_are_delivered_signed(
    client: TestClient, alice: dict[str, str], worker: dict[str, str], store: SqlStore
) -> None:
    wid = register(client, worker, "box")["id"]
    with receiver() as r:
        made = _hook(
            client, alice, url=r.url, secret=SECRET, events=["succeeded", "failed", "preempted"]
        )
        assert made.status_code == 201, made.text
        ok = submit(client, alice, name="good")
        assert _end(client, worker, wid, 0) == ok
        bad = submit(client, alice, name="bad", max_attempts=1)
        assert _end(client, worker, wid, 3) == bad
        moved = submit(client, alice, name="moved")
        assert _preempt(store, client, worker, wid) == moved
        got = r.wait(3, 15)
        _signed(r, SECRET)
    by = {g.data["gpufleet"]["event"]: g.data for g in got}
    assert set(by) == {"succeeded", "failed", "preempted"}
    assert by["succeeded"]["gpufleet"]["job"] == ok and "good" in by["succeeded"]["text"]
    assert by["failed"]["gpufleet"]["status"] == "failed"
    assert by["preempted"]["gpufleet"]["cause"] == "preempted"
    assert by["preempted"]["gpufleet"]["job"] == moved
    assert by["preempted"]["gpufleet"]["owner"] == "alice"
    assert len(got) == 3  # each once


def test_a_failing_receiver_is_retried_with_backoff(
    client: TestClient, alice: dict[str, str], worker: dict[str, str], app: Any
) -> None:
    app.state.gpufleet.services.hook_sender.base = 0.3
    wid = register(client, worker, "box")["id"]
    with receiver() as r:
        r.mode = "500"
        _hook(client, alice, url=r.url, secret=SECRET)
        submit(client, alice, name="good")
        _end(client, worker, wid, 0)
        got = r.wait(3, 20)
        r.mode = "ok"
        got = r.wait(4, 20)
    gaps = [b.at - a.at for a, b in itertools.pairwise(got)]
    assert gaps[0] >= 0.14 and gaps[1] >= 0.29 and gaps[2] >= 0.59, gaps  # doubling, jittered
    assert len({g.body for g in got}) == 1  # the same body each time


def test_a_hanging_receiver_costs_the_other_calls_nothing(
    client: TestClient, alice: dict[str, str], worker: dict[str, str], app: Any
) -> None:
    app.state.gpufleet.services.hook_sender.base = 0.2
    wid = register(client, worker, "box")["id"]
    with receiver() as r:
        r.mode, r.hang_for = "hang", 20
        for _ in range(3):
            _hook(client, alice, url=r.url, secret=SECRET)
        for i in range(4):
            submit(client, alice, name=f"j{i}")
            _end(client, worker, wid, 0)
        r.wait(8, 15)  # the sender is busy with hanging sends now
        took = []
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and len(took) < 200:
            start = time.perf_counter()
            assert client.get("/v1/health").status_code == 200
            assert client.get("/v1/jobs", headers=alice).status_code == 200
            took.append(time.perf_counter() - start)
        took.sort()
        p95 = took[int(len(took) * 0.95) - 1]
        # a send blocking the loop would hold a call for its 5 s time-out
        assert p95 < 0.5, (p95, len(took))
        got = r.wait(13, 20)  # 12 deliveries (3 webhooks, 4 jobs), and a try again
    assert len({g.body for g in got}) == 4 and len(got) > 12


def test_a_job_running_past_its_time_is_told_once(
    client: TestClient,
    alice: dict[str, str],
    worker: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpufleet.server import hooksend

    monkeypatch.setattr(hooksend, "RUNNING_EVERY", 0.2)
    wid = register(client, worker, "box")["id"]
    with receiver() as r:
        job = submit(client, alice, name="long")
        made = _hook(client, alice, url=r.url, job=job, running_past=1)
        assert made.json()["events"] == ["succeeded", "failed", "preempted", "running_past"]
        secret = made.json()["secret"]
        lease = claim(client, worker, wid)
        client.post(f"/v1/jobs/{job}/start", json={"attempt": lease["attempt"]}, headers=worker)
        got = r.wait(1, 10)
        time.sleep(1.0)  # looked at several times more: told once
        got = list(r.got)
    assert len(got) == 1, [g.data for g in got]
    assert got[0].data["gpufleet"]["event"] == "running_past"
    assert "running for more than 1s" in got[0].data["text"]
    assert verify_webhook(secret, got[0].headers, got[0].body)
