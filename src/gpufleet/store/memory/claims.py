"""The in-memory store's claims, as :class:`gpufleet.store.sql.claims.ClaimSession`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpufleet.domain import lifecycle
from gpufleet.domain.caps import POOLS, USERS, Recheck, tally
from gpufleet.domain.lifecycle import Change, Event
from gpufleet.domain.models import ACTIVE
from gpufleet.store.api import ClaimView, HeldRow, StaleClaim
from gpufleet.store.rows_read import JobRow

_ACTIVE = {s.value for s in ACTIVE}
_PENDING = lifecycle.INITIAL.value


def claim_order(job: Mapping[str, Any]) -> tuple[int, float, str]:
    """Claim order: priority, then age, then id."""
    return (-job["priority"], job["created_at"], job["id"])


class MemoryClaimSession:
    """A claim's reads and write, as :class:`gpufleet.store.sql.claims.ClaimSession`."""

    page_size, choices = 4, 1

    def __init__(self, store: Any) -> None:  # the MemoryStore (it imports this module)
        self.store = store

    def view(self, worker_id: str, name: str, pool: str, now: float, page: int) -> ClaimView:
        s = self.store
        with s._lock:
            held = [
                tuple(json.loads(j["gpus"]))
                for j in s.jobs.values()
                if j["worker_id"] == worker_id and j["status"] in _ACTIVE
            ]
            aimed = sorted(
                (
                    j
                    for j in s.jobs.values()
                    if j["target"] in (worker_id, name) and s._claimable(j, pool, now)
                ),
                key=claim_order,
            )[:8]
            claims = int(s.workers[worker_id]["claims"]) if worker_id in s.workers else 0
            rows = [s._row(j) for j in aimed]
        queue = self.page(pool, now, None, page) if page else []
        return ClaimView(held, claims, rows, queue)

    def page(self, pool: str, now: float, after: JobRow | None, limit: int) -> list[JobRow]:
        s = self.store
        key = None
        if after is not None:
            key = claim_order(
                {"priority": after.priority, "created_at": after.created_at, "id": after.id}
            )
        with s._lock:
            found = sorted(
                (
                    j
                    for j in s.jobs.values()
                    if s._claimable(j, pool, now) and (key is None or claim_order(j) > key)
                ),
                key=claim_order,
            )
            return [s._row(j) for j in found[:limit]]

    def made_way(self, worker_id: str, now: float) -> list[JobRow]:
        with self.store._lock:
            return [
                self.store._row(j)
                for j in self.store.jobs.values()
                if j["made_way_on"] == worker_id
                and j["status"] == _PENDING
                and (j["made_way_until"] or 0) > now
            ]

    def owners(self, pool: str) -> list[str]:
        with self.store._lock:
            jobs = self.store.jobs.values()
            return sorted(
                {j["owner"] for j in jobs if j["status"] == _PENDING and j["pool"] == pool}
            )

    def owner_page(
        self, pool: str, owner: str, now: float, after: JobRow | None, limit: int
    ) -> list[JobRow]:
        return [j for j in self.page(pool, now, after, 1 << 30) if j.owner == owner][:limit]

    def held(self, owners: Sequence[str], pools: Sequence[str]) -> list[HeldRow]:
        counts: dict[tuple[str, str, int], int] = {}
        with self.store._lock:
            for j in self.store.jobs.values():
                if j["status"] in _ACTIVE and (j["owner"] in owners or j["pool"] in pools):
                    key = (j["owner"], j["pool"], len(json.loads(j["gpus"])))
                    counts[key] = counts.get(key, 0) + 1
        return [(o, p, g, n) for (o, p, g), n in counts.items()]

    def claim(
        self, worker_id: str, seen: int, changes: Sequence[Change], caps: Recheck | None = None
    ) -> str | None:
        if any(c.event != Event.CLAIM for c in changes):
            raise ValueError("claim takes claims only")
        s = self.store
        with s._transaction():
            worker = s.workers.get(worker_id)
            if worker is None or worker["claims"] != seen:
                raise StaleClaim(worker_id)
            if caps is not None:  # the store's lock is held: nothing comes between
                changes = self._capped(changes, caps)
            for change in changes:
                if s.apply_change(change):
                    worker["claims"] = seen + 1
                    return change.job_id
        return None

    def _capped(self, changes: Sequence[Change], caps: Recheck) -> list[Change]:
        found = caps.holders()
        users = [n for k, n in found if k == USERS]
        pools = [n for k, n in found if k == POOLS]
        keep = set(caps.allowed([c.job_id for c in changes], tally(self.held(users, pools))))
        return [c for c in changes if c.job_id in keep]
