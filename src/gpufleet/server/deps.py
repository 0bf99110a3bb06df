"""Request dependencies: the shared service and the caller's token."""

from __future__ import annotations

from dataclasses import dataclass

from anyio import CapacityLimiter
from fastapi import Request

from gpufleet.domain.models import Role
from gpufleet.server.auth import Auth, require
from gpufleet.server.notify import Notifier
from gpufleet.server.queue import QueueService
from gpufleet.store import TokenRow


@dataclass
class ServerState:
    queue: QueueService
    auth: Auth
    notifier: Notifier
    # Claims take the store's write path; on SQLite (one writer) more than one claim thread
    # at a time only adds lock and GIL contention, so they queue here instead.
    claim_limiter: CapacityLimiter


def state(request: Request) -> ServerState:
    st: ServerState = request.app.state.gpufleet
    return st


def _caller(request: Request) -> TokenRow:
    return state(request).auth.check(request.headers.get("authorization"))


# The role checks are ``async def`` so FastAPI runs them on the loop: a cached token check
# costs microseconds, far less than a hop to the thread pool (claims are the hot path).


async def reader(request: Request) -> TokenRow:
    """Anyone with a client token may read the queue."""
    return require(_caller(request), Role.OPERATOR, Role.SUBMITTER)


async def submitter(request: Request) -> TokenRow:
    return require(_caller(request), Role.OPERATOR, Role.SUBMITTER)


async def operator(request: Request) -> TokenRow:
    return require(_caller(request), Role.OPERATOR)


async def admin(request: Request) -> TokenRow:
    return require(_caller(request))


async def worker(request: Request) -> TokenRow:
    return require(_caller(request), Role.WORKER)


async def blob_user(request: Request) -> TokenRow:
    """Blobs are read and written by clients (packages) and workers (artifacts)."""
    return require(_caller(request), Role.OPERATOR, Role.SUBMITTER, Role.WORKER)
