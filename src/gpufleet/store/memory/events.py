"""A job's event log in memory: output appended under its lease and quota, pages read
back, the fleet-wide stream of status changes, and the pruning of old records. A mixin of
:class:`~gpufleet.store.memory.store.MemoryStore`, under its lock.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from gpufleet.domain.models import ACTIVE, TERMINAL
from gpufleet.domain.quota import OutputQuota
from gpufleet.store.api import Appended
from gpufleet.store.memory.tables import MemoryTables
from gpufleet.store.pages import within
from gpufleet.store.rows_read import LogRow, line_bytes, log_offsets
from gpufleet.store.rows_written import account_columns, cut_event, metered, progress_columns

_ACTIVE = {s.value for s in ACTIVE}
_TERMINAL = {s.value for s in TERMINAL}


class MemoryEvents(MemoryTables):
    """The event log: rows numbered as they are appended, never a number twice."""

    def prune(self, logs_before: float | None, audit_before: float | None, batch: int) -> int:
        with self._lock:
            ended = (
                set()
                if logs_before is None
                else {
                    i
                    for i, j in self.jobs.items()
                    if j["status"] in _TERMINAL and (j["finished_at"] or 0) < logs_before
                }
            )
            doomed = [n for n, r in enumerate(self.log_rows) if r["job_id"] in ended][:batch]
            for n in reversed(doomed):
                del self.log_rows[n]
            left = batch - len(doomed)
            old = (
                []
                if audit_before is None
                else [n for n, r in enumerate(self.audit_rows) if r["at"] < audit_before][:left]
            )
            for n in reversed(old):
                del self.audit_rows[n]
            return len(doomed) + len(old)

    def _log(self, rows: Sequence[dict[str, Any]]) -> None:
        """Append rows to the event log, numbered (never a number twice, as in SQL)."""
        for row in rows:
            self.log_seq += 1
            self.log_rows.append({**row, "seq": self.log_seq})

    def append_logs(
        self,
        job_id: str,
        lease: int,
        lines: Sequence[tuple[str, str]],
        now: float,
        first: int | None = None,
        quota: OutputQuota | None = None,
    ) -> Appended:
        with self._lock:
            j = self.jobs.get(job_id)
            if j is None or j["lease"] != lease or j["status"] not in _ACTIVE:
                return Appended(False)
            attempt = self.attempt_rows[(job_id, lease)]
            fresh = log_offsets(attempt["log_lines"], first, lines)
            cut = None
            if fresh:
                got = metered(fresh.lines, attempt, quota, now)
                attempt.update(log_lines=fresh.end, **account_columns(got.account))
                j.update(progress_columns(fresh.lines, j["metrics"]) or {})
                self._log(
                    [
                        {"job_id": job_id, "attempt": lease, "stream": s, "line": ln, "ts": now}
                        for s, ln in got.lines
                    ]
                )
                if got.marker is not None:
                    cut = got.marker
                    self._log([cut_event(job_id, j["status"], lease, cut, now)])
            stop = None if j["stop_requested_at"] is None else float(j["stop_grace"] or 0)
            return Appended(True, stop, cut)

    def logs(
        self,
        job_id: str,
        after: int,
        limit: int,
        streams: Collection[str] | None = None,
        before: int | None = None,
        budget: int | None = None,
    ) -> list[LogRow]:
        with self._lock:
            found = [
                r
                for r in self.log_rows
                if r["job_id"] == job_id
                and after < r["seq"] < (before if before is not None else r["seq"] + 1)
                and (streams is None or r["stream"] in streams)
            ]
            page = found[::-1][:limit] if before is not None else found[:limit]
            if budget is not None:
                page = list(within(page, budget, lambda r: line_bytes(r["line"])))
            rows = [LogRow.from_mapping(dict(r)) for r in page]
            return rows[::-1] if before is not None else rows

    def state_events(
        self,
        after: int,
        limit: int,
        pools: Sequence[str] | None = None,
        budget: int | None = None,
    ) -> list[tuple[LogRow, str]]:
        with self._lock:
            found = [
                (LogRow.from_mapping(dict(r)), self.jobs[r["job_id"]]["pool"])
                for r in self.log_rows
                if r["stream"] == "state"
                and r["seq"] > after
                and r["job_id"] in self.jobs
                and (pools is None or self.jobs[r["job_id"]]["pool"] in pools)
            ]
            page = found[:limit]
            if budget is not None:
                page = list(within(page, budget, lambda r: line_bytes(r[0].line)))
            return page

    def last_seq(self, job_id: str | None = None) -> int:
        with self._lock:
            seqs = [r["seq"] for r in self.log_rows if job_id is None or r["job_id"] == job_id]
            return max(seqs, default=0)
