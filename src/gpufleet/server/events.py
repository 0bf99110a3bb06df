"""Following a job's event log, and the fleet's changes, as Server-Sent Events.

A job's event log (:mod:`gpufleet.store.schema`, ``job_logs``) numbers its status
changes, progress records and output lines with one sequence. Every follower of a job
on this server shares one :class:`Feed`: one reader that takes the job's new records
from the store when woken (a write through this server) or once a second (a write
through another server sharing the database), encodes each once, and keeps the newest
``RING`` of them. A follower that starts further back reads the store itself until it
reaches what the feed holds, then goes on from the feed. Records are sent in batches
(one write per batch, not per record), each as::

    id: <seq>
    event: state | progress | log
    data: {...}

so a follower that reconnects with ``Last-Event-ID`` (or ``?after=``) gets every record
after the last one it saw, once. Once the job has ended and everything is sent, an
``end`` event (no id; ``status``) says so and the stream closes: a browser's EventSource
would otherwise connect again. Between records, the response pings (a comment line)
every 15 seconds.

:class:`FleetFeed` is the fleet-wide stream: every job's status changes (from the
store, in order) and the workers' changes (their status, drain and GPU use, read once a
second and sent when they differ), filtered per follower by pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from gpufleet.domain.models import JobStatus
from gpufleet.store import LogRow, Store

log = logging.getLogger("gpufleet.server")

RING = 20_000  # a job's newest records a feed keeps for its followers
BATCH = 5_000  # records read from the store at a time
POLL = 1.0  # seconds between reads of a followed log when nothing wakes it
LINGER = 30.0  # seconds a feed with no followers stays (a follower may reconnect)
FLEET_POLL = 1.0
KINDS = {"stdout": "log", "stderr": "log", "progress": "progress", "state": "state"}


def record(row: LogRow) -> dict[str, Any]:
    """A record of a job's event log as a client sees it."""
    base: dict[str, Any] = {"seq": row.seq, "attempt": row.attempt, "ts": row.ts}
    if row.stream == "state":
        return {**base, **json.loads(row.line)}
    if row.stream == "progress":
        return {**base, "record": json.loads(row.line)}
    return {**base, "stream": row.stream, "line": row.line}


def frame(seq: int | None, kind: str, data: dict[str, Any]) -> bytes:
    """One Server-Sent Event (JSON has no raw newline, so ``data`` is one line)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {kind}\ndata: {text}\n\n".encode()


@dataclass
class Encoded:
    seq: int
    kind: str
    status: str | None  # a state record's status
    data: bytes


def encode(row: LogRow) -> Encoded:
    kind = KINDS.get(row.stream, "log")
    data = record(row)
    status = str(data["status"]) if kind == "state" else None
    return Encoded(row.seq, kind, status, frame(row.seq, kind, data))


class Feed:
    """The records of one job, read once for all of this server's followers of it."""

    def __init__(self, store: Store, job_id: str, floor: int) -> None:
        self.store = store
        self.job_id = job_id
        # Every record numbered after ``floor`` is in ``ring`` or not yet read.
        self.floor = floor
        self.last = floor
        self.ring: deque[Encoded] = deque()
        self.wake = asyncio.Event()
        self.updated = asyncio.Event()
        self.followers = 0
        self.idle_since: float | None = None
        self.task: asyncio.Task[None] | None = None

    async def run(self, linger: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                rows = await run_in_threadpool(self.store.logs, self.job_id, self.last, BATCH)
            except Exception:  # the database is away: try again, followers wait
                log.exception("reading job %s's events failed", self.job_id)
                rows = []
            if rows:
                self._take(rows)
                if len(rows) == BATCH:
                    continue
            if self.followers == 0:
                self.idle_since = self.idle_since or loop.time()
                if loop.time() - self.idle_since >= linger:
                    return
            else:
                self.idle_since = None
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), POLL)

    def _take(self, rows: Sequence[LogRow]) -> None:
        self.ring.extend(encode(row) for row in rows)
        self.last = rows[-1].seq
        while len(self.ring) > RING:
            self.floor = self.ring.popleft().seq
        updated, self.updated = self.updated, asyncio.Event()
        updated.set()

    def after(self, seq: int) -> list[Encoded]:
        """The records the feed holds numbered after ``seq`` (which is at least ``floor``)."""
        ring = self.ring
        if not ring or ring[-1].seq <= seq:
            return []
        # binary search: the ring is in sequence order
        lo, hi = 0, len(ring)
        while lo < hi:
            mid = (lo + hi) // 2
            if ring[mid].seq <= seq:
                lo = mid + 1
            else:
                hi = mid
        return [ring[i] for i in range(lo, len(ring))]


@dataclass
class Counters:
    """Connections now following, for /metrics."""

    job_streams: int = 0
    fleet_streams: int = 0


