"""A transition table: for each event, the statuses it is allowed from and the one status
it leads to. The job's table (:mod:`gpufleet.domain.lifecycle`) and the worker's
(:mod:`gpufleet.domain.worker_lifecycle`) are each one of these.

The lookups a store makes on every conditional update (``sources``, ``target``) are
worked out once, when the table is built, not searched for on each call; a table whose
event leads to two statuses is refused then too.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Generic, TypeVar

from gpufleet.errors import InvalidTransition

S = TypeVar("S", bound=StrEnum)  # a status
E = TypeVar("E", bound=StrEnum)  # an event
T = TypeVar("T")  # what an event leads to: a status (or, for a worker, None: the row goes)


class Table(Generic[S, E, T]):
    """The allowed transitions of one kind of thing (``noun``: "job", "worker"), from
    ``edges``: ``(status, event) -> status after``."""

    def __init__(self, noun: str, edges: Mapping[tuple[S, E], T]) -> None:
        self.noun = noun
        self.edges: Mapping[tuple[S, E], T] = dict(edges)
        froms: dict[E, set[S]] = {}
        tos: dict[E, set[T]] = {}
        for (src, event), dst in self.edges.items():
            froms.setdefault(event, set()).add(src)
            tos.setdefault(event, set()).add(dst)
        self._sources = {event: frozenset(found) for event, found in froms.items()}
        self._targets: dict[E, T] = {}
        for event, found in tos.items():
            if len(found) != 1:
                raise ValueError(f"{noun} event {event.value} leads to {len(found)} statuses")
            (self._targets[event],) = found

    def transition(self, status: S, event: E) -> T:
        """The status after ``event`` in ``status``, or :class:`InvalidTransition`."""
        try:
            return self.edges[(status, event)]
        except KeyError:
            raise InvalidTransition(
                f"a {status.value} {self.noun} cannot {event.value}",
                detail={"status": status.value, "event": event.value},
            ) from None

    def sources(self, event: E) -> frozenset[S]:
        """Every status from which ``event`` is allowed; stores use it in conditional
        updates."""
        return self._sources.get(event, frozenset())

    def target(self, event: E) -> T:
        """The one status ``event`` leads to, from whichever status it is allowed in."""
        return self._targets[event]
