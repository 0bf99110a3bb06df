"""The in-memory store's tables: rows are dicts of column values, as the SQL tables hold
them (a missing column takes the default ``store/schema.py`` declares), read back through
the same row models the SQL store uses. Each area of the store (:mod:`.fleet`,
:mod:`.access`, :mod:`.data`, :mod:`.events`) is a mixin over these.
"""

from __future__ import annotations

import threading
from typing import Any

from gpufleet.domain.models import WorkerStatus
from gpufleet.domain.worker_lifecycle import WorkerEvent, sources, status_after
from gpufleet.store.rows_read import (
    EnvLockRow,
)

_OFFLINE = WorkerStatus.OFFLINE.value
_SILENT_TO = status_after(WorkerEvent.SILENT).value
_REMOVABLE = frozenset(s.value for s in sources(WorkerEvent.REMOVE))


def defaults(table: Any) -> dict[str, Any]:
    """A row of ``table`` with every column at its declared default (None if it has none)."""
    out = {}
    for column in table.columns:
        arg = column.default.arg if column.default is not None else None
        out[column.name] = None if callable(arg) else arg
    return out


class MemoryTables:
    """The dicts every area of the in-memory store reads and writes, under one lock."""

    def _init_tables(self) -> None:
        self._lock = threading.RLock()
        self.jobs: dict[str, dict[str, Any]] = {}
        self.attempt_rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.log_rows: list[dict[str, Any]] = []
        self.log_seq = 0  # the last log line number given (numbers never repeat, as in SQL)
        self.deps: dict[str, list[str]] = {}  # job id -> the jobs it needs
        self.workers: dict[str, dict[str, Any]] = {}
        self.host_entries: dict[str, dict[str, Any]] = {}
        self.tokens: dict[str, dict[str, Any]] = {}
        self.keys: dict[str, str] = {}  # the fleet's secrets, by name
        self.sessions: dict[str, dict[str, Any]] = {}
        self.audit_rows: list[dict[str, Any]] = []
        self.audit_seq = 0  # the last audit number given (numbers never repeat, as in SQL)
        self.blobs: dict[str, dict[str, Any]] = {}
        self.blob_pools: set[tuple[str, str]] = set()
        self.uploads: dict[str, dict[str, Any]] = {}
        self.artifacts: dict[tuple[str, int], dict[str, Any]] = {}
        self.checkpoint_rows: list[dict[str, Any]] = []
        self.checkpoint_seq = 0  # the last snapshot id given (never twice, as in SQL)
        self.env_locks: dict[tuple[str, str], EnvLockRow] = {}
