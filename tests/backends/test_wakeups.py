"""Server replicas on one PostgreSQL database wake each other's long polls."""

from __future__ import annotations

import threading
import time

from gpufleet.domain.models import Role
from gpufleet.errors import Unauthorized
from gpufleet.server.auth import Auth
from gpufleet.store import open_store


def test_a_change_on_one_replica_wakes_listeners_on_another(pg_url: str) -> None:
    listener_side, publisher_side = open_store(pg_url), open_store(pg_url)
    woken, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=listener_side.listen, args=(woken.set, stop))
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


def test_a_token_revoked_on_one_replica_fails_at_once_on_another(pg_url: str) -> None:
    """Replica A has the token in its lookup cache (made long here, so only the NOTIFY
    can explain a prompt refusal); replica B revokes it; A refuses it within a second."""
    replica_a, replica_b = open_store(pg_url), open_store(pg_url)
    replica_b.migrate()
    auth_a = Auth(replica_a, cache_seconds=3600)
    auth_b = Auth(replica_b)
    row, secret = auth_b.create("laptop", Role.OPERATOR)
    stop = threading.Event()
    thread = threading.Thread(target=replica_a.listen, args=(lambda: None, stop, auth_a.forget))
    thread.start()
    try:
        assert auth_a.check(f"Bearer {secret}").id == row.id  # cached on A now
        time.sleep(0.5)  # LISTEN starts asynchronously
        auth_b.revoke(row.id)
        deadline = time.monotonic() + 1.0
        refused = False
        while not refused and time.monotonic() < deadline:
            try:
                auth_a.check(f"Bearer {secret}")
                time.sleep(0.02)
            except Unauthorized:
                refused = True
        assert refused, "replica A still accepts a token revoked on replica B"
    finally:
        stop.set()
        thread.join(5)
        replica_a.close()
        replica_b.close()
