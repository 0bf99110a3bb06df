"""Service tests: each server module's rules (``tests/service/test_<module>.py``), through
``Services`` over the memory store, on a fake clock. The stores themselves are held to
the same contract by ``tests/contract``, so these need no database and run fast."""

from __future__ import annotations

import pytest

from gpufleet.store.memory import MemoryStore
from tests.queue_steps import blobs, clock, queue

__all__ = ["blobs", "clock", "queue", "store"]


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()
