"""The in-memory store's preemption, as :mod:`gpufleet.store.sql.preemption`."""

from __future__ import annotations

from collections.abc import Iterable

from gpufleet.domain.models import ACTIVE, JobStatus
from gpufleet.store.api import Preempt
from gpufleet.store.memory.events import MemoryEvents
from gpufleet.store.rows_read import JobRow
from gpufleet.store.rows_written import preempt_events

_ACTIVE = frozenset(s.value for s in ACTIVE)
_PENDING, _RUNNING = JobStatus.PENDING.value, JobStatus.RUNNING.value
_ASKED = ("preempt_requested_at", "pause_requested_at", "stop_requested_at")


class MemoryPreemption(MemoryEvents):
    def preemptors(self, pool: str, min_priority: int, since: float, limit: int) -> list[JobRow]:
        with self._lock:
            found = [
                j
                for j in self.jobs.values()
                if j["status"] == _PENDING
                and j["pool"] == pool
                and j["waiting"] == 0
                and j["priority"] >= min_priority
                and (j["not_before"] if j["not_before"] is not None else j["created_at"]) <= since
            ]
            found.sort(key=lambda j: (-j["priority"], j["created_at"], j["id"]))
            return [JobRow.from_mapping(dict(j)) for j in found[:limit]]

    def request_preempt(self, ask: Preempt, now: float) -> bool:
        with self._lock:
            victim, waiting = self.jobs.get(ask.victim), self.jobs.get(ask.by)
            if victim is None or waiting is None or waiting["status"] != _PENDING:
                return False
            if victim["status"] != _RUNNING or victim["lease"] != ask.lease:
                return False
            if any(victim[k] is not None for k in _ASKED) or self._making_way(ask.by):
                return False
            victim.update(preempt_requested_at=now, preempted_at=now, preempted_by=ask.by)
            if ask.worker is not None:  # its slot, freed, goes to the waiting job first
                waiting.update(made_way_on=ask.worker, made_way_until=ask.until)
            self._log(
                preempt_events(
                    ask.victim, ask.lease, ask.by, waiting["lease"], ask.why, ask.said, now
                )
            )
            return True

    def _making_way(self, by: str) -> bool:
        return any(
            j["preempted_by"] == by
            and j["preempt_requested_at"] is not None
            and j["status"] in _ACTIVE
            for j in self.jobs.values()
        )

    def preempted_for(self, job_id: str, limit: int) -> list[JobRow]:
        with self._lock:
            found = [j for j in self.jobs.values() if j["preempted_by"] == job_id]
            found.sort(key=lambda j: (-(j["preempted_at"] or 0.0), j["id"]))
            return [JobRow.from_mapping(dict(j)) for j in found[:limit]]

    def preempting(self, leases: Iterable[tuple[str, int]]) -> set[str]:
        with self._lock:
            return {
                job_id
                for job_id, _ in leases
                if (j := self.jobs.get(job_id)) is not None
                and j["preempt_requested_at"] is not None
            }