class Hub:
    """This server's feeds, and the streams that read them."""

    def __init__(self, store: Store, ping: float = 15.0, linger: float = LINGER) -> None:
        self.store = store
        self.ping = ping
        self.linger = linger
        self.feeds: dict[str, Feed] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counters = Counters()
        self.fleet: FleetFeed | None = None

    def bind(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        if loop is None:
            for feed in self.feeds.values():
                if feed.task is not None:
                    feed.task.cancel()
            self.feeds.clear()
            if self.fleet is not None and self.fleet.task is not None:
                self.fleet.task.cancel()
            self.fleet = None

    def touch(self, job_id: str) -> None:
        """A write to ``job_id``'s log went through this server: its followers read now.
        Safe from any thread."""
        loop = self.loop
        if loop is None or loop.is_closed() or job_id not in self.feeds:
            return
        loop.call_soon_threadsafe(self._wake, job_id)

    def _wake(self, job_id: str) -> None:
        feed = self.feeds.get(job_id)
        if feed is not None:
            feed.wake.set()
        if self.fleet is not None:
            self.fleet.wake.set()

    async def _feed(self, job_id: str) -> Feed:
        feed = self.feeds.get(job_id)
        if feed is None or feed.task is None or feed.task.done():
            # A job's records commit in number order, so none still to come is numbered
            # below the newest one committed: the feed starts there.
            floor = await run_in_threadpool(self.store.last_seq, job_id)
            feed = self.feeds.get(job_id)  # another follower may have made it meanwhile
            if feed is None or feed.task is None or feed.task.done():
                feed = Feed(self.store, job_id, floor)
                self.feeds[job_id] = feed
                feed.task = asyncio.create_task(self._run(feed))
        return feed

    async def _run(self, feed: Feed) -> None:
        try:
            await feed.run(self.linger)
        finally:
            if self.feeds.get(feed.job_id) is feed:
                del self.feeds[feed.job_id]

    async def follow(self, job_id: str, status: str, after: int) -> AsyncIterator[bytes]:
        """A job's records after ``after``, in batches of encoded events, until the job
        has ended (``status``: as read before this call) and all are sent."""
        feed = await self._feed(job_id)
        feed.followers += 1
        self.counters.job_streams += 1
        try:
            while True:
                updated = feed.updated
                if after < feed.floor:  # behind what the feed holds: from the store
                    rows = await run_in_threadpool(self.store.logs, job_id, after, BATCH)
                    batch = [encode(r) for r in rows]
                    if not batch:  # pruned meanwhile
                        after = feed.floor
                        continue
                else:
                    batch = feed.after(after)
                if batch:
                    for ev in batch:
                        status = ev.status or status
                    after = batch[-1].seq
                    yield b"".join(ev.data for ev in batch)
                    continue
                if JobStatus(status).terminal:  # nothing more is written to its log
                    yield frame(None, "end", {"status": status, "seq": after})
                    return
                await updated.wait()
        finally:
            feed.followers -= 1
            self.counters.job_streams -= 1

    async def fleet_events(self, pools: Sequence[str] | None) -> AsyncIterator[bytes]:
        """Every status change of the jobs of ``pools`` (None: all) and every change of
        their workers, from now on."""
        if self.fleet is None or self.fleet.task is None or self.fleet.task.done():
            start = await run_in_threadpool(self.store.last_seq)
            self.fleet = FleetFeed(self.store, start)
            self.fleet.task = asyncio.create_task(self.fleet.run())
        fleet = self.fleet
        fleet.followers += 1
        self.counters.fleet_streams += 1
        seen = fleet.generation
        try:
            yield frame(None, "hello", {"seq": fleet.last})
            while True:
                updated = fleet.updated
                chunks = [ev.data for ev in fleet.since(seen) if pools is None or ev.pool in pools]
                seen = fleet.generation
                if chunks:
                    yield b"".join(chunks)
                    continue
                await updated.wait()
        finally:
            fleet.followers -= 1
            self.counters.fleet_streams -= 1


@dataclass
class FleetEvent:
    generation: int
    pool: str | None
    worker: Any  # the worker row, for a worker's change
    data: bytes


@dataclass
class FleetFeed:
    """Status changes of every job, and workers' changes, for every fleet follower."""

    store: Store
    last: int
    generation: int = 0
    followers: int = 0
    events: deque[FleetEvent] = field(default_factory=lambda: deque(maxlen=10_000))
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    workers: dict[str, str] = field(default_factory=dict)

    def since(self, generation: int) -> list[FleetEvent]:
        return [e for e in self.events if e.generation > generation]

    async def run(self) -> None:
        idle = 0.0
        while True:
            try:
                fresh = await run_in_threadpool(self._read)
            except Exception:
                log.exception("reading the fleet's events failed")
                fresh = []
            if fresh:
                self.generation += 1
                for pool, worker, data in fresh:
                    self.events.append(FleetEvent(self.generation, pool, worker, data))
                updated, self.updated = self.updated, asyncio.Event()
                updated.set()
            idle = idle + FLEET_POLL if self.followers == 0 else 0.0
            if idle >= LINGER:
                return
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), FLEET_POLL)

    def _read(self) -> list[tuple[str | None, Any, bytes]]:
        out: list[tuple[str | None, Any, bytes]] = []
        while True:
            rows = self.store.state_events(self.last, BATCH)
            for row, pool in rows:
                data = {"job_id": row.job_id, "pool": pool, **record(row)}
                out.append((pool, None, frame(row.seq, "job", data)))
            if rows:
                self.last = rows[-1][0].seq
            if len(rows) < BATCH:
                break
        for w in self.store.list_workers():
            # what a follower shows of a worker changed: it reads the worker again
            key = repr((w.status, w.drain, w.gpu_stats, w.offline_since, w.name, w.pool))
            if self.workers.get(w.id) != key:
                self.workers[w.id] = key
                data = {"id": w.id, "name": w.name, "pool": w.pool, "status": w.status.value}
                out.append((w.pool, w, frame(None, "worker", data)))
        return out
