"""The PostgreSQL backend: several servers on one database."""

from gpufleet.store.postgres.store import PostgresStore

__all__ = ["PostgresStore"]
