"""Persistence: the queue's operations (:class:`Store`) in memory, or over SQLite (the
default) or PostgreSQL, chosen by URL."""

from gpufleet.store._pages import within
from gpufleet.store._sql import SqlStore, normalize_url
from gpufleet.store.api import (
    Appended,
    Applied,
    Batch,
    ClaimView,
    Hold,
    Hosts,
    Offers,
    QueueGauges,
    StaleClaim,
    Store,
    Written,
)
from gpufleet.store.rows import (
    AttemptRow,
    AuditRow,
    BuiltEnv,
    EnvLockRow,
    HostRow,
    JobRow,
    LogRow,
    TokenRow,
    WorkerRow,
    line_bytes,
)

__all__ = [
    "Appended",
    "Applied",
    "AttemptRow",
    "AuditRow",
    "Batch",
    "BuiltEnv",
    "ClaimView",
    "EnvLockRow",
    "Hold",
    "HostRow",
    "Hosts",
    "JobRow",
    "LogRow",
    "Offers",
    "QueueGauges",
    "SqlStore",
    "StaleClaim",
    "Store",
    "TokenRow",
    "WorkerRow",
    "Written",
    "line_bytes",
    "normalize_url",
    "within",
]
