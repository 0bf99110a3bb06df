"""Reading a job that printed long lines costs the server a few MiB a read: a page of its
event log (and a stream's batch) stops at a byte budget as well as at its count, says
there is more, and the pages read on from each other miss nothing."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.config import load_token
from tests.e2e.conftest import PYTHON, Fleet
from tests.e2e.test_backlog import PeakRss

pytestmark = pytest.mark.e2e

MIB = 1 << 20
LINES = 48  # of 1 MiB each: stored as 96 records (a line is stored in pieces of 10^6)
JOB = f"""
import sys
for i in range({LINES}):
    sys.stdout.write(chr(97 + i % 26) * {MIB} + "\\n")
    sys.stdout.flush()
"""


def _page(http: httpx.Client, job: str, after: int = 0, limit: int = 1000) -> dict[str, Any]:
    resp = http.get(
        f"/v1/jobs/{job}/events", params={"format": "json", "after": after, "limit": limit}
    )
    assert resp.status_code == 200, resp.text
    page: dict[str, Any] = resp.json()
    return page


def _concurrently(n: int, read: Any) -> list[Any]:
    out: list[Any] = [None] * n

    def one(i: int) -> None:
        out[i] = read()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(o is not None for o in out)
    return out


def _six_at_once(pid: int, read: Any, what: str) -> list[Any]:
    """Six concurrent ``read`` calls, asserting the server (``pid``) grew by less than
    100 MiB meanwhile (its peak RSS, sampled)."""
    rss = PeakRss(pid)
    baseline = rss.proc.memory_info().rss
    rss.start()
    got = _concurrently(6, read)
    rss.stopping.set()
    rss.join(5)
    grew = (rss.peak - baseline) / MIB
    print(f"six concurrent {what}: server RSS {baseline / MIB:.0f} MiB, +{grew:.0f} MiB")
    assert grew < 100, grew
    return got


def _long_lines_job(fleet: Fleet, tmp_path: Path) -> str:
    script = tmp_path / "long.py"
    script.write_text(JOB)
    job = fleet.cli("submit", "--max-attempts", "1", "--", PYTHON, str(script)).stdout.split()[-1]
    assert fleet.wait_status(job, "succeeded", "failed", timeout=120)["status"] == "succeeded"
    return job


def test_six_concurrent_pages_of_1_mib_lines_add_under_100_mib(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    job = _long_lines_job(fleet, tmp_path)
    assert fleet.server is not None
    headers = {"Authorization": f"Bearer {load_token(fleet.url)}"}
    with httpx.Client(base_url=fleet.url, headers=headers, timeout=60) as http:
        _page(http, job, limit=1)  # the code paths warm, a record's worth read
        time.sleep(0.5)
        pid = fleet.server.popen.pid
        pages = _six_at_once(pid, lambda: _page(http, job), "pages")
        for page in pages:
            sizes = [len(e["data"]["line"]) for e in page["events"] if e["type"] == "log"]
            assert page["more"] and sizes and sum(sizes) <= 5 * MIB, sizes  # 4 MiB and a line

        # Read on from page to page: every piece of every line, once, in order.
        got: list[str] = []
        after, more = 0, True
        for _ in range(200):
            if not more:
                break
            page = _page(http, job, after)
            got += [e["data"]["line"] for e in page["events"] if e["type"] == "log"]
            after, more = page["next"], page["more"]
        assert not more
        assert "".join(got) == "".join(chr(97 + i % 26) * MIB for i in range(LINES))
        assert [len(x) for x in got[:2]] == [1_000_000, MIB - 1_000_000]  # its stored pieces

        # Six followers of its event stream, from the start: batches of a few MiB too.
        streamed = _six_at_once(pid, lambda: _follow(http, job), "followers")
        assert all(n > LINES * MIB for n in streamed), streamed


def _follow(http: httpx.Client, job: str) -> int:
    """Bytes of the job's event stream, read to its end."""
    got = 0
    with http.stream("GET", f"/v1/jobs/{job}/events") as resp:
        assert resp.status_code == 200
        for chunk in resp.iter_bytes():
            got += len(chunk)
    return got
