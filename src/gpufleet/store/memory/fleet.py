"""The in-memory store's fleet: workers, host policies, and which workers have a job
environment built (with the fleet-wide locks of environments). A mixin of
:class:`~gpufleet.store.memory.store.MemoryStore`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gpufleet.domain.models import ACTIVE, WorkerStatus
from gpufleet.domain.worker_lifecycle import WorkerChange, WorkerEvent, sources, status_after
from gpufleet.store import schema as t
from gpufleet.store.api import Hosts
from gpufleet.store.memory.tables import MemoryTables, defaults
from gpufleet.store.rows_read import (
    EnvLockRow,
    HostRow,
    WorkerRow,
)

_OFFLINE = WorkerStatus.OFFLINE.value
_SILENT_TO = status_after(WorkerEvent.SILENT).value
_REMOVABLE = frozenset(s.value for s in sources(WorkerEvent.REMOVE))


class MemoryFleet(MemoryTables):
    """Workers, hosts and environments, in dicts."""

    # ---- workers ----------------------------------------------------------------------

    def upsert_worker(self, worker_id: str, values: dict[str, Any]) -> tuple[str, bool]:
        with self._lock:
            for row in self.workers.values():
                if row["name"] == values["name"]:
                    came_back = row["status"] == _OFFLINE
                    row.update(values)
                    return str(row["id"]), came_back
            self.workers[worker_id] = {**defaults(t.workers), **values, "id": worker_id}
            return worker_id, True

    def get_worker(self, worker_id: str) -> WorkerRow | None:
        with self._lock:
            row = self.workers.get(worker_id) or next(
                (w for w in self.workers.values() if w["name"] == worker_id), None
            )
            return WorkerRow.from_mapping(dict(row)) if row else None

    def list_workers(self, pools: Sequence[str] | None = None) -> list[WorkerRow]:
        with self._lock:
            rows = sorted(self.workers.values(), key=lambda w: w["name"])
            return [
                WorkerRow.from_mapping(dict(w)) for w in rows if pools is None or w["pool"] in pools
            ]

    def change_worker(self, change: WorkerChange) -> bool:
        froms = {s.value for s in change.sources}
        with self._lock:
            row = self.workers.get(change.worker_id)
            if row is None or row["status"] not in froms:
                return False
            row.update(change.values())
            return True

    def _set_worker(self, worker_id: str, **values: Any) -> bool:
        with self._lock:
            row = self.workers.get(worker_id)
            if row is None:
                return False
            row.update(values)
            return True

    def drain_worker(self, worker_id: str, by: float | None = None) -> bool:
        return self._set_worker(worker_id, drain=True, drain_by=by)

    def set_worker_environments(self, worker_id: str, environments: str) -> bool:
        return self._set_worker(worker_id, environments=environments)

    def set_worker_owner_state(self, worker_id: str, state: str | None) -> bool:
        return self._set_worker(worker_id, owner_state=state)

    def set_worker_capability(self, worker_id: str, capability: str) -> bool:
        return self._set_worker(worker_id, capability=capability)

    def record_beats(self, beats: Sequence[tuple[str, float, str | None]]) -> None:
        with self._lock:
            for worker_id, at, stats in beats:
                row = self.workers.get(worker_id)
                if row is None or (row["last_heartbeat"] or 0.0) >= at:
                    continue
                row["last_heartbeat"] = at
                if stats is not None:
                    row["gpu_stats"] = stats

    def bind_worker(self, worker_id: str, token_id: str) -> bool:
        with self._lock:
            row = self.workers.get(worker_id)
            if row is None or row["token_id"] is not None:
                return False
            row["token_id"] = token_id
            return True

    def mark_offline(self, before: float) -> list[str]:
        froms = {s.value for s in sources(WorkerEvent.SILENT)}
        with self._lock:
            gone = []
            for row in self.workers.values():
                beat = row["last_heartbeat"]
                if row["status"] in froms and beat is not None and beat < before:
                    row.update(status=_SILENT_TO, offline_since=beat)
                    gone.append(str(row["id"]))
            return gone

    def delete_worker(self, worker_id: str) -> bool:
        with self._lock:
            row = self.workers.get(worker_id)
            if row is None or row["status"] not in _REMOVABLE:
                return False
            del self.workers[worker_id]
            return True

    def delete_gone_ephemeral(self, before: float) -> list[str]:
        with self._lock:
            gone = [
                i
                for i, w in self.workers.items()
                if w["status"] in _REMOVABLE
                and w["ephemeral"]
                and w["offline_since"] is not None
                and w["offline_since"] < before
            ]
            for worker_id in gone:
                del self.workers[worker_id]
            return gone

    def active_count(self, worker_id: str) -> int:
        """How many claimed or running jobs the worker holds."""
        active = {s.value for s in ACTIVE}
        return sum(
            1 for j in self.jobs.values() if j["worker_id"] == worker_id and j["status"] in active
        )

    # ---- hosts ------------------------------------------------------------------------

    def _write_hosts(self, hosts: Hosts, now: float) -> None:
        for name in [n for n, h in self.host_entries.items() if hosts.replaces(HostRow(**h))]:
            del self.host_entries[name]
        for name, policy in hosts.policies.items():
            self.host_entries[name] = {
                "name": name,
                "manifest": hosts.manifest,
                "policy": policy,
                "updated_at": now,
            }

    def hosts(self) -> list[HostRow]:
        with self._lock:
            return [HostRow(**h) for h in self.host_entries.values()]

    # ---- environments -----------------------------------------------------------------

    def get_env_lock(self, pool: str, key: str) -> EnvLockRow | None:
        with self._lock:
            return self.env_locks.get((pool, key))

    def put_env_lock(self, row: EnvLockRow, replace: bool) -> tuple[EnvLockRow, bool]:
        with self._lock:
            found = self.env_locks.get((row.pool, row.key))
            if found is None:
                self.env_locks[row.pool, row.key] = row
                return row, True
            if replace:
                found = dataclasses.replace(
                    row, created_at=found.created_at, replaced_at=row.created_at
                )
                self.env_locks[row.pool, row.key] = found
            return found, False

    def workers_with_env(self, spec_key: str, pools: Sequence[str] | None = None) -> list[str]:
        return [
            w.id
            for w in self.list_workers(pools)
            if any(e.spec_key == spec_key for e in w.environments)
        ]
