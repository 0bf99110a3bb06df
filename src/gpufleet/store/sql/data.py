"""Data-plane records: blobs, resumable uploads, artifacts, and job dependencies.

A mixin of :class:`gpufleet.store.SqlStore`: same connections, same writer lock. The blob
*bytes* live in files (:mod:`gpufleet.store.blobfiles`); a row here means they are complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, func, select, update

from gpufleet.domain.models import JobStatus
from gpufleet.store import schema as t
from gpufleet.store.rows_read import ArtifactRow, BlobRow, JobRow
from gpufleet.store.sql.base import SqlParts

_D, _DJ = t.job_deps.alias("d"), t.jobs.alias("dj")
# A pending job's unmet dependencies, counted (built once: aliases cost to build).
_UNMET = (
    select(func.count())
    .select_from(_D.join(_DJ, _DJ.c.id == _D.c.dep_id))
    .where(_D.c.job_id == t.jobs.c.id, _DJ.c.status != JobStatus.SUCCEEDED.value)
    .scalar_subquery()
)


class DataOps(SqlParts):
    """Record operations of the data plane."""

    # ---- blobs ------------------------------------------------------------------------

    def record_blob(self, sha256: str, size: int, now: float) -> None:
        """Record a complete blob (its file is already in place); a second time is a no-op."""
        stmt = self._insert(t.blobs).on_conflict_do_nothing()
        with self._write() as conn:
            conn.execute(stmt, {"sha256": sha256, "size": size, "created_at": now})

    def get_blob(self, sha256: str) -> BlobRow | None:
        with self._read() as conn:
            row = conn.execute(select(t.blobs).where(t.blobs.c.sha256 == sha256)).first()
        return BlobRow.from_row(row) if row else None

    def list_blobs(self, limit: int, pools: Sequence[str] | None = None) -> list[BlobRow]:
        """The newest blobs (those ``pools`` may read; None: every blob)."""
        q = select(t.blobs).order_by(t.blobs.c.created_at.desc()).limit(limit)
        if pools is not None:
            readable = select(t.blob_pools.c.sha256).where(t.blob_pools.c.pool.in_(pools))
            q = q.where(t.blobs.c.sha256.in_(readable))
        with self._read() as conn:
            return [BlobRow.from_row(r) for r in conn.execute(q).all()]

    def grant_blobs(self, grants: Iterable[tuple[str, str]]) -> None:
        """Let each (sha256, pool) pool read that blob (again: a no-op)."""
        with self._write() as conn:
            self._grant(conn, grants)

    def _grant(self, conn: Connection, grants: Iterable[tuple[str, str]]) -> None:
        rows = [{"sha256": s, "pool": p} for s, p in sorted(set(grants))]
        if rows:
            conn.execute(self._insert(t.blob_pools).on_conflict_do_nothing(), rows)

    def blob_readable(self, sha256: str, pools: Sequence[str]) -> bool:
        c = t.blob_pools.c
        q = select(c.sha256).where((c.sha256 == sha256) & c.pool.in_(pools)).limit(1)
        with self._read() as conn:
            return conn.execute(q).first() is not None

    def set_blob_archive(self, sha256: str, summary: dict[str, Any]) -> None:
        with self._write() as conn:
            conn.execute(
                update(t.blobs)
                .where(t.blobs.c.sha256 == sha256)
                .values(archive=json.dumps(summary))
            )

    # ---- resumable uploads ------------------------------------------------------------

    def create_upload(
        self, upload_id: str, sha256: str | None, size: int, now: float, owner: str | None = None
    ) -> None:
        values = {"id": upload_id, "sha256": sha256, "size": size, "created_at": now}
        with self._write() as conn:
            conn.execute(t.uploads.insert().values(**values, token_id=owner))

    def upload_owner(self, upload_id: str) -> str | None:
        """The token that opened an upload session (None: no such session, or one opened
        before sessions had owners)."""
        u = t.uploads.c
        with self._read() as conn:
            owner = conn.scalar(select(u.token_id).where(u.id == upload_id))
        return None if owner is None else str(owner)

    def get_upload(self, upload_id: str) -> tuple[str | None, int, float] | None:
        """(sha256, size, created_at) of an open upload session (sha256 None: named at
        its end)."""
        u = t.uploads.c
        with self._read() as conn:
            row = conn.execute(select(u.sha256, u.size, u.created_at).where(u.id == upload_id))
            found = row.first()
        return (found[0], int(found[1]), float(found[2])) if found else None

    def delete_upload(self, upload_id: str) -> None:
        with self._write() as conn:
            conn.execute(t.uploads.delete().where(t.uploads.c.id == upload_id))

    def old_uploads(self, created_before: float) -> list[str]:
        """Sessions opened before ``created_before``."""
        u = t.uploads.c
        with self._read() as conn:
            return list(conn.scalars(select(u.id).where(u.created_at < created_before)))

    def upload_ids(self, created_after: float) -> set[str]:
        """Sessions still open and younger than ``created_after``; older ones are dropped."""
        u = t.uploads.c
        with self._write() as conn:
            conn.execute(t.uploads.delete().where(u.created_at < created_after))
            return set(conn.scalars(select(u.id)))

    # ---- artifacts --------------------------------------------------------------------

    def attach_artifact(self, job_id: str, lease: int, values: dict[str, Any]) -> bool:
        """Attach an artifact to an attempt whose lease still holds the job."""
        j, a = t.jobs.c, t.artifacts.c
        active = [JobStatus.CLAIMED.value, JobStatus.RUNNING.value]
        with self._write() as conn:
            held = conn.execute(
                select(j.id).where((j.id == job_id) & (j.lease == lease) & j.status.in_(active))
            ).first()
            if held is None:
                return False
            conn.execute(t.artifacts.delete().where((a.job_id == job_id) & (a.attempt == lease)))
            conn.execute(t.artifacts.insert().values(job_id=job_id, attempt=lease, **values))
        return True

    def artifact(self, job_id: str, attempt: int | None = None) -> ArtifactRow | None:
        """The artifact of ``attempt``, else of the latest attempt that has one."""
        a = t.artifacts.c
        q = select(t.artifacts).where(a.job_id == job_id)
        if attempt is not None:
            q = q.where(a.attempt == attempt)
        with self._read() as conn:
            row = conn.execute(q.order_by(a.attempt.desc()).limit(1)).first()
        return ArtifactRow.from_row(row) if row else None

    # ---- dependencies -----------------------------------------------------------------

    def insert_deps(self, conn: Connection, deps: Mapping[str, Sequence[str]]) -> None:
        rows = [{"job_id": j, "dep_id": d} for j, ds in deps.items() for d in ds]
        if rows:
            conn.execute(self._insert(t.job_deps).on_conflict_do_nothing(), rows)

    def recount_waiting(self, conn: Connection, job_ids: Sequence[str] | None) -> int:
        if job_ids is not None and not job_ids:  # a job nothing waits on: most finishes
            return 0
        j = t.jobs.c
        where = j.status == JobStatus.PENDING.value
        where = where & (j.id.in_(list(job_ids)) if job_ids is not None else j.waiting > 0)
        stmt = update(t.jobs).where(where & (j.waiting != _UNMET)).values(waiting=_UNMET)
        return int(conn.execute(stmt).rowcount)

    def refresh_waiting(self, job_ids: Sequence[str] | None = None) -> int:
        """Recount the unmet dependencies of pending jobs (``job_ids``, or every waiting
        one). Counting, not decrementing, makes it safe to repeat. Returns rows changed."""
        with self._write() as conn:
            return self.recount_waiting(conn, job_ids)

    def dependencies(self, job_id: str) -> list[JobRow]:
        d = t.job_deps.c
        q = select(t.jobs).where(t.jobs.c.id.in_(select(d.dep_id).where(d.job_id == job_id)))
        with self._read() as conn:
            return [JobRow.from_row(r) for r in conn.execute(q).all()]
