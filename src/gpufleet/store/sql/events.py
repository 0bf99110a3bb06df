"""Events: a job's event log (its output, progress and status changes) appended
under its lease and its output quota, read back in pages, the fleet-wide stream of status
changes, and the pruning of old records.

A mixin of :class:`~gpufleet.store.sql.store.SqlStore` (:class:`~.base.SqlParts`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Collection, Sequence

from sqlalchemy import Connection, func, select, update

from gpufleet.domain.models import ACTIVE, TERMINAL
from gpufleet.domain.quota import OutputQuota
from gpufleet.store import schema as t
from gpufleet.store.api import Appended
from gpufleet.store.pages import Fitter, read_page, summed_as_read
from gpufleet.store.rows_read import LogRow, log_offsets
from gpufleet.store.rows_written import (
    account_columns,
    cut_event,
    metered,
    progress_columns,
)
from gpufleet.store.sql.base import SqlParts
from gpufleet.store.sql.leases import lease_where

LINE_COLUMNS = ("job_id", "attempt", "stream", "line", "ts")


class EventOps(SqlParts):
    """A job's event log, and the audit log's pruning."""

    @property
    def page_fitter(self) -> Fitter:
        """How a page of records is cut to its byte budget
        (:data:`gpufleet.store.pages.Fitter`): summed as rows are read; a backend may sum
        it in SQL instead."""
        return summed_as_read

    @abstractmethod
    def _insert_lines(self, conn: Connection, rows: list[tuple[str, int, str, str, float]]) -> None:
        """Insert a batch of a job's log rows (:data:`LINE_COLUMNS`) through the driver,
        in the write's transaction. A flooding job sends thousands of lines a second, and
        SQLAlchemy's per-row parameter handling cost more than the insert itself. Each row
        takes the next ``seq`` as it goes in, so the order is kept."""

    def append_logs(
        self,
        job_id: str,
        lease: int,
        lines: Sequence[tuple[str, str]],
        now: float,
        first: int | None = None,
        quota: OutputQuota | None = None,
    ) -> Appended:
        """Append output lines if the lease still holds the job, line ``first`` of the
        attempt on (None: after what it has): lines it has already are skipped, so a batch
        sent again is stored once. Output past the attempt's ``quota`` is dropped (a cut's
        marker and event are stored). Says whether the lease held, and the stop grace when
        the job has been asked to stop (read in the same go)."""
        j, a = t.jobs.c, t.attempts.c
        with self._write() as conn:
            # The job's row is locked, as a status change locks it: the job's events are
            # numbered in the order they commit, so a follower never skips one.
            held = conn.execute(
                select(j.status, j.stop_requested_at, j.stop_grace, j.metrics)
                .where(lease_where(job_id, lease, ACTIVE))
                .with_for_update()
            ).first()
            if held is None:
                return Appended(False)
            this = (a.job_id == job_id) & (a.attempt == lease)
            # the attempt's row is locked: appends of one attempt count one at a time
            account = (a.log_lines, a.claimed_at, a.output_bytes, a.output_dropped, a.output_cut)
            have = conn.execute(select(*account).where(this).with_for_update()).one()
            fresh = log_offsets(have.log_lines or 0, first, lines)
            cut = None
            if fresh:
                got = metered(fresh.lines, dict(have._mapping), quota, now)
                rows = [(job_id, lease, s, ln, now) for s, ln in got.lines]
                if rows:
                    self._insert_lines(conn, rows)
                columns = {"log_lines": fresh.end, **account_columns(got.account)}
                conn.execute(update(t.attempts).where(this), columns)
                # the job's latest progress, even from records the quota cut from its log
                summary = progress_columns(fresh.lines, held.metrics)
                if summary is not None:
                    conn.execute(update(t.jobs).where(j.id == job_id), summary)
                if got.marker is not None:
                    cut = got.marker
                    conn.execute(
                        t.job_logs.insert(), cut_event(job_id, held.status, lease, cut, now)
                    )
        stop = None if held.stop_requested_at is None else float(held.stop_grace or 0)
        return Appended(True, stop, cut)

    def prune(self, logs_before: float | None, audit_before: float | None, batch: int) -> int:
        """Delete up to ``batch`` rows: log lines of jobs that ended before ``logs_before``,
        then audit records from before ``audit_before`` (None: keep). Returns how many;
        called again while it returns ``batch``. Each delete is conditional, so servers
        sharing the database may run it at once."""
        lines, j, a = t.job_logs.c, t.jobs.c, t.audit.c
        ended = select(j.id).where(
            j.status.in_([s.value for s in TERMINAL]), j.finished_at < logs_before
        )
        done = 0
        with self._write() as conn:
            if logs_before is not None:
                old = select(lines.seq).where(lines.job_id.in_(ended)).limit(batch)
                done += conn.execute(t.job_logs.delete().where(lines.seq.in_(old))).rowcount
            if audit_before is not None and done < batch:
                old = select(a.seq).where(a.at < audit_before).limit(batch - done)
                done += conn.execute(t.audit.delete().where(a.seq.in_(old))).rowcount
        return done

    def logs(
        self,
        job_id: str,
        after: int,
        limit: int,
        streams: Collection[str] | None = None,
        before: int | None = None,
        budget: int | None = None,
    ) -> list[LogRow]:
        """The job's event log after ``after``, in order: every record, or those of
        ``streams`` (stdout, stderr, progress, state). With ``before``: the last ``limit``
        records between the two (a page scrolled back to), still in order. With
        ``budget``: only the records within that many bytes of lines (see
        :mod:`gpufleet.store.pages`)."""
        c = t.job_logs.c
        q = select(t.job_logs).where(c.job_id == job_id, c.seq > after)
        if streams is not None:
            q = q.where(c.stream.in_(sorted(streams)))
        if before is not None:
            q = q.where(c.seq < before)
        with self._read() as conn:
            rows = read_page(conn, q, limit, budget, before is not None, fitter=self.page_fitter)
        found = [LogRow.from_row(r) for r in rows]
        return found[::-1] if before is not None else found

    def state_events(
        self,
        after: int,
        limit: int,
        pools: Sequence[str] | None = None,
        budget: int | None = None,
    ) -> list[tuple[LogRow, str]]:
        """Status changes of every job (of ``pools``) after ``after``, in order, each with
        its job's pool: what the fleet-wide event stream carries (within ``budget``
        bytes of records, as :meth:`logs`)."""
        c, j = t.job_logs.c, t.jobs.c
        q = (
            select(t.job_logs, j.pool)
            .join(t.jobs, j.id == c.job_id)
            .where(c.stream == "state", c.seq > after)
        )
        if pools is not None:
            q = q.where(j.pool.in_(list(pools)))
        with self._read() as conn:
            rows = read_page(conn, q, limit, budget, fitter=self.page_fitter)
        out = []
        for r in rows:
            m = dict(r._mapping)
            pool = str(m.pop("pool"))
            out.append((LogRow.from_mapping(m), pool))
        return out

    def last_seq(self, job_id: str | None = None) -> int:
        """The newest record's number, of ``job_id``'s log or of all (0: none yet). A
        job's records commit in number order, so none still to come is numbered below."""
        c = t.job_logs.c
        q = select(func.max(c.seq))
        if job_id is not None:
            q = q.where(c.job_id == job_id)
        with self._read() as conn:
            return int(conn.execute(q).scalar() or 0)
