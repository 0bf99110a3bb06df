"""The in-memory store's data plane: blobs, the pools that may read them, resumable
uploads and artifacts. A mixin of :class:`~gpufleet.store.memory.store.MemoryStore`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gpufleet.domain.models import ACTIVE
from gpufleet.store.memory.tables import MemoryTables
from gpufleet.store.rows_read import (
    ArtifactRow,
    BlobRow,
)


class MemoryData(MemoryTables):
    """Blobs, uploads and artifacts, in dicts."""

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
