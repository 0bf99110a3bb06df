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
import bisect
import contextlib
import itertools
import json
import logging
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from starlette.concurrency import run_in_threadpool

from gpufleet.domain.models import JobStatus
from gpufleet.server.event_ids import MAX_SEQ, PLAIN, EventIds
from gpufleet.server.polls import wait_either
from gpufleet.server.reads import PAGE_BYTES, full
from gpufleet.store import EventStore, FleetStore, LogRow, WorkerRow, within

log = logging.getLogger("gpufleet.server")

RING = 20_000  # a job's newest records a feed keeps for its followers
RING_BYTES = 2 * PAGE_BYTES  # and the most bytes of them it keeps
BATCH = 5_000  # records read from the store at a time (and PAGE_BYTES at most)
# A follower's batch: what it reads of the store itself (behind the feed) and takes of
# the feed at a time. Each follower holds its own, so it is smaller than a page.
SEND_BYTES = 1 << 20
POLL = 1.0  # seconds between reads of a followed log when nothing wakes it
GAP = 0.2  # seconds at least between two reads of a stream: wakes in between are one read
LINGER = 30.0  # seconds a feed with no followers stays (a follower may reconnect)
T = TypeVar("T")
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


class FeedStore(EventStore, FleetStore, Protocol):
    """What the feeds read: jobs' event logs, and the workers (for the fleet's stream)."""


@dataclass
class Encoded:
    """A record's event, encoded once for every follower on this server: ``data`` with
    the fleet's numbers, ``hidden`` (made when first asked for) with opaque ones."""

    seq: int
    kind: str
    status: str | None  # a state record's status
    data: bytes
    fields: dict[str, Any] | None = None  # what ``data`` says (None: no id, no ``seq``)
    hidden: bytes | None = None

    def shown(self, ids: EventIds) -> bytes:
        """The event as a follower that sees ``ids`` gets it. There is one kind of
        opaque ids per server, so the opaque event is made once, for all."""
        if ids is PLAIN or self.fields is None:
            return self.data
        if self.hidden is None:
            seq = ids.hide(self.seq)
            self.hidden = frame(seq, self.kind, {**self.fields, "seq": seq})
        return self.hidden


def encode(row: LogRow, kind: str | None = None, **extra: Any) -> Encoded:
    """A record's event: of its own kind, or ``kind`` with ``extra`` fields first."""
    kind = kind or KINDS.get(row.stream, "log")
    data = {**extra, **record(row)}
    status = str(data["status"]) if kind == "state" else None
    return Encoded(row.seq, kind, status, frame(row.seq, kind, data), data)


class _Reader(Generic[T]):
    """One reader shared by the followers of a stream: it reads the store (``fetch``, in
    a thread) when woken or every ``POLL`` seconds, takes what it read on the event loop
    (``take``), tells its followers when something is new (``updated`` fires, and a fresh
    one waits for the next), and stops once it has had no follower for ``LINGER``
    seconds (one may reconnect meanwhile)."""

    what = "events"

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.updated = asyncio.Event()
        self.followers = 0
        self.task: asyncio.Task[None] | None = None

    def fetch(self) -> T:
        """Read what is new (in a thread; it changes nothing)."""
        raise NotImplementedError

    def take(self, fresh: T) -> bool:
        """Keep what ``fetch`` read (on the event loop); whether to read again at once."""
        raise NotImplementedError

    def publish(self) -> None:
        updated, self.updated = self.updated, asyncio.Event()
        updated.set()

    async def run(self, linger: float = LINGER) -> None:
        loop = asyncio.get_running_loop()
        idle_since: float | None = None
        read_at = -GAP
        while True:
            # Writes can wake a reader many times a second (a worker's log batches, each
            # status change); a read every GAP at most serves them all, and leaves the
            # writers the database and the CPU.
            await asyncio.sleep(max(0.0, read_at + GAP - loop.time()))
            read_at = loop.time()
            try:
                if self.take(await run_in_threadpool(self.fetch)):
                    continue
            except Exception:  # the database is away: try again, followers wait
                log.exception("reading %s failed", self.what)
            if self.followers:
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            elif loop.time() - idle_since >= linger:
                return
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), POLL)


