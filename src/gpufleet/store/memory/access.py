"""The in-memory store's access records: the server's own keys, tokens, dashboard
sessions and the audit log. A mixin of :class:`~gpufleet.store.memory.store.MemoryStore`.
"""

from __future__ import annotations

from typing import Any

from gpufleet.store import schema as t
from gpufleet.store.memory.tables import MemoryTables, defaults
from gpufleet.store.rows_read import (
    AuditRow,
    TokenRow,
)


class MemoryAccess(MemoryTables):
    """Keys, tokens, sessions and the audit log, in dicts."""

    # ---- the fleet's secrets ------------------------------------------------------------

    def server_key(self, name: str, fresh: str) -> str:
        with self._lock:
            return self.keys.setdefault(name, fresh)

    # ---- tokens -----------------------------------------------------------------------

    def insert_token(self, values: dict[str, Any]) -> None:
        with self._lock:
            if any(tok["hash"] == values["hash"] for tok in self.tokens.values()):
                raise ValueError("a token with this hash exists")
            self.tokens[values["id"]] = {**defaults(t.tokens), **values}

    def token_by_hash(self, digest: str) -> TokenRow | None:
        with self._lock:
            row = next((tok for tok in self.tokens.values() if tok["hash"] == digest), None)
            return TokenRow.from_mapping(dict(row)) if row else None

    def list_tokens(self) -> list[TokenRow]:
        with self._lock:
            rows = sorted(self.tokens.values(), key=lambda tok: tok["created_at"])
            return [TokenRow.from_mapping(dict(tok)) for tok in rows]

    def revoke_token(self, token_id: str, now: float) -> bool:
        with self._lock:
            row = self.tokens.get(token_id)
            if row is None or row["revoked_at"] is not None:
                return False
            row["revoked_at"] = now
            return True

    def get_token(self, token_id: str) -> TokenRow | None:
        with self._lock:
            row = self.tokens.get(token_id)
            return TokenRow.from_mapping(dict(row)) if row else None

    def rotate_token(self, token_id: str, digest: str, hint: str) -> bool:
        with self._lock:
            row = self.tokens.get(token_id)
            if row is None or row["revoked_at"] is not None:
                return False
            row.update(hash=digest, hint=hint)
            return True

    def count_tokens(self, role: str) -> int:
        with self._lock:
            return sum(
                1 for tok in self.tokens.values() if tok["role"] == role and not tok["revoked_at"]
            )

    # ---- dashboard sessions -------------------------------------------------------------

    def insert_session(self, values: dict[str, Any], now: float) -> None:
        with self._lock:
            for key in [k for k, v in self.sessions.items() if v["expires_at"] <= now]:
                del self.sessions[key]
            self.sessions[values["hash"]] = dict(values)

    def session_token(self, digest: str, now: float) -> TokenRow | None:
        with self._lock:
            found = self.sessions.get(digest)
            if found is None or found["expires_at"] <= now:
                return None
            tok = self.tokens.get(found["token_id"])
            if tok is None or tok["hash"] != found["token_hash"]:
                return None
            return TokenRow.from_mapping(dict(tok))

    def delete_session(self, digest: str) -> bool:
        with self._lock:
            return self.sessions.pop(digest, None) is not None

    # ---- audit ------------------------------------------------------------------------

    def insert_audit(self, rows: list[dict[str, Any]]) -> None:
        keys = [c.name for c in t.audit.columns if c.name != "seq"]
        with self._lock:
            for r in rows:
                self.audit_seq += 1
                self.audit_rows.append({"seq": self.audit_seq, **{k: r.get(k) for k in keys}})

    def audit(self, since: float, limit: int, after: int = 0) -> list[AuditRow]:
        with self._lock:
            found = [r for r in self.audit_rows if r["at"] >= since and r["seq"] > after]
            return [AuditRow.from_mapping(dict(r)) for r in found[:limit]]
