"""Fleet records: workers, host policies, tokens and the audit log.

A mixin of :class:`gpufleet.store.SqlStore`: same connections, same writer lock. Every
change is a conditional update or delete, so two server processes doing the same duty at
once do it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError

from gpufleet.domain.models import WorkerStatus
from gpufleet.domain.worker_lifecycle import WorkerChange, WorkerEvent, sources, status_after
from gpufleet.errors import Conflict
from gpufleet.store import schema as t
from gpufleet.store.api import Hosts
from gpufleet.store.rows_read import AuditRow, HostRow, TokenRow, WorkerRow
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

    def drain_worker(self, worker_id: str) -> bool:
        """Ask a worker to drain: its next heartbeat makes it draining."""
        return self._set_worker(worker_id, drain=True)

    def set_worker_environments(self, worker_id: str, environments: str) -> bool:
        """The environments in the worker's cache, as its heartbeat listed them (JSON)."""
        return self._set_worker(worker_id, environments=environments)

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

    # ---- the fleet's secrets ------------------------------------------------------------

    def server_key(self, name: str, fresh: str) -> str:
        """The fleet's secret ``name``: ``fresh`` if no server made it before (every
        server sharing the database reads the same one)."""
        c = t.server_keys.c
        q = select(c.secret).where(c.name == name)
        with self._read() as conn:
            found = conn.execute(q).scalar()
        if found is None:
            try:
                with self._write() as conn:
                    conn.execute(t.server_keys.insert().values(name=name, secret=fresh))
            except IntegrityError:
                pass  # another server made it meanwhile: theirs holds
            with self._read() as conn:
                found = conn.execute(q).scalar_one()
        return str(found)

    # ---- tokens -----------------------------------------------------------------------

    def insert_token(self, values: dict[str, Any]) -> None:
        with self._write() as conn:
            conn.execute(t.tokens.insert().values(**values))

    def token_by_hash(self, digest: str) -> TokenRow | None:
        with self._read() as conn:
            row = conn.execute(select(t.tokens).where(t.tokens.c.hash == digest)).first()
        return TokenRow.from_row(row) if row else None

    def list_tokens(self) -> list[TokenRow]:
        with self._read() as conn:
            rows = conn.execute(select(t.tokens).order_by(t.tokens.c.created_at)).all()
        return [TokenRow.from_row(r) for r in rows]

    def revoke_token(self, token_id: str, now: float) -> bool:
        c = t.tokens.c
        with self._write() as conn:
            res = conn.execute(
                update(t.tokens)
                .where((c.id == token_id) & c.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            return res.rowcount == 1

    def get_token(self, token_id: str) -> TokenRow | None:
        with self._read() as conn:
            row = conn.execute(select(t.tokens).where(t.tokens.c.id == token_id)).first()
        return TokenRow.from_row(row) if row else None

    def insert_session(self, values: dict[str, Any], now: float) -> None:
        """Record a dashboard session; sessions past their time are dropped as it goes."""
        with self._write() as conn:
            conn.execute(delete(t.sessions).where(t.sessions.c.expires_at <= now))
            conn.execute(t.sessions.insert().values(**values))

    def session_token(self, digest: str, now: float) -> TokenRow | None:
        """The token a live session (by its secret's digest) signed in with; None when the
        session is unknown, expired, or its token was rotated since."""
        s, tok = t.sessions.c, t.tokens.c
        q = (
            select(t.tokens)
            .join(t.sessions, (s.token_id == tok.id) & (s.token_hash == tok.hash))
            .where((s.hash == digest) & (s.expires_at > now))
        )
        with self._read() as conn:
            row = conn.execute(q).first()
        return TokenRow.from_row(row) if row else None

    def delete_session(self, digest: str) -> bool:
        with self._write() as conn:
            res = conn.execute(delete(t.sessions).where(t.sessions.c.hash == digest))
            return res.rowcount == 1

    def rotate_token(self, token_id: str, digest: str, hint: str) -> bool:
        """Give an active token a new secret; the old one stops matching at once."""
        c = t.tokens.c
        with self._write() as conn:
            res = conn.execute(
                update(t.tokens)
                .where((c.id == token_id) & c.revoked_at.is_(None))
                .values(hash=digest, hint=hint)
            )
            return res.rowcount == 1

    def count_tokens(self, role: str) -> int:
        c = t.tokens.c
        q = select(func.count()).select_from(t.tokens).where(c.role == role, c.revoked_at.is_(None))
        with self._read() as conn:
            return int(conn.execute(q).scalar_one())

    # ---- audit ------------------------------------------------------------------------

    def insert_audit(self, rows: list[dict[str, Any]]) -> None:
        """Append audit records (calls and events, each with the fields it has), in one
        transaction."""
        keys = [c.name for c in t.audit.columns if c.name != "seq"]
        with self._write() as conn:
            conn.execute(t.audit.insert(), [{k: r.get(k) for k in keys} for r in rows])

    def audit(self, since: float, limit: int, after: int = 0) -> list[AuditRow]:
        """The first ``limit`` audit records at or after ``since`` and past sequence
        number ``after``, oldest first: page on with the last one's ``seq``."""
        a = t.audit.c
        q = select(t.audit).where((a.at >= since) & (a.seq > after)).order_by(a.seq).limit(limit)
        with self._read() as conn:
            return [AuditRow.from_row(r) for r in conn.execute(q).all()]


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
