"""Bounded storage on the server: finished jobs' output and old audit records go.

A finished job's output lines and its checkpoints' snapshots are deleted
``log_retention`` after it ended (the job, its attempts, its artifact and its stderr tail
stay); audit records go ``audit_retention``
after they were written. Run every ten minutes by each server, in batches of
``BATCH`` rows per transaction (a long delete would hold SQLite's one writer). Each
delete is conditional, so servers sharing a database may run it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from gpufleet.server.settings import QueueSettings
from gpufleet.store import CheckpointStore, EventStore

BATCH = 5000
MOST_BATCHES = 200  # per run: a backlog of a million rows goes over a few runs


class RetentionStore(EventStore, CheckpointStore, Protocol):
    """What retention deletes from."""


class Retention:
    def __init__(
        self, store: RetentionStore, settings: QueueSettings, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock

    def run(self) -> int:
        """Delete what is past its retention; how many rows."""
        now, s = self.clock(), self.settings
        logs = None if s.log_retention is None else now - s.log_retention
        audit = None if s.audit_retention is None else now - s.audit_retention
        if logs is None and audit is None:
            return 0
        total = 0
        for _ in range(MOST_BATCHES if logs is not None else 0):
            done = self.store.prune_checkpoints(logs, BATCH) if logs is not None else 0
            total += done
            if done < BATCH:
                break
        for _ in range(MOST_BATCHES):
            done = self.store.prune(logs, audit, BATCH)
            total += done
            if done < BATCH:
                break
        return total
