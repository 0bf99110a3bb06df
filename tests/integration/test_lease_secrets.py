"""Each attempt's writes need the secret its claim gave: the worker's token alone is not
enough. A credential taken from one job's run cannot write another job's results, even
on the same worker, with the same token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gpufleet.server.lease_secrets import LeaseSecrets
from gpufleet.store import SqlStore
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    claim,
    register,
    submit,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX

WRITES = [
    ("start", {}),
    ("output", {"lines": [{"line": "forged"}]}),
    ("finish", {"exit_code": 0}),
    ("release", {}),
    ("artifact", {"sha256": "0" * 64}),
]


@pytest.fixture
def two_leases(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> tuple[dict[str, object], dict[str, object]]:
    """Two jobs held by one worker (one token): the attempt a job's code could see, and
    the other job's."""
    wid = register(client, worker, "w1", cpu_slots=2)["id"]
    submit(client, admin, name="mine")
    submit(client, admin, name="theirs")
    return claim(client, worker, wid), claim(client, worker, wid)


def test_a_claim_gives_each_attempt_its_own_secret(
    two_leases: tuple[dict[str, object], dict[str, object]],
) -> None:
    mine, theirs = two_leases
    assert str(mine["secret"]).startswith("gl_") and str(theirs["secret"]).startswith("gl_")
    assert mine["secret"] != theirs["secret"]


@pytest.mark.parametrize(("kind", "extra"), WRITES, ids=[w[0] for w in WRITES])
def test_a_write_without_the_attempts_secret_is_refused(
    client: TestClient,
    worker: dict[str, str],
    two_leases: tuple[dict[str, object], dict[str, object]],
    kind: str,
    extra: dict[str, object],
) -> None:
    mine, theirs = two_leases
    job, attempt = theirs["job_id"], theirs["attempt"]
    for secret in (None, mine["secret"], "gl_" + "A" * 43):
        body = {"attempt": attempt, "secret": secret, **extra}
        r = client.post(f"/v1/jobs/{job}/{kind}", json=body, headers=worker)
        assert_error(r, 403, "forbidden", "secret")


def test_a_refused_write_changes_nothing(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    two_leases: tuple[dict[str, object], dict[str, object]],
) -> None:
    mine, theirs = two_leases
    job = theirs["job_id"]
    for kind, extra in WRITES:
        body = {"attempt": theirs["attempt"], "secret": mine["secret"], **extra}
        assert client.post(f"/v1/jobs/{job}/{kind}", json=body, headers=worker).status_code == 403
    shown = client.get(f"/v1/jobs/{job}", headers=admin).json()
    assert shown["status"] == "claimed", shown
    logs = client.get(f"/v1/jobs/{job}/logs", headers=admin).json()
    assert "forged" not in str(logs)


def test_a_forged_finish_in_a_batch_is_refused_and_the_job_runs_on(
    client: TestClient,
    admin: dict[str, str],
    worker: dict[str, str],
    two_leases: tuple[dict[str, object], dict[str, object]],
) -> None:
    mine, theirs = two_leases
    forged = {"kind": "finish", "job_id": theirs["job_id"], "attempt": 1, "exit_code": 0}
    batch = {"reports": [{**forged, "secret": mine["secret"]}]}
    r = client.post("/v1/reports", json=batch, headers=worker)
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["status"] == 403
    job = client.get(f"/v1/jobs/{theirs['job_id']}", headers=admin).json()
    assert job["status"] == "claimed", job
    # the holder, with the right secret, finishes it
    r = client.post(
        "/v1/reports", json={"reports": [{**forged, "secret": theirs["secret"]}]}, headers=worker
    )
    assert r.json()["results"][0]["status"] == 200, r.text


def test_another_server_of_the_fleet_derives_the_same_secret(
    client: TestClient, worker: dict[str, str], admin: dict[str, str], store: SqlStore
) -> None:
    """Servers share the key through the database, so a replica, or this server after a
    restart, accepts the secret a claim gave (nothing is kept per attempt)."""
    wid = register(client, worker, "w1")["id"]
    job = submit(client, admin)
    lease = claim(client, worker, wid)
    row = store.get_job(job)
    assert row is not None and row.claimed_at is not None
    elsewhere = LeaseSecrets(store)
    assert elsewhere.holds(lease["secret"], job, 1, row.claimed_at)
    assert not elsewhere.holds(lease["secret"], job, 2, row.claimed_at)


def test_a_late_result_without_the_attempts_secret_leaves_no_word_in_its_history(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """A result for an attempt that ended is refused (409) and kept in the attempt's
    history, but only from the worker that held it: a worker token alone wrote a forged
    'late result' onto a succeeded job before."""
    w = register(client, worker, "box")
    job = submit(client, admin, max_attempts=1)
    lease = claim(client, worker, w["id"])
    assert client.post(f"/v1/jobs/{job}/cancel", headers=admin).status_code == 200
    forged = {"attempt": 1, "secret": None, "exit_code": 1, "error": "FORGED"}
    assert_error(client.post(f"/v1/jobs/{job}/finish", json=forged, headers=worker), 409)
    [first] = client.get(f"/v1/jobs/{job}", headers=admin).json()["history"]
    assert first["late_result"] is None
    late = {"attempt": 1, "secret": lease["secret"], "exit_code": 0, "error": "saved"}
    assert_error(client.post(f"/v1/jobs/{job}/finish", json=late, headers=worker), 409)
    [first] = client.get(f"/v1/jobs/{job}", headers=admin).json()["history"]
    assert first["late_result"].startswith("exit code 0 (saved)")
