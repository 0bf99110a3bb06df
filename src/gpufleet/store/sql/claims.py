"""Claims: a snapshot to rank on, read without locks, and one short write that takes the
first still-free job of the ones the service chose.

A mixin of :class:`gpufleet.store.SqlStore`; each backend's :class:`ClaimSession` reads
and writes in its own SQL. The service reads the worker's snapshot (the
slots its jobs hold, the jobs aimed at it, its claim count) and pages of its pool's queue,
ranks them in Python with no transaction open, and hands back the claims it would make,
best first. :meth:`ClaimOps.claim` then takes the first of those jobs still pending (on
PostgreSQL skipping rows another claimer holds) and applies its change, only if the
worker's claim count is still the one the snapshot read: a claim that came between
could have taken the slot the ranking counted on (:class:`StaleClaim`: rank again).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    func,
    literal_column,
    select,
    text,
    tuple_,
    union_all,
)

from gpufleet.domain import lifecycle
from gpufleet.domain.caps import POOLS, USERS, Recheck, tally
from gpufleet.domain.lifecycle import Change, Event
from gpufleet.domain.models import ACTIVE
from gpufleet.store import schema as t
from gpufleet.store.api import ClaimView, HeldRow
from gpufleet.store.rows_read import JobRow

_J, _W = t.jobs.c, t.workers.c
PENDING = lifecycle.INITIAL.value
_ACTIVE = ", ".join(f"'{s.value}'" for s in sorted(ACTIVE))
_ACTIVE_LIST = sorted(s.value for s in ACTIVE)
# What a claim reads about its worker first, in one statement: the GPUs its claimed and
# running jobs hold, grouped ('[]': a CPU slot, with how many), the pending jobs aimed at
# it that are claimable now in claim order (it takes those before its pool's queue), and
# its claim count. The aimed jobs come from the small partial index; left to itself SQLite
# would walk the pool's whole queue (ix_jobs_queue matches two equalities and the order).
# Run on the driver's own cursor: SQLAlchemy's execution path costs more than the query.
HELD_SQL = (
    "SELECT gpus, COUNT(*) AS n FROM jobs WHERE worker_id = {wid} "
    f"AND status IN ({_ACTIVE}) GROUP BY gpus"
)
AIMED_SQL = (
    "SELECT id, priority, created_at FROM jobs {hint}WHERE target IN ({wid}, {wname}) "
    f"AND status = '{PENDING}' AND pool = {{pool}} AND waiting = 0 "
    "AND (not_before IS NULL OR not_before <= {now}) ORDER BY priority DESC, created_at, id "
    "LIMIT 8"
)


def _json_list(value: Any) -> list[Any]:
    """A JSON array from the database: text on SQLite, decoded already by psycopg; NULL
    (an aggregate over no rows) is empty."""
    if value is None:
        return []
    found: list[Any] = value if isinstance(value, list) else json.loads(value)
    return found


# The owners with pending jobs in a pool: a loose index scan of ix_jobs_owner_queue (each
# step one seek to the next owner), so it costs the number of owners, not of jobs.
# Each step asks for the first owner in index order (ORDER BY ... LIMIT 1, not MIN): the
# index is then the plan even before PostgreSQL has statistics of a table just filled.
OWNERS_SQL = text(
    "WITH RECURSIVE o(owner) AS ("
    " SELECT (SELECT j.owner FROM jobs j WHERE j.status = 'pending' AND j.pool = :pool"
    " ORDER BY j.owner LIMIT 1)"
    " UNION ALL"
    " SELECT (SELECT j.owner FROM jobs j WHERE j.status = 'pending' AND j.pool = :pool"
    " AND j.owner > o.owner ORDER BY j.owner LIMIT 1) FROM o WHERE o.owner IS NOT NULL"
    ") SELECT owner FROM o WHERE owner IS NOT NULL"
)


class ClaimSession(ABC):
    """One claim's reads and its write, on one connection; each backend's session says
    how it reads the worker's snapshot and how it takes a job (:mod:`gpufleet.store.sqlite`,
    :mod:`gpufleet.store.postgres`)."""

    #: How many queued jobs to read at a time, and how many of them to offer at once.
    page_size: int
    choices: int

    def __init__(self, store: ClaimOps, conn: Connection) -> None:
        self.store = store
        self.conn = conn

    @abstractmethod
    def _snapshot(self, worker_id: str, name: str, pool: str, now: float) -> list[Any]:
        """One row: the GPUs the worker's jobs hold (JSON ``[[gpus, count], ...]``), the
        ids of the pending jobs aimed at it in claim order (JSON), its claim count."""

    @abstractmethod
    def claim(
        self, worker_id: str, seen: int, changes: Sequence[Change], caps: Recheck | None = None
    ) -> str | None:
        """Apply the first of ``changes`` (claims, best first) whose job is still pending;
        its job id, or None if every one is gone. Raises :class:`StaleClaim` if the
        worker's claim count is no longer ``seen``. With ``caps``, the capped holders are
        serialized first and the changes a cap holds back dropped (:meth:`capped`)."""

    def view(self, worker_id: str, name: str, pool: str, now: float, page: int) -> ClaimView:
        """The snapshot a claim for this worker ranks on, with the first ``page`` jobs of
        its pool's queue."""
        rows = self._snapshot(worker_id, name, pool, now)
        held_raw, aimed_raw, claims = rows[0] if rows else (None, None, 0)
        held = []
        for gpus, count in _json_list(held_raw):
            held += [tuple(json.loads(gpus))] * int(count)
        ids = [str(i) for i in _json_list(aimed_raw)]
        aimed = []
        if ids:
            q = select(t.jobs).where(_J.id.in_(ids))
            q = q.order_by(_J.priority.desc(), _J.created_at, _J.id)
            aimed = [JobRow.from_row(r) for r in self.conn.execute(q).all()]
        queue = self.page(pool, now, None, page) if page else []
        return ClaimView(held, int(claims or 0), aimed, queue)

    def page(self, pool: str, now: float, after: JobRow | None, limit: int) -> list[JobRow]:
        """The next ``limit`` claimable jobs of ``pool`` after ``after`` (a keyset
        position), best first: priority, then age."""
        params: dict[str, Any] = {"pool": pool, "now": now, "n": limit}
        return self._page(self.store.page_q, params, after)

    def _page(
        self, statements: tuple[Any, Any], params: dict[str, Any], after: JobRow | None
    ) -> list[JobRow]:
        if after is None:
            rows = self.conn.execute(statements[0], params).all()
        else:
            params |= {"p": after.priority, "c": after.created_at, "i": after.id}
            rows = self.conn.execute(statements[1], params).all()
        return [JobRow.from_row(r) for r in rows]

    def held(self, owners: Sequence[str], pools: Sequence[str]) -> list[HeldRow]:
        """What the jobs claimed or running now of ``owners`` or in ``pools`` hold, by
        (owner, pool, GPUs): a few rows, from the active jobs only (``ix_jobs_queue``)."""
        if not owners and not pools:
            return []
        q = (
            select(_J.owner, _J.pool, _J.gpus, func.count())
            .where(_J.status.in_(_ACTIVE_LIST) & (_J.owner.in_(owners) | _J.pool.in_(pools)))
            .group_by(_J.owner, _J.pool, _J.gpus)
        )
        return [(o, p, len(json.loads(g or "[]")), int(n)) for o, p, g, n in self.conn.execute(q)]

    def capped(self, changes: Sequence[Change], caps: Recheck) -> list[Change]:
        """The ``changes`` no cap holds back on what is held now (the caller holds what
        serializes the claims of their holders)."""
        found = caps.holders()
        users = [n for k, n in found if k == USERS]
        pools = [n for k, n in found if k == POOLS]
        held = tally(self.held(users, pools))
        keep = set(caps.allowed([c.job_id for c in changes], held))
        return [c for c in changes if c.job_id in keep]

    def made_way(self, worker_id: str, now: float) -> list[JobRow]:
        """The pending jobs a preemption is freeing a slot of this worker for, from the
        small partial index (none, nearly always)."""
        rows = self.conn.execute(_MADE_WAY, {"wid": worker_id, "now": now}).all()
        return [JobRow.from_row(r) for r in rows]

    def owners(self, pool: str) -> list[str]:
        return [str(r[0]) for r in self.conn.execute(OWNERS_SQL, {"pool": pool}).all()]

    def owner_page(
        self, pool: str, owner: str, now: float, after: JobRow | None, limit: int
    ) -> list[JobRow]:
        """The next ``limit`` claimable jobs of ``owner`` in ``pool`` after ``after``."""
        params: dict[str, Any] = {"pool": pool, "owner": owner, "now": now, "n": limit}
        return self._page(self.store.owner_q, params, after)


