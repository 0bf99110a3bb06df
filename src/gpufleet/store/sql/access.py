"""Access records: the server's own keys, tokens (stored hashed), dashboard sessions and
the audit log.

A mixin of :class:`~gpufleet.store.sql.store.SqlStore`: same connections, same writer
lock.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError

from gpufleet.store import schema as t
from gpufleet.store.rows_read import AuditRow, TokenRow
from gpufleet.store.sql.base import SqlParts


class AccessOps(SqlParts):
    """Keys, tokens, sessions and the audit log."""

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
