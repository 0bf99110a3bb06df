"""What a newer worker sends an older server: a field the older server does not know is
left out while it holds its default, so the older server (which refuses unknown fields)
still takes the call."""

from __future__ import annotations

from datetime import UTC, datetime

from gpufleet.client._api import Call
from gpufleet.wire import ClaimRequest, FinishRequest, HeartbeatRequest, StartRequest, Strict


def _sent(body: Strict) -> dict[str, object]:
    import json

    payload = Call("POST", "/v1/x", lambda reply: None, body).payload()
    assert payload is not None
    sent: dict[str, object] = json.loads(payload)
    return sent


def test_a_start_without_its_time_and_a_poll_for_one_job_send_only_the_old_fields() -> None:
    assert _sent(StartRequest(attempt=2, pid=7)) == {"attempt": 2, "pid": 7}
    assert set(_sent(ClaimRequest(cpu_slots=1))) == {"cpu_slots", "gpus", "wait", "supersede"}


def test_the_new_fields_are_sent_when_they_say_something() -> None:
    when = datetime(2026, 11, 26, 12, 0, 0, 250_000, tzinfo=UTC)
    assert _sent(StartRequest(attempt=1, started_at=when))["started_at"] == (
        "2026-11-26T12:00:00.250000Z"
    )
    assert _sent(ClaimRequest(cpu_slots=4, most=4))["most"] == 4


def test_reports_without_an_environment_or_a_failure_class_send_only_the_old_fields() -> None:
    """A newer worker's start, finish and heartbeat reach a server from before job
    environments unchanged while they have none to tell."""
    assert "environment" not in _sent(StartRequest(attempt=1))
    assert set(_sent(FinishRequest(attempt=1, exit_code=3))) == {
        "attempt",
        "exit_code",
        "error",
        "stderr_tail",
    }
    assert set(_sent(HeartbeatRequest())) == {"leases", "gpus", "draining"}
    sent = _sent(FinishRequest(attempt=1, failure="environment", final=True))
    assert (sent["failure"], sent["final"]) == ("environment", True)
    assert _sent(HeartbeatRequest(environments=[]))["environments"] == []