class Feed(_Reader[list[LogRow]]):
    """The records of one job, read once for all of this server's followers of it."""

    def __init__(
        self, store: FeedStore, job_id: str, floor: int, seed: Sequence[Encoded] = ()
    ) -> None:
        super().__init__()
        self.store = store
        self.job_id = job_id
        self.what = f"job {job_id}'s events"
        # Every record numbered after ``floor`` is in ``ring`` or not yet read.
        self.floor = floor
        self.ring: deque[Encoded] = deque(seed)
        self.size = sum(len(ev.data) for ev in seed)  # bytes the ring holds
        self.last = self.ring[-1].seq if self.ring else floor

    def fetch(self) -> list[LogRow]:
        return self.store.logs(self.job_id, self.last, BATCH, budget=PAGE_BYTES)

    def take(self, fresh: list[LogRow]) -> bool:
        if not fresh:
            return False
        for ev in map(encode, fresh):
            self.ring.append(ev)
            self.size += len(ev.data)
        self.last = fresh[-1].seq
        while len(self.ring) > RING or self.size > RING_BYTES:
            gone = self.ring.popleft()
            self.floor, self.size = gone.seq, self.size - len(gone.data)
        self.publish()
        return full(fresh, BATCH)

    def after(self, seq: int) -> list[Encoded]:
        """The records the feed holds numbered after ``seq`` (which is at least ``floor``),
        up to ``SEND_BYTES`` of them (one at least)."""
        start = bisect.bisect_right(self.ring, seq, key=lambda ev: ev.seq)
        held = itertools.islice(self.ring, start, None)
        return list(within(held, SEND_BYTES, lambda ev: len(ev.data)))


@dataclass
class Counters:
    """Connections now following, for /metrics."""

    job_streams: int = 0
    fleet_streams: int = 0


class Hub:
    """This server's feeds, and the streams that read them."""

    def __init__(self, store: FeedStore, ping: float = 15.0, linger: float = LINGER) -> None:
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
        if loop is None or loop.is_closed() or (job_id not in self.feeds and self.fleet is None):
            return
        loop.call_soon_threadsafe(self._wake, job_id)

    def _wake(self, job_id: str) -> None:
        feed = self.feeds.get(job_id)
        if feed is not None:
            feed.wake.set()
        if self.fleet is not None:
            self.fleet.wake.set()

    def _seed(self, job_id: str) -> tuple[int, list[Encoded]]:
        """A new feed's start: the job's newest records (at most ``RING``), encoded, and
        the floor below them (0 when they are the whole log). A job's records commit in
        number order, so none still to come is numbered below the newest one read.
        Followers that start from the beginning of a log that fits (a dashboard opened,
        ``logs -f``) then share this one read instead of each reading the store."""
        rows = self.store.logs(job_id, 0, RING, None, MAX_SEQ, RING_BYTES)
        if not rows:
            return self.store.last_seq(job_id), []
        floor = rows[0].seq - 1 if full(rows, RING, RING_BYTES) else 0
        return floor, [encode(row) for row in rows]

    async def _feed(self, job_id: str) -> Feed:
        feed = self.feeds.get(job_id)
        if feed is None or feed.task is None or feed.task.done():
            floor, seed = await run_in_threadpool(self._seed, job_id)
            feed = self.feeds.get(job_id)  # another follower may have made it meanwhile
            if feed is None or feed.task is None or feed.task.done():
                feed = Feed(self.store, job_id, floor, seed)
                self.feeds[job_id] = feed
                feed.task = asyncio.create_task(self._run(feed))
        return feed

    async def _run(self, feed: Feed) -> None:
        try:
            await feed.run(self.linger)
        finally:
            if self.feeds.get(feed.job_id) is feed:
                del self.feeds[feed.job_id]

    async def follow(
        self, job_id: str, status: str, after: int, revoked: asyncio.Event, ids: EventIds = PLAIN
    ) -> AsyncGenerator[bytes, None]:
        """A job's records after ``after``, in batches of encoded events, until the job
        has ended (``status``: as read before this call) and all are sent, or until
        ``revoked`` is set (the caller's token was: the stream stops without an ``end``);
        numbered as ``ids`` show them."""
        feed = await self._feed(job_id)
        feed.followers += 1
        self.counters.job_streams += 1
        ended = False  # the job has ended: its last records are read from the store
        try:
            while not revoked.is_set():
                updated = feed.updated
                # behind what the feed holds, or past what it has read of an ended job
                if after < feed.floor or ended:
                    rows = await run_in_threadpool(
                        self.store.logs, job_id, after, BATCH, None, None, SEND_BYTES
                    )
                    batch = [encode(r) for r in rows]
                    if not batch and after < feed.floor:  # pruned meanwhile
                        after = feed.floor
                        continue
                else:
                    batch = feed.after(after)
                if batch:
                    for ev in batch:
                        status = ev.status or status
                    after = batch[-1].seq
                    yield b"".join(ev.shown(ids) for ev in batch)
                    continue
                if JobStatus(status).terminal:  # nothing more is written to its log,
                    if not ended:  # but the feed may not have read all of it yet
                        ended = True
                        continue
                    yield frame(None, "end", {"status": status, "seq": ids.hide(after)})
                    return
                await wait_either(updated, revoked)
        finally:
            feed.followers -= 1
            self.counters.job_streams -= 1

    async def fleet_events(
        self, pools: Sequence[str] | None, revoked: asyncio.Event, ids: EventIds = PLAIN
    ) -> AsyncGenerator[bytes, None]:
        """Every status change of the jobs of ``pools`` (None: all) and every change of
        their workers, from now on, until ``revoked`` is set (the caller's token was)."""
        if self.fleet is None or self.fleet.task is None or self.fleet.task.done():
            start = await run_in_threadpool(self.store.last_seq)
            self.fleet = FleetFeed(self.store, start)
            self.fleet.task = asyncio.create_task(self.fleet.run(self.linger))
        fleet = self.fleet
        fleet.followers += 1
        self.counters.fleet_streams += 1
        seen = fleet.generation
        try:
            yield frame(None, "hello", {"seq": ids.hide(fleet.last)})
            while not revoked.is_set():
                updated = fleet.updated
                chunks = [
                    ev.event.shown(ids)
                    for ev in fleet.since(seen)
                    if pools is None or ev.pool in pools
                ]
                seen = fleet.generation
                if chunks:
                    yield b"".join(chunks)
                    continue
                await wait_either(updated, revoked)
        finally:
            fleet.followers -= 1
            self.counters.fleet_streams -= 1


