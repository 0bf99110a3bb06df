"""The SQLite backend: the default, one server's own database file."""

from gpufleet.store.sqlite.store import SqliteStore

__all__ = ["SqliteStore"]
