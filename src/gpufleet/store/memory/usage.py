"""The in-memory store's usage for fair share, as :mod:`gpufleet.store.sql.usage`."""

from __future__ import annotations

import json
from typing import Any

from gpufleet.domain import fairshare
from gpufleet.domain.lifecycle import Change
from gpufleet.domain.models import ACTIVE
from gpufleet.store.api import RunningUse, UsageSlice
from gpufleet.store.memory.tables import MemoryTables

_ACTIVE = frozenset(s.value for s in ACTIVE)


class MemoryUsage(MemoryTables):
    usage_width: float = fairshare.bucket_width(fairshare.HALF_LIFE)

    def _init_usage(self) -> None:
        self.usage_rows: dict[tuple[str, str, str, float], dict[str, Any]] = {}

    def _charge(self, change: Change, attempt: dict[str, Any] | None) -> None:
        """Charge the attempt ``change`` closes (``attempt``: its record, still open)."""
        if not change.record or "finished_at" not in change.record or attempt is None:
            return
        if attempt.get("finished_at") is not None or attempt.get("started_at") is None:
            return
        job = self.jobs[change.job_id]
        held = json.loads(attempt["gpus"])
        end = float(change.record["finished_at"])  # type: ignore[arg-type]
        width = self.usage_width
        for at, seconds in fairshare.pieces(
            attempt["started_at"], end, fairshare.amount(held), width
        ):
            key = (job["owner"], job["pool"], fairshare.kind(held), at)
            row = self.usage_rows.setdefault(key, {"width": width, "seconds": 0.0})
            row["seconds"] += seconds

    def usage_slices(self, since: float, pool: str | None = None) -> list[UsageSlice]:
        with self._lock:
            return [
                UsageSlice(o, p, k, s, r["width"], r["seconds"])
                for (o, p, k, s), r in self.usage_rows.items()
                if s + r["width"] > since and (pool is None or p == pool)
            ]

    def running_use(self, pool: str | None = None) -> list[RunningUse]:
        with self._lock:
            return [
                RunningUse(
                    j["id"],
                    j["owner"],
                    j["pool"],
                    tuple(json.loads(j["gpus"])),
                    j["started_at"],
                    j["claimed_at"],
                    j["status"],
                )
                for j in self.jobs.values()
                if j["status"] in _ACTIVE and (pool is None or j["pool"] == pool)
            ]

    def prune_usage(self, before: float) -> int:
        with self._lock:
            gone = [k for k, r in self.usage_rows.items() if k[3] + r["width"] < before]
            for k in gone:
                del self.usage_rows[k]
            return len(gone)
