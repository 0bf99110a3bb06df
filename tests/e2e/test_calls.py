"""The SDK's calls against a real server: kept-alive connections (reused, shared by
threads, and never written to once the server has closed them), and the CLI's calls,
which do not import httpx."""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

from gpufleet.client import Client
from gpufleet.config import load_token
from gpufleet.wire import JobSpecModel
from tests.e2e.conftest import Fleet
from tests.e2e.relay import Relay


def _relay_to(url: str) -> Relay:
    port = urlsplit(url).port
    assert port is not None
    return Relay(port, cuts=[])


def test_calls_reuse_one_connection_and_not_one_the_server_closed(fleet: Fleet) -> None:
    url = fleet.start_server()
    relay = _relay_to(url)
    try:
        with Client(relay.url, load_token(url)) as c:
            who = c.whoami()
            assert c.jobs() == []
            assert c.jobs(status="running") == []
            assert len(relay.legs) == 1  # three calls, one connection
            # The server drops the idle connection (as at its keep-alive timeout); the
            # next call must not be written into it and fail, but go on a new one.
            relay.hang_up(0)
            time.sleep(0.1)
            assert c.whoami() == who
            assert len(relay.legs) == 2
            assert bytes(relay.legs[1].sent).startswith(b"GET /v1/whoami ")
    finally:
        relay.close()


def test_threads_sharing_a_client_each_get_their_own_answers(fleet: Fleet) -> None:
    url = fleet.start_server()
    relay = _relay_to(url)
    names = [f"job-{n}" for n in range(4)]
    try:
        with Client(relay.url, load_token(url)) as c:
            ids = {
                name: c.submit(JobSpecModel(name=name, command=["true"])).job.id for name in names
            }
            wrong: list[str] = []

            def ask(name: str) -> None:
                for _ in range(5):
                    got = c.job(ids[name])
                    if got.name != name:
                        wrong.append(f"{name} got {got.name}")

            threads = [threading.Thread(target=ask, args=(name,)) for name in names]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)
            assert wrong == []
            # a connection at a time per thread, each kept for the next call
            assert 1 <= len(relay.legs) <= len(names) + 1
    finally:
        relay.close()


def test_the_cli_lists_jobs_without_importing_httpx_or_other_commands(fleet: Fleet) -> None:
    fleet.start_server()
    with fleet.client() as c:
        c.submit(JobSpecModel(name="listed-without-httpx", command=["true"]))
    done = fleet.cli("jobs", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert "listed-without-httpx" in done.stdout
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "gpufleet.client" in imported  # the profile was read
    heavy = sorted(n for n in imported if n.split(".")[0] in ("httpx", "httpcore", "h11"))
    assert heavy == [], f"gpufleet jobs imports {heavy}"
    # what other commands need: submitting, the live view, manifests
    others = ("gpufleet.cli.submit", "gpufleet.cli.watch", "gpufleet.domain.manifest", "rich.live")
    assert sorted(imported.intersection(others)) == [], "gpufleet jobs imports other commands"
