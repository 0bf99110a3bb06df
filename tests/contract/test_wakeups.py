"""Server replicas on one PostgreSQL database wake each other's long polls."""

from __future__ import annotations

import threading

from gpufleet.store import SqlStore


def test_a_change_on_one_replica_wakes_listeners_on_another(pg_url: str) -> None:
    listener_side, publisher_side = SqlStore(pg_url), SqlStore(pg_url)
    woken, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=listener_side.listen_claimable, args=(woken.set, stop))
    thread.start()
    try:
        # LISTEN starts asynchronously: publish until heard, a bounded number of times.
        for _ in range(50):
            publisher_side.publish_claimable()
            if woken.wait(0.2):
                break
        assert woken.is_set(), "no NOTIFY reached the other replica"
    finally:
        stop.set()
        thread.join(5)
        listener_side.close()
        publisher_side.close()
    assert not thread.is_alive()
