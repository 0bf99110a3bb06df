"""Blob bytes over a direct HTTP/1.1 connection (the standard library's ``http.client``).

httpx parses a body through h11 in 64 KiB pieces and copies each piece several times in
Python; for a large blob that is most of the CPU a download costs. ``http.client`` reads
the body straight into our own 1 MiB buffers. On loopback (bench/transfer.py) a verified
1 GiB download took about 1.4 s this way and about 2.5 s through httpx, with the write and
the hash running alongside in both cases.

This path serves only ``GET /v1/blobs/{sha256}``, and only when no proxy is configured for
the server (httpx knows proxies; a proxied client keeps using it). Headers, timeout and the
TLS context come from the same :class:`~gpufleet.client.Client`, so both paths
authenticate and verify certificates alike.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from gpufleet.client._api import raise_for, unreachable

# What a broken or refused connection looks like from http.client.
FAILURES = (OSError, http.client.HTTPException)


def proxied(url: str) -> bool:
    """Whether the environment routes ``url`` through a proxy (HTTP_PROXY and friends)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    return not bypass(parts.hostname or "", proxies)


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
    """GET requests to one server, one connection each, read into caller buffers."""

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
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        # The bytes as stored: they are hashed, so no content coding (case-insensitive
        # replace: httpx's own default would otherwise go along too).
        merged = httpx.Headers(headers)
        merged["Accept-Encoding"] = "identity"
        self._headers = dict(merged.items())
        self._timeout = timeout
        self._tls = tls

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._tls
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

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
                    _raise(resp, self.server + path)
            except FAILURES as exc:
                raise unreachable(self.server, exc) from exc
            yield Answer(resp.status, dict(resp.getheaders()), resp.length, resp)
        finally:
            conn.close()


def _raise(resp: http.client.HTTPResponse, url: str) -> None:
    body = resp.read(1 << 20)  # an error body is small JSON; never read a blob here
    answer = httpx.Response(
        resp.status,
        headers=resp.getheaders(),
        content=body,
        request=httpx.Request("GET", url),
    )
    raise_for(answer)
