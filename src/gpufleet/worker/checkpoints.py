"""A running job's checkpoint folder, kept on the server as snapshots, and restored into
the next attempt's folder before its command starts (gpufleet.domain.checkpoints).

:class:`FolderSync` looks at the folder twice a second. When every file in it has
stayed the same (size and modification time) across two looks, and the set differs from
the last snapshot's, it hashes the files that changed, uploads those the server lacks
(each file's bytes are sent once: content-addressed) and records a snapshot. The job may
also ask for one now (a progress record ``{"checkpoint": true}``); a last sync follows the
job's end. Hashing and uploads run in threads: the job and its output never wait for them.

The folder belongs to the job, which may run as another user (``--run-as``) while the
worker runs as root: it is walked and read through directory file descriptors that never
follow a symbolic link, and only regular files are taken, so a job cannot make the worker
send (or write, on a restore) a file outside its folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.client import Client
from gpufleet.domain.checkpoints import MOST_FILES, SnapFile, Snapshot, is_temporary, path_problem
from gpufleet.errors import Conflict, GpufleetError
from gpufleet.wire import CheckpointOut, Restored

LOOK_SECONDS = 0.5  # between two looks at the folder
# what one look walks at most: entries of any kind (a million temporary names, or empty
# folders, cost no more), and folders deep (each holds a descriptor while it is walked:
# a deep tree must not use up those of the worker, which its other jobs need)
MOST_ENTRIES = 10 * MOST_FILES
MOST_DEPTH = 32
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CHUNK = 1 << 20

#: A file as a look saw it: (size, modification time in ns).
Seen = tuple[int, int]


class FolderError(Exception):
    """The folder cannot be read or written as a checkpoint folder (it is a link, or a
    path in it is not a plain file or folder)."""


def snapshot_of(out: CheckpointOut) -> Snapshot:
    """The wire's snapshot as the domain's."""
    files = tuple(SnapFile(f.path, f.sha256, f.size) for f in out.files)
    return Snapshot(
        out.id, out.job_id, out.attempt, out.created_at.timestamp(), files, dict(out.progress)
    )


@contextlib.contextmanager
def opened_dir(root: Path, rel: str) -> Iterator[int]:
    """A descriptor of folder ``rel`` under ``root`` (made if missing), reached without
    following a link at any step."""
    fd = os.open(root, _DIR)
    try:
        for part in [p for p in rel.split("/") if p not in ("", ".")]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                raise FolderError(f"{rel}: {part!r} is not a folder ({exc.strerror})") from exc
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def look(root: Path, rel: str, owner: int | None = None) -> dict[str, Seen]:
    """The regular files under folder ``rel`` of ``root`` (paths '/'-separated), each
    with its size and modification time; links, temporary names, names that are not
    UTF-8, files not owned by ``owner`` (when given: the job's user; a file it did not
    write is one it hard-linked there) and anything not a plain file are left out."""
    found: dict[str, Seen] = {}
    try:
        with opened_dir(root, rel) as fd:
            _walk(fd, "", found, owner, [MOST_ENTRIES])
    except FileNotFoundError:
        return {}
    return found


def _walk(fd: int, prefix: str, found: dict[str, Seen], owner: int | None, left: list[int]) -> None:
    with os.scandir(fd) as listing:  # read, then closed: one descriptor a level
        names = [e.name for e, _ in zip(listing, range(max(left[0], 0)), strict=False)]
    left[0] -= len(names)
    for name in names:
        path = prefix + name
        if len(found) >= MOST_FILES or not _utf8(name):
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue  # gone since the listing
        if stat.S_ISDIR(st.st_mode) and path.count("/") < MOST_DEPTH - 1:
            try:
                sub = os.open(name, _DIR, dir_fd=fd)
            except OSError:
                continue
            try:
                _walk(sub, path + "/", found, owner, left)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode) and not is_temporary(path) and _owned(st, owner):
            found[path] = (st.st_size, st.st_mtime_ns)


def _utf8(name: str) -> bool:
    """Whether a name read from the disk is UTF-8 (the server keeps only such paths)."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def _owned(st: os.stat_result, owner: int | None) -> bool:
    return owner is None or st.st_uid == owner


