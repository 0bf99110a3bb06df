"""The fleet store's contract, on the memory store, SQLite and PostgreSQL: workers
registered once however many registrations race, heartbeats written late or across a
status change, and the hosts a manifest names.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from gpufleet.domain.models import WorkerStatus
from gpufleet.scheduling.matching import FreeResources
from gpufleet.server.services import Services
from gpufleet.store import Batch, Hosts, Store
from gpufleet.wire import GpuModel, HeartbeatRequest
from tests.queue_steps import GIB, LEASE, T0, FakeClock, Together, register, spec

# ---- workers -------------------------------------------------------------------------


def test_two_first_registrations_of_one_name_at_once_are_one_worker(
    store: Store, queue: Services
) -> None:
    """A worker restarted while its first registration is still in flight registers
    twice at once: both get the one worker. Read-then-insert failed the second on the
    name's key (a 500) on PostgreSQL."""

    def first_registration(name: str, start: threading.Barrier, ids: list[str]) -> None:
        start.wait()
        ids.append(register(queue, name).id)

    for round_ in range(10):
        ids: list[str] = []
        start = threading.Barrier(2, timeout=5)
        both = Together()
        for _ in range(2):
            both.start(first_registration, f"box-{round_}", start, ids)
        both.join(10)
        assert len(ids) == 2 and ids[0] == ids[1]
    assert len(store.list_workers()) == 10


def test_a_worker_whose_heartbeats_wait_in_memory_is_never_swept_offline(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    """A heartbeat that changes nothing but liveness waits in memory and is written with
    the fleet's others (a transaction a second, not one each). The sweep writes what
    waits before it judges who went silent: a worker that beat within the lease stays
    available, and its GPUs' last readings land with it. A heartbeat that changes the
    worker's status is written at once."""
    w = register(queue, "w1", gpus=[("A100", 40)])
    queue.leases.heartbeat(w.id, HeartbeatRequest())  # connecting -> available: at once
    assert queue.fleet.worker(w.id).status is WorkerStatus.AVAILABLE
    clock.advance(LEASE - 1)
    reading = GpuModel(index=0, name="A100", total_mib=40 * GIB, free_mib=1234)
    queue.leases.heartbeat(w.id, HeartbeatRequest(gpus=[reading]))
    queue.leases.heartbeat(w.id, HeartbeatRequest())  # no reading: the last one stays
    clock.advance(2)  # over a lease after the beat written at once
    assert queue.upkeep.sweep() == ([], [])
    row = queue.fleet.worker(w.id)
    assert row.status is WorkerStatus.AVAILABLE
    assert row.last_heartbeat == T0 + LEASE - 1
    assert [g.free_mib for g in row.gpu_stats] == [1234]
    store.record_beats([(w.id, T0, None)])  # a beat written late never goes back in time
    assert queue.fleet.worker(w.id).last_heartbeat == T0 + LEASE - 1
    # draining by its own word changes its status: shown at once
    queue.leases.heartbeat(w.id, HeartbeatRequest(draining=True))
    assert queue.fleet.worker(w.id).status is WorkerStatus.DRAINING
    clock.advance(LEASE + 1)  # and silent for a lease after that: offline
    assert queue.upkeep.sweep() == ([], [w.id])


def test_a_heartbeat_that_crosses_a_status_change_still_counts(
    store: Store, queue: Services, clock: FakeClock
) -> None:
    """A heartbeat read the worker offline; before it wrote, a poll (on another replica)
    made it available. The status change then applies to no row, and the beat is kept
    as a plain one: the sweep does not take the worker for silent."""
    w = register(queue, "w1")
    queue.leases.heartbeat(w.id, HeartbeatRequest())  # available
    clock.advance(LEASE + 1)
    assert queue.upkeep.sweep() == ([], [w.id])  # silent: offline
    read = queue.fleet.worker(w.id)  # the heartbeat's read: offline
    queue.dispatch.poll(w.id, FreeResources(cpu_slots=1), 0)  # meanwhile: available
    clock.advance(LEASE - 1)
    queue.fleet.beat(read, False, None)  # offline -> available: matches no row now
    clock.advance(2)  # over a lease after the poll, within one of the heartbeat
    assert queue.upkeep.sweep() == ([], [])
    row = queue.fleet.worker(w.id)
    assert (row.status, row.last_heartbeat) == (WorkerStatus.AVAILABLE, T0 + 2 * LEASE)


# ---- hosts ---------------------------------------------------------------------------


def test_a_manifests_hosts_replace_only_its_own_entries_and_the_hosts_it_names(
    store: Store,
) -> None:
    store.submit(Batch([], hosts=Hosts("a", {"box-1": "{}", "box-2": "{}"})), T0)
    store.submit(Batch([], hosts=Hosts("b", {"box-3": "{}"})), T0)
    # b names box-2 (a's until now); box-3 is b's, but b's operator may change box-1 only
    store.submit(Batch([], hosts=Hosts("b", {"box-2": "{}"}, within=["box-1"])), T0 + 1)
    owners = {h.name: h.manifest for h in store.hosts()}
    assert owners == {"box-1": "a", "box-2": "b", "box-3": "b"}
    store.submit(Batch([], hosts=Hosts("a", {})), T0 + 2)
    assert {h.name: h.manifest for h in store.hosts()} == {"box-2": "b", "box-3": "b"}


def test_two_applies_naming_one_host_at_once_both_succeed(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first apply holds its transaction open, its host written, while the second
    starts; the second waits for it and then writes over it. Written as delete and
    insert, the second failed on the host's key (a 500) on PostgreSQL."""
    real = store._insert_new
    written, second_started = threading.Event(), threading.Event()

    def slow_first(*args: Any) -> list[str]:
        if not written.is_set():
            written.set()
            second_started.wait(5)
            time.sleep(0.3)  # long enough for the second to reach the host's row
        return real(*args)

    monkeypatch.setattr(store, "_insert_new", slow_first)

    def apply(manifest: str, job_id: str) -> None:
        batch = Batch([(job_id, spec(job_id), None)], hosts=Hosts(manifest, {"box": "{}"}))
        store.submit(batch, T0)

    both = Together()
    both.start(apply, "a", "j-a")
    assert written.wait(5)
    both.start(apply, "b", "j-b")
    second_started.set()
    both.join(10)
    assert [(h.name, h.manifest) for h in store.hosts()] == [("box", "b")]
    assert store.get_job("j-a") is not None and store.get_job("j-b") is not None
