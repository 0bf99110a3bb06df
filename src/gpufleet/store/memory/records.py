"""The in-memory store's records of the fleet and the data plane: workers, host policies,
tokens, the audit log, blobs, uploads and artifacts.

A mixin of :class:`gpufleet.store.memory.MemoryStore`: rows are dicts of column values,
as the tables hold them, read back through the same row models the SQL store uses.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from gpufleet.domain.models import ACTIVE, WorkerStatus
from gpufleet.domain.worker_lifecycle import WorkerChange, WorkerEvent, sources, status_after
from gpufleet.store import schema as t
from gpufleet.store.api import Hosts
from gpufleet.store.rows_read import (
    ArtifactRow,
    AuditRow,
    BlobRow,
    EnvLockRow,
    HostRow,
    TokenRow,
    WorkerRow,
)

_OFFLINE = WorkerStatus.OFFLINE.value
_SILENT_TO = status_after(WorkerEvent.SILENT).value
_REMOVABLE = frozenset(s.value for s in sources(WorkerEvent.REMOVE))


def defaults(table: Any) -> dict[str, Any]:
    """A row of ``table`` with every column at its declared default (None if it has none)."""
    out = {}
    for column in table.columns:
        arg = column.default.arg if column.default is not None else None
        out[column.name] = None if callable(arg) else arg
    return out


class MemoryRecords:
    """Workers, hosts, tokens, audit, blobs, uploads and artifacts, in dicts."""

    _lock: threading.RLock
    jobs: dict[str, dict[str, Any]]

    def _init_records(self) -> None:
        self.workers: dict[str, dict[str, Any]] = {}
        self.host_entries: dict[str, dict[str, Any]] = {}
        self.tokens: dict[str, dict[str, Any]] = {}
        self.keys: dict[str, str] = {}  # the fleet's secrets, by name
        self.sessions: dict[str, dict[str, Any]] = {}
        self.audit_rows: list[dict[str, Any]] = []
        self.audit_seq = 0  # the last audit number given (numbers never repeat, as in SQL)
        self.blobs: dict[str, dict[str, Any]] = {}
        self.blob_pools: set[tuple[str, str]] = set()
        self.uploads: dict[str, dict[str, Any]] = {}
        self.artifacts: dict[tuple[str, int], dict[str, Any]] = {}
        self.env_locks: dict[tuple[str, str], EnvLockRow] = {}

    # ---- workers ----------------------------------------------------------------------

    def upsert_worker(self, worker_id: str, values: dict[str, Any]) -> tuple[str, bool]:
        with self._lock:
            for row in self.workers.values():
                if row["name"] == values["name"]:
                    came_back = row["status"] == _OFFLINE
                    row.update(values)
                    return str(row["id"]), came_back
            self.workers[worker_id] = {**defaults(t.workers), **values, "id": worker_id}
            return worker_id, True

    def get_worker(self, worker_id: str) -> WorkerRow | None:
        with self._lock:
            row = self.workers.get(worker_id) or next(
                (w for w in self.workers.values() if w["name"] == worker_id), None
            )
            return WorkerRow.from_mapping(dict(row)) if row else None

    def list_workers(self, pools: Sequence[str] | None = None) -> list[WorkerRow]:
        with self._lock:
            rows = sorted(self.workers.values(), key=lambda w: w["name"])
            return [
                WorkerRow.from_mapping(dict(w)) for w in rows if pools is None or w["pool"] in pools
            ]

    def change_worker(self, change: WorkerChange) -> bool:
        froms = {s.value for s in change.sources}
        with self._lock:
            row = self.workers.get(change.worker_id)
            if row is None or row["status"] not in froms:
                return False
            row.update(change.values())
            return True

    def _set_worker(self, worker_id: str, **values: Any) -> bool:
        with self._lock:
            row = self.workers.get(worker_id)
            if row is None:
                return False
            row.update(values)
            return True

    def drain_worker(self, worker_id: str) -> bool:
        return self._set_worker(worker_id, drain=True)

    def set_worker_environments(self, worker_id: str, environments: str) -> bool:
        return self._set_worker(worker_id, environments=environments)

    def set_worker_capability(self, worker_id: str, capability: str) -> bool:
        return self._set_worker(worker_id, capability=capability)

    def record_beats(self, beats: Sequence[tuple[str, float, str | None]]) -> None:
        with self._lock:
            for worker_id, at, stats in beats:
                row = self.workers.get(worker_id)
                if row is None or (row["last_heartbeat"] or 0.0) >= at:
                    continue
                row["last_heartbeat"] = at
                if stats is not None:
                    row["gpu_stats"] = stats

    def bind_worker(self, worker_id: str, token_id: str) -> bool:
        with self._lock:
            row = self.workers.get(worker_id)
            if row is None or row["token_id"] is not None:
                return False
            row["token_id"] = token_id
            return True

    def mark_offline(self, before: float) -> list[str]:
        froms = {s.value for s in sources(WorkerEvent.SILENT)}
        with self._lock:
            gone = []
            for row in self.workers.values():
                beat = row["last_heartbeat"]
                if row["status"] in froms and beat is not None and beat < before:
                    row.update(status=_SILENT_TO, offline_since=beat)
                    gone.append(str(row["id"]))
            return gone

    def delete_worker(self, worker_id: str) -> bool:
        with self._lock:
            row = self.workers.get(worker_id)
            if row is None or row["status"] not in _REMOVABLE:
                return False
            del self.workers[worker_id]
            return True

    def delete_gone_ephemeral(self, before: float) -> list[str]:
        with self._lock:
            gone = [
                i
                for i, w in self.workers.items()
                if w["status"] in _REMOVABLE
                and w["ephemeral"]
                and w["offline_since"] is not None
                and w["offline_since"] < before
            ]
            for worker_id in gone:
                del self.workers[worker_id]
            return gone

    def active_count(self, worker_id: str) -> int:
        """How many claimed or running jobs the worker holds."""
        active = {s.value for s in ACTIVE}
        return sum(
            1 for j in self.jobs.values() if j["worker_id"] == worker_id and j["status"] in active
        )

    # ---- hosts ------------------------------------------------------------------------

    def _write_hosts(self, hosts: Hosts, now: float) -> None:
        for name in [n for n, h in self.host_entries.items() if hosts.replaces(HostRow(**h))]:
            del self.host_entries[name]
        for name, policy in hosts.policies.items():
            self.host_entries[name] = {
                "name": name,
                "manifest": hosts.manifest,
                "policy": policy,
                "updated_at": now,
            }

    def hosts(self) -> list[HostRow]:
        with self._lock:
            return [HostRow(**h) for h in self.host_entries.values()]

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

    # ---- blobs and uploads ------------------------------------------------------------

    def record_blob(self, sha256: str, size: int, now: float) -> None:
        with self._lock:
            self.blobs.setdefault(
                sha256, {"sha256": sha256, "size": size, "created_at": now, "archive": None}
            )

    def get_blob(self, sha256: str) -> BlobRow | None:
        with self._lock:
            row = self.blobs.get(sha256)
            return BlobRow.from_mapping(dict(row)) if row else None

    def list_blobs(self, limit: int, pools: Sequence[str] | None = None) -> list[BlobRow]:
        with self._lock:
            rows = sorted(self.blobs.values(), key=lambda b: -b["created_at"])
            if pools is not None:
                rows = [b for b in rows if any((b["sha256"], p) in self.blob_pools for p in pools)]
            return [BlobRow.from_mapping(dict(b)) for b in rows[:limit]]

    def grant_blobs(self, grants: Iterable[tuple[str, str]]) -> None:
        with self._lock:
            self.blob_pools.update(grants)

    def blob_readable(self, sha256: str, pools: Sequence[str]) -> bool:
        with self._lock:
            return any((sha256, p) in self.blob_pools for p in pools)

    def set_blob_archive(self, sha256: str, summary: dict[str, Any]) -> None:
        import json

        with self._lock:
            if sha256 in self.blobs:
                self.blobs[sha256]["archive"] = json.dumps(summary)

    def create_upload(
        self, upload_id: str, sha256: str | None, size: int, now: float, owner: str | None = None
    ) -> None:
        with self._lock:
            if upload_id in self.uploads:
                raise ValueError(f"upload {upload_id} exists")
            self.uploads[upload_id] = {
                "sha256": sha256,
                "size": size,
                "created_at": now,
                "token_id": owner,
            }

    def upload_owner(self, upload_id: str) -> str | None:
        with self._lock:
            u = self.uploads.get(upload_id)
            return None if u is None or u["token_id"] is None else str(u["token_id"])

    def get_upload(self, upload_id: str) -> tuple[str | None, int, float] | None:
        with self._lock:
            u = self.uploads.get(upload_id)
            if u is None:
                return None
            sha256 = None if u["sha256"] is None else str(u["sha256"])
            return sha256, int(u["size"]), float(u["created_at"])

    def delete_upload(self, upload_id: str) -> None:
        with self._lock:
            self.uploads.pop(upload_id, None)

    def old_uploads(self, created_before: float) -> list[str]:
        with self._lock:
            return [i for i, u in self.uploads.items() if u["created_at"] < created_before]

    def upload_ids(self, created_after: float) -> set[str]:
        with self._lock:
            for upload_id in self.old_uploads(created_after):
                del self.uploads[upload_id]
            return set(self.uploads)

    # ---- artifacts --------------------------------------------------------------------

    def attach_artifact(self, job_id: str, lease: int, values: dict[str, Any]) -> bool:
        active = {s.value for s in ACTIVE}
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or job["lease"] != lease or job["status"] not in active:
                return False
            self.artifacts[(job_id, lease)] = {"job_id": job_id, "attempt": lease, **values}
            return True

    def artifact(self, job_id: str, attempt: int | None = None) -> ArtifactRow | None:
        with self._lock:
            found = [
                a
                for (j, n), a in self.artifacts.items()
                if j == job_id and (attempt is None or n == attempt)
            ]
            if not found:
                return None
            return ArtifactRow.from_mapping(dict(max(found, key=lambda a: a["attempt"])))

    # ---- environments -----------------------------------------------------------------

    def get_env_lock(self, pool: str, key: str) -> EnvLockRow | None:
        with self._lock:
            return self.env_locks.get((pool, key))

    def put_env_lock(self, row: EnvLockRow, replace: bool) -> tuple[EnvLockRow, bool]:
        with self._lock:
            found = self.env_locks.get((row.pool, row.key))
            if found is None:
                self.env_locks[row.pool, row.key] = row
                return row, True
            if replace:
                found = dataclasses.replace(
                    row, created_at=found.created_at, replaced_at=row.created_at
                )
                self.env_locks[row.pool, row.key] = found
            return found, False

    def workers_with_env(self, spec_key: str, pools: Sequence[str] | None = None) -> list[str]:
        return [
            w.id
            for w in self.list_workers(pools)
            if any(e.spec_key == spec_key for e in w.environments)
        ]
