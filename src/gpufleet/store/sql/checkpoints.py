"""Checkpoints: the snapshots of jobs' checkpoint folders (gpufleet.domain.checkpoints).

A mixin of :class:`gpufleet.store.SqlStore`. A snapshot is written only while its
attempt's lease still holds the job, and the job's oldest go as a new one comes, so at
most ``keep`` of a job are kept.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from gpufleet.domain.models import ACTIVE, TERMINAL
from gpufleet.store import schema as t
from gpufleet.store.rows_read import CheckpointRow
from gpufleet.store.sql.base import SqlParts


class CheckpointOps(SqlParts):
    """Record operations of checkpoints."""

    def add_checkpoint(
        self, job_id: str, lease: int, values: dict[str, Any], keep: int
    ) -> int | None:
        """Record a snapshot of the attempt ``lease`` holds (its files are blobs already),
        keeping the job's newest ``keep``; its id, or None when the lease no longer holds
        the job."""
        j, c = t.jobs.c, t.checkpoints.c
        with self._write() as conn:
            held = conn.execute(
                select(j.id).where(
                    (j.id == job_id) & (j.lease == lease) & j.status.in_([s.value for s in ACTIVE])
                )
            ).first()
            if held is None:
                return None
            new = conn.execute(
                t.checkpoints.insert()
                .values(job_id=job_id, attempt=lease, **values)
                .returning(c.id)
            ).scalar_one()
            kept = select(c.id).where(c.job_id == job_id).order_by(c.id.desc()).limit(max(1, keep))
            conn.execute(t.checkpoints.delete().where((c.job_id == job_id) & c.id.not_in(kept)))
        return int(new)

    def checkpoints(self, job_id: str, limit: int = 100) -> list[CheckpointRow]:
        """The job's snapshots, newest first."""
        c = t.checkpoints.c
        q = select(t.checkpoints).where(c.job_id == job_id).order_by(c.id.desc()).limit(limit)
        with self._read() as conn:
            return [CheckpointRow.from_row(r) for r in conn.execute(q).all()]

    def checkpoint_totals(self) -> tuple[int, int]:
        """Snapshots kept and the bytes their files add up to (each file counted in every
        snapshot that lists it), for /metrics."""
        c = t.checkpoints.c
        with self._read() as conn:
            row = conn.execute(select(func.count(), func.coalesce(func.sum(c.bytes), 0))).one()
        return int(row[0]), int(row[1])

    def prune_checkpoints(self, before: float, batch: int) -> int:
        """Delete up to ``batch`` snapshots of jobs that ended before ``before``."""
        j, c = t.jobs.c, t.checkpoints.c
        ended = select(j.id).where(
            j.status.in_([s.value for s in TERMINAL]), j.finished_at < before
        )
        old = select(c.id).where(c.job_id.in_(ended)).limit(batch)
        with self._write() as conn:
            return int(conn.execute(t.checkpoints.delete().where(c.id.in_(old))).rowcount)
