"""The store suite runs every test against the memory store, SQLite and a real PostgreSQL
server: each test takes the ``store`` fixture, and the queue (``Services``) over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.store import Store, open_store
from gpufleet.store.memory import MemoryStore
from tests.queue_steps import blobs, clock, queue

__all__ = ["blobs", "clock", "queue", "store"]


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A store of each kind: in memory, and migrated on a fresh database (PostgreSQL: a
    fresh schema; skips without one)."""
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/s.db"
    else:
        url = request.getfixturevalue("pg_url")
    s = open_store(url)
    try:
        s.migrate()
        yield s
    finally:
        s.close()
