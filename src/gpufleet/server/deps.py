"""Request dependencies: the shared service and the caller's token."""

from __future__ import annotations

from dataclasses import dataclass

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


def state(request: Request) -> ServerState:
    st: ServerState = request.app.state.gpufleet
    return st


def _caller(request: Request) -> TokenRow:
    return state(request).auth.check(request.headers.get("authorization"))


def reader(request: Request) -> TokenRow:
    """Anyone with a client token may read the queue."""
    return require(_caller(request), Role.OPERATOR, Role.SUBMITTER)


def submitter(request: Request) -> TokenRow:
    return require(_caller(request), Role.OPERATOR, Role.SUBMITTER)


def operator(request: Request) -> TokenRow:
    return require(_caller(request), Role.OPERATOR)


def admin(request: Request) -> TokenRow:
    return require(_caller(request))


def worker(request: Request) -> TokenRow:
    return require(_caller(request), Role.WORKER)
