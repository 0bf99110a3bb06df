"""The audit log: every state-changing call, who made it, from where, and how it ended.

An ASGI middleware around the app records each POST, PUT, PATCH and DELETE after its
response is sent: the token (id, name, role; none when the call had no valid token),
the client address, the method and path, the status, and the object the call created or
changed when the route names it (``deps.note``). Refused calls (401, 403, 4xx) are
recorded too: they are what an operator looks for after an incident.

Not recorded, by design: the worker protocol's periodic calls that carry no decision
(heartbeats, log batches, claim polls that found nothing). Their effects are in the job's
attempts and logs; recording them would bury everything else.

The server's own decisions about a worker's life are recorded as *events* (no method,
path or status; an ``event`` and a ``detail``): ``worker.registered``, ``worker.offline``
(no heartbeat, it stopped, or its token was revoked), ``worker.removed`` (``workers rm``,
or an ephemeral worker past its TTL) and ``lease.lost`` (a job's worker went silent).

Records are written in batches, a quarter of a second after the first of a batch and at
shutdown, in one transaction: a row per claim written on its own would halve claim
throughput on SQLite's single writer. A server killed outright loses at most the last
quarter second of records.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpufleet.server.asgi import StatusWatch
from gpufleet.server.requests import loggable
from gpufleet.server.shortage import log_failure
from gpufleet.store import AccessStore, TokenRow

log = logging.getLogger("gpufleet.audit")
CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_PERIODIC = re.compile(r"^/v1/(workers/[^/]+/heartbeat|jobs/[^/]+/output)$")
_CLAIM = re.compile(r"^/v1/workers/[^/]+/claim$")


class AuditWriter:
    """Collects audit records and writes them in batches, off the event loop."""

    def __init__(
        self, store: AccessStore, delay: float = 0.25, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.delay = delay
        self.clock = clock
        self._pending: list[dict[str, Any]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing: asyncio.Lock | None = None  # one batch written at a time

    def bind(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The loop events are batched on; None (the loop stops): written at once."""
        self._loop = loop
        self._writing = None  # made on the loop that first flushes

    def event(self, event: str, target: str, detail: str, token: TokenRow | None) -> None:
        """Record a lifecycle event; callable from any thread (the sweep, sync routes).
        Before the loop runs (or after it closed) it is written at once."""
        values = {
            "at": self.clock(),
            "token_id": token.id if token else None,
            "token_name": token.name if token else None,
            "role": token.role if token else None,
            "address": "-",
            "target": target[:200],
            "event": event,
            "detail": loggable(detail)[:2000],
        }
        loop = self._loop
        if loop is None or loop.is_closed():
            self.store.insert_audit([values])
            return
        loop.call_soon_threadsafe(self.add, values)

    def request(
        self, scope: Scope, path: str, status: int, target: str | None, token: TokenRow | None
    ) -> None:
        """Record a call (``path`` may be one part of a batch), on the loop."""
        client = scope.get("client")
        values = {
            "at": self.clock(),
            "token_id": token.id if token else None,
            "token_name": token.name if token else None,
            "role": token.role if token else None,
            "address": str(client[0])[:64] if client else "-",
            "method": scope["method"],
            "path": loggable(path)[:2000],
            "status": status,
            "target": target[:200] if target is not None else None,
        }
        self.add(values)

    def refused(self, scope: Scope, status: int) -> None:
        """Record a changing call refused before the app saw it (no valid credential)."""
        if scope["method"] in CHANGING:
            self.request(scope, scope["path"], status, None, None)

    def add(self, values: dict[str, Any]) -> None:
        self._pending.append(values)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(self.delay)
        await self.flush()

    async def flush(self) -> None:
        """Write what is pending now (shielded: a cancelled flush still writes). When it
        returns, every record added before it is written, those of a flush still writing
        when it began too (a reader of the log right after a call sees the call)."""
        if self._writing is None:
            self._writing = asyncio.Lock()
        async with self._writing:
            batch, self._pending = self._pending, []
            if not batch:
                return
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(self.store.insert_audit, batch)
                except (
                    Exception
                ) as exc:  # the calls happened; losing their records must not hide it
                    log_failure(exc, f"could not write {len(batch)} audit record(s)")

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
        await self.flush()


class AuditLog:
    def __init__(self, app: ASGIApp, writer: AuditWriter) -> None:
        self.app = app
        self.writer = writer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in CHANGING:
            await self.app(scope, receive, send)
            return
        if _PERIODIC.match(scope["path"]):  # recorded only when refused
            await self.app(scope, receive, self._refusals(scope, send))
            return
        watch = StatusWatch(send)
        try:
            await self.app(scope, receive, watch)
        finally:
            status = watch.status or 500  # no answer started: the app failed
            if status >= 400 or not (status == 204 and _CLAIM.match(scope["path"])):
                self._record(scope, status)

    def _refusals(self, scope: Scope, send: Send) -> Send:
        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self._record(scope, message["status"])
            await send(message)

        return watch

    def _record(self, scope: Scope, status: int) -> None:
        st: dict[str, Any] = scope.get("state") or {}
        # A batch: a record per call it stands for that was applied, and its own record
        # too if the batch as a whole was refused or failed.
        for path, item_status in st.get("audit_items", ()):
            self._write(scope, st, path, item_status, None)
        if status >= 400 or "audit_items" not in st:
            target = str(st["audit_target"]) if "audit_target" in st else None
            self._write(scope, st, scope["path"], status, target)

    def _write(
        self, scope: Scope, st: dict[str, Any], path: str, status: int, target: str | None
    ) -> None:
        caller = st.get("caller")
        self.writer.request(scope, path, status, target, caller.token if caller else None)
