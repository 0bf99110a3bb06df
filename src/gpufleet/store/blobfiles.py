"""Blob bytes on disk, content-addressed by SHA-256, under the server's data dir.

::

    DATA/blobs/objects/ab/abcdef...   complete, verified blobs (never modified)
    DATA/blobs/tmp/                   single-request uploads in flight
    DATA/blobs/uploads/ID             resumable upload sessions

A blob is written to a temp file, fsynced, renamed into ``objects`` and the directory
fsynced; only then does the caller record its row. A crash leaves at most a temp file,
which :meth:`BlobFiles.clean` removes at a later start.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from gpufleet.errors import HashMismatch, InsufficientStorage, StorageUnusable
from gpufleet.store.blobbytes import Busy
from gpufleet.streams import file_hasher


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


WRITEBACK_EVERY = 8 << 20
# A temp or session file nobody wrote for this long is a crash's leftover.
LEFTOVER_AFTER = 3600.0


def _writeback_starter() -> Callable[[int, int, int], object] | None:
    """Linux's ``sync_file_range(..., SYNC_FILE_RANGE_WRITE)``: start writing a range of a
    file to disk without waiting, so the fsync at the end of an upload finds little left to
    do (the disk works while the network does). None where it does not exist; it is only a
    hint, so then the final fsync simply does all the work."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    sync_write = 2  # SYNC_FILE_RANGE_WRITE
    return lambda fd, offset, length: fn(fd, offset, length, sync_write)


_start_writeback = _writeback_starter()


