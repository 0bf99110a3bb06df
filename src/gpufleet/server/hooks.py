"""Webhooks as callers make them: who may set which, where they may point, and what a
list shows (:mod:`gpufleet.domain.webhooks`; delivery: :mod:`gpufleet.server.hooksend`).

- A webhook without a scope is its maker's: it is told of the jobs its token's name owns.
  A ``pool`` webhook (operators and admins of that pool) is told of every job of the
  pool; a ``job`` webhook (``submit --notify``) of one job, its submitter's or an
  operator's.
- Its URL is checked when it is made (:mod:`gpufleet.domain.destinations`: the scheme,
  no credentials, every address its host resolves to now) and again at every delivery.
- Its URL and secret are kept as given (the server needs the secret to sign) and never
  shown again: a list shows the URL's host, and only its maker (or an admin, or an
  operator of its pool) sees it at all.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Protocol

from gpufleet.domain.destinations import Address, Allowed, Refused, check_url, host_of, literal
from gpufleet.domain.models import Role
from gpufleet.domain.webhooks import JobFacts, body, event_of, parse_events
from gpufleet.errors import Conflict, Forbidden, NotFound, ValidationFailed
from gpufleet.server.access import Caller
from gpufleet.server.settings import QueueSettings
from gpufleet.server.sharing import SharingRules
from gpufleet.store import EventStore, JobRow, JobStore, WebhookRow, WebhookStore
from gpufleet.wire import WebhookCreate, WebhookCreated

SECRET_PREFIX = "gw_"
#: Webhooks one token may hold: its own and its pools' (they live until removed), and one
#: job's (``submit --notify``: forgotten a day after the job ends). Each webhook is a
#: delivery per event, all in one queue: without a bound, one caller's hundreds of
#: webhooks to a receiver that never answers would fill it and push everyone's out.
MOST_HOOKS = 20
MOST_JOB_HOOKS = 1000
Resolve = Callable[[str, int], Sequence[Address]]


class HookStore(WebhookStore, JobStore, EventStore, Protocol):
    """What webhooks read and write: themselves, the jobs one may name, and how far the
    status changes go."""


def resolve(host: str, port: int) -> list[Address]:
    """Every address ``host`` resolves to (the system's resolver)."""
    found = literal(host)
    if found is not None:
        return [found]
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[Address] = []
    for info in infos:
        ip = literal(str(info[4][0]).split("%")[0])
        if ip is not None and ip not in out:
            out.append(ip)
    return out


def own_addresses(host: str) -> frozenset[Address]:
    """The server's own addresses: the one it binds, and its host name's."""
    found: set[Address] = set()
    bound = literal(host)
    if bound is not None:
        found.add(bound)
    # A host name that does not resolve: loopback and the bound address are refused anyway.
    with contextlib.suppress(OSError):
        found.update(resolve(socket.gethostname(), 0))
    return frozenset(found)


def key(hook_id: str, job_id: str, event: str, attempt: int) -> str:
    """A delivery's key: one per webhook, job, event and attempt."""
    return f"{hook_id}:{job_id}:{event}:{attempt}"


def delivery(hook: WebhookRow, event: str, facts: JobFacts, at: float) -> dict[str, object]:
    """The row of one delivery of ``event`` to ``hook``, due now."""
    return {
        "key": key(hook.id, facts.job, event, 0 if event == "running_past" else facts.attempt),
        "webhook_id": hook.id,
        "job_id": facts.job,
        "event": event,
        "body": body(event, facts, at, hook.running_past).decode(),
        "state": "pending",
        "tries": 0,
        "next_at": at,
        "created_at": at,
    }


def matches(hook: WebhookRow, job: JobRow) -> bool:
    """Whether ``hook`` is told of ``job``'s events."""
    if hook.scope == "user":
        return hook.target == job.owner
    if hook.scope == "pool":
        return hook.target == job.pool
    return hook.target == job.id


class Webhooks:
    """Webhooks made, listed and removed; and the destinations allowed now."""

    def __init__(
        self,
        store: HookStore,
        settings: QueueSettings,
        sharing: SharingRules,
        clock: Callable[[], float] = time.time,
        resolver: Resolve = resolve,
    ) -> None:
        self.store, self.settings, self.sharing = store, settings, sharing
        self.clock, self.resolver = clock, resolver
        self._own: frozenset[Address] | None = None
        self._lock = threading.Lock()

    def allowed(self) -> Allowed:
        """The rules now: the server's allowlist and the sharing file's, and its own
        addresses and ports (looked up once)."""
        with self._lock:
            if self._own is None:
                self._own = own_addresses(self.settings.host)
        entries: Iterable[str] = (
            *self.settings.webhook_allow,
            *self.sharing.current().webhook_allow,
        )
        return Allowed.of(entries, self.settings.own_ports, self._own)

    def check(self, url: str) -> None:
        """ValidationFailed naming ``url`` unless it may be sent to now."""
        try:
            target = check_url(url)
            allowed = self.allowed()
            why = allowed.name_refusal(target.host)
            if why is None:
                try:
                    addresses = self.resolver(target.host, target.port)
                except OSError:
                    addresses = []  # not resolvable now: checked again at each delivery
                for address in addresses:
                    why = why or allowed.refusal(target.host, address, target.port)
            if why is not None:
                raise Refused(why)
        except Refused as exc:
            raise ValidationFailed(
                f"url: refused: {exc}", detail={"field": "url", "problem": str(exc)}
            ) from None

    def create(self, caller: Caller, req: WebhookCreate) -> tuple[WebhookRow, str | None]:
        """Make a webhook for ``caller``; with the secret the server made, if it made one."""
        scope, target = self._scope(caller, req)
        self._room(caller, scope)
        self.check(req.url)
        made = None if req.secret else SECRET_PREFIX + secrets.token_urlsafe(32)
        events = parse_events(req.events)
        if req.running_past is not None and "running_past" not in events:
            events = (*events, "running_past")
        values = {
            "id": "h-" + secrets.token_hex(8),
            "scope": scope,
            "target": target,
            "url": req.url.strip(),
            "secret": req.secret or made,
            "events": list(events),
            "running_past": req.running_past,
            "created_by": caller.id,
            "created_at": self.clock(),
        }
        if not self.store.webhooks():
            # The first webhook: status changes are told from here on, none from before
            # (none was scanned while there was no webhook).
            self.store.move_webhook_cursor(self.store.webhook_cursor(), self.store.last_seq())
        self.store.add_webhook(values)
        hook = next(h for h in self.store.webhooks() if h.id == values["id"])
        if scope == "job":
            self._ended_already(hook)
        return hook, made

    def _room(self, caller: Caller, scope: str) -> None:
        """Conflict when ``caller`` holds as many webhooks of this kind as it may."""
        most = MOST_JOB_HOOKS if scope == "job" else MOST_HOOKS
        held = sum(
            1
            for h in self.store.webhooks()
            if h.created_by == caller.id and (h.scope == "job") == (scope == "job")
        )
        if held >= most:
            kind = "one job's webhooks (--notify)" if scope == "job" else "webhooks"
            raise Conflict(
                f"this token holds {held} {kind}, the most it may: remove one first "
                "(gpufleet webhooks list, gpufleet webhooks remove)",
                detail={"most": most, "held": held},
            )

    def _scope(self, caller: Caller, req: WebhookCreate) -> tuple[str, str]:
        if req.pool is not None and req.job is not None:
            raise ValidationFailed(
                "pool, job: give one of them, or neither (your own jobs)",
                detail={"field": "pool"},
            )
        if req.pool is not None:
            if caller.role not in (Role.ADMIN, Role.OPERATOR):
                raise Forbidden(
                    "pool: only operators and admins set a pool's webhooks; leave it out "
                    "for your own jobs",
                    detail={"field": "pool"},
                )
            caller.may_use(req.pool)
            return "pool", req.pool
        if req.job is not None:
            job = self.store.get_job(req.job)
            if job is None or not caller.sees(job.pool):
                raise NotFound(f"no job {req.job!r}", detail={"job": req.job})
            if caller.owner is not None and job.submitted_by != caller.owner:
                raise Forbidden(
                    f"job: {req.job} is not yours", detail={"field": "job", "job": req.job}
                )
            return "job", job.id
        return "user", caller.name

    def _ended_already(self, hook: WebhookRow) -> None:
        """A job webhook made after its job ended (a fast job, a slow client): its end is
        delivered now (once: the scan of status changes makes the same delivery)."""
        job = self.store.get_job(hook.target)
        if job is None or not job.status.terminal:
            return
        event = event_of(job.status.value, None)
        if event is None or event not in hook.events:
            return
        self.store.add_deliveries(
            [delivery(hook, event, facts(job, job.lease, None), self.clock())]
        )

    def visible(self, caller: Caller) -> list[WebhookRow]:
        """The webhooks ``caller`` sees: its own; an admin every one; an operator also
        those of its pools' jobs."""
        return [h for h in self.store.webhooks() if self._sees(caller, h)]

    def _sees(self, caller: Caller, hook: WebhookRow) -> bool:
        if hook.created_by == caller.id or caller.role == Role.ADMIN:
            return True
        if caller.role != Role.OPERATOR:
            return False
        if caller.pools is None:
            return True
        if hook.scope == "pool":
            return caller.sees(hook.target)
        job = self.store.get_job(hook.target) if hook.scope == "job" else None
        return job is not None and caller.sees(job.pool)

    def remove(self, caller: Caller, hook_id: str) -> None:
        """Remove a webhook ``caller`` sees (404 for one it does not)."""
        hook = next((h for h in self.store.webhooks() if h.id == hook_id), None)
        if hook is None or not self._sees(caller, hook) or not self.store.remove_webhook(hook_id):
            raise NotFound(f"no webhook {hook_id!r}", detail={"webhook": hook_id})


def facts(job: JobRow, attempt: int, cause: str | None) -> JobFacts:
    """What a webhook says of ``job`` (its status now)."""
    return JobFacts(
        job=job.id,
        name=job.name,
        owner=job.owner,
        pool=job.pool,
        status=job.status.value,
        attempt=attempt,
        cause=cause,
        error=job.error,
    )


def view(hook: WebhookRow, secret: str | None = None) -> WebhookCreated:
    """A webhook as an answer shows it: the URL's host, never the URL; the secret only
    when given (the one the server made, once)."""
    return WebhookCreated(
        id=hook.id,
        scope=hook.scope,
        target=hook.target,
        host=host_of(hook.url),
        events=list(hook.events),
        running_past=hook.running_past,
        created_at=datetime.fromtimestamp(hook.created_at, UTC),
        secret=secret,
    )
