"""The PostgreSQL claim: the snapshot and the write in one transaction. The reads take no
row locks, so while the service ranks in Python none are held; the write locks the one
job it takes (``FOR UPDATE SKIP LOCKED``: concurrent claimers never wait on each other's
rows) and the worker's row, and commits when the session ends."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from gpufleet.domain import lifecycle
from gpufleet.domain.caps import Holder, Recheck
from gpufleet.domain.lifecycle import Change, Event
from gpufleet.store.api import StaleClaim
from gpufleet.store.rows_written import state_rows
from gpufleet.store.sql.claims import (
    HELD_SQL,
    PENDING,
    ClaimOps,
    ClaimSession,
    claims_only,
    driver_rows,
)

# PostgreSQL would walk the pool's whole queue in claim order (ix_jobs_queue) and filter
# it for the few aimed jobs: O(pending jobs) a claim. Reading the aimed jobs first (OFFSET
# 0 keeps the planner from folding the two together) makes it take them from the partial
# index, and sort the few it finds.
_AIMED_PG = (
    "SELECT id, priority, created_at FROM (SELECT * FROM jobs WHERE target IS NOT NULL "
    f"AND target IN (w.id, w.name) AND status = '{PENDING}' OFFSET 0) aimed "
    "WHERE pool = w.pool AND waiting = 0 AND (not_before IS NULL OR not_before <= %s) "
    "ORDER BY priority DESC, created_at, id LIMIT 8"
)
_VIEW = (
    "SELECT (SELECT json_agg(json_build_array(h.gpus, h.n)) FROM ("
    + HELD_SQL.format(wid="w.id")
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
_STILL_PENDING = "coalesce({}status, '') = '" + PENDING + "'"
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


class PostgresClaims(ClaimSession):
    """Claimers run side by side and race for the first jobs, so each offers several
    (and takes the first no other holds)."""

    page_size, choices = 8, 4

    def __init__(self, store: ClaimOps, conn: Connection) -> None:
        super().__init__(store, conn)
        self._tried = False  # a claim was written in this transaction already
        self._locked: set[int] = set()  # the caps' advisory locks it holds

    def _snapshot(self, worker_id: str, name: str, pool: str, now: float) -> list[Any]:
        return driver_rows(self.conn, _VIEW, (now, worker_id))

    def claim(
        self, worker_id: str, seen: int, changes: Sequence[Change], caps: Recheck | None = None
    ) -> str | None:
        claims_only(changes)
        if changes and caps is not None:
            self._serialize(worker_id, caps.holders())
            changes = self.capped(changes, caps)
        if not changes:
            return None
        self._tried = True
        return self._claim_pg(self.conn, worker_id, seen, changes)

    def _serialize(self, worker_id: str, holders: Sequence[Holder]) -> None:
        """Take each capped holder's transaction-level advisory lock (held to the commit),
        so the claims that count against one holder run one at a time, on every replica,
        and each counts what the ones before it committed.

        A session's first claim holds no lock of any kind yet (its reads take none): it
        waits for each lock in key order. A later claim of the same transaction may hold
        job rows or its worker's row: it only tries, and a lock another claim holds ends
        the session (:class:`StaleClaim`: rank again) rather than risk a circle of waits."""
        for key in sorted({lock_id(h) for h in holders} - self._locked):
            if not self._tried and all(key > k for k in self._locked):
                driver_rows(self.conn, "SELECT pg_advisory_xact_lock(%s)", (key,))
            elif not driver_rows(self.conn, "SELECT pg_try_advisory_xact_lock(%s)", (key,))[0][0]:
                raise StaleClaim(worker_id)
            self._locked.add(key)

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
            rows = driver_rows(conn, _FIRST_FREE, (ids, ids))
            if not rows:
                break
            ids.remove(rows[0][0])
            if self.store.apply_change(conn, by_id[rows[0][0]]):
                return str(rows[0][0])
        return None


def _claim_in_one(
    conn: Connection, worker_id: str, seen: int, changes: Sequence[Change]
) -> tuple[str | None, int, str | None]:
    """PostgreSQL: the whole claim in one statement (``_CLAIM_IN_ONE``). Returns the job
    picked, whether the claim was counted, and the job claimed (None if its lease moved)."""
    _check_settable(changes)
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(_CLAIM_IN_ONE, _claim_params(seen, changes))
        picked, counted, taken = cursor.fetchone()
    finally:
        cursor.close()
    return picked, int(counted), taken


def _check_settable(changes: Sequence[Change]) -> None:
    """Refuse claims the one statement would apply only in part: each must set exactly
    the fields it sets (for the first claim's worker and time), open its attempt with
    the fields it inserts, and guard at most the spec."""
    first = changes[0]
    for c in changes:
        said = {**c.fields, "gpus": None, "lease_expires_at": None}
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


def _claim_params(seen: int, changes: Sequence[Change]) -> dict[str, Any]:
    """``_CLAIM_IN_ONE``'s parameters: the worker, the time and the claim count the
    ranking saw, with each choice's values (its old lease, GPUs, lease expiry, guarded
    spec and state record) as one JSON text: psycopg dumps a text in C, but a Python list
    into an array element by element (15 % of the server's time in a claim)."""
    first = changes[0]
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
    return {
        "ids": [c.job_id for c in changes],
        "choices": json.dumps(choices),
        "wid": first.fields["worker_id"],
        "wname": (first.opens or {})["worker_name"],
        "now": first.fields["claimed_at"],
        "ts": records[0]["ts"],
        "seen": seen,
    }


def lock_id(holder: Holder) -> int:
    """A capped holder's advisory lock key: the same 64 bits on every replica (Python's
    own hash differs between processes). Two holders sharing one only wait for each
    other."""
    kind, name = holder
    digest = hashlib.blake2b(f"gpufleet caps {kind} {name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
