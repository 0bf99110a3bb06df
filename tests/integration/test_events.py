"""Event streams in-process: pings while idle, where a follower resumes (and a bad
Last-Event-ID), a follower that leaves is no longer counted, and the fleet stream keeps
a submitter to its pools."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from gpufleet.client._events import parse
from gpufleet.domain.models import Role
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, assert_error, bearer, submit

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


def _streams(client: TestClient, headers: dict[str, str]) -> float:
    text = client.get("/metrics", headers=headers).text
    line = next(
        ln for ln in text.splitlines() if ln.startswith('gpufleet_event_streams{kind="job"}')
    )
    return float(line.split()[-1])


def test_a_follower_is_pinged_while_idle_resumes_where_it_says_and_is_let_go(
    client: TestClient, admin: dict[str, str]
) -> None:
    client.app.state.gpufleet.hub.ping = 0.2  # type: ignore[attr-defined]
    job = submit(client, admin)
    assert client.post(f"/v1/jobs/{job}/stop", headers=admin).status_code == 409  # pending
    client.post(f"/v1/jobs/{job}/cancel", headers=admin)
    requeued = client.post(f"/v1/jobs/{job}/requeue", headers=admin)
    assert requeued.status_code == 200, requeued.text
    page = client.get(f"/v1/jobs/{job}/events?format=json", headers=admin).json()
    seqs = [e["seq"] for e in page["events"]]
    assert [e["data"]["event"] for e in page["events"]] == ["submit", "cancel", "requeue"]

    # Last-Event-ID wins over ?after= (a reconnecting EventSource keeps its first URL)
    headers = {**admin, "Last-Event-ID": str(seqs[0])}
    with client.stream("GET", f"/v1/jobs/{job}/events?after=0", headers=headers) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        got = []
        for event in parse(lines):
            got.append(event.seq)
            if len(got) == 2:
                break
        assert got == seqs[1:]
        assert _streams(client, admin) == 1
        # the job waits: nothing comes but a ping (every 0.2 s here, 15 s by default)
        quiet = next(lines)
        assert quiet.startswith(": ping"), quiet
    deadline = time.monotonic() + 10
    while _streams(client, admin) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _streams(client, admin) == 0  # the follower that left is not counted


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "9" * 30])
def test_a_bad_last_event_id_is_refused_naming_the_header(
    client: TestClient, admin: dict[str, str], value: str
) -> None:
    job = submit(client, admin)
    r = client.get(f"/v1/jobs/{job}/events", headers={**admin, "Last-Event-ID": value})
    assert_error(r, 422, "validation_error", "Last-Event-ID")


def test_the_fleet_stream_keeps_a_submitter_to_its_pools(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    alice = bearer(Auth(store).create("alice", Role.SUBMITTER, pools=["lab"])[1])
    refused = client.get("/v1/events?pool=other", headers=alice)
    assert_error(refused, 403, "forbidden", "other")
    with client.stream("GET", "/v1/events", headers=alice) as r:
        seen = []
        for event in parse(r.iter_lines()):
            if event.type == "hello":
                submit(client, admin, name="theirs", pool="other")
                submit(client, alice, name="mine", pool="lab")
                continue
            seen.append(event)
            if event.type == "job":
                break
    assert [(e.data["pool"], e.data["event"]) for e in seen] == [("lab", "submit")]


def test_a_pool_scoped_callers_ids_at_their_edge_are_answered_not_500(
    client: TestClient, admin: dict[str, str], store: SqlStore
) -> None:
    """An opaque id past every id (``after``, ``before``, ``Last-Event-ID`` at the
    largest a client may send) is an empty page, never a server error."""
    from gpufleet.server.event_ids import MAX_SEQ

    job = submit(client, admin)
    scoped = bearer(Auth(store).create("alice", Role.SUBMITTER, pools=["default"])[1])
    url = f"/v1/jobs/{job}/events"
    for query in (f"after={MAX_SEQ}", f"before={MAX_SEQ}", f"after={MAX_SEQ - 1}"):
        r = client.get(f"{url}?format=json&{query}", headers=scoped)
        assert r.status_code == 200, (query, r.text)
    r = client.get(f"{url}?format=json", headers={**scoped, "Last-Event-ID": str(MAX_SEQ)})
    assert r.status_code == 200 and r.json()["events"] == [], r.text
