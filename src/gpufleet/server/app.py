"""The FastAPI application: error shape, lifespan (lease sweeper), routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from anyio import CapacityLimiter
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from gpufleet import __version__
from gpufleet.errors import GpufleetError, InsufficientStorage
from gpufleet.server import routes
from gpufleet.server.audit import AuditLog, AuditWriter
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService
from gpufleet.server.deps import ServerState, state
from gpufleet.server.event_ids import KEY_NAME, Opaque
from gpufleet.server.events import Hub
from gpufleet.server.gate import Gate
from gpufleet.server.holds import Holds
from gpufleet.server.limits import Limits, LimitsMiddleware
from gpufleet.server.notify import Notifier
from gpufleet.server.polls import Polls
from gpufleet.server.requests import RequestIds
from gpufleet.server.responses import error_response
from gpufleet.server.services import Services
from gpufleet.server.settings import QueueSettings
from gpufleet.server.shortage import RETRY_AFTER, log_failure, noted
from gpufleet.server.text_input import RefuseNul
from gpufleet.store import Store
from gpufleet.store.space import shortage_classes

log = logging.getLogger("gpufleet.server")


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


async def _on_gpufleet_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GpufleetError)
    headers = None
    if isinstance(exc, InsufficientStorage):  # a blob's disk filled: health says so
        state(request).services.store.space.full(exc.message)
        headers = {"Retry-After": str(RETRY_AFTER)}
    return error_response(exc.status, exc.code, exc.message, exc.detail, headers)


async def _on_shortage(request: Request, exc: Exception) -> JSONResponse:
    """The handler of database and file errors: a shortage (a full disk) is answered 507
    or 503, never a 500; anything else goes on up as it would have (a 500, logged with
    its traceback)."""
    err = noted(request, exc, state(request).services.store.space)
    if err is None:
        raise exc
    headers = {"Retry-After": str(RETRY_AFTER)}
    return error_response(err.status, err.code, err.message, err.detail, headers)


def _problem(message: str) -> str:
    return message.removeprefix("Value error, ")


async def _on_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [
        {"field": _field(tuple(e["loc"])), "problem": _problem(e["msg"])} for e in exc.errors()
    ]
    first = problems[0] if problems else {"field": "body", "problem": "invalid"}
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    message = f"invalid request: {first['field']}: {first['problem']}{more}"
    return error_response(422, "validation_error", message, problems)


def _allowed_methods(request: Request) -> str:
    """Every method the API serves at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for template, ops in request.app.openapi().get("paths", {}).items():
        pattern = re.sub(r"\{[^}]+\}", "[^/]+", template)
        if re.fullmatch(pattern, request.url.path):
            methods |= {m.upper() for m in ops}
    return ", ".join(sorted(methods))


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    response = error_response(exc.status_code, code, str(exc.detail))
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:
        response.headers["Allow"] = _allowed_methods(request)
    return response


UPLOAD_SWEEP_EVERY = 600.0  # and retention (server/retention.py)


async def _sweeper(services: Services, interval: float) -> None:
    """Write the heartbeats kept in memory (:meth:`Fleet.flush_beats`), lose the leases
    that lapsed and preempt where the sharing rules say so, at start and every
    ``interval``; recount and mark silent workers offline
    every five seconds
    at most (a worker goes offline a lease after its last heartbeat); upload sessions and
    retention every ten minutes. The first sweep runs at once: a lease that lapsed while
    no server ran goes back to the queue as the server starts (its worker has fenced)."""
    loop = asyncio.get_running_loop()
    next_uploads = next_recount = loop.time()
    recount_every = max(interval, min(services.settings.lease_timeout / 4, 5.0))
    while True:
        try:
            await run_in_threadpool(services.fleet.flush_beats)
            requeued = await run_in_threadpool(services.upkeep.lose_lapsed_leases)
            await run_in_threadpool(services.preemption.sweep)
            offline: list[str] = []
            if loop.time() >= next_recount:
                next_recount = loop.time() + recount_every
                offline = await run_in_threadpool(services.upkeep.recount_and_mark_offline)
            if loop.time() >= next_uploads:
                next_uploads = loop.time() + UPLOAD_SWEEP_EVERY
                expired = await run_in_threadpool(services.blobs.uploads.expire)
                if expired:
                    log.warning("removed %d upload session(s) unfinished for a day", expired)
                await run_in_threadpool(services.retention.run)
                await run_in_threadpool(services.fair.prune)
        except Exception as exc:  # keep sweeping: one failed sweep must not stop expiry forever
            log_failure(exc, "sweep failed")
        else:
            for job_id in requeued:
                log.warning("lease lost for job %s (no heartbeat)", job_id)
            for worker_id in offline:
                log.warning("worker %s is offline (no heartbeat)", worker_id)
        await asyncio.sleep(interval)


