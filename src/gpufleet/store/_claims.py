"""Claims: a snapshot to rank on, read without locks, and one short write that takes the
first still-free job of the ones the service chose.

A mixin of :class:`gpufleet.store.SqlStore`. The service reads the worker's snapshot (the
slots its jobs hold, the jobs aimed at it, its claim count) and pages of its pool's queue,
ranks them in Python with no transaction open, and hands back the claims it would make,
best first. :meth:`ClaimOps.claim` then takes the first of those jobs still pending (on
PostgreSQL skipping rows another claimer holds) and applies its change, only if the
worker's claim count is still the one the snapshot read: a claim that came between
could have taken the slot the ranking counted on (:class:`StaleClaim`: rank again).
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from sqlalchemy import Connection, bindparam, select, tuple_, union_all, update

from gpufleet.domain import lifecycle
from gpufleet.domain.lifecycle import Change, Event
from gpufleet.domain.models import ACTIVE
from gpufleet.store import schema as t
from gpufleet.store._values import state_rows
from gpufleet.store.api import ClaimView, StaleClaim
from gpufleet.store.rows import JobRow

_J, _W = t.jobs.c, t.workers.c
_PENDING = lifecycle.INITIAL.value
_ACTIVE = ", ".join(f"'{s.value}'" for s in sorted(ACTIVE))
# What a claim reads about its worker first, in one statement: the GPUs its claimed and
# running jobs hold, grouped ('[]': a CPU slot, with how many), the pending jobs aimed at
# it that are claimable now in claim order (it takes those before its pool's queue), and
# its claim count. The aimed jobs come from the small partial index; left to itself SQLite
# would walk the pool's whole queue (ix_jobs_queue matches two equalities and the order).
# Run on the driver's own cursor: SQLAlchemy's execution path costs more than the query.
_HELD = (
    "SELECT gpus, COUNT(*) AS n FROM jobs WHERE worker_id = {wid} "
    f"AND status IN ({_ACTIVE}) GROUP BY gpus"
)
_AIMED = (
    "SELECT id, priority, created_at FROM jobs {hint}WHERE target IN ({wid}, {wname}) "
    f"AND status = '{_PENDING}' AND pool = {{pool}} AND waiting = 0 "
    "AND (not_before IS NULL OR not_before <= {now}) ORDER BY priority DESC, created_at, id "
    "LIMIT 8"
)
_VIEW_SQLITE = (
    "SELECT (SELECT json_group_array(json_array(gpus, n)) FROM ("
    + _HELD.format(wid="?")
    + ")), (SELECT json_group_array(id) FROM ("
    + _AIMED.format(hint="INDEXED BY ix_jobs_target ", wid="?", wname="?", pool="?", now="?")
    + ")), (SELECT claims FROM workers WHERE id = ?)"
)
# PostgreSQL would walk the pool's whole queue in claim order (ix_jobs_queue) and filter
# it for the few aimed jobs: O(pending jobs) a claim. Reading the aimed jobs first (OFFSET
# 0 keeps the planner from folding the two together) makes it take them from the partial
# index, and sort the few it finds.
_AIMED_PG = (
    "SELECT id, priority, created_at FROM (SELECT * FROM jobs WHERE target IS NOT NULL "
    f"AND target IN (w.id, w.name) AND status = '{_PENDING}' OFFSET 0) aimed "
    "WHERE pool = w.pool AND waiting = 0 AND (not_before IS NULL OR not_before <= %s) "
    "ORDER BY priority DESC, created_at, id LIMIT 8"
)
_VIEW_POSTGRES = (
    "SELECT (SELECT json_agg(json_build_array(h.gpus, h.n)) FROM ("
    + _HELD.format(wid="w.id")
    + ") h), (SELECT json_agg(a.id ORDER BY a.priority DESC, a.created_at, a.id) FROM ("
    + _AIMED_PG
    + ") a), w.claims FROM workers w WHERE w.id = %s"
)
# PostgreSQL, one round trip for a whole claim: lock the first chosen job still pending
# that no other claimer holds (skipping rows they hold); count the claim on the worker's
# row only if there is one and the count is still the one the claim ranked on; then apply
# that job's claim change (if its lease is still the one ranked on), open its attempt and
# write its state record to the job's event log (in order: the job's row stays locked
# until the claim commits).
# The change's fields are the parameters: a claim changes exactly these (checked).
_CLAIM_FIELDS = frozenset(
    {"worker_id", "gpus", "lease", "claimed_at", "started_at", "finished_at", "exit_code"}
    | {"lease_expires_at"}
)
_OPENS = frozenset({"worker_id", "gpus", "worker_name", "claimed_at"})
# The chosen jobs are found by id (the primary key) and only then checked for 'pending'.
# Written as a plain "status = 'pending'", the check is one an index on status answers,
# and when the statistics lag a large apply (PostgreSQL thinks a handful of jobs are
# pending) the planner walks every pending job for the few ids instead: coalesce() keeps
# it from using any index for the check, whatever the statistics say.
_STILL_PENDING = "coalesce({}status, '') = '" + _PENDING + "'"
_CLAIM_IN_ONE = (
    "WITH pick AS (SELECT id FROM jobs "
    f"WHERE id = ANY(%(ids)s) AND {_STILL_PENDING.format('')} "
    "ORDER BY array_position(%(ids)s::text[], id::text) LIMIT 1 FOR UPDATE SKIP LOCKED), "
    "bump AS (UPDATE workers SET claims = claims + 1 WHERE id = %(wid)s AND claims = %(seen)s "
    "AND EXISTS (SELECT 1 FROM pick) RETURNING 1), "
    "c AS (SELECT u.* FROM json_to_recordset(%(choices)s::json) "
    "AS u(id text, old int, gpus text, expires float8, spec text, line text) "
    "JOIN pick ON pick.id = u.id WHERE EXISTS (SELECT 1 FROM bump)), "
    f"upd AS (UPDATE jobs j SET status = '{lifecycle.target(Event.CLAIM).value}', "
    "lease = c.old + 1, worker_id = %(wid)s, gpus = c.gpus, claimed_at = %(now)s, "
    "started_at = NULL, finished_at = NULL, exit_code = NULL, lease_expires_at = c.expires "
    f"FROM c WHERE j.id = c.id AND j.lease = c.old AND {_STILL_PENDING.format('j.')} "
    "AND (c.spec IS NULL OR j.spec = c.spec) "
    "RETURNING j.id, j.lease, c.gpus, c.line), "
    "ins AS (INSERT INTO attempts (job_id, attempt, worker_id, worker_name, gpus, claimed_at) "
    "SELECT id, lease, %(wid)s, %(wname)s, gpus, %(now)s FROM upd RETURNING job_id), "
    "logged AS (INSERT INTO job_logs (job_id, attempt, stream, line, ts) "
    "SELECT id, lease, 'state', line, %(ts)s FROM upd) "
    "SELECT (SELECT id FROM pick), (SELECT count(*) FROM bump), (SELECT job_id FROM ins)"
)
_FIRST_FREE = (
    f"SELECT id FROM jobs WHERE id = ANY(%s) AND {_STILL_PENDING.format('')} "
    "ORDER BY array_position(%s::text[], id::text) LIMIT 1 FOR UPDATE SKIP LOCKED"
)
# A worker's claim count moves on only from the count a claim ranked on (SQLite).
_COUNT_CLAIM = (
    update(t.workers)
    .where((_W.id == bindparam("wid")) & (_W.claims == bindparam("seen")))
    .values(claims=_W.claims + 1)
)


def _json_list(value: Any) -> list[Any]:
    """A JSON array from the database: text on SQLite, decoded already by psycopg; NULL
    (an aggregate over no rows) is empty."""
    if value is None:
        return []
    found: list[Any] = value if isinstance(value, list) else json.loads(value)
    return found


class ClaimSession:
    """One claim's reads and its write, on one connection. On PostgreSQL they share one
    transaction: the reads take no row locks, so while the service ranks in Python none
    are held; the write locks the one job it takes (skipping rows other claimers hold)
    and the worker's row, and commits when the session ends. On SQLite the reads run
    outside the writer lock and the write takes it."""

    def __init__(self, store: ClaimOps, conn: Connection) -> None:
        self.store = store
        self.conn = conn
        self.pg = store.dialect == "postgresql"
        # How many queued jobs to read at a time, and how many of them to offer at once:
        # PostgreSQL's claimers run side by side and race for the first jobs, so each
        # offers several (and takes the first no other holds); SQLite's claims run one
        # after the other, so the first choice is still there.
        self.page_size, self.choices = (8, 4) if self.pg else (4, 1)

    def view(self, worker_id: str, name: str, pool: str, now: float, page: int) -> ClaimView:
        """The snapshot a claim for this worker ranks on, with the first ``page`` jobs of
        its pool's queue."""
        if self.pg:
            params: tuple[Any, ...] = (now, worker_id)
            sql = _VIEW_POSTGRES
        else:
            params, sql = (worker_id, worker_id, name, pool, now, worker_id), _VIEW_SQLITE
        rows = _driver_rows(self.conn, sql, params)
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
        queue = self.page(pool, now, None, page)
        return ClaimView(held, int(claims or 0), aimed, queue)

    def page(self, pool: str, now: float, after: JobRow | None, limit: int) -> list[JobRow]:
        """The next ``limit`` claimable jobs of ``pool`` after ``after`` (a keyset
        position), best first: priority, then age."""
        params: dict[str, Any] = {"pool": pool, "now": now, "n": limit}
        if after is None:
            rows = self.conn.execute(self.store.page_q[0], params).all()
        else:
            params |= {"p": after.priority, "c": after.created_at, "i": after.id}
            rows = self.conn.execute(self.store.page_q[1], params).all()
        return [JobRow.from_row(r) for r in rows]

    def claim(self, worker_id: str, seen: int, changes: Sequence[Change]) -> str | None:
        """Apply the first of ``changes`` (claims, best first) whose job is still pending;
        its job id, or None if every one is gone. Raises :class:`StaleClaim` if the
        worker's claim count is no longer ``seen``."""
        if any(c.event != Event.CLAIM for c in changes):
            raise ValueError("claim takes claims only")
        if not changes:
            return None
        if self.pg:
            return self._claim_pg(self.conn, worker_id, seen, changes)
        conn = self.conn
        conn.commit()  # the reads' implicit transaction; SQLite took no lock for them
        with self.store._lock or nullcontext(), conn.begin():
            for change in changes:
                if self.store.apply_change(conn, change):
                    counted = conn.execute(_COUNT_CLAIM, {"wid": worker_id, "seen": seen})
                    if counted.rowcount != 1:
                        raise StaleClaim(worker_id)  # and the claim rolls back
                    return change.job_id
        return None

    def _claim_pg(
        self, conn: Connection, worker_id: str, seen: int, changes: Sequence[Change]
    ) -> str | None:
        ids = [c.job_id for c in changes]
        by_id = {c.job_id: c for c in changes}
        picked, counted, taken = _claim_in_one(conn, worker_id, seen, changes)
        if taken is not None:
            return str(taken)
        if picked is None:
            return None
        if not counted:
            raise StaleClaim(worker_id)
        ids.remove(picked)  # still pending, but its lease or spec moved since the ranking
        while ids:  # the count moved on already: take the next one still as ranked
            rows = _driver_rows(conn, _FIRST_FREE, (ids, ids))
            if not rows:
                break
            ids.remove(rows[0][0])
            if self.store.apply_change(conn, by_id[rows[0][0]]):
                return str(rows[0][0])
        return None


