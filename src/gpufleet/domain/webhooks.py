"""Webhooks: word when a job ends. What each job event is called, the body a receiver
gets, its signature, and when a delivery that failed is tried again.

Events (a webhook names those it wants; ``DEFAULT_EVENTS`` when it names none):

- ``succeeded``: the job ended well;
- ``failed``: it failed for good (no attempts left, a dependency failed, lost too often);
- ``cancelled``: an owner or operator cancelled it (only when asked for: the one who
  cancels knows already);
- ``preempted``: an attempt ended with the cause ``preempted`` (the job goes back to the
  queue); any attempt cause named in ``CAUSE_EVENTS`` becomes its event;
- ``running_past``: the job has run longer than the webhook's ``running_past`` seconds
  (once per job and webhook).

The body is Slack-compatible (``text``, which Slack's incoming webhooks show) with the
facts under ``gpufleet``. It is signed with HMAC-SHA256 over ``"{t}.{body}"``, where ``t``
is the Unix time of the delivery, and sent as ``X-Gpufleet-Signature: t=<t>,v1=<hex>``;
:func:`verify` checks one (the SDK's ``gpufleet.client.verify_webhook``).

Nothing here does I/O; time and randomness come in as arguments.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass

EVENTS = ("succeeded", "failed", "cancelled", "preempted", "running_past")
DEFAULT_EVENTS = ("succeeded", "failed", "preempted")
#: An attempt that ended with one of these causes is told as the event named.
CAUSE_EVENTS = {"preempted": "preempted"}
_STATUS_EVENTS = {"succeeded": "succeeded", "failed": "failed", "cancelled": "cancelled"}

SIGNATURE_HEADER = "X-Gpufleet-Signature"
EVENT_HEADER = "X-Gpufleet-Event"
#: How old a signature's time may be before :func:`verify` refuses it (a replay).
TOLERANCE = 300.0

#: Tries of one delivery in all, and the base of the wait between two (doubled each time,
#: jittered): 4, 8, 16, 32 s, about a minute from the first try to the last.
TRIES = 5
BASE_DELAY = 4.0


def event_of(status: str, cause: str | None) -> str | None:
    """The webhook event a job's status change is, if any: an attempt's cause first
    (``preempted``), then the status it ended in."""
    if cause is not None and cause in CAUSE_EVENTS:
        return CAUSE_EVENTS[cause]
    return _STATUS_EVENTS.get(status)


@dataclass(frozen=True)
class JobFacts:
    """What a webhook says of a job."""

    job: str
    name: str
    owner: str
    pool: str
    status: str
    attempt: int
    cause: str | None = None
    error: str | None = None
    url: str | None = None  # the job's page on the dashboard, when the server knows it


_VERBS = {
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "was cancelled",
    "preempted": "was preempted (it goes back to the queue)",
}


def text(event: str, facts: JobFacts, running_past: float | None = None) -> str:
    """The one line a chat shows; what users wrote (a job's name, its owner, its error)
    escaped as Slack asks, so a name cannot ping a channel or hide a link."""
    who = (
        f"gpufleet job {chat(facts.name)} ({chat(facts.job)}) of "
        f"{chat(facts.owner) if facts.owner else 'nobody'}"
    )
    if event == "running_past":
        return f"{who} has been running for more than {_duration(running_past or 0)}"
    line = f"{who} {_VERBS.get(event, event)}"
    if event == "failed" and facts.error:
        line += f": {chat(facts.error[:300])}"
    return line


def chat(value: str) -> str:
    """``value`` as plain text in a Slack message: ``&``, ``<`` and ``>`` escaped (Slack's
    control sequences, ``<!channel>``, ``<@U123>``, ``<https://x|text>``, start with ``<``)."""
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def body(event: str, facts: JobFacts, at: float, running_past: float | None = None) -> bytes:
    """The JSON body of one delivery (``at``: when the event happened)."""
    data: dict[str, object] = {
        "text": text(event, facts, running_past),
        "gpufleet": {
            "event": event,
            "at": at,
            "job": facts.job,
            "name": facts.name,
            "owner": facts.owner,
            "pool": facts.pool,
            "status": facts.status,
            "attempt": facts.attempt,
            "cause": facts.cause,
            "error": facts.error,
            "url": facts.url,
        },
    }
    return json.dumps(data, separators=(",", ":")).encode()


def signature(secret: str, at: int, payload: bytes) -> str:
    """The signature header's value for ``payload`` sent at ``at`` (Unix seconds)."""
    mac = hmac.new(secret.encode(), f"{at}.".encode() + payload, hashlib.sha256)
    return f"t={at},v1={mac.hexdigest()}"


def verify(
    secret: str, header: str | None, payload: bytes, now: float, tolerance: float = TOLERANCE
) -> bool:
    """Whether ``header`` (the signature header's value) signs ``payload`` with
    ``secret``, made within ``tolerance`` seconds of ``now``."""
    if not header:
        return False
    parts: dict[str, list[str]] = {}
    for item in header.split(","):
        key, _, value = item.strip().partition("=")
        parts.setdefault(key, []).append(value)
    try:
        at = int(parts.get("t", [""])[0])
    except ValueError:
        return False
    if abs(now - at) > tolerance:
        return False
    want = signature(secret, at, payload).partition(",v1=")[2]
    return any(hmac.compare_digest(want, given) for given in parts.get("v1", []))


def header_value(headers: Mapping[str, str], name: str) -> str | None:
    """A header by name, whatever its case."""
    lower = name.lower()
    return next((v for k, v in headers.items() if k.lower() == lower), None)


def delay(tried: int, jitter: float, base: float = BASE_DELAY) -> float | None:
    """Seconds to wait after the ``tried``-th failed try (1 for the first), or None when
    no try is left. ``jitter`` in [0, 1): the wait is between 0.5 and 1.5 times the
    doubled base, so receivers that failed together are not tried together."""
    if tried >= TRIES:
        return None
    return float(base * 2 ** (tried - 1) * (0.5 + jitter))


def parse_events(given: list[str] | None) -> tuple[str, ...]:
    """The events a webhook asked for (checked), or the default; ValueError names a
    wrong one."""
    if not given:
        return DEFAULT_EVENTS
    for e in given:
        if e not in EVENTS:
            raise ValueError(f"unknown event {e!r}; expected some of {', '.join(EVENTS)}")
    return tuple(dict.fromkeys(given))
