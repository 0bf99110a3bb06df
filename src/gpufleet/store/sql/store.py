"""The SQL store: queue operations over SQLAlchemy Core, the part SQLite and PostgreSQL
share. Each backend (:mod:`gpufleet.store.sqlite`, :mod:`gpufleet.store.postgres`)
subclasses :class:`SqlStore` with what it does its own way: its engine, its INSERT, row
locks, its own SQL where a query differs, and what it offers beyond the contract. Nothing
here asks which backend it is.

Every write for a running job is a conditional update on (job id, lease, status), so a
stale lease changes nothing and the caller answers 409.
"""

from __future__ import annotations

import copy
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    select,
)

from gpufleet.store.api import Offers
from gpufleet.store.space import SpaceWatch, watch_engine
from gpufleet.store.sql.access import AccessOps
from gpufleet.store.sql.changes import ChangeOps
from gpufleet.store.sql.checkpoints import CheckpointOps
from gpufleet.store.sql.claims import ClaimOps, ClaimSession, page_statements
from gpufleet.store.sql.data import DataOps
from gpufleet.store.sql.environments import EnvironmentOps
from gpufleet.store.sql.events import EventOps
from gpufleet.store.sql.fleet import FleetOps
from gpufleet.store.sql.jobs import JobOps
from gpufleet.store.sql.leases import LeaseOps
from gpufleet.store.sql.preemption import PreemptionOps
from gpufleet.store.sql.webhooks import WebhookOps
from gpufleet.store.unit import UnitOfWork

_MIGRATIONS = Path(__file__).parent.parent / "migrations"
POOL_SIZE = 40  # the server's worker threads (anyio's default limiter)


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg 3; a bare path means a SQLite file."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    return url


class SqlStore(
    DataOps,
    CheckpointOps,
    ChangeOps,
    ClaimOps,
    FleetOps,
    AccessOps,
    EnvironmentOps,
    JobOps,
    LeaseOps,
    PreemptionOps,
    EventOps,
    WebhookOps,
):
    """Queue operations; policy (what a state change *is*) lives above, in the service."""

    #: The backend's name, for the server's log; never asked by code outside it.
    dialect: ClassVar[str]
    #: SQLite's one writer: writes take it, so they queue here rather than spin on
    #: ``SQLITE_BUSY`` (None: the database orders its writers itself).
    _lock: AbstractContextManager[None] | None = None

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.engine: Engine = self._make_engine(self.url)
        self.space = SpaceWatch()
        watch_engine(self.engine, self.space)
        self.page_q = page_statements()
        self.owner_q = page_statements(by_owner=True)
        #: The transaction this store is bound to (:meth:`transaction` gives a copy bound
        #: to its own); None: each call opens its own.
        self._conn: Connection | None = None

    # ---- what each backend does its own way ------------------------------------------

    @abstractmethod
    def _make_engine(self, url: str) -> Engine:
        """The engine, its pool sized for the server's threads."""

    @abstractmethod
    def _begin_transaction(self, conn: Connection, job_ids: Sequence[str]) -> None:
        """Begin :meth:`transaction`'s transaction on ``conn``, holding what its calls
        will change (``job_ids``) as this backend must."""

    @abstractmethod
    def _insert(self, table: Any) -> Any:
        """The backend's INSERT (with ON CONFLICT) for ``table``."""

    @abstractmethod
    def _lock_rows(self, conn: Connection, q: Select[Any], read: bool = False) -> None:
        """Lock the rows ``q`` selects until the transaction ends (``read``: shared), where
        the backend has row locks; where one writer holds everything, nothing."""

    @abstractmethod
    def claiming(self) -> AbstractContextManager[ClaimSession]:
        """A claim session (:mod:`gpufleet.store.sql.claims`)."""

    @abstractmethod
    def fold_job_counts(self) -> int:
        """Fold count changes kept apart into ``job_counts``; how many were folded."""

    @property
    @abstractmethod
    def offers(self) -> Offers:
        """What this backend offers beyond the contract."""

    @abstractmethod
    def publish_claimable(self) -> None:
        """Tell other server replicas that a job may have become claimable."""

    @abstractmethod
    def publish_tokens_changed(self) -> None:
        """Tell other server replicas that a token was rotated or revoked."""

    @abstractmethod
    def publish_superseded(self, worker_id: str, replica: str) -> None:
        """Tell other replicas that ``worker_id`` sent a poll replacing its open one."""

    @abstractmethod
    def listen(
        self,
        on_notify: Callable[[], None],
        stop: threading.Event,
        on_tokens: Callable[[], None] | None = None,
        on_superseded: Callable[[str, str], None] | None = None,
    ) -> None:
        """Hear other servers' changes until ``stop`` is set (see :class:`Offers`)."""

    # ---- plumbing ---------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the schema to the newest version (idempotent)."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(_MIGRATIONS))
        with self._write() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def close(self) -> None:
        """Close every pooled connection. A connection still checked out (a call running in
        another thread as the server stops) is waited for, 5 s at most: disposing the pool
        under it would leave it to be closed by the garbage collector."""
        pool = self.engine.pool
        deadline = time.monotonic() + 5.0
        while getattr(pool, "checkedout", lambda: 0)() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.engine.dispose()

    @contextmanager
    def transaction(self, job_ids: Sequence[str] = ()) -> Iterator[UnitOfWork]:
        """One transaction (:class:`~gpufleet.store.api.Transaction`): its store is a copy
        of this one bound to it, its savepoints are the database's, and its after-commit
        calls run once it has committed. ``job_ids``: the jobs its calls will change, held
        first as the backend must (:meth:`_begin_transaction`)."""
        self._outside_transaction("a transaction")
        began = self.space.mark()
        with self._lock or nullcontext(), self.engine.begin() as conn:
            self._begin_transaction(conn, job_ids)
            unit = UnitOfWork(self._bound(conn), conn.begin_nested)
            yield unit
        self.space.wrote(began)  # committed: a full disk (if one was seen) has room again
        unit.committed()

    def _bound(self, conn: Connection) -> SqlStore:
        """This store with every call made on ``conn``, in its transaction."""
        bound = copy.copy(self)
        bound._conn = conn
        return bound

    def _outside_transaction(self, what: str) -> None:
        """Refuse ``what`` (a claim, a transaction) on a store bound to a transaction: it
        runs in a transaction of its own, which would wait for this one's writer (the
        types of :class:`~gpufleet.store.api.Transaction` rule this out already)."""
        if self._conn is not None:
            raise RuntimeError(f"{what} cannot run inside a transaction")

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        if self._conn is not None:
            yield self._conn
            return
        began = self.space.mark()
        with self._lock or nullcontext(), self.engine.begin() as conn:
            yield conn
        self.space.wrote(began)  # committed: a full disk (if one was seen) has room again

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        if self._conn is not None:
            yield self._conn
            return
        with self.engine.connect() as conn:
            yield conn

    def ping(self) -> str:
        with self._read() as conn:
            conn.execute(select(1))
        return self.dialect
