"""What every area of the SQL store works through: its connections, its INSERT and its
row locks. Each area (:mod:`.jobs`, :mod:`.leases`, :mod:`.events`, :mod:`.changes`,
:mod:`.fleet`, :mod:`.data`, :mod:`.environments`) is a mixin of this, composed into
:class:`~gpufleet.store.sql.store.SqlStore`, which provides these per backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import Connection, Select


class SqlParts(ABC):
    """The connections and statements an area of the SQL store is given."""

    @abstractmethod
    def _write(self) -> AbstractContextManager[Connection]:
        """A connection in a write transaction (the store's one writer on SQLite), or the
        transaction's own when the store is bound to one."""

    @abstractmethod
    def _read(self) -> AbstractContextManager[Connection]:
        """A connection for reading (the transaction's own when bound to one)."""

    @abstractmethod
    def _insert(self, table: Any) -> Any:
        """The backend's INSERT (with ON CONFLICT) for ``table``."""

    @abstractmethod
    def _lock_rows(self, conn: Connection, q: Select[Any], read: bool = False) -> None:
        """Lock the rows ``q`` selects until the transaction ends (``read``: shared), where
        the backend has row locks; where one writer holds everything, nothing."""
