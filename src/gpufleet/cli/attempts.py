"""What ``submit --wait``, ``logs -f`` and ``watch`` say of a failed attempt as it ends.

A failed attempt's ``state`` record (:func:`gpufleet.domain.lifecycle.failed_attempt`)
holds why it ended, its exit code, the last lines of its stderr and when the job is tried
again. Each becomes a line of text here, every character the job wrote shown as a
visible escape (:func:`gpufleet.terminal.visible`): a job's stderr cannot drive the
terminal through them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gpufleet.terminal import visible

#: The ``state`` events that end an attempt without success.
FAILED = frozenset({"retry", "fail", "lose", "lose_final"})


def attempt_lines(data: Mapping[str, Any]) -> list[str]:
    """The lines saying how a failed attempt ended (none for any other state record):
    which attempt, why, what comes next, then its stderr's last lines."""
    event = data.get("event")
    if event not in FAILED:
        return []
    used, most = data.get("attempts"), data.get("max_attempts")
    which = f"attempt {used}/{most}" if used and most else f"attempt {data.get('attempt', '?')}"
    how = "lost" if event in ("lose", "lose_final") else "failed"
    head = f"{which} {how}: {_cause(data)}; {_next(data)}"
    tail = [f"  stderr: {visible(str(line))}" for line in data.get("stderr_tail") or ()]
    return [visible(head), *tail]


def _cause(data: Mapping[str, Any]) -> str:
    """Why the attempt failed, led by its class when the worker named one
    ("environment: ...": its environment could not be built)."""
    code = data.get("exit_code")
    said = f"exit code {code}" if code is not None else ""
    why = str(data.get("why") or "") or said or "no exit code"
    why = why if not said or said in why else f"{why} ({said})"
    failure = data.get("failure")
    if failure and not why.startswith(f"{failure}:"):
        why = f"{failure}: {why}"
    return why


def _next(data: Mapping[str, Any]) -> str:
    """When the job runs again, or that it does not."""
    event = data.get("event")
    if event == "lose":
        return "back in the queue now"
    if event == "retry":
        at = data.get("retry_at")
        if not isinstance(at, int | float):
            return "retried"
        clock = time.strftime("%H:%M:%S", time.localtime(at))
        ts = data.get("ts")
        wait = f" (after a {_seconds(at - ts)} backoff)" if isinstance(ts, int | float) else ""
        return f"retry at {clock}{wait}"
    if data.get("not_retried"):
        return "the job has failed"
    used = data.get("attempts")
    if data.get("status") == "failed" and used is not None and used == data.get("max_attempts"):
        return "no attempts left"
    return "not retried"


def _seconds(span: float) -> str:
    return f"{span:.1f}s" if span < 10 else f"{span:.0f}s"
