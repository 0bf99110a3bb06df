"""Blob bytes on disk, content-addressed by SHA-256, under the server's data dir.

::

    DATA/blobs/objects/ab/abcdef...   complete, verified blobs (never modified)
    DATA/blobs/tmp/                   single-request uploads in flight
    DATA/blobs/uploads/ID             resumable upload sessions

A blob is written to a temp file, fsynced, renamed into ``objects`` and the directory
fsynced; only then does the caller record its row. A crash leaves at most a temp file,
which :meth:`BlobFiles.clean` removes at the next start.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
from pathlib import Path
from typing import Any

from gpufleet.errors import InsufficientStorage, TooLarge


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_full(exc: OSError, what: str) -> InsufficientStorage:
    return InsufficientStorage(
        f"the server's disk is full ({exc.strerror}) while {what}; nothing was kept. "
        "Free space in the server's data dir and retry"
    )


class BlobWriter:
    """Appends to one file while hashing; refuses to grow past ``limit`` bytes.

    Writes are called from a worker thread; ``hashlib`` and file writes release the GIL,
    so hashing runs alongside the event loop that receives the next chunk."""

    def __init__(self, path: Path, limit: int, *, append: bool = False, hasher: Any = None) -> None:
        self.path = path
        self.limit = limit
        self._file = open(path, "ab" if append else "wb")  # noqa: SIM115 - closed in close()
        self.size = self._file.tell()
        self.hasher = hasher if hasher is not None else hashlib.sha256()

    def write(self, data: bytes) -> None:
        if self.size + len(data) > self.limit:
            raise TooLarge(f"the blob is larger than the limit of {self.limit} bytes")
        try:
            self._file.write(data)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise disk_full(exc, "storing an upload") from exc
            raise
        self.hasher.update(data)
        self.size += len(data)

    def sync(self) -> None:
        """Make what was written durable (the committed offset of a resumable upload)."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise disk_full(exc, "storing an upload") from exc
            raise

    def truncate(self, size: int) -> None:
        self._file.flush()
        self._file.truncate(size)
        self.size = size
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def digest(self) -> str:
        return str(self.hasher.hexdigest())


class BlobFiles:
    """Where blob bytes live; knows nothing of the database."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = root / "objects"
        self.tmp = root / "tmp"
        self.sessions = root / "uploads"

    def path(self, sha256: str) -> Path:
        return self.objects / sha256[:2] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def temp(self) -> Path:
        return self.tmp / f"put-{secrets.token_hex(8)}"

    def session(self, upload_id: str) -> Path:
        return self.sessions / upload_id

    def commit(self, written: Path, sha256: str) -> None:
        """Move a complete, fsynced file into place (atomic rename, then fsync the dir)."""
        final = self.path(sha256)
        final.parent.mkdir(exist_ok=True)
        os.replace(written, final)
        _fsync_dir(final.parent)

    def clean(self, live_sessions: set[str]) -> int:
        """Create the folders; remove what a crash left: every temp file, and sessions
        nobody holds any more. Run once at server start."""
        for d in (self.objects, self.tmp, self.sessions):
            d.mkdir(parents=True, exist_ok=True)
        removed = 0
        for leftover in self.tmp.iterdir():
            leftover.unlink(missing_ok=True)
            removed += 1
        for session in self.sessions.iterdir():
            if session.name not in live_sessions:
                session.unlink(missing_ok=True)
                removed += 1
        return removed


def hash_file(path: Path, upto: int | None = None) -> Any:
    """A SHA-256 object fed with the first ``upto`` bytes of ``path`` (all when None)."""
    h = hashlib.sha256()
    left = upto
    with open(path, "rb") as f:
        while left is None or left > 0:
            chunk = f.read(1 << 20 if left is None else min(1 << 20, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h


def new_upload_id() -> str:
    return "u-" + secrets.token_hex(12)
