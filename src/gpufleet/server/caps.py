"""Caps as the server applies them: what users and pools hold now, read for a claim and for
``why``; the claims a cap holds back, and the recheck inside the claim's write; a job's
run limited by its pool's ``max_run`` (:mod:`gpufleet.domain.caps`).

With no cap in the rules, a claim reads nothing more and offers the store no recheck.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from gpufleet.domain import caps
from gpufleet.domain.caps import Ask, Holdings, Recheck
from gpufleet.domain.lifecycle import Change
from gpufleet.domain.models import JobSpec
from gpufleet.domain.sharing import Sharing
from gpufleet.server.sharing import SharingRules
from gpufleet.store import JobRow, UsageStore
from gpufleet.store.api import ClaimSession


class Gate:
    """One claim's caps: the jobs they hold back while it ranks (on what was held when it
    first needed to know, read without locks), and the recheck its write makes."""

    def __init__(self, rules: Sharing, session: ClaimSession) -> None:
        self.rules = rules
        self.session = session
        self._held: Holdings | None = None

    def _holdings(self) -> Holdings:
        if self._held is None:
            users, pools = caps.capped_holders(self.rules)
            self._held = caps.tally(self.session.held(users, pools))
        return self._held

    def refuses(self, job: JobRow, gpus: Sequence[int]) -> bool:
        """Whether a cap holds ``job`` back from taking ``gpus`` (none: a CPU slot). A job
        no cap counts against reads nothing."""
        if not caps.holders(self.rules, job.owner, job.pool):
            return False
        ask = Ask(job.id, job.owner, job.pool, len(gpus))
        return caps.refusal(self.rules, ask, self._holdings()) is not None

    def recheck(self, choices: Sequence[Change], jobs: Mapping[str, JobRow]) -> Recheck | None:
        """What the claim's write checks again (None: no cap counts any of ``choices``)."""
        asks = {}
        for c in choices:
            job = jobs[c.job_id]
            if caps.holders(self.rules, job.owner, job.pool):
                gpus = len(c.fields["gpus"])  # type: ignore[arg-type]
                asks[c.job_id] = Ask(c.job_id, job.owner, job.pool, gpus)
        return Recheck(self.rules, asks) if asks else None


class Caps:
    """Caps for claims, ``why`` and leases; one per server process."""

    def __init__(self, store: UsageStore, rules: SharingRules) -> None:
        self.store = store
        self.rules = rules

    def gate(self, session: ClaimSession) -> Gate | None:
        """A claim's caps, or None when the rules cap nothing (the claim costs nothing
        more)."""
        rules = self.rules.current()
        return Gate(rules, session) if caps.any_caps(rules) else None

    def holding_back(self, job: JobRow, asks: Sequence[int]) -> list[str | None]:
        """For each of ``asks`` (GPUs; 0: a CPU slot), why a cap holds ``job`` back from
        taking it now, naming the cap and who holds it (None: no cap does). What is held
        is read once, and only if a cap counts the job."""
        rules = self.rules.current()
        if not caps.holders(rules, job.owner, job.pool):
            return [None] * len(asks)
        held = self.held_now()
        return [caps.refusal(rules, Ask(job.id, job.owner, job.pool, n), held) for n in asks]

    def held_now(self) -> Holdings:
        """What every user and pool holds now (its jobs claimed or running)."""
        return caps.tally((r.owner, r.pool, len(r.gpus), 1) for r in self.store.running_use())

    def limited(self, job: JobRow) -> tuple[JobSpec, str | None]:
        """The spec a new attempt of ``job`` runs: its timeout no longer than its pool's
        ``max_run``; and the pool, if that limit is its timeout now."""
        timeout, by_pool = caps.run_limit(self.rules.current(), job.pool, job.spec.timeout)
        if not by_pool:
            return job.spec, None
        return dataclasses.replace(job.spec, timeout=timeout), job.pool
