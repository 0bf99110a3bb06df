"""Progress you can see (issue 31, item 6): a job's carriage-return progress bar reaches
``logs -f`` while it runs, at most a state every half second, and its stored log keeps
a few states and its last; the worker's download of a job's inputs says how far it is."""

from __future__ import annotations

import os
import subprocess
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.e2e.conftest import PYTHON, Fleet

pytestmark = pytest.mark.e2e

#: a bar redrawn every 0.1 s for 5 s, as ``print(..., end="\r")`` draws one, no newline
BAR = textwrap.dedent(
    """
    import time
    for n in range(51):
        print(f"{2 * n:3d}% training", end="\\r", flush=True)
        time.sleep(0.1)
    print()
    print("trained")
    """
)


def _submit(fleet: Fleet, script: str, *args: str) -> str:
    out = fleet.cli("submit", "--max-attempts", "1", *args, "--", PYTHON, "-c", script).stdout
    return out.split()[-1]


def _follow(fleet: Fleet, job: str) -> list[tuple[float, str]]:
    """What ``logs -f`` prints on stdout (a pipe), a line at a time, with when it came."""
    got: list[tuple[float, str]] = []
    proc = subprocess.Popen(
        [PYTHON, "-m", "gpufleet", "logs", "-f", job],
        env=fleet.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            got.append((time.time(), raw.decode()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(60)
    finally:
        proc.kill()
        proc.wait(10)
        reader.join(10)
        proc.stdout.close()
    return got


def test_a_progress_bar_without_newline_reaches_logs_follow_while_it_runs(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    job = _submit(fleet, BAR)
    got = _follow(fleet, job)
    ended = datetime.fromisoformat(fleet.wait_status(job, "succeeded")["finished_at"]).timestamp()

    states = [(at, line) for at, line in got if "% training" in line]
    early = {line for at, line in states if at < ended - 0.5}  # seen well before its end
    assert len(early) >= 3, got  # without the change: none before the newline at its end
    assert len(states) <= 14  # a state every half second at most (and its last), not 51
    # off a terminal each state is a line of its own, and the bar ends with its last state
    assert [line for _, line in got][-2:] == ["100% training\n", "trained\n"]

    # the stored log keeps those states and the last; --raw writes them as the job did
    stored = fleet.cli("logs", job).stdout.splitlines()
    assert 3 <= sum("% training" in line for line in stored) <= 14
    raw = subprocess.run(
        [PYTHON, "-m", "gpufleet", "logs", "--raw", job],
        env=fleet.env,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    assert raw.endswith(b"% training\r100% training\ntrained\n"), raw
    assert raw.count(b"\n") == 2  # the states are joined by carriage returns, as written


def test_the_download_of_a_jobs_inputs_says_how_far_it_is(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "data.bin").write_bytes(os.urandom(4 << 20))  # 4 MiB that do not compress
    job = _submit(fleet, "import os; print(os.path.getsize('data.bin'))", "--package", str(pkg))
    fleet.wait_status(job, "succeeded")

    with fleet.client() as c:
        events = c.events(job, limit=1000).events
    records = [e.data["record"] for e in events if e.type == "progress"]
    said = [r["message"] for r in records]
    assert said[0] == "downloading inputs 0.0/4.0 MiB", said  # at its start, with its size
    assert said[-1].startswith("inputs downloaded: 4.0 MiB in "), said  # and its end, rate
    assert records[0]["bytes_total"] >= 4 << 20 and records[-1]["bytes"] >= 4 << 20
    assert records[-1]["bytes_per_s"] > 0
    assert len(records) <= 3  # a download of a moment: no storm of events
    # its words in the job's output, and its latest in show
    assert "[gpufleet] inputs downloaded: 4.0 MiB in " in fleet.cli("logs", job).stderr
    assert "inputs downloaded: 4.0 MiB" in fleet.cli("show", job).stdout
    assert fleet.job(job)["metrics"] == {}  # bytes are no metric to plot
