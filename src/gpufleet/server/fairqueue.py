"""The queue in fair-share order: a claim's candidates when the operator turned fair share
on.

Each user with jobs pending in the pool is a stream of its own claimable jobs, in claim
order (priority, then age), read a page at a time from ``ix_jobs_owner_queue``. The streams
are merged by (priority, the owner's standing, age): priority first, and among jobs of one
priority the user furthest below its share first. A sweep of 200 jobs by one user is then
one stream among several, not the head of the queue every claim reads.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

from gpufleet.domain import fairshare
from gpufleet.store import JobRow
from gpufleet.store.api import ClaimSession


def _kind(job: JobRow) -> str:
    r = job.spec.requirements
    return fairshare.GPU if r.needs_gpu or r.prefer_cuda else fairshare.CPU


def fair_order(
    session: ClaimSession,
    pool: str,
    now: float,
    standings: Mapping[str, fairshare.Standing],
    page: int,
) -> Iterator[JobRow]:
    """The pool's claimable jobs in fair-share order, read lazily."""

    def rank(job: JobRow) -> tuple[int, float, float, str]:
        s = standings.get(job.owner)
        standing = 0.0 if s is None else s.of(_kind(job))
        return (-job.priority, standing, job.created_at, job.id)

    pending: dict[str, list[JobRow]] = {}
    heap: list[tuple[tuple[int, float, float, str], str, int]] = []

    def refill(owner: str, after: JobRow | None) -> None:
        rows = session.owner_page(pool, owner, now, after, page)
        pending[owner] = rows
        if rows:
            heapq.heappush(heap, (rank(rows[0]), owner, 0))

    for owner in session.owners(pool):
        refill(owner, None)
    while heap:
        _, owner, at = heapq.heappop(heap)
        rows = pending[owner]
        job = rows[at]
        yield job
        if at + 1 < len(rows):
            heapq.heappush(heap, (rank(rows[at + 1]), owner, at + 1))
        elif len(rows) == page:
            refill(owner, job)