class ClaimOps(ABC):
    """Claims: a session with the claim's reads and its one write."""

    dialect: str
    engine: Any
    page_q: tuple[Any, Any]  # page_statements()
    _lock: threading.Lock | None  # SQLite's one writer

    @abstractmethod
    def _read(self) -> AbstractContextManager[Connection]:
        """A connection for reading."""

    @abstractmethod
    def apply_change(self, conn: Connection, change: Change) -> bool:
        """Apply ``change`` if the job is still where it expects."""

    @contextmanager
    def claiming(self) -> Iterator[ClaimSession]:
        """A claim session (one connection; on PostgreSQL one transaction)."""
        if self.dialect == "postgresql":
            with self.engine.begin() as conn:
                yield ClaimSession(self, conn)
        else:
            with self._read() as conn:
                yield ClaimSession(self, conn)


def page_statements() -> tuple[Any, Any]:
    """Built once: a pool's first claimable jobs, and the next ones after a keyset
    position, best first (priority, then age), from the claim index.

    The next page is read as two index ranges, the rest of the position's priority and
    the lower priorities, so the scan starts where the last page ended. The one range an
    ``OR`` of the two would be is not one an index scan can start from: it would walk the
    queue from its head again, past every job of the pages before."""
    claimable = (
        (_J.status == _PENDING)
        & (_J.pool == bindparam("pool"))
        & (_J.waiting == 0)
        & ((_J.not_before.is_(None)) | (_J.not_before <= bindparam("now")))
    )
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


