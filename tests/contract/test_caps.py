"""Caps in the store's claim: the recheck inside the claim's write counts what a capped
user holds *then*, serialized per holder, so two claims ranked at the same instant on
two server replicas (each saw room for one more GPU) cannot both take it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpufleet.domain import lifecycle
from gpufleet.domain.caps import Ask, Recheck
from gpufleet.domain.models import Requirements
from gpufleet.domain.sharing import Share, Sharing
from gpufleet.scheduling.matching import FreeGpu, FreeResources
from gpufleet.server.blobs import BlobService
from gpufleet.server.services import Services
from gpufleet.server.sharing import SharingRules
from gpufleet.store import JobRow, StaleClaim, Store, WorkerRow, open_store
from tests.queue_steps import GIB, LEASE, SETTINGS, T0, FakeClock, Together, job, register, spec

RULES = Sharing(users={"alice": Share(max_gpus=2)})
GPU1 = Requirements(gpu_count=1)


@contextmanager
def _replica(store: Store, request: pytest.FixtureRequest) -> Iterator[Store]:
    """A second server's store on the same database (PostgreSQL); else the same store."""
    if store.dialect != "postgresql":
        yield store
        return
    other = open_store(request.getfixturevalue("pg_url"))  # the store fixture's database
    try:
        yield other
    finally:
        other.close()


def _queue(store: Store, clock: FakeClock, blobs: BlobService) -> Services:
    rules = SharingRules(fixed=RULES)
    return Services(store, SETTINGS, blobs, clock=lambda: clock.now, sharing=rules)


def _claim_with_recheck(store: Store, w: WorkerRow, row: JobRow, hold: float) -> str | None:
    """One claim of ``row`` for ``w`` with the cap's recheck, its transaction held open
    ``hold`` seconds after the write (a slow claimer on another replica)."""
    with store.claiming() as session:
        view = session.view(w.id, w.name, w.pool, T0, session.page_size)
        change = lifecycle.claim(row, w.id, w.name, (0,), T0, T0 + LEASE, row.spec_json)
        check = Recheck(RULES, {row.id: Ask(row.id, row.owner, row.pool, 1)})
        taken = session.claim(w.id, view.claims, [change], check)
        time.sleep(hold)
        return taken


def test_two_claims_at_once_cannot_both_take_a_capped_users_last_gpu(
    store: Store, queue: Services, request: pytest.FixtureRequest
) -> None:
    """alice (capped at 2) holds 1 GPU; two workers each claim one of her jobs at once, on
    two replicas. The first claim's transaction stays open a moment after its write: the
    second waits for it (on PostgreSQL, the holder's advisory lock), then counts 2 and
    takes nothing."""
    w1, w2, w3 = (register(queue, f"w{i}", gpus=[("A100", 80)]) for i in range(3))
    ids = [
        queue.submission.submit(spec(f"a{i}", requirements=GPU1), by="alice").id for i in range(3)
    ]
    first = queue.dispatch.try_claim(w3.id, FreeResources(1, (FreeGpu(0, 80 * GIB),)))
    assert first is not None
    x, y = (job(store, i) for i in ids if i != first.job_id)
    got: dict[str, str | None] = {}
    with _replica(store, request) as other:
        both = Together()
        both.start(lambda: got.__setitem__("w1", _claim_with_recheck(store, w1, x, 0.5)))
        time.sleep(0.1)
        both.start(lambda: got.__setitem__("w2", _claim_with_recheck(other, w2, y, 0.0)))
        both.join()
    # One of the two took its job (the first, unless the second thread was quicker to
    # start): never both.
    taken = [j for j in (got["w1"], got["w2"]) if j is not None]
    assert len(taken) == 1 and taken[0] in (x.id, y.id)
    assert sum(len(r.gpus) for r in store.running_use() if r.owner == "alice") == 2
    # Without the recheck the store would take the other: the cap is all in the way.
    (left,) = {x.id, y.id} - set(taken)
    loser, row = (w2 if got["w1"] else w1), job(store, left)
    with store.claiming() as session:
        view = session.view(loser.id, loser.name, loser.pool, T0, session.page_size)
        change = lifecycle.claim(row, loser.id, loser.name, (0,), T0, T0 + LEASE, row.spec_json)
        assert session.claim(loser.id, view.claims, [change]) == left


