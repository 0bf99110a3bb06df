"""The in-memory store's checkpoints: the snapshots of jobs' checkpoint folders. A mixin
of :class:`~gpufleet.store.memory.store.MemoryStore`."""

from __future__ import annotations

from typing import Any

from gpufleet.domain.models import ACTIVE, TERMINAL
from gpufleet.store.memory.tables import MemoryTables
from gpufleet.store.rows_read import CheckpointRow

_ACTIVE = frozenset(s.value for s in ACTIVE)
_TERMINAL = frozenset(s.value for s in TERMINAL)


class MemoryCheckpoints(MemoryTables):
    """Snapshots in a list, oldest first."""

    def add_checkpoint(
        self, job_id: str, lease: int, values: dict[str, Any], keep: int
    ) -> int | None:
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or job["lease"] != lease or job["status"] not in _ACTIVE:
                return None
            self.checkpoint_seq += 1
            row = {"progress": "{}", **values, "id": self.checkpoint_seq}
            self.checkpoint_rows.append({**row, "job_id": job_id, "attempt": lease})
            mine = [r["id"] for r in self.checkpoint_rows if r["job_id"] == job_id]
            gone = set(mine[: max(0, len(mine) - max(1, keep))])
            self.checkpoint_rows = [r for r in self.checkpoint_rows if r["id"] not in gone]
            return self.checkpoint_seq

    def checkpoints(self, job_id: str, limit: int = 100) -> list[CheckpointRow]:
        with self._lock:
            mine = [r for r in self.checkpoint_rows if r["job_id"] == job_id]
            return [CheckpointRow.from_mapping(dict(r)) for r in reversed(mine)][:limit]

    def checkpoint_totals(self) -> tuple[int, int]:
        with self._lock:
            return len(self.checkpoint_rows), sum(r["bytes"] for r in self.checkpoint_rows)

    def prune_checkpoints(self, before: float, batch: int) -> int:
        with self._lock:
            ended = {
                i
                for i, j in self.jobs.items()
                if j["status"] in _TERMINAL and (j["finished_at"] or 0) < before
            }
            doomed = [r["id"] for r in self.checkpoint_rows if r["job_id"] in ended][:batch]
            gone = set(doomed)
            self.checkpoint_rows = [r for r in self.checkpoint_rows if r["id"] not in gone]
            return len(doomed)
