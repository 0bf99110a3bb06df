"""Usage for fair share: each ended attempt charged to its owner and pool, in the
transaction that ends it, and read back by time slice (:mod:`gpufleet.domain.fairshare`).

A mixin of :class:`~gpufleet.store.sql.store.SqlStore`. An attempt is charged once: when
the change that closes its record (``finished_at``) takes, and only if the record was
still open and had started. Charges add to a slice's row (``ON CONFLICT DO UPDATE``), so
two servers ending attempts of one user at once both count.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, delete, select

from gpufleet.domain import fairshare
from gpufleet.domain.lifecycle import Change
from gpufleet.domain.models import ACTIVE
from gpufleet.store import schema as t
from gpufleet.store.api import RunningUse, UsageSlice
from gpufleet.store.sql.base import SqlParts

_A, _J, _U = t.attempts.c, t.jobs.c, t.usage.c
_ACTIVE = sorted(s.value for s in ACTIVE)


class UsageOps(SqlParts):
    """Charging ended attempts, and reading usage back."""

    #: The width of the usage slices charged now (the server sets it from its half-life).
    usage_width: float = fairshare.bucket_width(fairshare.HALF_LIFE)

    def _charge(self, conn: Connection, change: Change) -> None:
        """Charge the attempt ``change`` closes, if it closes one that ran."""
        if not change.record or "finished_at" not in change.record:
            return
        q = (
            select(_A.started_at, _A.finished_at, _A.gpus, _J.owner, _J.pool)
            .select_from(t.attempts.join(t.jobs, _J.id == _A.job_id))
            .where((_A.job_id == change.job_id) & (_A.attempt == change.attempt))
        )
        row = conn.execute(q).first()
        if row is None or row.finished_at is not None or row.started_at is None:
            return
        end = float(change.record["finished_at"])  # type: ignore[arg-type]
        self._add_usage(conn, row.owner, row.pool, row.gpus, row.started_at, end)

    def _add_usage(
        self, conn: Connection, owner: str, pool: str, gpus: str, start: float, end: float
    ) -> None:
        held = json.loads(gpus)
        width = self.usage_width
        rows = [
            {
                "owner": owner,
                "pool": pool,
                "kind": fairshare.kind(held),
                "start": at,
                "width": width,
                "seconds": seconds,
            }
            for at, seconds in fairshare.pieces(start, end, fairshare.amount(held), width)
        ]
        if not rows:
            return
        stmt = self._insert(t.usage)
        stmt = stmt.on_conflict_do_update(
            index_elements=[_U.owner, _U.pool, _U.kind, _U.start],
            set_={"seconds": _U.seconds + stmt.excluded.seconds},
        )
        for row in rows:  # one slice may be charged by two pieces: one statement each
            conn.execute(stmt, row)

    def usage_slices(self, since: float, pool: str | None = None) -> list[UsageSlice]:
        """The usage slices that end after ``since`` (of ``pool``, or every pool)."""
        q = select(t.usage).where(_U.start + _U.width > since)
        if pool is not None:
            q = q.where(_U.pool == pool)
        with self._read() as conn:
            return [
                UsageSlice(r.owner, r.pool, r.kind, r.start, r.width, r.seconds)
                for r in conn.execute(q).all()
            ]

    def running_use(self, pool: str | None = None) -> list[RunningUse]:
        """What the jobs claimed or running now hold (of ``pool``, or every pool)."""
        q = select(_J.id, _J.owner, _J.pool, _J.gpus, _J.started_at, _J.claimed_at, _J.status)
        q = q.where(_J.status.in_(_ACTIVE))
        if pool is not None:
            q = q.where(_J.pool == pool)
        with self._read() as conn:
            return [_running(r) for r in conn.execute(q).all()]

    def prune_usage(self, before: float) -> int:
        """Drop the slices that ended before ``before``; how many."""
        with self._write() as conn:
            return int(conn.execute(delete(t.usage).where(_U.start + _U.width < before)).rowcount)


def _running(r: Any) -> RunningUse:
    return RunningUse(
        r.id, r.owner, r.pool, tuple(json.loads(r.gpus)), r.started_at, r.claimed_at, r.status
    )
