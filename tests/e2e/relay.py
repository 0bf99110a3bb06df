"""A TCP relay between a client and a real server: it cuts connections the way a flaky
network does, paces them like a slow one, and counts what crossed."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Leg:
    """One relayed connection: what the client sent, what came back."""

    sent: bytearray = field(default_factory=bytearray)  # the request's first bytes
    up: int = 0  # bytes from the client to the server
    first: bytearray = field(default_factory=bytearray)  # the answer's first bytes
    head: bytes = b""  # the server's response head, up to the blank line
    down: int = 0  # bytes from the server to the client, head included

    @property
    def body(self) -> int:
        return self.down - len(self.head)


class Relay:
    """A TCP relay to 127.0.0.1:``port``. Connection ``n`` is closed after ``cuts[n]``
    bytes came back from the server, or after ``up_cuts[n]`` bytes went to it
    (connections past the lists are never cut). ``up_rate``: bytes a second at most
    toward the server (a slow network)."""

    def __init__(
        self,
        port: int,
        cuts: list[int],
        up_cuts: list[int] | None = None,
        drop_answer_with: bytes | None = None,
        up_rate: float | None = None,
    ) -> None:
        self.target = port
        self.up_rate = up_rate
        self.cuts = cuts
        self.up_cuts = up_cuts or []
        self.drop = drop_answer_with  # the first answer holding these bytes is lost
        self.legs: list[Leg] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            leg, n = Leg(), len(self.legs)
            cut = self.cuts[n] if n < len(self.cuts) else None
            up_cut = self.up_cuts[n] if n < len(self.up_cuts) else None
            self.legs.append(leg)
            server = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            client.settimeout(10)
            self._sockets += [client, server]
            for t in (
                threading.Thread(target=self._up, args=(client, server, leg, up_cut), daemon=True),
                threading.Thread(target=self._down, args=(server, client, leg, cut), daemon=True),
            ):
                t.start()
                self._threads.append(t)

    def _up(self, client: socket.socket, server: socket.socket, leg: Leg, cut: int | None) -> None:
        try:
            while data := client.recv(65536):
                if cut is not None:
                    data = data[: cut - leg.up]
                if len(leg.sent) < 65536:
                    leg.sent += data[: 65536 - len(leg.sent)]
                server.sendall(data)
                leg.up += len(data)
                if self.up_rate:
                    time.sleep(len(data) / self.up_rate)
                if cut is not None and leg.up >= cut:
                    _hang_up(client, server)
                    return
            server.shutdown(socket.SHUT_WR)  # the client hung up: so does the relay
        except OSError:
            pass

    def _down(
        self, server: socket.socket, client: socket.socket, leg: Leg, cut: int | None
    ) -> None:
        try:
            while data := server.recv(65536):
                if self.drop is not None and self.drop in data:
                    self.drop = None
                    return  # the answer never reaches the client
                if cut is not None:
                    data = data[: cut - leg.down]
                if not leg.head and len(leg.first) < 65536:
                    leg.first += data
                    end = leg.first.find(b"\r\n\r\n")
                    leg.head = bytes(leg.first[: end + 4]) if end >= 0 else b""
                client.sendall(data)
                leg.down += len(data)
                if cut is not None and leg.down >= cut:
                    break
        except OSError:
            pass
        finally:
            _hang_up(client, server)

    def ranges(self) -> list[str | None]:
        """The Range header of each connection's request, None where it had none."""
        found: list[str | None] = []
        for leg in self.legs:
            lines = bytes(leg.sent).split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
            value = [ln.split(":", 1)[1].strip() for ln in lines if ln.lower().startswith("range:")]
            found.append(value[0] if value else None)
        return found

    def hang_up(self, n: int) -> None:
        """Close connection ``n`` at both ends, as a server closes a kept-alive connection
        that sat idle."""
        _hang_up(*self._sockets[2 * n : 2 * n + 2])

    def close(self) -> None:
        self._stop.set()
        _hang_up(*self._sockets)
        for t in self._threads:
            t.join(10)
        self.listener.close()


def _hang_up(*sockets: socket.socket) -> None:
    """Shut down, then close: a bare close() would neither wake a thread blocked in recv
    on the socket nor send the peer its FIN until that recv returned."""
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