@dataclass
class FleetEvent:
    generation: int
    pool: str
    event: Encoded


class FleetFeed(_Reader[tuple[list[tuple[LogRow, str]], list[WorkerRow]]]):
    """Status changes of every job, and workers' changes, for every fleet follower."""

    what = "the fleet's events"

    def __init__(self, store: FeedStore, last: int) -> None:
        super().__init__()
        self.store = store
        self.last = last
        self.generation = 0
        self.events: deque[FleetEvent] = deque(maxlen=10_000)
        self.workers: dict[str, str] = {}  # what a follower was last told of each worker

    def since(self, generation: int) -> list[FleetEvent]:
        """The events kept that came after ``generation`` (the newest are last)."""
        start = bisect.bisect_right(self.events, generation, key=lambda ev: ev.generation)
        return list(itertools.islice(self.events, start, None))

    def fetch(self) -> tuple[list[tuple[LogRow, str]], list[WorkerRow]]:
        changes = self.store.state_events(self.last, BATCH, budget=PAGE_BYTES)
        return changes, self.store.list_workers()

    def take(self, fresh: tuple[list[tuple[LogRow, str]], list[WorkerRow]]) -> bool:
        changes, workers = fresh
        out = [(pool, encode(row, "job", job_id=row.job_id, pool=pool)) for row, pool in changes]
        if changes:
            self.last = changes[-1][0].seq
        for w in workers:
            # what a follower shows of a worker changed: it reads the worker again
            key = repr((w.status, w.drain, w.gpu_stats, w.offline_since, w.name, w.pool))
            if self.workers.get(w.id) != key:
                self.workers[w.id] = key
                data = {"id": w.id, "name": w.name, "pool": w.pool, "status": w.status.value}
                out.append((w.pool, Encoded(0, "worker", None, frame(None, "worker", data))))
        if out:
            self.generation += 1
            self.events.extend(FleetEvent(self.generation, pool, ev) for pool, ev in out)
            self.publish()
        return full([row for row, _ in changes], BATCH)
