"""The SQL that SQLite and PostgreSQL share: :class:`SqlStore`, composed of one mixin per
area (jobs, leases, events, status changes, claims, fleet and access, data,
environments). Each backend (:mod:`gpufleet.store.sqlite`, :mod:`gpufleet.store.postgres`)
subclasses it with what it does its own way; nothing here asks which backend it is."""

from gpufleet.store.sql.store import SqlStore, normalize_url

__all__ = ["SqlStore", "normalize_url"]
