"""A webhook receiver for tests: a real HTTP server on 127.0.0.1 (a free port), in a
thread, that keeps what it is sent and answers as told (``ok``, ``500``, or ``hang``:
no answer for ``hang_for`` seconds)."""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Got:
    at: float
    headers: dict[str, str]
    body: bytes

    @property
    def data(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed


@dataclass
class Receiver:
    url: str
    port: int
    mode: str = "ok"
    hang_for: float = 30.0
    got: list[Got] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def events(self) -> list[str]:
        return [g.data["gpufleet"]["event"] for g in list(self.got)]

    def wait(self, count: int, timeout: float) -> list[Got]:
        """The first ``count`` deliveries, waiting ``timeout`` seconds at most."""
        deadline = time.monotonic() + timeout
        while len(self.got) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.got) >= count, f"{len(self.got)} of {count} deliveries: {self.events()}"
        return list(self.got)


@contextmanager
def receiver(
    path: str = "/hook/T0KEN-in-path", tls: ssl.SSLContext | None = None
) -> Iterator[Receiver]:
    """A running receiver (``tls``: over HTTPS with that context), stopped at the end."""
    box: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            r = box[0]
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            r.got.append(Got(time.time(), dict(self.headers.items()), body))
            if r.mode == "hang":
                r.stop.wait(r.hang_for)
                return
            self.send_response(500 if r.mode == "500" else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    port = server.server_address[1]
    scheme = "https" if tls else "http"
    box.append(Receiver(f"{scheme}://127.0.0.1:{port}{path}", port))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield box[0]
    finally:
        box[0].stop.set()
        server.shutdown()
        server.server_close()
        thread.join(5)
