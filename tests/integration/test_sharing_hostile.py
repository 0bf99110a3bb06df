"""A sharing file's extreme but valid values (a vast or the least half-life, weights
near the float limits, caps of 0, waits of a lifetime) keep the server answering: claims,
``usage`` and ``why`` go on, never a 5xx."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from gpufleet.domain.models import Role
from gpufleet.domain.sharing import parse
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, bearer, register, submit

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX

HOSTILE: list[dict[str, Any]] = [
    {"fair_share": {"half_life": 1.7e308}},
    {"fair_share": {"half_life": 1}},
    {"users": {"alice": {"weight": 5e-324}, "bob": {"weight": 1.7e308}}},
    {"users": {"alice": {"weight": 1.7e308}, "bob": {"weight": 1.7e308}}},
    {"users": {"alice": {"max_gpus": 0, "max_cpu_slots": 0}}},
    {"pools": {"default": {"max_cpu_slots": 0, "weight": 1e-300}}},
    {
        "preemption": {"min_priority": -1_000_000, "min_wait": 1e300, "protection": 1e300},
        "users": {"alice": {"max_priority": 1_000_000}},  # else below -1e6: none allowed
    },
    {"preemption": {"min_priority": 1_000_000, "min_wait": 0, "protection": 0}},
]


@pytest.mark.parametrize("raw", HOSTILE)
def test_extreme_rules_never_make_a_5xx(
    client: TestClient, admin: dict[str, str], worker: dict[str, str], app: Any, store: SqlStore,
    raw: dict[str, Any],
) -> None:  # fmt: skip
    app.state.gpufleet.services.sharing.set(parse(raw, "sharing.toml"))
    alice = bearer(Auth(store).create("alice", Role.SUBMITTER, ["default"])[1])
    wid = register(client, worker, "w1")["id"]
    jobs = [submit(client, alice, name=f"a{i}", priority=i) for i in range(3)]
    got = client.post(f"/v1/workers/{wid}/claim", json={"cpu_slots": 1, "wait": 0}, headers=worker)
    assert got.status_code in (200, 204), got.text
    if raw.get("users", {}).get("alice", {}).get("max_cpu_slots") != 0 and "pools" not in raw:
        assert got.status_code == 200, got.text
    if got.status_code == 200:
        lease = got.json()
        started = client.post(
            f"/v1/jobs/{lease['job_id']}/start", json={"attempt": lease["attempt"]}, headers=worker
        )
        assert started.status_code == 204, started.text
    for path in ("/v1/usage", "/v1/usage?window_hours=8784", f"/v1/jobs/{jobs[0]}/why"):
        r = client.get(path, headers=admin)
        assert r.status_code == 200, (path, r.text)