def test_a_capped_user_never_holds_more_than_its_cap_under_many_claimers(
    store: Store, clock: FakeClock, blobs: BlobService, request: pytest.FixtureRequest
) -> None:
    """Eight workers of two GPUs claim side by side, half through a second replica, for
    three rounds (alice's jobs ending between them): alice never holds more than 2 GPUs,
    and bob's jobs take the rest."""
    q1 = _queue(store, clock, blobs)
    with _replica(store, request) as other:
        q2 = q1 if other is store else _queue(other, clock, blobs)
        workers = [register(q1, f"w{i}", gpus=[("A100", 80)] * 2) for i in range(8)]
        for i in range(8):
            q1.submission.submit(spec(f"a{i}", requirements=GPU1), by="alice")
        for i in range(12):
            q1.submission.submit(spec(f"b{i}", requirements=GPU1), by="bob")
        free = FreeResources(1, tuple(FreeGpu(i, 80 * GIB) for i in range(2)))
        for _ in range(3):
            crowd = Together()
            for n, w in enumerate(workers):
                q = q1 if n % 2 else q2
                crowd.start(lambda q=q, w=w: [q.dispatch.try_claim(w.id, free) for _ in range(2)])
            crowd.join(60)
            mine = [r for r in store.running_use() if r.owner == "alice"]
            assert sum(len(r.gpus) for r in mine) == 2
            for r in mine:
                attempt = job(store, r.job_id).lease
                q1.leases.start(r.job_id, attempt)
                q1.leases.finish(r.job_id, attempt, 0, None)
        assert sum(len(r.gpus) for r in store.running_use() if r.owner == "bob") == 12


def test_a_later_claim_of_a_session_never_waits_for_a_caps_lock(
    store: Store, queue: Services, request: pytest.FixtureRequest
) -> None:
    """PostgreSQL: a claim session whose first write found nothing (it may hold rows now)
    does not wait for a capped holder's lock another claim holds: it gives up at once
    (StaleClaim: rank again), so claims never wait on each other in a circle."""
    if store.dialect != "postgresql":
        pytest.skip("advisory locks are PostgreSQL's")
    w1, w2, w3 = (register(queue, f"w{i}", gpus=[("A100", 80)]) for i in range(3))
    ids = [
        queue.submission.submit(spec(f"a{i}", requirements=GPU1), by="alice").id for i in range(3)
    ]
    gone = queue.dispatch.try_claim(w3.id, FreeResources(1, (FreeGpu(0, 80 * GIB),)))
    assert gone is not None
    x, y = (job(store, i) for i in ids if i != gone.job_id)
    holding = Together()
    holding.start(_claim_with_recheck, store, w1, x, 1.0)
    time.sleep(0.2)
    with _replica(store, request) as other, other.claiming() as session:
        view = session.view(w2.id, w2.name, w2.pool, T0, session.page_size)
        stale = job(store, gone.job_id)  # claimed already: the first write takes nothing
        change = lifecycle.claim(stale, w2.id, w2.name, (0,), T0, T0 + LEASE, stale.spec_json)
        assert session.claim(w2.id, view.claims, [change]) is None
        change = lifecycle.claim(y, w2.id, w2.name, (0,), T0, T0 + LEASE, y.spec_json)
        check = Recheck(RULES, {y.id: Ask(y.id, "alice", y.pool, 1)})
        began = time.monotonic()
        with pytest.raises(StaleClaim):
            session.claim(w2.id, view.claims, [change], check)
        assert time.monotonic() - began < 0.5
    holding.join()
