"""Webhook delivery, off the request path: one task per server process.

Every half second it

1. reads the fleet's status changes after its cursor (``job_logs``, the records the
   fleet-wide event stream reads, once they are ``SETTLE`` seconds old; the cursor is kept
   in the database) and writes a delivery for each webhook an ending (or a preemption)
   concerns; nothing at all while there is no webhook;
2. every few seconds, writes a ``running_past`` delivery for each running job that has run
   longer than a webhook's ``running_past``;
3. takes the deliveries that are due (as many as it has free senders) and sends them.

Deliveries live in ``webhook_deliveries``: one due when the server stops is sent after it
starts again, and two servers sharing a database neither write nor send one twice (a
unique key per webhook, job, event and attempt; a conditional update takes it). At most
``MAX_PENDING`` wait: past that, new ones are dropped with a log line.

A send resolves the URL's host, checks every address (:mod:`gpufleet.domain.
destinations`), connects to the checked one (the name still goes in ``Host`` and TLS's
SNI, and the certificate is checked against it), follows no redirect, and gives up after
``TIMEOUT`` seconds. At most ``SENDERS`` sends run at once, on the event loop, so a dead or
hanging receiver costs the server's other calls nothing but a few idle sockets. A failed
send (a network error, a time-out, an answer other than 2xx) is tried again after
:func:`gpufleet.domain.webhooks.delay`, up to ``TRIES`` tries. Logs name the webhook and
its URL's host, never the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import ssl
import time
from collections.abc import Callable
from typing import Protocol

import httpx
from starlette.concurrency import run_in_threadpool

from gpufleet import __version__
from gpufleet.domain import webhooks
from gpufleet.domain.destinations import Address, Refused, check_url, host_of
from gpufleet.domain.webhooks import EVENT_HEADER, SIGNATURE_HEADER, event_of, signature
from gpufleet.server.hooks import HookStore, Webhooks, delivery, facts, matches
from gpufleet.server.shortage import log_failure
from gpufleet.store import DeliveryRow, EventStore, LogRow, UsageStore, WebhookRow

log = logging.getLogger("gpufleet.webhooks")

EVERY = 0.5  # seconds between two looks
RUNNING_EVERY = 5.0  # seconds between two looks at running jobs
SENDERS = 8
TIMEOUT = 5.0  # seconds a send may take in all
HOLD = 60.0  # a taken delivery is due again after this if its server died sending it
MAX_PENDING = 10_000
BATCH = 500  # status changes read at a time
KEEP = 7 * 86400.0  # sent and given-up deliveries are kept this long
ENDED = 86400.0  # a job's own webhook is forgotten this long after the job ended
#: Seconds a status change is left before it is read: on PostgreSQL a record numbered
#: earlier may commit later, and the cursor must not pass it unseen.
SETTLE = 1.0
#: Status changes that end no attempt and no job (the cause is not looked up).
_NO_END = frozenset({"submit", "requeue", "resume", "stop", "pausing"})


class SenderStore(HookStore, EventStore, UsageStore, Protocol):
    """Webhooks and deliveries, the status changes and the jobs running now."""


class Sender:
    """Scans status changes into deliveries and sends them; one per server process."""

    def __init__(
        self,
        store: SenderStore,
        hooks: Webhooks,
        clock: Callable[[], float] = time.time,
        base: float = webhooks.BASE_DELAY,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | None = None,
    ) -> None:
        self.store, self.hooks, self.clock, self.base = store, hooks, clock, base
        self.transport = transport
        # The system's trust store (SSL_CERT_FILE honoured): a lab's own CA works.
        self.verify = verify
        self._running: set[asyncio.Task[None]] = set()
        self._next_running = 0.0
        self._next_prune = 0.0

    # ---- the loop ---------------------------------------------------------------------

    def client(self) -> httpx.AsyncClient:
        """The HTTP client sends go through: no redirect followed, no proxy, a time-out."""
        return httpx.AsyncClient(
            timeout=httpx.Timeout(TIMEOUT, connect=min(3.0, TIMEOUT)),
            follow_redirects=False,
            limits=httpx.Limits(max_connections=SENDERS, max_keepalive_connections=0),
            transport=self.transport,
            verify=self.verify or ssl.create_default_context(),
            trust_env=False,  # never through a proxy the environment names
        )

    async def run(self) -> None:
        """Look, write and send until cancelled."""
        async with self.client() as client:
            try:
                while True:
                    try:
                        await self.once(client)
                    except Exception as exc:  # keep going: the next look may succeed
                        log_failure(exc, "webhooks: a look failed")
                    await asyncio.sleep(EVERY)
            finally:
                for task in list(self._running):
                    task.cancel()

    async def once(self, client: httpx.AsyncClient) -> None:
        """One look: scan, running jobs (now and then), send what is due."""
        hooks = await run_in_threadpool(self.store.webhooks)
        if not hooks:  # nothing to tell, nothing written (the first webhook sets the cursor)
            return
        await run_in_threadpool(self.scan, hooks)
        now = self.clock()
        if now >= self._next_running:
            self._next_running = now + RUNNING_EVERY
            await run_in_threadpool(self.running_past, hooks)
        if now >= self._next_prune:
            self._next_prune = now + 3600.0
            await run_in_threadpool(self.prune, hooks)
        free = SENDERS - len(self._running)
        if free <= 0:
            return
        due = await run_in_threadpool(self.store.take_deliveries, now, free, HOLD)
        by_id = {h.id: h for h in hooks}
        for d in due:
            task = asyncio.create_task(self.send(client, d, by_id.get(d.webhook_id)))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    # ---- deliveries written -----------------------------------------------------------

    def scan(self, hooks: list[WebhookRow]) -> int:
        """Write the deliveries of the status changes after the cursor; how many."""
        cursor = self.store.webhook_cursor()
        if cursor is None:  # history is not told
            self.store.move_webhook_cursor(None, self.store.last_seq())
            return 0
        settled = self.clock() - SETTLE
        changes = list(
            itertools.takewhile(
                lambda c: c[0].ts <= settled, self.store.state_events(cursor, BATCH)
            )
        )
        if not changes:
            return 0
        rows = [row for log_row, _pool in changes for row in self._deliveries(hooks, log_row)]
        added = self._add(rows)
        self.store.move_webhook_cursor(cursor, changes[-1][0].seq)
        return added

    def _deliveries(self, hooks: list[WebhookRow], record: LogRow) -> list[dict[str, object]]:
        """The deliveries one status change makes (none for most)."""
        if not hooks:
            return []
        said = json.loads(record.line)
        status = str(said.get("status", ""))
        if status in ("claimed", "running") or said.get("event") in _NO_END:
            return []
        cause = said.get("cause") or self._cause(record.job_id, record.attempt, status)
        event = event_of(status, cause)
        job = self.store.get_job(record.job_id) if event else None
        if event is None or job is None:
            return []
        told = facts(job, record.attempt, cause)
        return [
            delivery(h, event, told, record.ts)
            for h in hooks
            if event in h.events and matches(h, job)
        ]

    def _cause(self, job_id: str, attempt: int, status: str) -> str | None:
        """Why the attempt ended (its record's cause), for an attempt that ended."""
        if status in ("succeeded", "cancelled"):
            return None
        found = [a for a in self.store.attempts(job_id) if a.attempt == attempt]
        return found[0].cause if found else None

    def running_past(self, hooks: list[WebhookRow]) -> int:
        """Write a delivery for each running job past a webhook's ``running_past``."""
        timed = [h for h in hooks if h.running_past is not None and "running_past" in h.events]
        if not timed:
            return 0
        now, rows = self.clock(), []
        for use in self.store.running_use():
            if use.started_at is None:
                continue
            job = None
            for h in timed:
                assert h.running_past is not None
                if now - use.started_at < h.running_past:
                    continue
                job = job or self.store.get_job(use.job_id)
                if job is not None and matches(h, job):
                    rows.append(delivery(h, "running_past", facts(job, job.lease, None), now))
        return self._add(rows)

    def prune(self, hooks: list[WebhookRow]) -> None:
        """Forget deliveries made or given up ``KEEP`` ago, and the webhooks of one job
        that ended a day ago (``submit --notify``: its word is long sent by then)."""
        now = self.clock()
        self.store.prune_deliveries(now - KEEP)
        for h in hooks:
            if h.scope != "job" or h.created_at > now - ENDED:
                continue
            job = self.store.get_job(h.target)
            if job is None or (job.status.terminal and (job.finished_at or 0) < now - ENDED):
                self.store.remove_webhook(h.id)

    def _add(self, rows: list[dict[str, object]]) -> int:
        if not rows:
            return 0
        pending = self.store.pending_deliveries()
        room = max(0, MAX_PENDING - pending)
        if len(rows) > room:
            log.warning(
                "webhooks: %d deliveries wait already; %d new one(s) dropped",
                pending,
                len(rows) - room,
            )
            rows = rows[:room]
        return self.store.add_deliveries(rows)

    # ---- sending ----------------------------------------------------------------------

    async def send(
        self, client: httpx.AsyncClient, d: DeliveryRow, hook: WebhookRow | None
    ) -> None:
        """Send one delivery and write how it went."""
        if hook is None:
            await run_in_threadpool(
                self.store.end_delivery, d.id, "failed", self.clock(), "webhook removed"
            )
            return
        error = None
        try:
            status = await asyncio.wait_for(self._post(client, hook, d), TIMEOUT + 1)
            if not 200 <= status < 300:
                error = f"answered {status}"
        except Refused as exc:
            error = f"refused: {exc}"
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: could not send"
        await self._ended(d, hook, error)

    async def _ended(self, d: DeliveryRow, hook: WebhookRow, error: str | None) -> None:
        now = self.clock()
        if error is None:
            await run_in_threadpool(self.store.end_delivery, d.id, "sent", now, None)
            return
        wait = webhooks.delay(d.tries, random.random(), self.base)
        host = host_of(hook.url)
        if wait is None:
            log.warning(
                "webhook %s (%s): %s event of job %s not delivered after %d tries: %s",
                hook.id, host, d.event, d.job_id, d.tries, error,
            )  # fmt: skip
            await run_in_threadpool(self.store.end_delivery, d.id, "failed", now, error)
            return
        log.info("webhook %s (%s): try %d failed (%s); again in %.1f s", hook.id, host,
                 d.tries, error, wait)  # fmt: skip
        await run_in_threadpool(self.store.end_delivery, d.id, "pending", now + wait, error)

    async def _post(self, client: httpx.AsyncClient, hook: WebhookRow, d: DeliveryRow) -> int:
        """POST the delivery to the checked address of the webhook's host; the status."""
        target = check_url(hook.url)
        allowed = await run_in_threadpool(self.hooks.allowed)
        why = allowed.name_refusal(target.host)
        if why is not None:
            raise Refused(why)
        address = await self._resolved(target.host, target.port)
        for a in address:
            why = allowed.refusal(target.host, a, target.port)
            if why is not None:
                raise Refused(why)
        ip = address[0]
        shown = f"[{ip}]" if ip.version == 6 else str(ip)
        url = f"{target.scheme}://{shown}:{target.port}{target.path}"
        payload = d.body.encode()
        default_port = 443 if target.scheme == "https" else 80
        headers = {
            "Host": target.host if target.port == default_port else f"{target.host}:{target.port}",
            "Content-Type": "application/json",
            "User-Agent": f"gpufleet/{__version__}",
            SIGNATURE_HEADER: signature(hook.secret, int(self.clock()), payload),
            EVENT_HEADER: d.event,
        }
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        response = await client.post(url, content=payload, headers=headers, extensions=extensions)
        return response.status_code

    async def _resolved(self, host: str, port: int) -> list[Address]:
        """The host's addresses, resolved now (a name that changed is checked again)."""
        found = await asyncio.wait_for(
            run_in_threadpool(self.hooks.resolver, host, port), timeout=3.0
        )
        if not found:
            raise Refused(f"{host} resolves to no address")
        return list(found)

    async def drain(self) -> None:
        """Wait for the sends under way (tests)."""
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._running, return_exceptions=True)
