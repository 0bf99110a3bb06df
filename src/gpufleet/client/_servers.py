"""Several servers for one client: ``--server URL1,URL2`` (servers sharing a database).

A client calls the server in use until it cannot connect; then the next one, in turn. A
connection that could not be made sent nothing, so the call goes to the next server at
once. A connection that broke while a call was in flight may have been served: that call
fails as unreachable (the caller decides whether to retry), and its retry goes to the
next server. A client of one URL behaves as before.
"""

from __future__ import annotations

import threading

import httpx

from gpufleet.errors import ConfigError

# The request never left: safe to send again, to another server.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


def split(servers: str) -> list[str]:
    """The URLs of ``URL1,URL2`` (whitespace and trailing slashes dropped)."""
    urls = [u.strip().rstrip("/") for u in servers.split(",") if u.strip()]
    if not urls:
        raise ConfigError("no server URL given")
    return list(dict.fromkeys(urls))


class Servers:
    """The servers a client may call, and the one in use."""

    def __init__(self, servers: str) -> None:
        self.urls = split(servers)
        self._at = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self.urls[self._at]

    def failed(self, url: str) -> None:
        """``url`` could not be reached: the next call goes to the next server (unless
        another call moved on already)."""
        with self._lock:
            if self.urls[self._at] == url:
                self._at = (self._at + 1) % len(self.urls)
