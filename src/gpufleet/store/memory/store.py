"""The in-memory store: the queue's operations over dicts, for fast policy tests.

It keeps what the SQL store keeps, as dicts of column values (a missing column takes the
default ``store/schema.py`` declares), and reads them back through the same row models.
It decides nothing either: every status change is a :class:`~gpufleet.domain.lifecycle.
Change` applied only if the job is still where the change expects, and a job ending and
what follows from it happen under one lock, as one SQL transaction would. The contract
suite (``tests/contract``) runs the same tests over this store, SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

from gpufleet.domain import lifecycle
from gpufleet.domain.lifecycle import Change, Event
from gpufleet.domain.models import ACTIVE, TERMINAL, JobSpec, JobStatus
from gpufleet.store import schema as t
from gpufleet.store.alone import OneServer
from gpufleet.store.api import (
    Applied,
    Batch,
    QueueGauges,
    Store,
    Submitted,
)
from gpufleet.store.changes import FAILS_DEPENDENTS, NamedChanges, encode
from gpufleet.store.json_columns import spec_json
from gpufleet.store.memory.access import MemoryAccess
from gpufleet.store.memory.checkpoints import MemoryCheckpoints
from gpufleet.store.memory.claims import MemoryClaimSession, claim_order
from gpufleet.store.memory.data import MemoryData
from gpufleet.store.memory.events import MemoryEvents
from gpufleet.store.memory.fleet import MemoryFleet
from gpufleet.store.memory.preemption import MemoryPreemption
from gpufleet.store.memory.tables import defaults
from gpufleet.store.memory.usage import MemoryUsage
from gpufleet.store.memory.webhooks import MemoryWebhooks
from gpufleet.store.rows_read import AttemptRow, JobRow, WorkerRow
from gpufleet.store.rows_written import (
    job_values,
    pause_event,
    state_rows,
    stop_event,
    submit_events,
)
from gpufleet.store.space import SpaceWatch
from gpufleet.store.unit import UnitOfWork

_ACTIVE = {s.value for s in ACTIVE}
_TERMINAL = {s.value for s in TERMINAL}
_PENDING = lifecycle.INITIAL.value
_FAILED = {s.value for s in FAILS_DEPENDENTS}


class MemoryStore(
    OneServer,
    MemoryFleet,
    MemoryAccess,
    MemoryData,
    MemoryCheckpoints,
    MemoryPreemption,
    MemoryEvents,
    MemoryUsage,
    MemoryWebhooks,
    NamedChanges,
):
    """Every operation of the store, held in memory by one process."""

    dialect: ClassVar[str] = "memory"

    def __init__(self) -> None:
        self._init_tables()
        self._init_usage()
        self._init_webhooks()
        self.space = SpaceWatch()  # never full: it has no disk

    # ---- plumbing ---------------------------------------------------------------------

    def migrate(self) -> None:
        return None

    def close(self) -> None:
        return None

    def ping(self) -> str:
        return self.dialect

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """All or nothing, as one SQL transaction: on an exception the jobs, their
        attempts and dependencies, the workers, hosts and grants, and the event log are as
        they were (its numbers are not given again, as in SQL)."""
        with self._lock:
            jobs = {k: dict(v) for k, v in self.jobs.items()}
            attempts = {k: dict(v) for k, v in self.attempt_rows.items()}
            deps = dict(self.deps)
            workers = {k: dict(v) for k, v in self.workers.items()}
            hosts, grants = dict(self.host_entries), set(self.blob_pools)
            logged = len(self.log_rows)  # the event log only grows inside one
            try:
                yield
            except BaseException:
                self.jobs, self.attempt_rows, self.deps = jobs, attempts, deps
                self.workers, self.host_entries, self.blob_pools = workers, hosts, grants
                del self.log_rows[logged:]
                raise

    def _row(self, job: Mapping[str, Any]) -> JobRow:
        return JobRow.from_mapping(dict(job))

    def _claimable(self, j: Mapping[str, Any], pool: str, now: float) -> bool:
        return (
            j["status"] == _PENDING
            and j["pool"] == pool
            and j["waiting"] == 0
            and (j["not_before"] is None or j["not_before"] <= now)
        )

    # ---- submitting -------------------------------------------------------------------

    def submit(self, batch: Batch, now: float) -> Submitted:
        with self._transaction():
            self.blob_pools.update(batch.grants)
            if batch.hosts is not None:
                self._write_hosts(batch.hosts, now)
            created = self._insert_new(batch, now)
            fresh = set(created)
            updated = (
                self._update_pending([j for j in batch.jobs if j[0] not in fresh])
                if batch.update
                else []
            )
            return Submitted(created, updated)

    def _insert_new(self, batch: Batch, now: float) -> list[str]:
        created = []
        for job_id, spec, unrunnable in batch.jobs:
            if job_id in self.jobs:
                continue
            values = job_values(job_id, spec, now, unrunnable, batch.submitted_by, batch.by)
            self.jobs[job_id] = {**defaults(t.jobs), **values}
            created.append(job_id)
        self._log(submit_events(created, batch.by, now))
        mine = {i: list(dict.fromkeys(d)) for i, d in batch.deps.items() if i in created and d}
        self.deps.update(mine)
        self._recount(list(mine))
        for job_id in mine:
            self._fail_if_a_dep_failed(job_id, now)
        return created

    def _update_pending(self, jobs: Sequence[tuple[str, JobSpec, str | None]]) -> list[str]:
        changed = []
        for job_id, spec, why in jobs:
            row = self.jobs.get(job_id)
            text = spec_json(spec)
            if row is None or row["status"] != _PENDING or row["spec"] == text:
                continue
            row.update(
                spec=text,
                priority=spec.priority,
                max_attempts=spec.max_attempts,
                pool=spec.pool,
                unrunnable=why,
                target=spec.requirements.worker,
            )
            changed.append(job_id)
        return changed

    # ---- reading ----------------------------------------------------------------------

    def _select(
        self, keep: Callable[[dict[str, Any]], bool], key: Callable[[Any], Any] = claim_order
    ) -> list[JobRow]:
        with self._lock:
            return [self._row(j) for j in sorted(filter(keep, self.jobs.values()), key=key)]

    def get_job(self, job_id: str) -> JobRow | None:
        with self._lock:
            row = self.jobs.get(job_id)
            return self._row(row) if row else None

    def find_jobs_by_name(
        self, name: str, limit: int = 2, pools: Sequence[str] | None = None
    ) -> list[JobRow]:
        found = self._select(
            lambda j: j["name"] == name and (pools is None or j["pool"] in pools),
            key=lambda j: -j["created_at"],
        )
        return found[:limit]

    def list_jobs(
        self,
        statuses: Iterable[str] = (),
        limit: int = 1000,
        pools: Sequence[str] | None = None,
        name: str | None = None,
        before: tuple[float, str] | None = None,
    ) -> list[JobRow]:
        wanted = set(statuses)
        found = self._select(
            lambda j: (
                (not wanted or j["status"] in wanted)
                and (pools is None or j["pool"] in pools)
                and _named(j, name)
                and (before is None or (j["created_at"], j["id"]) < before)
            ),
            key=lambda j: (j["created_at"], j["id"]),
        )
        return found[-limit:] if limit else []

    def job_counts(
        self, pools: Sequence[str] | None = None, name: str | None = None
    ) -> dict[str, int]:
        counts: dict[str, int] = {}
        with self._lock:
            for j in self.jobs.values():
                if (pools is None or j["pool"] in pools) and _named(j, name):
                    counts[j["status"]] = counts.get(j["status"], 0) + 1
        return counts

    def queue_ahead(self, job: JobRow, limit: int) -> list[JobRow]:
        mine = (-job.priority, job.created_at, job.id)
        found = self._select(
            lambda j: (
                j["status"] == _PENDING
                and j["pool"] == job.pool
                and (-j["priority"], j["created_at"], j["id"]) < mine
            ),
            key=lambda j: (-j["priority"], j["created_at"], j["id"]),
        )
        return found[:limit]

    def queue_gauges(self) -> QueueGauges:
        with self._lock:
            jobs: dict[tuple[str, str], int] = {}
            oldest: dict[str, float] = {}
            for j in self.jobs.values():
                key = (j["status"], j["pool"])
                jobs[key] = jobs.get(key, 0) + 1
                if j["status"] == _PENDING:
                    oldest[j["pool"]] = min(oldest.get(j["pool"], j["created_at"]), j["created_at"])
            kept = {r["sha256"] for r in self.artifacts.values()}
            sizes = {sha: int(b["size"]) for sha, b in self.blobs.items()}
        return QueueGauges(
            jobs=jobs,
            oldest_pending=oldest,
            artifact_bytes=sum(n for sha, n in sizes.items() if sha in kept),
            package_bytes=sum(n for sha, n in sizes.items() if sha not in kept),
        )

    def manifest_jobs(
        self, manifest: str, pools: Sequence[str] | None = None
    ) -> list[tuple[str, str]]:
        found = self._select(
            lambda j: j["manifest"] == manifest and (pools is None or j["pool"] in pools),
            key=lambda j: (j["created_at"], j["id"]),
        )
        return [(j.id, j.status.value) for j in found]

    def pools_of(self, job_ids: Sequence[str]) -> dict[str, str]:
        with self._lock:
            return {i: str(self.jobs[i]["pool"]) for i in job_ids if i in self.jobs}

    def _holding(self, worker_id: str, name: str) -> list[JobRow]:
        return self._select(
            lambda j: (
                (j["worker_id"] == worker_id and j["status"] in _ACTIVE)
                or (j["target"] in (worker_id, name) and j["status"] == _PENDING)
            )
        )

    def holding(self, worker: Any) -> list[JobRow]:
        return self._holding(worker.id, worker.name)

    def aimed_jobs(self) -> list[JobRow]:
        return self._select(lambda j: j["target"] is not None and j["status"] == _PENDING)

    def active_jobs(self, worker_id: str | None = None) -> list[JobRow]:
        return self._select(
            lambda j: j["status"] in _ACTIVE and (worker_id is None or j["worker_id"] == worker_id)
        )

    def lost_leases(self, now: float) -> list[JobRow]:
        return self._select(
            lambda j: (
                j["status"] in _ACTIVE
                and j["lease_expires_at"] is not None
                and j["lease_expires_at"] < now
            )
        )

    def attempts(self, job_id: str) -> list[AttemptRow]:
        with self._lock:
            rows = [a for (j, _), a in self.attempt_rows.items() if j == job_id]
            return [
                AttemptRow.from_mapping(dict(a)) for a in sorted(rows, key=lambda a: a["attempt"])
            ]

    def late_result(self, job_id: str, attempt: int, text: str) -> None:
        with self._lock:
            row = self.attempt_rows.get((job_id, attempt))
            if row is not None and row.get("late_result") is None:
                row["late_result"] = text

    def dependencies(self, job_id: str) -> list[JobRow]:
        with self._lock:
            needed = set(self.deps.get(job_id, ()))
        return self._select(lambda j: j["id"] in needed)

    def stops(self, leases: Iterable[tuple[str, int]]) -> dict[str, float]:
        with self._lock:
            out = {}
            for job_id, _ in leases:
                j = self.jobs.get(job_id)
                if j is not None and j["stop_requested_at"] is not None:
                    out[job_id] = float(j["stop_grace"] or 0.0)
            return out

    def request_pause(self, job_id: str, now: float, by: str | None = None) -> bool:
        with self._lock:
            j = self.jobs.get(job_id)
            if j is None or j["status"] not in _ACTIVE or j["pause_requested_at"] is not None:
                return False
            j["pause_requested_at"] = now
            self._log([pause_event(job_id, j["lease"], by, now)])
            return True

    def pausing(self, leases: Iterable[tuple[str, int]]) -> set[str]:
        with self._lock:
            return {
                job_id
                for job_id, _ in leases
                if (j := self.jobs.get(job_id)) is not None and j["pause_requested_at"] is not None
            }

    # ---- claims and leases ------------------------------------------------------------

    @contextmanager
    def claiming(self) -> Iterator[MemoryClaimSession]:
        yield MemoryClaimSession(self)

    @contextmanager
    def transaction(self, job_ids: Sequence[str] = ()) -> Iterator[UnitOfWork]:
        """The store's lock, held until the ``with`` block ends, and everything restored
        if the block raises; each savepoint restores what it wrote likewise. Its store
        is this one: every call inside runs in the lock this thread holds."""
        unit = UnitOfWork(self, self._transaction)
        with self._transaction():
            yield unit
        unit.committed()

    def hold_worker(self, worker: WorkerRow) -> list[JobRow]:
        with self._lock:
            if worker.id in self.workers:  # a claim ranked before this call ranks again
                self.workers[worker.id]["claims"] += 1
            return self._holding(worker.id, worker.name)

    def extend_leases(
        self,
        leases: Iterable[tuple[str, int]],
        expires: float,
        worker_id: str,
        gpu_mib: Mapping[tuple[str, int], int] | None = None,
    ) -> set[tuple[str, int]]:
        held = set()
        used = gpu_mib or {}
        with self._lock:
            for job_id, lease in leases:
                j = self.jobs.get(job_id)
                if (
                    j is not None
                    and j["lease"] == lease
                    and j["status"] in _ACTIVE
                    and j["worker_id"] == worker_id
                ):
                    j["lease_expires_at"] = expires
                    if (job_id, lease) in used:
                        j["gpu_mib"] = used[(job_id, lease)]
                    held.add((job_id, lease))
        return held

    def request_stop(self, job_id: str, now: float, grace: float, by: str | None = None) -> bool:
        with self._lock:
            j = self.jobs.get(job_id)
            if j is None or j["status"] not in _ACTIVE or j["stop_requested_at"] is not None:
                return False
            j.update(stop_requested_at=now, stop_grace=grace)
            self._log([stop_event(job_id, j["status"], j["lease"], by, grace, now)])
            return True

    # ---- status changes ---------------------------------------------------------------

    def _commit(self, change: Change) -> Applied | None:
        with self._transaction():
            if not self.apply_change(change):
                return None
            job = self._row(self.jobs[change.job_id])
            if job.status == JobStatus.SUCCEEDED:
                return Applied(job, released=self._recount(self._dependents(job.id)))
            if job.status.value in _FAILED:
                return Applied(job, failed=self._fail_dependents(job, job.finished_at or 0.0))
            if change.event == Event.REQUEUE:
                self._recount([job.id])
            return Applied(job)

    def apply_change(self, change: Change) -> bool:
        """Apply ``change`` if the job is still where it expects (under the lock)."""
        j = self.jobs.get(change.job_id)
        if (
            j is None
            or j["lease"] != change.lease
            or JobStatus(j["status"]) not in change.sources
            or any(j[k] != v for k, v in change.guard.items())
            or (
                change.lost_before is not None
                and not (
                    j["lease_expires_at"] is not None and j["lease_expires_at"] < change.lost_before
                )
            )
        ):
            return False
        j.update(encode(change.fields), status=change.status.value)
        key = (change.job_id, change.attempt)
        if change.opens is not None:
            attempt = {**defaults(t.attempts), "job_id": change.job_id, "attempt": change.attempt}
            self.attempt_rows[key] = {**attempt, **encode(change.opens)}
        elif change.record and self.attempt_rows.get(key, {}).get("finished_at", 0) is None:
            self._charge(change, self.attempt_rows[key])
            self.attempt_rows[key].update(encode(change.record))
        self._log(state_rows([change]))
        return True

    # ---- dependencies -----------------------------------------------------------------

    def _dependents(self, dep_id: str) -> list[str]:
        return [i for i, needed in self.deps.items() if dep_id in needed]

    def _recount(self, job_ids: Sequence[str] | None) -> int:
        changed = 0
        for job_id, j in self.jobs.items():
            if j["status"] != _PENDING:
                continue
            if job_ids is None and not j["waiting"]:
                continue
            if job_ids is not None and job_id not in job_ids:
                continue
            unmet = sum(
                1
                for d in self.deps.get(job_id, ())
                if d in self.jobs and self.jobs[d]["status"] != JobStatus.SUCCEEDED.value
            )
            if j["waiting"] != unmet:
                j["waiting"] = unmet
                changed += 1
        return changed

    def refresh_waiting(self, job_ids: Sequence[str] | None = None) -> int:
        with self._lock:
            return self._recount(job_ids)

    def fold_job_counts(self) -> int:
        return 0  # counted from the jobs when asked

    def _fail_dependents(self, job: JobRow, now: float) -> list[str]:
        below: dict[str, list[JobRow]] = {}
        for waiting_id in sorted(self.deps):
            if self.jobs[waiting_id]["status"] != _PENDING:
                continue
            waiting = self._row(self.jobs[waiting_id])
            for dep_id in self.deps[waiting_id]:
                below.setdefault(dep_id, []).append(waiting)
        changes = lifecycle.dependents_failed(job, below, now)
        return [c.job_id for c in changes if self.apply_change(c)]

    def _fail_if_a_dep_failed(self, job_id: str, now: float) -> None:
        job = self.jobs[job_id]
        failed = sorted(
            d for d in self.deps.get(job_id, ()) if self.jobs.get(d, {}).get("status") in _FAILED
        )
        if failed and job["status"] == _PENDING:
            change = lifecycle.dependency_failed(
                self._row(job), self._row(self.jobs[failed[0]]), now
            )
            if self.apply_change(change):
                self._fail_dependents(self._row(job), now)


def _keeps_the_contract(store: MemoryStore) -> Store:
    """Never called: mypy checks here that the memory store is a :class:`Store`."""
    return store


def _named(job: dict[str, Any], name: str | None) -> bool:
    """Whether a job's name holds ``name`` (any case); every job when there is none."""
    return not name or name.lower() in str(job["name"]).lower()