@contextlib.contextmanager
def open_file(root: Path, rel: str, path: str) -> Iterator[int]:
    """A read descriptor of regular file ``path`` in folder ``rel``, no link followed."""
    folder, _, name = path.rpartition("/")
    with opened_dir(root, f"{rel}/{folder}" if folder else rel) as dfd:
        fd = os.open(name, _FILE, dir_fd=dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FolderError(f"{path}: not a plain file")
        os.set_blocking(fd, True)
        yield fd
    finally:
        os.close(fd)


def hash_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, CHUNK):
        h.update(chunk)
    return h.hexdigest()


def fd_path(fd: int) -> Path:
    """A path that opens the very file ``fd`` is open on (never a path the job could
    swap for a link meanwhile)."""
    return Path(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}")


@dataclass
class Synced:
    """What one sync did: the snapshot it recorded (None: none was needed), the bytes it
    uploaded, and whether a file changed while it was read (the next look tries again)."""

    snapshot: Snapshot | None = None
    bytes: int = 0
    changed: bool = False


@dataclass
class FolderSync:
    """Keeps one attempt's checkpoint folder on the server. ``post`` records a snapshot
    (files, progress) and returns it; ``data`` uploads blobs (run in threads)."""

    root: Path  # the job's directory
    rel: str  # its checkpoint folder, relative to it
    data: Client
    post: Callable[[list[SnapFile], dict[str, int]], Awaitable[Snapshot]]
    owner: int | None = None  # the job's user, when it is not the worker's (--run-as)
    last: Snapshot | None = None  # the snapshot the folder holds now (restored, or sent)
    seen: dict[str, Seen] = field(default_factory=dict)  # the last look
    hashes: dict[str, tuple[Seen, str]] = field(default_factory=dict)
    on_server: set[str] = field(default_factory=set)  # blobs known to be there
    wanted: asyncio.Event = field(default_factory=asyncio.Event)  # the job asked for one
    sent_bytes: int = 0
    snapshots: int = 0
    closing: bool = False  # the job has ended: the loop stops after the sync it is in
    # the hashing and sending under way, in its thread: a cancelled sync leaves it running,
    # and the next sync waits for it rather than send the same bytes again beside it
    sending: asyncio.Future[tuple[list[SnapFile] | None, int]] | None = None

    def restored(self, snap: Snapshot, seen: dict[str, Seen]) -> None:
        """The folder holds ``snap`` as restored (``seen``: its files as written): an
        unchanged folder is never sent again."""
        self.last = snap
        self.on_server.update(f.sha256 for f in snap.files)
        by_path = {f.path: f.sha256 for f in snap.files}
        self.hashes = {p: (s, by_path[p]) for p, s in seen.items() if p in by_path}
        self.seen = dict(seen)

    async def loop(
        self, progress: Callable[[], dict[str, int]], say: Callable[[str], None]
    ) -> None:
        """Sync whenever the folder has settled with changes, or the job asks."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wanted.wait(), LOOK_SECONDS)
            if self.closing:
                return
            forced = self.wanted.is_set()
            self.wanted.clear()
            try:
                done = await self.sync(progress(), settled=not forced)
                if forced and done.changed:  # still being written: asked for, at the next look
                    asyncio.get_running_loop().call_later(LOOK_SECONDS, self.wanted.set)
            except Conflict:
                return  # the lease is gone: the job is being stopped
            except GpufleetError as exc:  # the server is away: the next look tries again
                say(f"checkpoint not kept yet: {exc.message}")
            except (FolderError, OSError) as exc:
                say(f"checkpoint not kept: {exc}")

    async def sync(self, progress: dict[str, int], settled: bool = True) -> Synced:
        """One look: with ``settled``, a snapshot only of a folder unchanged since the
        last look; without (the job asked, or it has ended), of the folder as it is."""
        now = await asyncio.to_thread(look, self.root, self.rel, self.owner)
        before, self.seen = self.seen, now
        if settled and now != before:
            return Synced()
        if self.last is not None and self._same_as_last(now):
            return Synced()
        if self.last is None and not now:  # nothing to keep yet: an empty folder is no snapshot
            return Synced()
        if self.sending is not None and not self.sending.done():
            await asyncio.wait([self.sending])  # what it sent is on_server now
            if not self.sending.cancelled():
                self.sending.exception()  # seen: a failed one is simply tried again
        self.sending = asyncio.ensure_future(asyncio.to_thread(self._send, now))
        files, sent = await asyncio.shield(self.sending)
        if files is None:  # a file changed while it was read: the next look tries again
            return Synced(bytes=sent, changed=True)
        self.last = await self.post(files, progress)
        self.snapshots += 1
        return Synced(self.last, sent)

    def _same_as_last(self, now: dict[str, Seen]) -> bool:
        assert self.last is not None
        known = {p: h for p, (s, h) in self.hashes.items() if now.get(p) == s}
        last = {f.path: f.sha256 for f in self.last.files}
        return known == last and set(now) == set(last)

    def _send(self, now: dict[str, Seen]) -> tuple[list[SnapFile] | None, int]:
        """Hash what changed and upload what the server lacks (in a thread): the files,
        or None when one changed meanwhile, and the bytes uploaded."""
        files: list[SnapFile] = []
        sent = 0
        for path, seen in sorted(now.items()):
            if path_problem(path) is not None:
                continue
            try:
                with open_file(self.root, self.rel, path) as fd:
                    st = os.fstat(fd)
                    if (st.st_size, st.st_mtime_ns) != seen or not _owned(st, self.owner):
                        return None, sent
                    sha = self._hash(path, seen, fd)
                    if sha not in self.on_server:
                        os.lseek(fd, 0, os.SEEK_SET)
                        sent += self.data.put_blob(fd_path(fd), sha).sent
                        self.on_server.add(sha)
                    st = os.fstat(fd)
                    if (st.st_size, st.st_mtime_ns) != seen:
                        return None, sent
            except FileNotFoundError:
                return None, sent
            files.append(SnapFile(path, sha, seen[0]))
        self.sent_bytes += sent
        return files, sent

    def _hash(self, path: str, seen: Seen, fd: int) -> str:
        cached = self.hashes.get(path)
        if cached is not None and cached[0] == seen:
            return cached[1]
        sha = hash_fd(fd)
        self.hashes[path] = (seen, sha)
        return sha


def restore(data: Client, snap: Snapshot, root: Path, rel: str) -> tuple[Restored, dict[str, Seen]]:
    """Write ``snap``'s files into folder ``rel`` of ``root`` (a new attempt's, empty
    but for its inputs), each blob downloaded once and verified, then moved into place
    (copied for a second path with the same bytes); what was restored, and the files as
    written. Blocking: run it in a thread."""
    began = time.monotonic()
    paths: dict[str, list[str]] = {}
    for f in snap.files:
        problem = path_problem(f.path)
        if problem is not None:
            raise FolderError(problem)
        paths.setdefault(f.sha256, []).append(f.path)
    with opened_dir(root, rel):
        pass  # the folder exists, reached without a link
    # a new folder of its own: a name that an input could have placed a link at would
    # send the worker's writes, and its clean-up, elsewhere
    staging = Path(tempfile.mkdtemp(prefix=".gpufleet-restore-", dir=root))
    try:
        for sha, named in paths.items():
            got = staging / sha
            data.get_blob(sha, got)
            for path in named[:-1]:
                _place(got, root, rel, path, move=False)
            _place(got, root, rel, named[-1], move=True)
    finally:
        for p in staging.iterdir():
            p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            staging.rmdir()
    seen = look(root, rel)
    took = time.monotonic() - began
    done = Restored(snapshot=snap.id, files=len(snap.files), bytes=snap.bytes, seconds=took)
    return done, seen


def _place(source: Path, root: Path, rel: str, path: str, move: bool) -> None:
    """Put ``source`` at ``path`` in the folder (moved, or copied), never through a
    link: the folders on the way are reached by descriptor."""
    folder, _, name = path.rpartition("/")
    with opened_dir(root, f"{rel}/{folder}" if folder else rel) as dfd:
        if move:
            os.rename(source, name, dst_dir_fd=dfd)
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=dfd)
        with os.fdopen(fd, "wb") as out, source.open("rb") as src:
            while chunk := src.read(CHUNK):
                out.write(chunk)
