"""Caps on real processes: a server started with ``--sharing`` whose file caps alice at
2 GPUs (or gives pool default a longest run), two workers with two fake NVML GPUs each.
alice never holds more than 2 GPUs while bob's job takes a free one, ``gpufleet why``
names the cap and who holds it, and a job of the pool is stopped at the pool's limit."""

from __future__ import annotations

import sys
from datetime import datetime

import pytest

from gpufleet.wire import TokenCreate
from tests.e2e.conftest import Fleet, free_port, wait_for

pytestmark = pytest.mark.e2e

CAPPED = """
[users.alice]
max_gpus = 2
"""
SHORT_RUNS = """
[pools.default]
max_run = "4s"
"""
# A job that runs until the file named by its argument exists (bounded: 60 s).
HOLD = (
    "import os, sys, time\n"
    "end = time.monotonic() + 60\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() < end:\n"
    "    time.sleep(0.05)\n"
)


def _start(fleet: Fleet, sharing: str) -> dict[str, dict[str, str]]:
    rules = fleet.root / "sharing.toml"
    rules.write_text(sharing)
    fleet.start_server("--sharing", str(rules))
    for n in range(2):
        fleet.start_gpu_worker(f"gpu{n}", [("NVIDIA A100", 40, 40)] * 2)
    return _users(fleet)


def _users(fleet: Fleet) -> dict[str, dict[str, str]]:
    """alice's and bob's submitter tokens, as the CLI's environment."""
    users = {}
    with fleet.client() as c:
        for name in ("alice", "bob"):
            made = c.create_token(TokenCreate(name=name, role="submitter", pools=["default"]))
            users[name] = {"GPUFLEET_TOKEN": made.token}
    return users


def _submit(fleet: Fleet, env: dict[str, str], *args: str) -> str:
    first = () if "--max-attempts" in args else ("--max-attempts", "1")
    out = fleet.cli("submit", "--gpus", "1", *first, *args, env=env).stdout
    return out.split()[-1]


def _most_at_once(spans: list[tuple[datetime, datetime]]) -> int:
    """The most of ``spans`` (claimed, finished) that overlap at any instant."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        now += step
        most = max(most, now)
    return most


def test_a_user_capped_at_two_gpus_never_holds_three_and_why_says_so(fleet: Fleet) -> None:
    users = _start(fleet, CAPPED)
    release = fleet.root / "release"
    script = ("--", sys.executable, "-c", HOLD, str(release))
    alice = [_submit(fleet, users["alice"], "--name", f"a{i}", *script) for i in range(5)]
    with fleet.client() as c:
        wait_for(
            lambda: sum(c.job(j).status == "running" for j in alice) == 2, 30, "two of alice's"
        )
        bob = _submit(fleet, users["bob"], "--name", "b", *script)
        fleet.wait_status(bob, "running")  # a third GPU is free: not alice's to take
        waiting = next(j for j in alice if c.job(j).status == "pending")
        assert sum(c.job(j).status in ("claimed", "running") for j in alice) == 2
    said = fleet.cli("why", waiting).stdout
    assert "alice holds 2 of their 2 GPUs (cap users.alice.max_gpus)" in " ".join(said.split())
    release.write_text("")
    for j in [*alice, bob]:
        fleet.wait_status(j, "succeeded", timeout=60)
    with fleet.client() as c:
        spans = []
        for j in alice:
            (attempt,) = c.job(j).history
            assert attempt.finished_at is not None
            spans.append((attempt.claimed_at, attempt.finished_at))
    assert _most_at_once(spans) == 2


def test_a_job_runs_no_longer_than_its_pools_max_run(fleet: Fleet) -> None:
    users = _start(fleet, SHORT_RUNS)
    forever = ("--", sys.executable, "-c", "import time; time.sleep(60)")
    j = _submit(fleet, users["bob"], "--max-attempts", "3", "--timeout", "30", *forever)
    done = fleet.wait_status(j, "failed", timeout=30)
    assert done["failure"] == "timeout"
    assert "the longest a job of pool default may run (pools.default.max_run)" in done["error"]
    assert done["error"].startswith("timed out after 4s")
    # the pool's longest run is the job's, in all: not tried again, attempts left or not
    assert len(done["history"]) == 1 and "not retried: the pool's max_run" in done["error"]


def test_claims_through_two_server_replicas_keep_the_cap(fleet: Fleet, pg_url: str) -> None:
    """Two servers on one PostgreSQL database, each with two workers of two GPUs polling
    it: alice's jobs, claimed through both at once, never hold more than her 2 GPUs."""
    rules = fleet.root / "sharing.toml"
    rules.write_text(CAPPED)
    url_a = fleet.start_server("--port", str(free_port()), "--sharing", str(rules), db=pg_url)
    url_b = fleet.start_server("--sharing", str(rules), db=pg_url)
    fleet.url = fleet.env["GPUFLEET_SERVER"] = f"{url_a},{url_b}"  # the token is url_a's
    for n, order in enumerate([(url_a, url_b), (url_a, url_b), (url_b, url_a), (url_b, url_a)]):
        fleet.start_gpu_worker(
            f"gpu{n}", [("NVIDIA A100", 40, 40)] * 2, "--server", ",".join(order)
        )
    users = _users(fleet)
    work = ("--", sys.executable, "-c", "import time; time.sleep(0.5)")
    alice = [_submit(fleet, users["alice"], "--name", f"a{i}", *work) for i in range(8)]
    for j in alice:
        fleet.wait_status(j, "succeeded", timeout=90)
    with fleet.client() as c:
        spans = []
        for j in alice:
            (attempt,) = c.job(j).history
            assert attempt.finished_at is not None
            spans.append((attempt.claimed_at, attempt.finished_at))
    assert _most_at_once(spans) == 2
