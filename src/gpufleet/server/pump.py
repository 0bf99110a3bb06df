"""Moving a request body to disk: 1 MiB buffers handed to a writer and a hasher at once.

Bodies are never held whole: chunks are gathered into 1 MiB buffers and handed to two
threads, one writing and one hashing (:class:`gpufleet.streams.Fanout`), while the loop
receives the next buffer, so memory stays flat and the disk, the hash and the network all
work at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future

from starlette.requests import ClientDisconnect

from gpufleet.errors import TooLarge
from gpufleet.streams import Fanout, Sink

BUFFER = 1 << 20


class Stalled(ClientDisconnect):
    """No byte arrived for the idle timeout: the client is treated as gone (a laptop that
    slept, a dropped VPN), so its upload session is free for the resume."""


async def pump(chunks: AsyncIterator[bytes], sinks: Sequence[Sink], limit: int, idle: float) -> int:
    """Feed ``chunks`` to every sink in 1 MiB buffers; return the bytes received.

    Raises TooLarge as soon as more than ``limit`` bytes arrive, and :class:`Stalled` when
    nothing arrives for ``idle`` seconds. Whatever the outcome (cancellation included),
    when this returns or raises every buffer handed over has been taken by every sink and
    the sinks' threads are gone, so the caller may close files. A sink's error (a full
    disk) is raised in preference to the client having gone."""
    fan = Fanout(sinks)
    try:
        total = await _gather(chunks, fan, limit, idle)
        await _settled(fan)
        fan.wait()  # raises a sink's error
        return total
    except ClientDisconnect:
        await _settled(fan)
        if fan.error is not None:
            raise fan.error from None
        raise
    finally:
        try:
            await _settled(fan)
        finally:
            fan.close()  # joins the threads; blocks only if the settling was cancelled


async def _gather(chunks: AsyncIterator[bytes], fan: Fanout, limit: int, idle: float) -> int:
    """Receive, handing every full buffer and then the tail to the fanout; bytes received."""
    loop = asyncio.get_running_loop()
    parts: list[bytes] = []
    gathered = total = 0
    step = min(1.0, idle / 4)  # how often the deadline moves: cheap, and never late
    last = loop.time()
    try:
        async with asyncio.timeout(idle) as deadline:
            async for chunk in chunks:
                now = loop.time()
                if now - last > step:
                    deadline.reschedule(now + idle)
                    last = now
                total += len(chunk)
                if total > limit:
                    raise TooLarge(f"the body is larger than the limit of {limit} bytes")
                parts.append(chunk)
                gathered += len(chunk)
                if gathered >= BUFFER:
                    if not fan.has_room():
                        # the server's own disk is behind, not the client: no deadline
                        deadline.reschedule(None)
                        await _room(fan)
                        last = loop.time()
                        deadline.reschedule(last + idle)
                    fan.submit(b"".join(parts))
                    parts, gathered = [], 0
    except TimeoutError:
        if deadline.expired():
            raise Stalled() from None
        raise
    if parts:  # the last part (or a whole small body)
        await _room(fan)
        fan.submit(b"".join(parts))
    return total


async def _room(fan: Fanout) -> None:
    """Wait, without blocking the loop, until the fanout takes another buffer."""
    while not fan.has_room():
        await _finished(fan.oldest())


async def _settled(fan: Fanout) -> None:
    """Wait, without blocking the loop, until the sinks have taken every buffer."""
    while futures := fan.oldest():
        await _finished(futures)
        fan.discard_done()


async def _finished(futures: list[Future[object]]) -> None:
    wrapped = [asyncio.wrap_future(f) for f in futures]
    await asyncio.wait(wrapped)
    for w in wrapped:
        w.exception()  # seen here so asyncio does not log it; the fanout raises it