def _server_state(
    store: Store, settings: QueueSettings, blobs: BlobService, metrics_public: bool
) -> ServerState:
    """The services and the live parts (notifier, polls, hub, holds) the routes share."""
    notifier = Notifier()

    def on_change() -> None:
        notifier.notify()
        store.publish_claimable()

    audit = AuditWriter(store)
    hub = Hub(store)
    services = Services(
        store, settings, blobs, on_change=on_change, on_event=audit.event, on_written=hub.touch
    )
    auth = Auth(store)
    holds = Holds(auth.valid)
    auth.on_forget.append(holds.changed)  # a token changed, here or on another replica
    st = ServerState(
        services=services,
        auth=auth,
        notifier=notifier,
        claim_limiter=CapacityLimiter(store.offers.claimers),
        audit=audit,
        polls=Polls(),
        hub=hub,
        holds=holds,
        event_ids=Opaque(),
        metrics_public=metrics_public,
    )
    st.services.metrics.watch(st.services.reads, st.services.fleet, st.polls, st.hub)
    return st


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answered in the one JSON error shape."""
    app.add_exception_handler(GpufleetError, _on_gpufleet_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(HTTPException, _on_http)
    for cls in shortage_classes():
        app.add_exception_handler(cls, _on_shortage)


def _add_middleware(
    app: FastAPI, st: ServerState, limits: Limits | None, access_log: bool, metrics_public: bool
) -> None:
    """The middleware, innermost first: audit, NUL refusal, security headers, limits,
    request ids."""
    app.add_middleware(AuditLog, writer=st.audit)
    app.add_middleware(RefuseNul)
    app.add_middleware(routes.dashboard.SecurityHeaders)
    # Added last, so outermost: a refused flood costs no audit row, no database write.
    app.add_middleware(
        LimitsMiddleware,
        limits=limits,
        gate=Gate(st.auth),
        audit=st.audit,
        metrics_public=metrics_public,
    )
    # Outermost of all: every answer carries its request id, and a crash anywhere inside
    # is answered (and logged) once, with that id.
    app.add_middleware(RequestIds, access_log=access_log)


def _add_routes(app: FastAPI) -> None:
    """The API's routers, the dashboard and its static files."""
    app.include_router(routes.jobs.router)
    app.include_router(routes.workers.router)
    app.include_router(routes.blobs.router)
    app.include_router(routes.environments.router)
    app.include_router(routes.events.router)
    app.include_router(routes.sharing.router)
    app.include_router(routes.hooks.router)
    app.include_router(routes.metrics.router)
    app.include_router(routes.dashboard.router)
    app.mount("/ui", routes.dashboard.static_files(), name="ui")


def create_app(
    store: Store,
    settings: QueueSettings,
    blobs: BlobService,
    limits: Limits | None = None,
    access_log: bool = False,
    metrics_public: bool = False,
    api_docs: bool = False,
) -> FastAPI:
    """The server app over ``store`` (already migrated) and ``blobs``, behind the abuse
    ``limits`` (the defaults when None); ``access_log``: a log line per request;
    ``api_docs``: serve the API browser (Swagger UI at /docs, ReDoc at /redoc), whose
    pages load their scripts from a CDN, so it is off unless asked for."""
    st = _server_state(store, settings, blobs, metrics_public)
    app = FastAPI(
        title="gpufleet",
        version=__version__,
        description="Queue, fleet state and job control for gpufleet workers and clients.",
        lifespan=_lifespan(store, st),
        docs_url="/docs" if api_docs else None,
        redoc_url="/redoc" if api_docs else None,
    )
    app.state.gpufleet = st
    _add_error_handlers(app)
    _add_middleware(app, st, limits, access_log, metrics_public)
    _add_routes(app)
    return app


async def _start(store: Store, st: ServerState) -> asyncio.Task[None]:
    """Bind the live parts to the running loop, load the event-id key, clean up what an
    earlier run left, and start the sweeper (returned)."""
    services = st.services
    loop = asyncio.get_running_loop()
    st.notifier.bind(loop)
    st.polls.bind(loop)
    st.audit.bind(loop)
    st.hub.bind(loop)
    st.holds.bind(loop)
    key = await run_in_threadpool(store.server_key, KEY_NAME, Opaque.fresh_key())
    st.event_ids.load(key)
    cleaned = await run_in_threadpool(services.blobs.startup)
    if cleaned:
        log.warning("removed %d unfinished upload file(s) left by an earlier run", cleaned)
    # Leases are not extended at a start: a worker that had no heartbeat answered for a
    # whole lease has stopped its jobs itself (it fences), so a lease that lapsed while
    # no server ran is requeued at the first sweep. Sweeps come every second at most,
    # so a lapsed lease is requeued within a second of its end.
    interval = max(0.05, min(services.settings.lease_timeout / 4, 1.0))
    return asyncio.create_task(_sweeper(services, interval))


def _listen(store: Store, st: ServerState, stop: threading.Event) -> threading.Thread | None:
    """The thread that wakes polls held by this replica on others' changes, started; None
    where the store cannot listen."""
    if not store.offers.listens:
        return None
    listener = threading.Thread(
        target=store.listen,
        args=(
            st.notifier.notify,
            stop,
            st.auth.forget,
            st.polls.superseded_elsewhere,
        ),
        daemon=True,
    )
    listener.start()
    return listener


async def _stop(
    st: ServerState,
    task: asyncio.Task[None],
    listener: threading.Thread | None,
    stop_listening: threading.Event,
) -> None:
    """Undo :func:`_start` and :func:`_listen`: stop listening and sweeping, write the last
    heartbeats and audit rows, unbind from the loop."""
    stop_listening.set()
    if listener is not None:
        listener.join(5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    try:  # the last second's heartbeats
        await run_in_threadpool(st.services.fleet.flush_beats)
    except Exception:
        log.exception("could not write the last heartbeats")
    await st.audit.close()
    st.audit.bind(None)
    st.hub.bind(None)
    st.holds.bind(None)


def _lifespan(
    store: Store, st: ServerState
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """What the server does at start (clean up, sweep, listen to other replicas) and
    undoes at stop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = await _start(store, st)
        stop_listening = threading.Event()
        listener = _listen(store, st, stop_listening)
        hooks = asyncio.create_task(st.services.hook_sender.run())  # webhooks: hooksend
        try:
            yield
        finally:
            hooks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hooks
            await _stop(st, task, listener, stop_listening)

    return lifespan
