"""Checkpoints on the server: a worker records a snapshot of a running job's checkpoint
folder once every file of it is a blob here; the next attempt is given the latest.

A snapshot is accepted only from the worker whose lease holds the job, and only if every
blob it lists is here with the size it says: a snapshot on record is complete. The job's
pool may read its files from then on (its later attempts run in that pool), and no other
pool through it. The job's newest ``checkpoint_keep`` snapshots are kept
(:class:`~gpufleet.server.settings.QueueSettings`); retention deletes a finished job's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gpufleet.domain import checkpoints
from gpufleet.domain.checkpoints import SnapFile, Snapshot
from gpufleet.errors import Conflict, ValidationFailed
from gpufleet.server.blobs import BlobService
from gpufleet.store import CheckpointRow, CheckpointStore, DataStore, JobRow


class SnapshotStore(CheckpointStore, DataStore, Protocol):
    """What checkpoints read and write."""


class Checkpoints:
    def __init__(
        self,
        store: SnapshotStore,
        blobs: BlobService,
        keep: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.keep = keep
        self.clock = clock

    def record(
        self,
        job: JobRow,
        attempt: int,
        files: Sequence[SnapFile],
        progress: dict[str, int],
        pools: Sequence[str] | None,
    ) -> Snapshot:
        """Record a snapshot of ``job``'s folder taken by the attempt ``attempt`` (whose
        lease the caller showed; ``pools``: those the caller may read blobs of). Refused
        (422) when a path is wrong or named twice, or a blob is missing, of another size
        or not the caller's to read; (409) when the lease no longer holds the job."""
        self._check(files, pools)
        self.blobs.grant((f.sha256, job.pool) for f in files)
        now = self.clock()
        values = {
            "created_at": now,
            "files": json.dumps([[f.path, f.sha256, f.size] for f in files]),
            "file_count": len(files),
            "bytes": sum(f.size for f in files),
            "progress": json.dumps(progress, separators=(",", ":")),
        }
        new = self.store.add_checkpoint(job.id, attempt, values, self.keep)
        if new is None:
            raise Conflict(
                f"job {job.id}: attempt {attempt} no longer holds it; snapshot not kept",
                detail={"job": job.id, "attempt": attempt},
            )
        return Snapshot(new, job.id, attempt, now, tuple(files), dict(progress))

    def _check(self, files: Sequence[SnapFile], pools: Sequence[str] | None) -> None:
        seen: set[str] = set()
        folders: set[str] = set()  # of the paths so far: "a" of "a/b"
        for n, f in enumerate(files):
            where = f"files[{n}].path"
            problem = checkpoints.path_problem(f.path)
            if problem is not None:
                raise ValidationFailed(problem, detail={"field": where})
            if f.path in seen:
                raise ValidationFailed(f"{f.path!r} is listed twice", detail={"field": where})
            parents = {f.path[:i] for i, c in enumerate(f.path) if c == "/"}
            if f.path in folders or parents & seen:
                raise ValidationFailed(
                    f"{f.path!r}: a path is a file and a folder of another in this snapshot",
                    detail={"field": where},
                )
            seen.add(f.path)
            folders |= parents
            size = self.blobs.has(f.sha256)
            # a blob the caller may not read is one it cannot name here: a snapshot would
            # hand it to the job's pool
            if size is None or not self.blobs.readable(f.sha256, pools):
                raise ValidationFailed(
                    f"{f.path}: blob {f.sha256} is not on the server; upload it first",
                    detail={"field": f"files[{n}].sha256", "blob": f.sha256},
                )
            if size != f.size:
                raise ValidationFailed(
                    f"{f.path}: blob {f.sha256} holds {size} bytes, not {f.size}",
                    detail={"field": f"files[{n}].size", "blob": f.sha256},
                )

    def latest(self, job_id: str) -> Snapshot | None:
        """The job's newest snapshot, if it has one."""
        found = self.store.checkpoints(job_id, limit=1)
        return found[0].snapshot() if found else None

    def of(self, job: JobRow, limit: int = 100) -> list[CheckpointRow]:
        """The job's snapshots, newest first."""
        return self.store.checkpoints(job.id, limit)
