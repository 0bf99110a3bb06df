"""Slow and oversized requests, cut off in the HTTP protocol itself.

uvicorn bounds what it has settings for: connections in all (``limit_concurrency``: a
request beyond it is answered 503) and idle kept-alive connections
(``timeout_keep_alive``). Its httptools protocol has no limit on the size of a request's
headers, nor on the time a client takes to send them or its body, so a few clients
sending headers without end, or hundreds sending them a byte at a time, could hold the
server's memory and connections. :class:`Guarded` adds, per connection:

* **a header cap**: more than ``max_header_bytes`` before the headers end is answered 431
  and the connection closed; what was received is dropped (the parser had at most one
  read's worth more than the cap);
* **a header deadline**: a request's line and headers must arrive within
  ``header_timeout`` seconds of its first byte (or of the connection, for its first
  request); else 408 and the connection closes;
* **a body stall limit**: a body that gives no byte for ``body_timeout`` seconds while the
  server waits for one ends its connection (the app sees a disconnect);
* **connections per address**: past ``connections_per_address`` open at once from one
  address (an IPv6 address counts as its /64), a new connection is answered 503 and
  closed before anything is read. A trusted reverse proxy (``--trusted-proxies``) carries
  many clients' connections and is not counted: the proxy limits its own clients.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gpufleet.server.limits import Limits, address_key, trusts

log = logging.getLogger("gpufleet.server.limits")


def _answer(status: str, message: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP answer in the server's error shape, closing its connection."""
    code = {"408": "request_timeout", "431": "headers_too_large", "503": "unavailable"}
    error = {"code": code[status[:3]], "message": message, "detail": None}
    body = json.dumps({"error": error}).encode()
    head = [
        f"HTTP/1.1 {status}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Census:
    """Connections open per client address, for one server process."""

    def __init__(self) -> None:
        self.open: Counter[str] = Counter()

    def admit(self, address: str, cap: int) -> bool:
        if cap and self.open[address] >= cap:
            return False
        self.open[address] += 1
        return True

    def leave(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


def guarded_protocol(limits: Limits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, bounded by ``limits`` (see the module's text)."""
    census = Census()

    class Bound(Guarded):
        pass

    Bound.limits = limits
    Bound.census = census
    return Bound


class Guarded(HttpToolsProtocol):
    limits: Limits
    census: Census

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._address: str | None = None  # counted in the census
        self._in_headers = True  # waiting for (the rest of) a request's line and headers
        self._ended_headers = False  # a request's headers ended in the read being parsed
        self._header_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None

    # ---- connections ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self.client[0] if self.client else "-"
        address = address_key(peer)
        trusted = trusts(self.limits.trusted_proxies, peer)
        cap = 0 if trusted else self.limits.connections_per_address
        if not self.census.admit(address, cap):
            log.warning(
                "refusing a connection from %s: %d open from that address already",
                address,
                self.limits.connections_per_address,
            )
            message = "too many connections from your address; try again later"
            transport.write(_answer("503 Service Unavailable", message, retry_after=1))
            transport.close()
            return
        self._address = address
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._address is not None:
            self.census.leave(self._address)
            self._address = None
        super().connection_lost(exc)

    # ---- headers -------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._address is None:  # refused at connection: nothing is read
            return
        if self._in_headers and self._deadline is None:
            self._arm_deadline()  # a kept-alive connection's next request begins
        counted, self._ended_headers = self._in_headers, False
        super().data_received(data)
        if counted and not self._ended_headers and not self.transport.is_closing():
            # all of it was line and headers: no request's headers ended in this read (one
            # that did, with its body, may even be complete by now)
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._headers_too_large()
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and cycle.more_body:
            # answered before its body ended (a 404, a 405): the rest is unwanted, and
            # reading it on would hold the connection past every deadline
            self.transport.close()
            return
        if self._stall is not None and not self.transport.is_closing():
            self._arm_stall()

    def on_headers_complete(self) -> None:
        self._in_headers, self._ended_headers = False, True
        self._header_bytes = 0
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body:
            self._arm_stall()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers = True  # the next request's headers, if it sends one
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _headers_too_large(self) -> None:
        cap = self.limits.max_header_bytes
        log.warning("431 for %s: request headers over %d bytes", self._address, cap)
        message = f"request line and headers over the server's limit of {cap} bytes"
        self._close_with(_answer("431 Request Header Fields Too Large", message))

    def _arm_deadline(self) -> None:
        timeout = self.limits.header_timeout
        if timeout:
            self._deadline = self.loop.call_later(timeout, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered (pipelined bytes wait for it)
        message = f"request headers not received within {self.limits.header_timeout:g} s"
        self._close_with(_answer("408 Request Timeout", message))

    # ---- bodies --------------------------------------------------------------------------

    def _arm_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
        timeout = self.limits.body_timeout
        self._stall = self.loop.call_later(timeout, self._body_stalled) if timeout else None

    def _body_stalled(self) -> None:
        self._stall = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete:
            return
        if self.flow.read_paused:  # the app is not reading: the wait is ours, not theirs
            self._arm_stall()
            return
        log.warning(
            "closing a connection from %s: its request body gave nothing for %g s",
            self._address,
            self.limits.body_timeout,
        )
        self.transport.close()

    # ---- helpers -------------------------------------------------------------------------

    def _close_with(self, answer: bytes) -> None:
        self._cancel_timers()
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(answer)
        self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._deadline, self._stall):
            if timer is not None:
                timer.cancel()
        self._deadline = self._stall = None
