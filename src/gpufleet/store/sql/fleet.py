"""Fleet records: workers and host policies.

A mixin of :class:`~gpufleet.store.sql.store.SqlStore`: same connections, same writer lock. Every
change is a conditional update or delete, so two server processes doing the same duty at
once do it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, func, or_, select, update

from gpufleet.domain.models import WorkerStatus
from gpufleet.domain.worker_lifecycle import WorkerChange, WorkerEvent, sources, status_after
from gpufleet.errors import Conflict
from gpufleet.store import schema as t
from gpufleet.store.api import Hosts
from gpufleet.store.rows_read import HostRow, WorkerRow
from gpufleet.store.sql.base import SqlParts

_W = t.workers.c
_OFFLINE = WorkerStatus.OFFLINE.value
_SILENT_TO = status_after(WorkerEvent.SILENT).value
_REMOVABLE = [s.value for s in sources(WorkerEvent.REMOVE)]


class FleetOps(SqlParts):
    """Record operations of the fleet: workers, hosts, tokens, audit."""

    # ---- workers ----------------------------------------------------------------------

    def upsert_worker(self, worker_id: str, values: dict[str, Any]) -> tuple[str, bool]:
        """Register a worker; a name seen before keeps its id. Returns the id, and whether
        it came back (new, or offline before) rather than re-registering while online."""
        fresh = (
            self._insert(t.workers)
            .values(id=worker_id, **values)
            .on_conflict_do_nothing(index_elements=[_W.name])
            .returning(_W.id)
        )
        with self._write() as conn:
            # Insert first: two first registrations of one name at once then meet on the
            # name's key (the second waits, then finds the row), instead of both reading
            # no row and the second failing on the key.
            named = select(_W.id, _W.status).where(_W.name == values["name"])
            for _ in range(5):  # twice, unless the name's row goes and comes back meanwhile
                if conn.execute(fresh).first() is not None:
                    return worker_id, True
                known = conn.execute(named.with_for_update()).first()
                if known is not None:  # (None: removed since the insert met it)
                    conn.execute(update(t.workers).where(_W.id == known.id).values(**values))
                    return str(known.id), known.status == _OFFLINE
        name = values["name"]
        raise Conflict(
            f"worker {name!r} is being registered and removed at once; register again",
            detail={"worker": name},
        )

    def get_worker(self, worker_id: str) -> WorkerRow | None:
        """A worker by id, else by name (an id wins over a name that looks like one)."""
        with self._read() as conn:
            row = conn.execute(select(t.workers).where(_W.id == worker_id)).first()
            if row is None:
                row = conn.execute(select(t.workers).where(_W.name == worker_id)).first()
        return WorkerRow.from_row(row) if row else None

    def list_workers(self, pools: Sequence[str] | None = None) -> list[WorkerRow]:
        """Workers by name (of ``pools``; None: every pool)."""
        q = select(t.workers).order_by(_W.name)
        if pools is not None:
            q = q.where(_W.pool.in_(pools))
        with self._read() as conn:
            rows = conn.execute(q).all()
        return [WorkerRow.from_row(r) for r in rows]

    def change_worker(self, change: WorkerChange) -> bool:
        """Apply a status change the worker table decided, if the worker is still in one
        of its sources; whether it was."""
        froms = [s.value for s in change.sources]
        where = (_W.id == change.worker_id) & _W.status.in_(froms)
        with self._write() as conn:
            res = conn.execute(update(t.workers).where(where).values(**change.values()))
            return res.rowcount == 1

    def _set_worker(self, worker_id: str, **values: Any) -> bool:
        with self._write() as conn:
            res = conn.execute(update(t.workers).where(_W.id == worker_id).values(**values))
            return res.rowcount == 1

    def drain_worker(self, worker_id: str, by: float | None = None) -> bool:
        """Ask a worker to drain: its next heartbeat makes it draining; ``by``: when its
        running jobs are vacated (None: they may finish)."""
        return self._set_worker(worker_id, drain=True, drain_by=by)

    def set_worker_environments(self, worker_id: str, environments: str) -> bool:
        """The environments in the worker's cache, as its heartbeat listed them (JSON)."""
        return self._set_worker(worker_id, environments=environments)

    def set_worker_owner_state(self, worker_id: str, state: str | None) -> bool:
        """The worker's owner policy as its heartbeat said it (JSON; None: none)."""
        return self._set_worker(worker_id, owner_state=state)

    def set_worker_capability(self, worker_id: str, capability: str) -> bool:
        """The worker's capability (JSON), as its heartbeat completed it."""
        return self._set_worker(worker_id, capability=capability)

    def record_beats(self, beats: Sequence[tuple[str, float, str | None]]) -> None:
        """Heartbeats that changed nothing but liveness, many workers in one transaction:
        (worker id, when, its GPUs' readings as JSON or None to keep the last). A beat
        older than the worker's last heartbeat changes nothing."""
        if not beats:
            return
        stmt = (
            update(t.workers)
            .where(
                (_W.id == bindparam("wid"))
                & or_(_W.last_heartbeat.is_(None), _W.last_heartbeat < bindparam("at"))
            )
            .values(
                last_heartbeat=bindparam("at"),
                gpu_stats=func.coalesce(bindparam("stats"), _W.gpu_stats),
            )
        )
        rows = [{"wid": w, "at": at, "stats": stats} for w, at, stats in sorted(beats)]
        with self._write() as conn:
            conn.execute(stmt, rows)

    def bind_worker(self, worker_id: str, token_id: str) -> bool:
        """Bind a worker not bound to any token yet (registered before tokens owned
        workers) to ``token_id``; False if some token already holds it."""
        with self._write() as conn:
            res = conn.execute(
                update(t.workers)
                .where((_W.id == worker_id) & _W.token_id.is_(None))
                .values(token_id=token_id)
            )
            return res.rowcount == 1

    def mark_offline(self, before: float) -> list[str]:
        """Workers silent since before ``before`` go offline, gone since their last beat.
        Returns the ids this call changed (another replica's sweep, or a heartbeat landing
        meanwhile, changes the answer, not the outcome)."""
        froms = [s.value for s in sources(WorkerEvent.SILENT)]
        where = _W.status.in_(froms) & (_W.last_heartbeat < before)
        stmt = (
            update(t.workers)
            .where(where)
            .values(status=_SILENT_TO, offline_since=_W.last_heartbeat)
            .returning(_W.id)
        )
        with self._write() as conn:
            return [str(i) for i in conn.scalars(stmt)]

    def delete_worker(self, worker_id: str) -> bool:
        """Forget an offline worker; False if it is not (or no longer) offline."""
        with self._write() as conn:
            res = conn.execute(
                t.workers.delete().where((_W.id == worker_id) & _W.status.in_(_REMOVABLE))
            )
            return res.rowcount == 1

    def delete_gone_ephemeral(self, before: float) -> list[str]:
        """Forget ephemeral workers offline since before ``before``; their ids."""
        where = _W.status.in_(_REMOVABLE) & _W.ephemeral & (_W.offline_since < before)
        with self._write() as conn:
            return [str(i) for i in conn.scalars(t.workers.delete().where(where).returning(_W.id))]

    # ---- hosts ------------------------------------------------------------------------

    def hosts(self) -> list[HostRow]:
        with self._read() as conn:
            return [HostRow.from_row(r) for r in conn.execute(select(t.hosts)).all()]


def write_hosts(conn: Connection, hosts: Hosts, now: float, insert: Any) -> None:
    """Write a manifest's hosts entries over the ones they replace (``Hosts.replaces``).
    The hosts it names are upserted, not deleted and inserted: two applies naming the
    same host at once then wait for each other instead of one failing on its key.
    ``insert`` is the dialect's INSERT (with ON CONFLICT) for the hosts table."""
    h = t.hosts.c
    stale = h.manifest == hosts.manifest
    if hosts.within is not None:
        stale = stale & h.name.in_(list(hosts.within))
    conn.execute(t.hosts.delete().where(stale & h.name.not_in(list(hosts.policies))))
    rows = [
        {"name": name, "manifest": hosts.manifest, "policy": policy, "updated_at": now}
        for name, policy in sorted(hosts.policies.items())
    ]
    if rows:
        stmt = insert.on_conflict_do_update(
            index_elements=[h.name],
            set_={
                "manifest": insert.excluded.manifest,
                "policy": insert.excluded.policy,
                "updated_at": insert.excluded.updated_at,
            },
        )
        conn.execute(stmt, rows)
