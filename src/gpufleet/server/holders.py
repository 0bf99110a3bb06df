"""Who may write an attempt's results: the worker holding its lease, enrolled with the
caller's token, and carrying the secret the attempt's claim gave it
(:mod:`gpufleet.server.lease_secrets`). A job's code that got hold of its worker's token
cannot write another job's output, artifact or finish.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Protocol

from gpufleet.errors import Forbidden
from gpufleet.server.fleet import Fleet
from gpufleet.server.lease_secrets import LeaseSecrets
from gpufleet.server.leases import Leases, printable
from gpufleet.store import FleetStore, JobRow, JobStore, Transaction


class HolderStore(JobStore, FleetStore, Protocol):
    """What the check reads: the job and its attempts, and the worker holding it."""


class Holders:
    """The check every lease-carrying write passes first; one per server process."""

    def __init__(
        self,
        store: HolderStore,
        fleet: Fleet,
        leases: Leases,
        secrets: LeaseSecrets,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.leases = leases
        self.secrets = secrets
        self.clock = clock

    def within(self, tx: Transaction) -> Holders:
        """These checks read through ``tx``, and the lease protocol's writes made through
        it (:meth:`Leases.within`)."""
        bound = copy.copy(self)
        bound.store, bound.leases = tx.store, self.leases.within(tx)
        return bound

    def check(
        self,
        job_id: str,
        attempt: int,
        token_id: str,
        pools: Sequence[str] | None,
        secret: str | None,
    ) -> JobRow:
        """The job, if (job_id, attempt) is its current lease, the worker holding it was
        enrolled with ``token_id``, and ``secret`` is the one its claim gave: 404 for a job
        of a pool the caller cannot see, 409 for a stale lease, 403 for a lease another
        token's worker holds or a wrong secret."""
        job = self.leases.held(job_id, attempt, pools)
        holder = self.fleet.claimer(job.worker_id, self.store) if job.worker_id else None
        if holder is None or holder.token_id != token_id:
            raise Forbidden(
                f"job {job_id} attempt {attempt} is held by worker "
                f"{holder.name if holder else '?'}, not by a worker of this token",
                detail={"job": job_id, "attempt": attempt},
            )
        if job.claimed_at is None or not self.secrets.holds(
            secret, job_id, attempt, job.claimed_at
        ):
            raise Forbidden(
                f"job {job_id} attempt {attempt}: this write does not carry the secret the "
                "attempt's claim gave its worker (field 'secret'); a worker's token alone "
                "cannot write an attempt's results",
                detail={"job": job_id, "attempt": attempt, "field": "secret"},
            )
        return job

    def refused_result(
        self,
        job_id: str,
        attempt: int,
        token_id: str,
        exit_code: int | None,
        error: str | None,
        secret: str | None = None,
    ) -> None:
        """A result for an attempt that had ended (its lease lost, the job cancelled) is
        refused with 409; keep what it said in that attempt's history, if a worker of
        ``token_id`` ran the attempt."""
        ran = next((a for a in self.store.attempts(job_id) if a.attempt == attempt), None)
        holder = self.fleet.claimer(ran.worker_id, self.store) if ran and ran.worker_id else None
        if holder is None or holder.token_id != token_id:
            return
        if ran is None or not self.secrets.holds(secret, job_id, attempt, ran.claimed_at):
            return  # only the attempt's own worker may leave a word in its history
        said = f"exit code {exit_code}" if exit_code is not None else "no exit code"
        if error:
            said += f" ({printable(error)[:500]})"
        when = datetime.fromtimestamp(self.clock(), UTC).isoformat(timespec="seconds")
        self.store.late_result(job_id, attempt, f"{said}, sent at {when}; refused")
