"""Streams of bytes: hashing files, and feeding buffers to several sinks at once.

Moving a large blob costs three things per byte: the network, the disk write and the
SHA-256. Done one after the other in one thread they add up; :class:`Fanout` gives each sink
a thread of its own, so they overlap each other and whoever is receiving the next buffer.
File writes and ``hashlib`` release the GIL for large buffers, so the threads really run in
parallel. Used by the server (upload bodies) and the SDK (downloads).

Kept free of heavy imports: the CLI loads it on every start.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

Sink = Callable[[Any], object]
CHUNK = 1 << 20


def file_hasher(
    path: Path, upto: int | None = None, stop: threading.Event | None = None
) -> hashlib._Hash:
    """A SHA-256 object fed with the first ``upto`` bytes of ``path`` (all when None), to
    go on hashing what comes next (a resumed upload or download). Once ``stop`` is set
    it reads no more (the caller then drops the unfinished hash)."""
    digest = hashlib.sha256()
    left = upto
    with path.open("rb") as f:
        while (left is None or left > 0) and not (stop is not None and stop.is_set()):
            data = f.read(CHUNK if left is None else min(CHUNK, left))
            if not data:
                break
            digest.update(data)
            if left is not None:
                left -= len(data)
    return digest


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file, read in 1 MiB chunks."""
    return file_hasher(path).hexdigest()


class Fanout:
    """Each buffer goes to every sink, each sink in its own thread, buffers in order.

    :meth:`submit` hands a buffer over and returns at once, as long as fewer than ``depth``
    buffers are still with the sinks (:meth:`room` waits for that; asyncio code awaits
    :meth:`oldest` instead). So memory stays at ``depth + 1`` buffers whatever the
    stream's size, and a slow moment of one sink does not stall the receiver. A sink's
    exception is raised by the next call that collects finished buffers (and by every
    call after it: the stream is broken)."""

    def __init__(self, sinks: Sequence[Sink], depth: int = 4) -> None:
        if not sinks or depth < 1:
            raise ValueError("a fanout needs a sink and a depth of at least 1")
        self._sinks = list(sinks)
        self.depth = depth
        # One thread per sink keeps each sink's calls in order.
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix="fanout") for _ in sinks]
        self._queued: deque[list[Future[object]]] = deque()
        self._error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        """The first error a sink raised on a buffer collected so far (then the stream
        is broken: later calls raise it again)."""
        return self._error

    def submit(self, data: Any) -> None:
        """Give ``data`` to every sink; raises a sink's error from an earlier buffer."""
        if not self.has_room():
            raise RuntimeError("submit with no room: wait for room() first")
        self._queued.append(
            [t.submit(s, data) for t, s in zip(self._threads, self._sinks, strict=True)]
        )

    def oldest(self) -> list[Future[object]]:
        """The futures of the oldest buffer still with the sinks (empty when none), for
        callers that wait their own way (asyncio)."""
        return list(self._queued[0]) if self._queued else []

    def has_room(self) -> bool:
        """Whether another buffer may be submitted now; raises a sink's error."""
        self.discard_done()
        self._raise()
        return len(self._queued) < self.depth

    def room(self) -> None:
        """Block until another buffer may be submitted."""
        while not self.has_room():
            self._finish_oldest()

    def feed(self, data: Any) -> None:
        """Wait for room, then submit ``data`` (for blocking callers)."""
        self.room()
        self.submit(data)

    def wait(self) -> None:
        """Block until every sink has taken every buffer; raise the first error."""
        while self._queued:
            self._finish_oldest()
        self._raise()

    def _finish_oldest(self) -> None:
        for f in self._queued[0]:
            f.exception()  # waits; the error is noted by discard_done
        self.discard_done()

    def discard_done(self) -> None:
        """Forget the buffers every sink has finished with, noting the first error."""
        while self._queued and all(f.done() for f in self._queued[0]):
            for f in self._queued.popleft():
                self._error = self._error or f.exception()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Let what is in flight finish and stop the threads (collect errors first with
        :meth:`wait`)."""
        for t in self._threads:
            t.shutdown(wait=True)
        self._queued.clear()

    def __enter__(self) -> Fanout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