def is_locked(path: Path) -> bool:
    """Whether some writer holds ``path``'s lock right now (see :meth:`BlobWriter.locked`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no locks on this filesystem: nobody can hold one
        return False
    finally:
        os.close(fd)  # also releases the lock just taken
    return False


# :func:`is_locked` holds the lock for a moment: a writer retries this long before it
# takes the lock to be a writer's (Busy).
PROBE_GRACE = 0.2


def _lock_past_probes(fd: int) -> None:
    """Take ``fd``'s exclusive flock, retrying for :data:`PROBE_GRACE` seconds so that a
    status read probing the lock at that instant does not turn a PATCH into a 409.
    Raises BlockingIOError when it stays held (a writer has it)."""
    deadline = time.monotonic() + PROBE_GRACE
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


class BlobWriter:
    """Appends to one file, unbuffered: callers hand it large buffers (from a thread of its
    own, see :class:`gpufleet.streams.Fanout`). Every ``WRITEBACK_EVERY`` bytes it asks the
    kernel to start writing them out, so :meth:`sync` is short."""

    def __init__(self, path: Path, *, append: bool = False, create: bool = True) -> None:
        self.path = path
        flags = os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC)
        self._fd = os.open(path, flags | (os.O_CREAT if create else 0), 0o644)
        self.size = os.lseek(self._fd, 0, os.SEEK_END)
        self._started = self.size  # where writeback has been asked for up to

    @classmethod
    def locked(cls, path: Path) -> BlobWriter:
        """An existing file opened for appending under an exclusive ``flock`` (which works
        across processes and, on Linux, across NFS v4 clients). Raises Busy when another
        writer has it, FileNotFoundError when it is gone (also when it went between the
        open and the lock). ``size`` is read under the lock."""
        writer = cls(path, append=True, create=False)
        try:
            _lock_past_probes(writer._fd)
            held = os.fstat(writer._fd)
            named = os.stat(path)  # FileNotFoundError: removed or renamed meanwhile
            if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino) or not held.st_nlink:
                raise FileNotFoundError(errno.ENOENT, "replaced while opening", str(path))
        except BlockingIOError:
            writer.close()
            raise Busy(str(path)) from None
        except OSError as exc:
            writer.close()
            if exc.errno == errno.ENOLCK:
                raise StorageUnusable(
                    f"the server's data dir cannot lock files ({exc.strerror}); resumable "
                    "uploads need flock: use a local disk or NFS v4 for --data-dir"
                ) from exc
            raise
        writer.size = writer._started = os.lseek(writer._fd, 0, os.SEEK_END)
        return writer

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise disk_full(exc, "storing an upload") from exc
            raise
        self.size += len(data)
        if _start_writeback is not None and self.size - self._started >= WRITEBACK_EVERY:
            _start_writeback(self._fd, self._started, self.size - self._started)
            self._started = self.size

    def on_disk(self) -> int:
        """The file's size as the filesystem has it."""
        return os.fstat(self._fd).st_size

    def modified(self) -> float:
        return os.fstat(self._fd).st_mtime

    def sync(self) -> None:
        """Make what was written durable (the committed offset of a resumable upload)."""
        try:
            os.fsync(self._fd)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise disk_full(exc, "storing an upload") from exc
            raise

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        self.size = self._started = size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class BlobFiles:
    """Blob bytes in a directory (see the module's docstring); knows nothing of the
    database. Implements :class:`gpufleet.store.blobbytes.BlobBytes`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)
        self.objects = root / "objects"
        self.tmp = root / "tmp"
        self.sessions = root / "uploads"

    def path(self, sha256: str) -> Path:
        return self.objects / sha256[:2] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def local_path(self, sha256: str) -> Path | None:
        return self.path(sha256)

    @contextlib.contextmanager
    def reader(self, sha256: str) -> Iterator[BinaryIO]:
        with open(self.path(sha256), "rb") as f:
            yield f

    def chunks(self, sha256: str, start: int, end: int) -> Iterator[bytes]:
        f = open(self.path(sha256), "rb")  # noqa: SIM115 (closed by the stream)

        def stream() -> Iterator[bytes]:
            with f:
                f.seek(start)
                left = end - start + 1
                while left > 0 and (data := f.read(min(left, 1 << 20))):
                    left -= len(data)
                    yield data

        return stream()

    def writer(self, sha256: str) -> _TempWriter:
        return _TempWriter(self, self.tmp / f"put-{secrets.token_hex(8)}")

    def session(self, upload_id: str) -> Path:
        return self.sessions / upload_id

    def commit(self, written: Path, sha256: str) -> None:
        """Move a complete, fsynced file into place (atomic rename, then fsync the dir)."""
        final = self.path(sha256)
        final.parent.mkdir(exist_ok=True)
        os.replace(written, final)
        _fsync_dir(final.parent)

    # ---- sessions: a file each, appended under an flock -------------------------------

    names_at_end = True  # a session's file is renamed to its hash at the end

    def start(self, upload_id: str, sha256: str | None, size: int) -> None:
        self.session(upload_id).touch()

    def kept(self, upload_id: str, sha256: str | None, size: int) -> tuple[int, float]:
        st = self.session(upload_id).stat()
        return st.st_size, st.st_mtime

    def receiving(self, upload_id: str, sha256: str | None) -> bool:
        return is_locked(self.session(upload_id))

    def appender(
        self, upload_id: str, sha256: str | None, size: int, proof: object | None = None
    ) -> _SessionFile:
        return _SessionFile(self, BlobWriter.locked(self.session(upload_id)))

    def drop(self, upload_id: str, sha256: str | None) -> None:
        path = self.session(upload_id)
        writer = BlobWriter.locked(path)
        try:
            path.unlink(missing_ok=True)
        finally:
            writer.close()

    def clean(self, live_sessions: set[str], now: float) -> int:
        """Create the folders; remove what a crash left: temp files and session files
        without a session, untouched for an hour (another replica sharing this data dir
        may be writing newer ones right now). Run at server start."""
        for d in (self.objects, self.tmp, self.sessions):
            d.mkdir(parents=True, exist_ok=True)
        removed = 0
        for leftover in self.tmp.iterdir():
            removed += _remove_if_idle(leftover, now)
        for session in self.sessions.iterdir():
            if session.name not in live_sessions:
                removed += _remove_if_idle(session, now)
        return removed


class _TempWriter:
    """A single-request upload: a temp file, renamed into place once verified."""

    def __init__(self, files: BlobFiles, path: Path) -> None:
        self.files, self.path = files, path
        self._file = BlobWriter(path)
        self.write = self._file.write

    @property
    def size(self) -> int:
        return self._file.size

    def commit(self, sha256: str) -> None:
        self._file.sync()
        self._file.close()
        self.files.commit(self.path, sha256)

    def close(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class _SessionFile:
    """A request's hold on a session file (its flock, until :meth:`close`)."""

    # Nobody else wrote the file while no request held its lock: a flock per request, and
    # the size checked against the hash's at every resume.
    trusted = True
    proof = None

    def __init__(self, files: BlobFiles, writer: BlobWriter) -> None:
        self.files, self._file = files, writer
        self.write, self.sync = writer.write, writer.sync

    @property
    def size(self) -> int:
        return self._file.size

    @property
    def touched(self) -> float:
        return self._file.modified()

    def revert(self, size: int) -> None:
        self._file.truncate(size)

    def rehash(self) -> hashlib._Hash:
        return file_hasher(self._file.path, self._file.size)

    def seal(self, hasher: hashlib._Hash | None) -> str:
        size, on_disk = self._file.size, self._file.on_disk()
        if on_disk != size:  # only this request could write it; say so if not
            raise HashMismatch(
                f"upload {self._file.path.name} holds {on_disk} bytes on disk, not the "
                f"{size} received; nothing was kept, start again",
                detail={"expected": size, "got": on_disk},
            )
        return (hasher or self.rehash()).hexdigest()

    def promote(self, sha256: str) -> None:
        self.files.commit(self._file.path, sha256)

    def discard(self) -> None:
        self._file.path.unlink(missing_ok=True)

    def close(self) -> None:
        self._file.close()


def _remove_if_idle(path: Path, now: float, idle: float = LEFTOVER_AFTER) -> int:
    try:
        if path.stat().st_mtime > now - idle:
            return 0
        path.unlink()
    except FileNotFoundError:
        return 0
    return 1


def new_upload_id() -> str:
    return "u-" + secrets.token_hex(12)