def _claim_in_one(
    conn: Connection, worker_id: str, seen: int, changes: Sequence[Change]
) -> tuple[str | None, int, str | None]:
    """PostgreSQL: the whole claim in one statement (``_CLAIM_IN_ONE``). Returns the job
    picked, whether the claim was counted, and the job claimed (None if its lease moved)."""
    first = changes[0]
    for c in changes:
        f = c.fields
        said = {**f, "gpus": None, "lease_expires_at": None}
        meant = {k: None for k in _CLAIM_FIELDS} | {
            "worker_id": first.fields["worker_id"],
            "lease": c.lease + 1,
            "claimed_at": first.fields["claimed_at"],
        }
        if (
            said != meant
            or c.opens is None
            or set(c.opens) != _OPENS
            or not set(c.guard) <= {"spec"}
        ):
            raise ValueError("a claim changes other fields than the one statement sets")
    # Each choice's values go as one JSON text: psycopg dumps a text in C, but a Python
    # list into an array element by element (15 % of the server's time in a claim).
    records = state_rows(changes)  # each claim's state record, as the job's log keeps it
    choices = [
        {
            "id": c.job_id,
            "old": c.lease,
            "gpus": json.dumps(list(c.fields["gpus"])),  # type: ignore[call-overload]
            "expires": c.fields["lease_expires_at"],
            "spec": c.guard.get("spec"),
            "line": record["line"],
        }
        for c, record in zip(changes, records, strict=True)
    ]
    params = {
        "ids": [c.job_id for c in changes],
        "choices": json.dumps(choices),
        "wid": first.fields["worker_id"],
        "wname": (first.opens or {})["worker_name"],
        "now": first.fields["claimed_at"],
        "ts": records[0]["ts"],
        "seen": seen,
    }
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(_CLAIM_IN_ONE, params)
        picked, counted, taken = cursor.fetchone()
    finally:
        cursor.close()
    return picked, int(counted), taken


def _driver_rows(conn: Connection, sql: str, params: tuple[Any, ...]) -> list[Any]:
    """Rows of a hot-path query run on the driver's own cursor (SQLAlchemy's execution
    path costs more than these queries do)."""
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(sql, params)
        return list(cursor.fetchall())
    finally:
        cursor.close()
