"""``server/events.py``: a follower of a job's event log misses none of its records."""

from __future__ import annotations

from gpufleet.server.services import Services
from gpufleet.store import Store
from tests.queue_steps import claim, register, spec


def test_a_follower_of_an_ended_job_gets_every_record_its_feed_had_not_read(
    store: Store, queue: Services
) -> None:
    """A follower that reconnects after the job ended, while this server's feed of the
    job (kept for a moment after its last follower left) has not yet read the job's last
    records, is sent them before the ``end``: none is lost to the feed's lag."""
    import asyncio

    from gpufleet.server.events import Hub

    w = register(queue, "w1")
    submitted = queue.submission.submit(spec())
    lease = claim(queue, w)
    queue.leases.start(lease.job_id, lease.attempt)
    queue.leases.append_logs(lease.job_id, lease.attempt, [("stdout", "line 1")])

    async def scenario() -> tuple[bytes, bytes]:
        hub, open_ = Hub(store), asyncio.Event()  # the follower's token stays valid
        try:
            first = hub.follow(submitted.id, "running", 0, open_)
            seen = await anext(first)  # what the feed has: up to "line 1"
            await first.aclose()  # the follower breaks off; its feed lingers
            last = store.logs(submitted.id, 0, 100)[-1].seq
            queue.leases.append_logs(lease.job_id, lease.attempt, [("stdout", "line 2")])
            queue.leases.finish(lease.job_id, lease.attempt, 0, None)
            rest = b"".join(
                [chunk async for chunk in hub.follow(submitted.id, "succeeded", last, open_)]
            )
            return seen, rest
        finally:
            hub.bind(None)

    seen, rest = asyncio.run(scenario())
    assert b"line 1" in seen and b"line 2" not in seen
    assert b"line 2" in rest and rest.index(b"line 2") < rest.index(b"event: end")
