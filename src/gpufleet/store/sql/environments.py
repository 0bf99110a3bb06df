"""Environment records: each pool's locks of unlocked environment specs, and which
workers have a spec built.

A mixin of :class:`gpufleet.store.SqlStore`: same connections, same writer lock. The
first lock recorded for a (pool, key) wins (an insert that does nothing when the key exists), so
two workers whose first builds of one spec end at once record one lock between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from sqlalchemy import select, update

from gpufleet.store import schema as t
from gpufleet.store.rows_read import EnvLockRow, WorkerRow
from gpufleet.store.sql.base import SqlParts

_L, _W = t.environment_locks.c, t.workers.c


class EnvironmentOps(SqlParts):
    """Record operations of job environments."""

    def get_env_lock(self, pool: str, key: str) -> EnvLockRow | None:
        """The lock ``pool`` recorded under ``key`` (a ``lock_key``), if any."""
        with self._read() as conn:
            q = select(t.environment_locks).where(_L.pool == pool, _L.key == key)
            row = conn.execute(q).first()
        return EnvLockRow.from_row(row) if row else None

    def put_env_lock(self, row: EnvLockRow, replace: bool) -> tuple[EnvLockRow, bool]:
        """Record ``row`` unless a lock exists under its pool and key: then the existing one stands
        and is returned, or with ``replace`` it is overwritten (``replaced_at`` set to
        ``row.created_at``, its first ``created_at`` kept). Returns the lock now recorded
        and whether this call created it."""
        values = asdict(row)
        fresh = (
            self._insert(t.environment_locks)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[_L.pool, _L.key])
            .returning(_L.key)
        )
        this = (_L.pool == row.pool) & (_L.key == row.key)
        with self._write() as conn:
            if conn.execute(fresh).first() is not None:
                return row, True
            if replace:
                kept = {k: v for k, v in values.items() if k not in ("pool", "key", "created_at")}
                kept["replaced_at"] = row.created_at
                conn.execute(update(t.environment_locks).where(this).values(**kept))
            found = conn.execute(select(t.environment_locks).where(this)).one()
        return EnvLockRow.from_row(found), False

    def workers_with_env(self, spec_key: str, pools: Sequence[str] | None = None) -> list[str]:
        """The ids of the workers (of ``pools``; None: every pool) whose cache holds an
        environment built from ``spec_key``, as their heartbeats last said, by name."""
        # A spec key is 64 hex digits: a plain substring match finds the candidates, and
        # reading their lists back keeps only an exact one.
        q = (
            select(t.workers)
            .where(_W.environments.contains(spec_key, autoescape=True))
            .order_by(_W.name)
        )
        if pools is not None:
            q = q.where(_W.pool.in_(list(pools)))
        with self._read() as conn:
            rows = [WorkerRow.from_row(r) for r in conn.execute(q).all()]
        return [w.id for w in rows if any(e.spec_key == spec_key for e in w.environments)]
