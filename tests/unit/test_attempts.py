"""What the CLI says of a failed attempt as it ends (submit --wait, logs -f, watch)."""

from __future__ import annotations

import time
from collections import deque

from gpufleet.cli.attempts import attempt_lines
from gpufleet.cli.watch import ATTEMPT, Seen, output_line

RETRY = {
    "status": "pending",
    "event": "retry",
    "attempt": 1,
    "attempts": 1,
    "max_attempts": 3,
    "why": "exit code 4",
    "exit_code": 4,
    "stderr_tail": ["no such file: data.csv"],
    "retry_at": 1_000_010.0,
    "ts": 1_000_000.0,
}


def test_a_retried_attempt_says_its_exit_code_stderr_and_when_it_runs_again() -> None:
    clock = time.strftime("%H:%M:%S", time.localtime(1_000_010.0))
    assert attempt_lines(RETRY) == [
        f"attempt 1/3 failed: exit code 4; retry at {clock} (after a 10s backoff)",
        "  stderr: no such file: data.csv",
    ]


def test_an_attempt_whose_environment_could_not_be_built_says_so_first() -> None:
    why = (
        "No solution found: nosuchpkg was not found, "
        "not retried: the environment cannot be built on any worker"
    )
    final = {
        "status": "failed",
        "event": "fail",
        "attempts": 1,
        "max_attempts": 3,
        "why": why,
        "failure": "environment",
        "not_retried": "not retried: the environment cannot be built on any worker",
    }
    assert attempt_lines(final) == [f"attempt 1/3 failed: environment: {why}; the job has failed"]
    passing = {**RETRY, "why": "environment: connection reset", "failure": "environment"}
    del passing["exit_code"]
    assert attempt_lines(passing)[0].startswith(
        "attempt 1/3 failed: environment: connection reset; retry at"
    )


def test_the_last_attempt_a_timeout_and_a_lost_lease_say_what_follows() -> None:
    last = {**RETRY, "status": "failed", "event": "fail", "attempts": 3, "retry_at": None}
    assert attempt_lines(last)[0] == "attempt 3/3 failed: exit code 4; no attempts left"
    timed = {**RETRY, "why": "timed out after 5s", "exit_code": -9}
    assert attempt_lines(timed)[0].startswith(
        "attempt 1/3 failed: timed out after 5s (exit code -9)"
    )
    lost = {"status": "pending", "event": "lose", "attempts": 1, "max_attempts": 3, "why": "x"}
    assert attempt_lines(lost) == ["attempt 1/3 lost: x; back in the queue now"]
    assert attempt_lines({"status": "running", "event": "start", "attempt": 1}) == []
    stopped = {"status": "failed", "event": "fail", "attempt": 2, "why": "asked to stop"}
    assert attempt_lines(stopped) == ["attempt 2 failed: asked to stop; not retried"]


def test_what_a_job_wrote_is_shown_as_escapes() -> None:
    hostile = {**RETRY, "stderr_tail": ["\x1b]0;owned\x07\x1b[2J"], "why": "exit\x1b[31m 4"}
    lines = attempt_lines(hostile)
    assert not any("\x1b" in line or "\x07" in line for line in lines)
    assert lines[1] == "  stderr: \\x1b]0;owned\\x07\\x1b[2J"


def test_watch_shows_a_failed_attempt_among_the_output_lines() -> None:
    seen = Seen(tail=deque(maxlen=10))
    seen.take("log", {"stream": "stderr", "line": "no such file: data.csv"})
    assert seen.take("state", RETRY) is True
    assert [stream for stream, _ in seen.tail] == ["stderr", ATTEMPT, ATTEMPT]
    shown = output_line(seen.tail[1][1], ATTEMPT)
    assert shown.plain.startswith("attempt 1/3 failed: exit code 4; retry at ")
