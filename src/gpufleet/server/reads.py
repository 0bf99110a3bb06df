"""What clients read: jobs (found by id or name, in the caller's pools), their history and
output, the queue's counts, the fleet's names, tokens, the audit log and the database's
health. Routes read through here, never the store."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from gpufleet.domain.models import JobStatus
from gpufleet.errors import NotFound, ValidationFailed
from gpufleet.store import (
    AttemptRow,
    AuditRow,
    JobRow,
    LogRow,
    QueueGauges,
    Store,
    TokenRow,
    line_bytes,
)
from gpufleet.store.rows_read import ArtifactRow

#: A job's output: the records of its event log that are lines it wrote.
OUTPUT = frozenset({"stdout", "stderr"})
#: Every read of a job's event log (a page, a stream's batch) stops once its lines take
#: this many bytes, besides its count of records; it holds one record at least. A job's
#: lines may be a million characters each: six concurrent pages of a thousand such lines
#: took the server from 365 to 1,222 MiB.
PAGE_BYTES = 4 << 20


def full(rows: Sequence[LogRow], limit: int, budget: int = PAGE_BYTES) -> bool:
    """Whether a read of at most ``limit`` records and ``budget`` bytes stopped at either
    bound: more records may follow its last one."""
    return len(rows) >= limit or sum(line_bytes(r.line) for r in rows) >= budget


@dataclass(frozen=True)
class Page:
    """A page of a job's event log, and whether more may follow it (read on from its
    last record: ``after`` it, or ``before`` its first when scrolling back)."""

    rows: list[LogRow]
    more: bool


class Reads:
    """Read-only queries over the store; one per server process."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def job(self, ref: str, pools: Sequence[str] | None = None) -> JobRow:
        """A job by id, or by name when exactly one job has it; of ``pools`` only (None:
        every pool). A job in another pool is answered as unknown."""
        job = self.store.get_job(ref)
        if job is not None and (pools is None or job.pool in pools):
            return job
        named = self.store.find_jobs_by_name(ref, pools=pools)
        if len(named) == 1:
            return named[0]
        if named:
            raise NotFound(f"several jobs are named {ref!r}; use the job id", detail={"job": ref})
        raise NotFound(f"no job {ref!r}", detail={"job": ref})

    def jobs(
        self,
        statuses: Iterable[str],
        limit: int,
        pools: Sequence[str] | None,
        name: str | None = None,
        before: str | None = None,
    ) -> list[JobRow]:
        """The newest ``limit`` jobs of ``pools`` (None: every pool), oldest first; of
        those whose name holds ``name``; created before the job ``before`` (a page back)."""
        cursor = None
        if before is not None:
            mark = self.store.get_job(before)
            if mark is None or (pools is not None and mark.pool not in pools):
                raise ValidationFailed(
                    f"before: no job {before!r} to page back from", detail={"field": "before"}
                )
            cursor = (mark.created_at, mark.id)
        return self.store.list_jobs(statuses, limit, pools, name, cursor)

    def history(self, job: JobRow) -> tuple[list[AttemptRow], ArtifactRow | None, list[JobRow]]:
        """A job's attempts, its latest artifact, and the jobs whose results it needs."""
        deps = self.store.dependencies(job.id) if job.spec.dependencies else []
        return self.store.attempts(job.id), self.store.artifact(job.id), deps

    def result(self, job: JobRow) -> ArtifactRow | None:
        """What ``jobs get`` downloads: the artifact of the attempt that succeeded, else the
        latest one."""
        return self.store.artifact(job.id, job.lease if job.status == JobStatus.SUCCEEDED else None)

    @staticmethod
    def no_result(job: JobRow) -> str:
        """Why :meth:`result` found nothing to download, plainly: the job has not ended,
        keeps nothing, or wrote nothing where its outputs are kept."""
        said = f"job {job.id} ({job.status.value})"
        if not job.status.terminal:
            return f"{said} has no outputs yet: they are kept when it ends"
        if not job.spec.outputs:
            return f"{said} keeps no outputs (submitted without any): nothing to download"
        if tuple(job.spec.outputs) == ("outputs",):
            return f"{said} wrote no files to its outputs folder (outputs/): nothing to download"
        kept = ", ".join(job.spec.outputs)
        return f"{said} left no outputs (no file matched {kept}): nothing to download"

    def logs(
        self,
        job_id: str,
        after: int,
        limit: int,
        streams: Collection[str] | None = OUTPUT,
        before: int | None = None,
    ) -> Page:
        """A page of the job's event log after ``after`` (and before ``before``: the last
        page of that span): its output lines, or the records of ``streams`` (None: every
        record, status changes and progress too); ``limit`` records and ``PAGE_BYTES``
        at most."""
        rows = self.store.logs(job_id, after, limit, streams, before, PAGE_BYTES)
        return Page(rows, full(rows, limit))

    def counts(self, pools: Sequence[str] | None) -> dict[str, int]:
        """How many jobs of ``pools`` are in each status."""
        return self.store.job_counts(pools)

    def checkpoint_totals(self) -> tuple[int, int]:
        """Snapshots kept, and the bytes they list."""
        return self.store.checkpoint_totals()

    def gauges(self) -> QueueGauges:
        """The queue as ``/metrics`` shows it, read at each scrape: jobs by status and
        pool, each pool's oldest pending job, and the bytes of blobs kept."""
        return self.store.queue_gauges()

    def matching(self, pools: Sequence[str] | None, name: str | None) -> dict[str, int]:
        """How many jobs of ``pools`` whose name holds ``name`` are in each status."""
        return self.store.job_counts(pools, name)

    def worker_names(self) -> dict[str, str]:
        """Every worker's name by id (a job shows where it ran by name)."""
        return {w.id: w.name for w in self.store.list_workers()}

    def token_name(self, token_id: str | None) -> str | None:
        """The name of the token ``token_id`` (None: no such token, or none given)."""
        found = self.store.get_token(token_id) if token_id else None
        return found.name if found else None

    def tokens(self) -> list[TokenRow]:
        return self.store.list_tokens()

    def audit(self, since: float, limit: int, after: int) -> list[AuditRow]:
        return self.store.audit(since, limit, after)

    def database(self) -> str:
        """The database's kind, once it answered (raises if it does not)."""
        return self.store.ping()

    def problems(self) -> list[str]:
        """What keeps the server from working whole: writes failing for lack of disk."""
        why = self.store.space.why
        if why is None:
            return []
        return [f"writes fail: the disk is full ({why}); free space in its data dir or database"]
