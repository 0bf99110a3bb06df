"""Persistence: queue operations over SQLite (default) or PostgreSQL, chosen by URL."""

from gpufleet.store._sql import Hold, SqlStore, normalize_url
from gpufleet.store.rows import AttemptRow, AuditRow, JobRow, LogRow, TokenRow, WorkerRow

__all__ = [
    "AttemptRow",
    "AuditRow",
    "Hold",
    "JobRow",
    "LogRow",
    "SqlStore",
    "TokenRow",
    "WorkerRow",
    "normalize_url",
]
