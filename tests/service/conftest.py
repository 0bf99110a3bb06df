"""Service tests: each server module's rules (``tests/service/test_<module>.py``), through
``Services`` over the memory store, on a fake clock. The stores themselves are held to
the same contract by ``tests/contract``, so these need no database and run fast."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.server.blobs import BlobService
from gpufleet.server.services import Services
from gpufleet.store.memory import MemoryStore
from tests.queue_steps import FakeClock, blob_service, service


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def blobs(store: MemoryStore, tmp_path: Path) -> BlobService:
    return blob_service(store, tmp_path)


@pytest.fixture
def queue(store: MemoryStore, clock: FakeClock, blobs: BlobService) -> Services:
    return service(store, clock, blobs)
