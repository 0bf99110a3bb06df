"""Watching a running job: the progress it reports (file, ``::gpufleet::`` lines,
``gpufleet.report``), its one event log, and following it over Server-Sent Events with
resume after a break."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from gpufleet.client import Client
from gpufleet.client._events import parse
from tests.e2e.conftest import Fleet, wait_for
from tests.procs import Proc, free_port

pytestmark = pytest.mark.e2e

PY = sys.executable

REPORTING = textwrap.dedent(
    """
    import json, os, sys, gpufleet
    for epoch in range(1, 6):
        gpufleet.report(epoch=epoch, epochs=5, loss=1.0 / epoch, message=f"epoch {epoch}")
        print(f"trained epoch {epoch}")
    print('::gpufleet:: {"step": 7, "steps": 10, "val_loss": 0.25}', flush=True)
    print("::gpufleet:: not json", flush=True)
    print('::gpufleet:: {"epoch": -1}', file=sys.stderr, flush=True)
    with open(os.environ["GPUFLEET_PROGRESS_FILE"], "a") as f:
        f.write("[1, 2]\\n")
    print("done")
    """
)


def _submit(fleet: Fleet, script: str, *args: str) -> str:
    out = fleet.cli("submit", "--max-attempts", "1", *args, "--", PY, "-c", script).stdout
    return out.split()[-1]


def test_a_job_reports_progress_and_its_event_log_tells_the_whole_story(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    job = _submit(fleet, REPORTING)
    fleet.wait_status(job, "succeeded")

    shown = fleet.job(job)  # show --json
    assert shown["progress"] == {"step": 7, "steps": 10, "val_loss": 0.25}
    assert shown["metrics"] == {"loss": pytest.approx(0.2), "val_loss": 0.25}

    with fleet.client() as c:
        page = c.events(job, limit=1000)
    kinds = [e.type for e in page.events]
    seqs = [e.seq for e in page.events]
    assert seqs == sorted(set(seqs))  # one sequence, in order, no repeats
    states = [(e.data["event"], e.data["status"]) for e in page.events if e.type == "state"]
    assert states == [
        ("submit", "pending"),
        ("claim", "claimed"),
        ("start", "running"),
        ("succeed", "succeeded"),
    ]
    claim = next(e for e in page.events if e.type == "state" and e.data["event"] == "claim")
    assert claim.data["by"] == "w1"
    records = [e.data["record"] for e in page.events if e.type == "progress"]
    assert [r.get("epoch") for r in records[:5]] == [1, 2, 3, 4, 5]
    assert records[0] == {"epoch": 1, "epochs": 5, "loss": 1.0, "message": "epoch 1"}
    lines = [e.data["line"] for e in page.events if e.type == "log"]
    assert not any(line.startswith("::gpufleet::") for line in lines)  # progress, not output
    assert "trained epoch 3" in lines and "done" in lines
    bad = [line for line in lines if "progress line" in line]
    # the first bad line is shown once, with why; then only the count, at the end
    assert len(bad) == 2, bad
    assert "was not understood" in bad[0] and "more such lines are counted" in bad[0]
    assert bad[1] == "[gpufleet] 3 progress line(s) were not understood and were skipped"
    assert kinds.index("state") == 0 and kinds[-1] == "state"


def test_a_follower_that_breaks_off_resumes_with_every_event_once(fleet: Fleet) -> None:
    """A job writes 100,000 output lines and 1,000 progress records; a follower reads
    part of the stream, drops the connection, and goes on with Last-Event-ID."""
    fleet.start_server()
    fleet.start_worker("w1")
    script = textwrap.dedent(
        """
        import sys, gpufleet
        for i in range(100_000):
            sys.stdout.write(f"line {i}\\n")
            if i % 100 == 0:
                gpufleet.report(step=i // 100, steps=1000, loss=1.0 / (1 + i))
        """
    )
    job = _submit(fleet, script)
    with fleet.client() as c:
        token = c._token
    seen: list[tuple[int, str]] = []
    with httpx.Client(base_url=fleet.url, timeout=60) as http:
        headers = {"Authorization": f"Bearer {token}"}
        with http.stream("GET", f"/v1/jobs/{job}/events", headers=headers) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            for event in parse(resp.iter_lines()):
                if event.seq is not None:
                    seen.append((event.seq, event.type))
                if len(seen) >= 30_000:
                    break  # the connection is dropped mid-stream
        last = seen[-1][0]
        ended = None
        with http.stream(
            "GET",
            f"/v1/jobs/{job}/events",
            headers={**headers, "Last-Event-ID": str(last)},
        ) as resp:
            for event in parse(resp.iter_lines()):
                if event.type == "end":
                    ended = event.data
                    break
                assert event.seq is not None
                seen.append((event.seq, event.type))
    assert ended is not None and ended["status"] == "succeeded"
    seqs = [s for s, _ in seen]
    assert len(seqs) == len(set(seqs)) and seqs == sorted(seqs)
    assert sum(1 for _, k in seen if k == "log") == 100_000
    assert sum(1 for _, k in seen if k == "progress") == 1_000
    # everything the log holds, nothing else
    with fleet.client() as c:
        total, after = 0, 0
        while page := c.events(job, after=after, limit=10_000).events:
            total += len(page)
            after = page[-1].seq
    assert total == len(seen)


def test_the_sdk_follows_a_running_job_to_its_end(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    script = "import time, gpufleet\nfor e in range(3):\n    gpufleet.report(epoch=e + 1, epochs=3, loss=0.5)\n    print('epoch', e + 1, flush=True)\n    time.sleep(0.4)\n"  # noqa: E501
    job = _submit(fleet, script)
    with fleet.client() as c:
        events = list(c.follow(job))
    assert events[-1].type == "end" and events[-1].data["status"] == "succeeded"
    assert [e.data["line"] for e in events if e.type == "log"] == ["epoch 1", "epoch 2", "epoch 3"]
    assert [e.data["record"]["epoch"] for e in events if e.type == "progress"] == [1, 2, 3]
    statuses = [e.data["status"] for e in events if e.type == "state"]
    assert statuses[0] == "pending" and statuses[-1] == "succeeded"


def test_followers_on_one_server_see_events_written_through_another(
    fleet: Fleet, database: str | None
) -> None:
    if database is None:
        pytest.skip("servers share a PostgreSQL database (make test-postgresql runs this)")
    db = database
    first = fleet.start_server(db=db)
    with fleet.client() as c:
        token = c._token
    second = fleet.start_server(db=db)
    fleet.url = fleet.env["GPUFLEET_SERVER"] = first  # the worker and the submit: the first
    fleet.start_worker("w1")
    job = _submit(
        fleet,
        "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.3)\n",
    )
    with Client(second, token) as c:  # the follower reads the second
        events = list(c.follow(job))
    assert [e.data["line"] for e in events if e.type == "log"] == ["tick 0", "tick 1", "tick 2"]
    assert events[-1].data["status"] == "succeeded"
    json.dumps([e.data for e in events])  # plain JSON all through


def test_logs_follow_rides_out_a_server_restart_with_nothing_missed_or_repeated(
    fleet: Fleet,
) -> None:
    fleet.start_server("--port", str(free_port()), lease_timeout=30)
    fleet.start_worker("w1")
    script = (
        "import time\nfor i in range(40):\n    print('line', i, flush=True)\n    time.sleep(0.1)\n"
    )
    job = _submit(fleet, script)
    follower = Proc(
        [PY, "-m", "gpufleet", "logs", "-f", job], fleet.env, fleet.root / "follower.log"
    )
    fleet.procs.append(follower)
    wait_for(lambda: "line 3" in follower.text(), 30, "the follower to print")
    fleet.restart_server(down_for=1.0)  # the follower's stream breaks mid-job
    assert follower.popen.wait(60) == 0, follower.text()
    printed = [ln for ln in follower.text().splitlines() if ln.startswith("line ")]
    assert printed == [f"line {i}" for i in range(40)]
