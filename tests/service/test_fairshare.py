"""Fair share, by simulation on the fake clock: users with weights 2:1:1 keep four GPUs
busy for a simulated day with jobs of mixed lengths, through the real claim path
(``Services`` over the memory store and over a SQLite file). Each user's GPU-seconds
follow its weight within 10 %, a user who starts late gets its share within one
half-life, and with fair share off the same day goes first come, first served.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpufleet.domain.models import Requirements
from gpufleet.domain.sharing import Share, Sharing
from gpufleet.scheduling.matching import FreeGpu, FreeResources
from gpufleet.server.services import Services
from gpufleet.server.sharing import SharingRules
from gpufleet.store import Store, open_store
from gpufleet.store.memory import MemoryStore
from tests.queue_steps import SETTINGS, T0, FakeClock, blob_service, register, spec

HOUR = 3600.0
HALF_LIFE = 2 * HOUR
STEP = 60.0  # the simulation's tick: jobs end and GPUs are claimed once a minute
LENGTHS = (5 * 60.0, 15 * 60.0, 30 * 60.0, 60 * 60.0)
GPU = Requirements(require_cuda=True, gpu_count=1)
FREE = FreeResources(cpu_slots=0, gpus=(FreeGpu(0, 24 * 1024), FreeGpu(1, 24 * 1024)))


@dataclass
class Day:
    """A simulated day: who ran how long, by hour."""

    used: dict[str, list[float]] = field(default_factory=dict)  # owner -> GPU-seconds by hour

    def total(self, owner: str, since: float = 0.0, until: float = 24 * HOUR) -> float:
        hours = self.used.get(owner, [])
        return sum(v for h, v in enumerate(hours) if since <= h * HOUR < until)


def _store(kind: str, tmp_path: Path) -> Store:
    if kind == "memory":
        return MemoryStore()
    store = open_store(f"sqlite:///{tmp_path / 'fair.db'}")
    store.migrate()
    return store


def simulate(
    store: Store,
    tmp_path: Path,
    weights: Mapping[str, float],
    starts: Mapping[str, float],
    fair: bool = True,
    seed: int = 7,
) -> Day:
    """Run a day: each user keeps eight jobs waiting from its start on; two workers of two
    GPUs each claim whenever a GPU is free; a job runs its length, then succeeds."""
    clock = FakeClock(T0)
    rules = Sharing(
        fair_share=fair,
        half_life=HALF_LIFE,
        users={u: Share(weight=w) for u, w in weights.items()},
    )
    q = Services(
        store,
        SETTINGS,
        blob_service(store, tmp_path),
        clock=lambda: clock.now,
        sharing=SharingRules(fixed=rules),
    )
    workers = [register(q, f"w{i}", gpus=[("A10", 24), ("A10", 24)], cpu_slots=0) for i in (1, 2)]
    rng = random.Random(seed)
    waiting = dict.fromkeys(weights, 0)
    running: dict[str, tuple[str, float, float]] = {}  # job -> owner, started, ends
    day = Day({u: [0.0] * 24 for u in weights})
    t = 0.0
    while t < 24 * HOUR:
        for job_id, (_owner, _started, ends) in list(running.items()):
            if ends <= t:
                lease = store.get_job(job_id)
                assert lease is not None
                q.leases.finish(job_id, lease.lease, 0, None)
                del running[job_id]
        for owner in weights:
            while t >= starts[owner] and waiting[owner] < 8:
                q.submission.submit(spec(f"{owner}-job", requirements=GPU), by=owner)
                waiting[owner] += 1
        for w in workers:
            while (lease := q.dispatch.try_claim(w.id, FREE)) is not None:
                q.leases.start(lease.job_id, lease.attempt)
                owner = lease.spec.name.removesuffix("-job")
                waiting[owner] -= 1
                running[lease.job_id] = (owner, t, t + rng.choice(LENGTHS))
        step = min(STEP, 24 * HOUR - t)
        for owner, _started, _ends in running.values():
            day.used[owner][int(t // HOUR)] += step
        t += step
        clock.advance(step)
    return day


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_three_users_weighted_2_1_1_get_their_shares_of_a_day(kind: str, tmp_path: Path) -> None:
    weights = {"alice": 2.0, "bob": 1.0, "carol": 1.0}
    day = simulate(_store(kind, tmp_path), tmp_path, weights, dict.fromkeys(weights, 0.0))
    whole = 4 * 24 * HOUR
    assert sum(day.total(u) for u in weights) == pytest.approx(whole, rel=0.01)  # never idle
    for user, weight in weights.items():
        share = whole * weight / sum(weights.values())
        assert day.total(user) == pytest.approx(share, rel=0.10), (user, day.total(user), share)


def test_a_user_who_starts_late_gets_its_share_within_one_half_life(tmp_path: Path) -> None:
    weights = {"alice": 2.0, "bob": 1.0, "carol": 1.0}
    late = 6 * HOUR
    day = simulate(
        _store("sqlite", tmp_path), tmp_path, weights, {"alice": 0, "bob": 0, "carol": late}
    )
    share = 0.25  # carol's weight, of four
    first = day.total("carol", late, late + HALF_LIFE)
    assert first >= 0.9 * share * 4 * HALF_LIFE, first  # caught up within one half-life
    rest = day.total("carol", late + HALF_LIFE)
    span = 24 * HOUR - late - HALF_LIFE
    assert rest == pytest.approx(share * 4 * span, rel=0.10)


def test_with_fair_share_off_the_first_to_queue_runs_first(tmp_path: Path) -> None:
    """The same day without the rules: jobs go in order of age, and what a user gets
    follows how fast it queues, not its weight (the comparison the figures need)."""
    weights = {"alice": 2.0, "bob": 1.0, "carol": 1.0}
    day = simulate(
        _store("sqlite", tmp_path), tmp_path, weights, dict.fromkeys(weights, 0.0), fair=False
    )
    whole = 4 * 24 * HOUR
    alice = day.total("alice") / whole
    assert abs(alice - 0.5) > 0.10, alice  # no longer half: each keeps 8 queued, FIFO