# Built once (its compiled form is cached): a claim of a worker whose slot a preemption
# frees reads it, while preemption is on.
_MADE_WAY = (
    select(t.jobs)
    .where(
        (_J.made_way_on == bindparam("wid"))
        & (_J.status == PENDING)
        & (_J.made_way_until > bindparam("now"))
        & (_J.waiting == 0)
    )
    .limit(4)
)


def claims_only(changes: Sequence[Change]) -> None:
    """A claim session takes claims only."""
    if any(c.event != Event.CLAIM for c in changes):
        raise ValueError("claim takes claims only")


class ClaimOps(ABC):
    """Claims: a session with the claim's reads and its one write (the backend's)."""

    engine: Any
    page_q: tuple[Any, Any]  # page_statements()
    owner_q: tuple[Any, Any]  # page_statements(by_owner=True)

    @abstractmethod
    def _read(self) -> AbstractContextManager[Connection]:
        """A connection for reading."""

    @abstractmethod
    def apply_change(self, conn: Connection, change: Change) -> bool:
        """Apply ``change`` if the job is still where it expects."""


def page_statements(by_owner: bool = False) -> tuple[Any, Any]:
    """Built once: a pool's first claimable jobs, and the next ones after a keyset
    position, best first (priority, then age), from the claim index.

    The next page is read as two index ranges, the rest of the position's priority and
    the lower priorities, so the scan starts where the last page ended. The one range an
    ``OR`` of the two would be is not one an index scan can start from: it would walk the
    queue from its head again, past every job of the pages before."""
    claimable = (
        # a literal, not a parameter: a prepared statement's generic plan may then use the
        # partial index of pending jobs by owner (PostgreSQL)
        (_J.status == literal_column(f"'{PENDING}'"))
        & (_J.pool == bindparam("pool"))
        & (_J.waiting == 0)
        & ((_J.not_before.is_(None)) | (_J.not_before <= bindparam("now")))
    )
    if by_owner:  # one user's jobs (fair share), from ix_jobs_owner_queue
        claimable = claimable & (_J.owner == bindparam("owner"))
    order = (_J.priority.desc(), _J.created_at, _J.id)
    head = select(t.jobs).where(claimable).order_by(*order).limit(bindparam("n"))
    p: Any = bindparam("p")
    position = tuple_(_J.created_at, _J.id) > tuple_(bindparam("c"), bindparam("i"))
    same = select(t.jobs).where(claimable & (_J.priority == p) & position)
    lower = select(t.jobs).where(claimable & (_J.priority < p))
    parts = [part.order_by(*order).limit(bindparam("n")).subquery() for part in (same, lower)]
    both = union_all(*(select(part) for part in parts)).subquery()
    u = both.c
    after = select(both).order_by(u.priority.desc(), u.created_at, u.id).limit(bindparam("n"))
    return head, after


def driver_rows(conn: Connection, sql: str, params: tuple[Any, ...]) -> list[Any]:
    """Rows of a hot-path query run on the driver's own cursor (SQLAlchemy's execution
    path costs more than these queries do)."""
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(sql, params)
        return list(cursor.fetchall())
    finally:
        cursor.close()
