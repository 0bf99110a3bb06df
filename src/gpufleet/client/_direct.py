"""Calls and blob bytes over direct HTTP/1.1 connections (the standard library's
``http.client``).

Two uses. A :class:`~gpufleet.client.Client`'s calls (:meth:`Direct.send`): a CLI command
makes a call or two, and importing httpx cost it more than the calls (about 60 ms of
every start); connections are kept alive and reused, each checked before reuse (one the
server closed meanwhile is dropped, not written to). And blob downloads
(:meth:`Direct.get`): httpx parses a body through h11 in 64 KiB pieces and copies each
piece several times in Python; for a large blob that is most of the CPU a download costs.
``http.client`` reads the body straight into our own 1 MiB buffers. On loopback
(bench/transfer.py) a verified 1 GiB download took about 1.4 s this way and about 2.5 s
through httpx, with the write and the hash running alongside in both cases.

Neither is used when a proxy is configured for the server (httpx knows proxies; a
proxied client keeps using it), nor by the asyncio client (the worker), which stays on
httpx. Headers, timeout and the TLS context come from the same client, so every path
authenticates and verifies certificates alike.
"""

from __future__ import annotations

import http.client
import select
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from typing import Any
from urllib.parse import urlsplit

from gpufleet import __version__
from gpufleet.client._api import JSON, Call, CallFailed, raise_for, unreachable

# What a broken or refused connection looks like from http.client.
FAILURES = (OSError, http.client.HTTPException)
KEEP = 8  # idle connections kept per server (a client's threads may call at once)
KEEP_FOR = 5.0  # seconds an idle connection is kept (as httpx): a silent middlebox may drop it


def proxied(url: str) -> bool:
    """Whether the environment routes ``url`` through a proxy (HTTP_PROXY and friends)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    return not bypass(parts.hostname or "", proxies)


@dataclass(frozen=True)
class Whole:
    """A whole answer (what :class:`~gpufleet.client._api.Reply` asks)."""

    status_code: int
    headers: Message  # http.client's: a case-insensitive get
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


def _stale(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept connection can no longer carry a request: readable before
    anything was asked means the server closed it (or sent what nobody asked for)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        if hasattr(select, "poll"):  # any descriptor number (select() stops at 1024)
            poll = select.poll()
            poll.register(sock, select.POLLIN)
            return bool(poll.poll(0))
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


@dataclass(frozen=True)
class Answer:
    """A response whose body is read with :meth:`readinto`."""

    status: int
    headers: Mapping[str, str]
    length: int | None
    _resp: http.client.HTTPResponse

    def readinto(self, buffer: bytearray | memoryview) -> int:
        return self._resp.readinto(buffer)


class Direct:
    """Requests to one server: calls on kept-alive connections, blob GETs on a
    connection each, read into caller buffers."""

    def __init__(
        self,
        server: str,
        headers: Mapping[str, str],
        timeout: float,
        tls: ssl.SSLContext | None,
    ) -> None:
        parts = urlsplit(server)
        self.server = server
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        # explicit: given no port, http.client would read one off an IPv6 address's end
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        own = {k: v for k, v in headers.items() if k.lower() != "accept-encoding"}
        # The bytes as stored (blobs are hashed; JSON is small): no content coding.
        self._headers = {**own, "Accept-Encoding": "identity"}
        self._calls = {
            **self._headers,
            "Accept": "application/json",
            "User-Agent": f"gpufleet/{__version__}",
        }
        self._timeout = timeout
        self._tls = tls
        self._idle: list[tuple[float, http.client.HTTPConnection]] = []
        self._lock = threading.Lock()

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._tls
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def _kept(self) -> http.client.HTTPConnection | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                since, conn = self._idle.pop()
            if time.monotonic() - since < KEEP_FOR and not _stale(conn):
                return conn
            conn.close()

    def _keep(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < KEEP:
                self._idle.append((time.monotonic(), conn))
                return
        conn.close()

    def send(self, call: Call[Any]) -> Whole:
        """Send ``call`` and read its whole answer. No answer raises
        :class:`~gpufleet.client._api.CallFailed`, ``sent`` False when the connection
        could not be made (the request never left)."""
        body, target = call.payload(), self._prefix + call.target()
        headers = self._calls if body is None else {**self._calls, **JSON}
        conn = self._kept()
        if conn is None:
            conn = self._connect()
            try:
                conn.connect()
            except FAILURES as exc:
                conn.close()
                raise CallFailed(exc, sent=False) from exc
            except BaseException:
                conn.close()
                raise
        try:
            assert conn.sock is not None
            conn.sock.settimeout(call.timeout if call.timeout is not None else self._timeout)
            conn.request(call.method, target, body=body, headers=headers)
            resp = conn.getresponse()
            content = resp.read()
        except FAILURES as exc:
            conn.close()
            raise CallFailed(exc, sent=True) from exc
        except BaseException:  # interrupted: the connection is in an unknown state
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            self._keep(conn)
        return Whole(resp.status, resp.msg, content)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()

    @contextmanager
    def get(self, path: str, headers: Mapping[str, str]) -> Iterator[Answer]:
        """Send ``GET path``; an error status raises its :class:`GpufleetError` (with the
        server's message), a connection problem raises ServerUnavailable."""
        conn = self._connect()
        try:
            try:
                conn.request("GET", self._prefix + path, headers={**self._headers, **headers})
                resp = conn.getresponse()
                if resp.status >= 400:
                    _raise(resp)
            except FAILURES as exc:
                raise unreachable(self.server, exc) from exc
            yield Answer(resp.status, dict(resp.getheaders()), resp.length, resp)
        finally:
            conn.close()


def _raise(resp: http.client.HTTPResponse) -> None:
    body = resp.read(1 << 20)  # an error body is small JSON; never read a blob here
    raise_for(Whole(resp.status, resp.msg, body))
