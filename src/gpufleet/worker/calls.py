"""What the agent lends the parts that run its jobs: a way to retry a call while the
server is away, and a way to run a coroutine in the background."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

#: Runs a coroutine in the background, keeping a reference to it until it ends.
Spawn = Callable[[Coroutine[Any, Any, None]], None]


class Retrying(Protocol):
    """``call``, retried while the server is away; after ``give_up`` seconds (None:
    never) its :class:`~gpufleet.errors.ServerUnavailable` is raised."""

    def __call__(
        self, what: str, call: Callable[[], Awaitable[T]], give_up: float | None = None
    ) -> Awaitable[T]: ...
