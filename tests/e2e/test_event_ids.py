"""A token confined to some pools sees opaque event ids: the gap between two of its
records' ids says nothing of how much other pools did meanwhile, and a stream broken off
resumes from the last id it gave (on any server of the fleet) with nothing missed."""

from __future__ import annotations

import sys

import httpx
import pytest

from gpufleet.client import Client
from gpufleet.client._events import parse
from gpufleet.config import load_token
from gpufleet.wire import JobSpecModel, TokenCreate
from tests.e2e.conftest import Fleet

pytestmark = pytest.mark.e2e

LINES = 3000


def _submit(c: Client, pool: str, command: list[str] | None = None) -> str:
    spec = JobSpecModel(name=f"in-{pool}", pool=pool, command=command or ["true"])
    return c.submit(spec).job.id


def _first_id(c: Client, job: str) -> int:
    """The id of the job's first record (its submit), as ``c``'s token sees it."""
    return c.events(job, limit=1).events[0].seq


def _gaps(admin: Client, seen_by: list[Client], between: int) -> list[int]:
    """Submit two pool-a jobs with ``between`` pool-b jobs in between: the difference of
    their first records' ids, as each of ``seen_by`` sees them."""
    first = _submit(admin, "a")
    for _ in range(between):
        _submit(admin, "b")
    second = _submit(admin, "a")
    return [_first_id(c, second) - _first_id(c, first) for c in seen_by]


def test_a_pool_scoped_token_cannot_count_another_pools_events(fleet: Fleet) -> None:
    fleet.start_server()
    with fleet.client() as admin:
        made = admin.create_token(TokenCreate(name="pool-a", role="submitter", pools=["a"]))
        with Client(fleet.url, made.token) as mine:
            quiet = _gaps(admin, [admin, mine], 0)
            busy = _gaps(admin, [admin, mine], 50)
            # The fleet's numbers tell the two apart: that is what an admin sees.
            assert (quiet[0], busy[0]) == (1, 51)
            # The pool-a submitter's ids are scattered over 2^52 numbers either way.
            for gap in (quiet[1], busy[1]):
                assert abs(gap) > 2**30, (quiet, busy)
            # Its pages and its streams number a record alike; none is the fleet's number.
            job = _submit(admin, "a")
            page = mine.events(job)
            assert page.events[0].seq != admin.events(job).events[0].seq
            assert page.events[0].data["seq"] == page.events[0].seq == page.next
            stream = next(mine.follow(job))
            assert (stream.seq, stream.data["seq"]) == (page.next, page.next)


def _read(
    url: str, token: str, job: str, last: int | None, stop_at: int | None
) -> list[tuple[int, str]]:
    """(id, line) of the job's log events, from after ``last``, until ``stop_at`` of them
    (the connection is then dropped) or the stream's end."""
    got: list[tuple[int, str]] = []
    headers = {"Authorization": f"Bearer {token}"}
    if last is not None:
        headers["Last-Event-ID"] = str(last)
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("GET", f"/v1/jobs/{job}/events", headers=headers) as resp,
    ):
        assert resp.status_code == 200
        for event in parse(resp.iter_lines()):
            if event.type == "end":
                return got
            if event.type == "log" and event.seq is not None:
                got.append((event.seq, event.data["line"]))
            if stop_at is not None and len(got) >= stop_at:
                return got
    raise AssertionError("the stream ended without its end event")


def test_a_pool_scoped_follower_resumes_from_its_opaque_id_on_any_server(
    fleet: Fleet, database: str | None
) -> None:
    """On PostgreSQL the stream breaks off on one server and resumes on another."""
    first = fleet.start_server()
    second = fleet.start_server() if database else first
    fleet.url = fleet.env["GPUFLEET_SERVER"] = first
    fleet.start_worker("w1", "--pool", "a")
    printing = f"for i in range({LINES}):\n    print(i, flush=True)\n"
    with Client(first, load_token(first)) as admin:
        token = admin.create_token(TokenCreate(name="a", role="submitter", pools=["a"])).token
        job = _submit(admin, "a", [sys.executable, "-c", printing])
    fleet.wait_status(job, "succeeded", timeout=60)
    before = _read(first, token, job, None, 1000)
    after = _read(second, token, job, before[-1][0], None)
    with Client(second, token) as mine:  # the SDK resumes from an opaque id as well
        resumed = [e for e in mine.follow(job, after=before[-1][0]) if e.type == "log"]
    assert [(e.seq, e.data["line"]) for e in resumed] == after
    lines = [line for _, line in before + after]
    assert lines == [str(i) for i in range(LINES)]  # every line once, in order
    ids = [seq for seq, _ in before + after]
    assert len(set(ids)) == len(ids) and ids != sorted(ids)  # unique, and in no order
