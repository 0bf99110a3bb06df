"""Persistence: the queue's operations (:class:`Store`) in memory, or over SQLite (the
default) or PostgreSQL, chosen by URL."""

from gpufleet.store.api import (
    AccessStore,
    Appended,
    Applied,
    Batch,
    CheckpointStore,
    ClaimStore,
    ClaimView,
    DataStore,
    EnvironmentStore,
    EventStore,
    FleetStore,
    HeldRow,
    Hosts,
    InTransaction,
    JobStore,
    Offers,
    Preempt,
    PreemptionStore,
    QueueGauges,
    RunningUse,
    StaleClaim,
    Store,
    Submitted,
    Transaction,
    UsageSlice,
    UsageStore,
    WebhookStore,
)
from gpufleet.store.pages import within
from gpufleet.store.postgres import PostgresStore
from gpufleet.store.rows_read import (
    AttemptRow,
    AuditRow,
    BuiltEnv,
    CheckpointRow,
    DeliveryRow,
    EnvLockRow,
    HostRow,
    JobRow,
    LogRow,
    TokenRow,
    WebhookRow,
    WorkerRow,
    line_bytes,
)
from gpufleet.store.sql.store import SqlStore, normalize_url
from gpufleet.store.sqlite import SqliteStore


def open_store(url: str) -> SqlStore:
    """The SQL store for ``url``: PostgreSQL for ``postgresql://`` (and ``postgres://``),
    else SQLite (a ``sqlite://`` URL, or a bare path: a file)."""
    url = normalize_url(url)
    if url.startswith("postgresql"):
        return PostgresStore(url)
    return SqliteStore(url)


__all__ = [
    "AccessStore",
    "Appended",
    "Applied",
    "AttemptRow",
    "AuditRow",
    "Batch",
    "BuiltEnv",
    "CheckpointRow",
    "CheckpointStore",
    "ClaimStore",
    "ClaimView",
    "DataStore",
    "DeliveryRow",
    "EnvLockRow",
    "EnvironmentStore",
    "EventStore",
    "FleetStore",
    "HeldRow",
    "HostRow",
    "Hosts",
    "InTransaction",
    "JobRow",
    "JobStore",
    "LogRow",
    "Offers",
    "PostgresStore",
    "Preempt",
    "PreemptionStore",
    "QueueGauges",
    "RunningUse",
    "SqlStore",
    "SqliteStore",
    "StaleClaim",
    "Store",
    "Submitted",
    "TokenRow",
    "Transaction",
    "UsageSlice",
    "UsageStore",
    "WebhookRow",
    "WebhookStore",
    "WorkerRow",
    "line_bytes",
    "normalize_url",
    "open_store",
    "within",
]
