"""The quickstart's one machine: `gpufleet server` and then `gpufleet worker` with nothing
configured. The worker runs with a worker token the fresh server made and saved for this
machine's workers (0600, beside the admin's), never with the admin's token.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from gpufleet.config import load_token, load_worker_token
from tests.e2e.conftest import Fleet, free_port

pytestmark = pytest.mark.e2e


def test_the_local_worker_runs_with_a_worker_token_not_the_admins(
    fleet: Fleet, _isolated_config: Path
) -> None:
    fleet.start_server("--port", str(free_port()))  # the same URL after the restart
    said = fleet.server.text() if fleet.server else ""
    assert "Worker token 'local-worker' (pool default) created" in said
    admin, worker_token = load_token(fleet.url), load_worker_token(fleet.url)
    assert admin and worker_token and worker_token != admin
    assert worker_token not in said  # saved, never printed
    credentials = _isolated_config / "credentials.json"
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600

    worker = fleet.start_worker("laptop")  # no token given: the quickstart's own
    job = fleet.cli("submit", "--", sys.executable, "-c", "print('hello')").stdout.split()[-1]
    fleet.wait_status(job, "succeeded")
    assert worker_token not in worker.text()

    # The server saw the worker enrolled by the local worker token, a worker's role.
    audit = json.loads(fleet.cli("audit", "--json").stdout)
    [registered] = [a for a in audit if a["event"] == "worker.registered"]
    assert (registered["token_name"], registered["role"]) == ("local-worker", "worker")
    [w] = json.loads(fleet.cli("workers", "--json").stdout)
    tokens = json.loads(fleet.cli("tokens", "ls", "--json").stdout)
    assert {t["name"]: t["role"] for t in tokens} == {"admin": "admin", "local-worker": "worker"}

    # What that worker holds cannot act as the admin: an admin call with it is refused.
    refused = fleet.cli("tokens", "ls", env={"GPUFLEET_TOKEN": worker_token}, check=False)
    assert refused.returncode != 0 and "admin" in refused.stderr
    assert w["name"] == "laptop"

    # A restart keeps the saved worker token (it still works): no new one.
    fleet.restart_server()
    assert "Worker token" not in (fleet.server.text() if fleet.server else "")
    assert load_worker_token(fleet.url) == worker_token
    assert len(json.loads(fleet.cli("tokens", "ls", "--json").stdout)) == 2

    # An admin who revokes it keeps it revoked: a restart makes no new one.
    local = next(t["id"] for t in tokens if t["name"] == "local-worker")
    fleet.cli("tokens", "revoke", local)
    fleet.restart_server()
    assert "Worker token" not in (fleet.server.text() if fleet.server else "")
    after = json.loads(fleet.cli("tokens", "ls", "--json").stdout)
    assert [t["id"] for t in after if t["name"] == "local-worker"] == [local]


def test_a_worker_with_only_the_admins_token_saved_refuses_to_use_it(
    fleet: Fleet, _isolated_config: Path
) -> None:
    fleet.start_server()
    credentials = _isolated_config / "credentials.json"
    data = json.loads(credentials.read_text())
    del data["workers"]  # as a machine whose server came before the local worker token
    credentials.write_text(json.dumps(data))
    done = fleet.cli("worker", "--name", "old", check=False, timeout=30)
    assert done.returncode != 0
    assert "a worker does not run with the admin's token" in done.stderr
    assert json.loads(fleet.cli("workers", "--json").stdout) == []
