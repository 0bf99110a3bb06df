"""One token's webhooks are bounded: a caller cannot flood the one delivery queue every
webhook shares (a 409 naming the bound, and a removed webhook makes room)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings
from gpufleet.server.auth import Auth
from gpufleet.server.hooks import MOST_HOOKS
from gpufleet.store import SqlStore
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, assert_error, bearer

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX
SECRET = "a-receiver-secret-of-32-chars-ok"


@pytest.fixture
def settings() -> QueueSettings:
    return QueueSettings(lease_timeout=120.0, webhook_allow=("127.0.0.1",))


def test_a_token_holds_at_most_so_many_webhooks(client: TestClient, store: SqlStore) -> None:
    auth = Auth(store)
    alice = bearer(auth.create("alice", Role.SUBMITTER, ["default"])[1])
    bob = bearer(auth.create("bob", Role.SUBMITTER, ["default"])[1])
    body = {"url": "http://127.0.0.1:9/hook", "secret": SECRET}
    for _ in range(MOST_HOOKS):
        assert client.post("/v1/webhooks", json=body, headers=alice).status_code == 201
    over = client.post("/v1/webhooks", json=body, headers=alice)
    assert_error(over, 409)
    assert over.json()["error"]["detail"]["most"] == MOST_HOOKS
    assert "remove one first" in over.json()["error"]["message"]
    # Another token's room is its own.
    assert client.post("/v1/webhooks", json=body, headers=bob).status_code == 201
    first = client.get("/v1/webhooks", headers=alice).json()[0]["id"]
    assert client.delete(f"/v1/webhooks/{first}", headers=alice).status_code == 204
    assert client.post("/v1/webhooks", json=body, headers=alice).status_code == 201
