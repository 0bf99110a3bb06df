"""Several servers for one client: ``--server URL1,URL2`` (servers sharing a database).

A client calls the server in use until it cannot connect; then the next one, in turn. A
connection that could not be made sent nothing, so the call goes to the next server at
once. A connection that broke while a call was in flight may have been served: that call
fails as unreachable (the caller decides whether to retry), and its retry goes to the
next server. A client of one URL behaves as before.
"""

from __future__ import annotations

import threading

from gpufleet.config.values import server_urls
from gpufleet.errors import ConfigError


class Servers:
    """The servers a client may call, and the one in use."""

    def __init__(self, servers: str) -> None:
        self.urls = server_urls(servers)
        if not self.urls:
            raise ConfigError("no server URL given")
        self._at = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self.urls[self._at]

    def tries(self) -> range:
        """One try per server: a call that cannot connect goes on to the next."""
        return range(len(self.urls))

    def pass_on(self, url: str, sent: bool, tried: int) -> bool:
        """``url`` failed a call on its try number ``tried`` (``sent``: perhaps after the
        request left): whether the call goes on to the next server (it was never sent,
        and servers are left). Either way the next call goes to the next server."""
        self.failed(url)
        return not sent and tried < len(self.urls) - 1

    def failed(self, url: str) -> None:
        """``url`` could not be reached: the next call goes to the next server (unless
        another call moved on already)."""
        with self._lock:
            if self.urls[self._at] == url:
                self._at = (self._at + 1) % len(self.urls)
