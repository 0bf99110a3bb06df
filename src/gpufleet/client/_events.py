"""Following a job's event log over Server-Sent Events, resuming after a break.

:func:`follow` reads ``GET /v1/jobs/{ref}/events`` and yields each :class:`Event`. When
the connection breaks (or the server in use goes away), it connects again (to the next
server, when several are named) with ``Last-Event-ID`` set to the last event it yielded:
the server sends what came after it, so nothing is missed and nothing is yielded twice.
An event's id is a whole number, but a token confined to some pools gets opaque ones (in
no order), so ids are sent back, never compared.
It ends when the server says the stream has ended (the job has ended and all was sent).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpufleet.client._api import raise_for, unreachable
from gpufleet.errors import ServerUnavailable

if TYPE_CHECKING:
    import httpx

READ_TIMEOUT = 60.0  # the server pings every 15 s: a minute of silence is a dead link
RETRY_FOR = 300.0  # seconds to keep trying to reconnect without an event


@dataclass(frozen=True)
class Event:
    """One event: ``state``, ``progress`` or ``log`` with its sequence number (``seq``);
    ``end`` (no ``seq``) when the stream is over."""

    type: str
    data: dict[str, Any]
    seq: int | None = None


def parse(lines: Iterator[str]) -> Iterator[Event]:
    """Events from the lines of an event stream (comments and pings skipped)."""
    kind, seq = "message", None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield Event(kind, json.loads("\n".join(data)), seq)
            kind, data, seq = "message", [], None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            kind = value
        elif name == "data":
            data.append(value)
        elif name == "id" and value.isdigit():
            seq = int(value)


def follow(
    at: Callable[[], tuple[str, httpx.Client]],
    failed: Callable[[str], None],
    ref: str,
    after: int = 0,
    retry_for: float = RETRY_FOR,
) -> Iterator[Event]:
    """The events of job ``ref`` after ``after``, until its stream ends; see the module.
    ``at`` gives the server in use and its HTTP client; ``failed`` moves on from one."""
    import httpx

    last = after
    gave_up_at = time.monotonic() + retry_for
    pause = 0.2
    while True:
        url, http = at()
        try:
            headers = {"Accept": "text/event-stream"}
            if last:
                headers["Last-Event-ID"] = str(last)
            timeout = httpx.Timeout(http.timeout.connect, read=READ_TIMEOUT)
            with http.stream(
                "GET", f"/v1/jobs/{ref}/events", headers=headers, timeout=timeout
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise_for(resp)
                for event in parse(resp.iter_lines()):
                    if event.type == "end":
                        yield event
                        return
                    if event.seq is not None:
                        last = event.seq
                    gave_up_at = time.monotonic() + retry_for
                    pause = 0.2
                    yield event
        except httpx.TransportError as exc:
            failed(url)
            if time.monotonic() >= gave_up_at:
                raise unreachable(url, exc) from exc
        except ServerUnavailable:
            failed(url)
            if time.monotonic() >= gave_up_at:
                raise
        # the stream broke (or the server closed it without saying it ended): resume
        time.sleep(pause)
        pause = min(pause * 2, 5.0)
