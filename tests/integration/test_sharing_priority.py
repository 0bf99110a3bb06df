"""Priority is what preempts another user's job, so the operator grants it: a submitter
asks for no priority above its user's ``max_priority``, or, with preemption on and no
``max_priority``, none that may preempt (403 naming the rule; nothing is queued).
Operators and admins are not bounded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpufleet.domain.models import Role
from gpufleet.domain.sharing import parse
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, assert_error, bearer, job_body

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


def _rules(app: FastAPI, raw: dict[str, Any]) -> None:
    app.state.gpufleet.services.sharing.set(parse(raw, "sharing.toml"))


def _jobs(client: TestClient, admin: dict[str, str]) -> int:
    return len(client.get("/v1/jobs", headers=admin).json())


def test_with_preemption_on_a_submitter_cannot_ask_for_a_priority_that_preempts(
    app: FastAPI, client: TestClient, admin: dict[str, str], store: SqlStore
) -> None:
    _rules(app, {"preemption": {"min_priority": 10}, "users": {"carol": {"max_priority": 50}}})
    auth = Auth(store)
    bob = bearer(auth.create("bob", Role.SUBMITTER)[1])
    carol = bearer(auth.create("carol", Role.SUBMITTER)[1])
    before = _jobs(client, admin)
    r = client.post("/v1/jobs", json=job_body("urgent", priority=10), headers=bob)
    assert_error(r, 403)
    said = r.json()["error"]
    assert "priority 10 is above the most bob may ask for: 9" in said["message"]
    assert said["detail"]["field"] == "priority"
    assert _jobs(client, admin) == before, "nothing queued"
    ok = client.post("/v1/jobs", json=job_body("normal", priority=9), headers=bob)
    assert ok.status_code == 201, ok.text
    granted = client.post("/v1/jobs", json=job_body("urgent", priority=50), headers=carol)
    assert granted.status_code == 201, granted.text
    over = client.post("/v1/jobs", json=job_body("more", priority=51), headers=carol)
    assert_error(over, 403)
    assert "users.carol.max_priority" in over.json()["error"]["message"]
    boss = client.post("/v1/jobs", json=job_body("ops", priority=1000), headers=admin)
    assert boss.status_code == 201, boss.text


def test_without_rules_any_priority_is_a_submitters_to_ask(
    client: TestClient, store: SqlStore
) -> None:
    bob = bearer(Auth(store).create("bob", Role.SUBMITTER)[1])
    r = client.post("/v1/jobs", json=job_body("sweep", priority=1000), headers=bob)
    assert r.status_code == 201, r.text
