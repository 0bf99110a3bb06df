"""The worker's package cache: blobs kept by hash, bounded in size, least recently used
evicted first. A dataset used by ten jobs crosses the network once per worker.

Several workers on one machine may share the folder: each download goes to a temp name
of its own and is renamed into place (same hash, same bytes, so a double download is
harmless), and a blob evicted by a neighbour is fetched again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import psutil

#: Downloads a blob, verified, into a path; given a third argument, tells it each
#: number of bytes received.
Fetch = Callable[..., int]
Received = Callable[[int], None]
LEFTOVER_IDLE = 600.0


class BlobCache:
    """Blobs in ``root/<sha256>``; ``fetch`` downloads (verified) into a given path."""

    def __init__(self, root: Path, max_bytes: int, fetch: Fetch) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._fetch = fetch
        self._locks: dict[str, asyncio.Lock] = {}
        self._in_use: dict[str, int] = {}
        root.mkdir(parents=True, exist_ok=True)
        self.leftovers = remove_leftovers(root, ".")

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    def has(self, sha256: str) -> bool:
        """Whether the blob is cached now (a neighbour may evict it yet)."""
        return self.path(sha256).is_file()

    async def get(self, sha256: str, received: Received | None = None) -> tuple[Path, bool]:
        """The blob's local path and whether it was already cached. Concurrent jobs that
        need the same blob share one download. Call :meth:`release` when done with it.
        ``received``: told each number of bytes the download receives (in its thread)."""
        lock = self._locks.setdefault(sha256, asyncio.Lock())
        async with lock:
            self._in_use[sha256] = self._in_use.get(sha256, 0) + 1
            try:
                return await self._get(sha256, received)
            except BaseException:
                self.release(sha256)
                raise

    async def _get(self, sha256: str, received: Received | None) -> tuple[Path, bool]:
        path = self.path(sha256)
        with contextlib.suppress(FileNotFoundError):  # gone: a neighbour evicted it
            os.utime(path)  # most recently used
            return path, True
        temp = self.root / f".{sha256}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            more = () if received is None else (received,)
            await asyncio.to_thread(self._fetch, sha256, temp, *more)
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
            temp.with_name(temp.name + ".partial").unlink(missing_ok=True)
        await asyncio.to_thread(self.evict)
        return path, False

    def release(self, sha256: str) -> None:
        left = self._in_use.get(sha256, 1) - 1
        if left <= 0:
            self._in_use.pop(sha256, None)
        else:
            self._in_use[sha256] = left

    def evict(self) -> list[str]:
        """Remove least recently used blobs (not in use) until the cache fits its bound."""
        entries = []
        for p in self.root.iterdir():
            if p.is_file() and not p.name.startswith("."):  # not a download in progress
                st = p.stat()
                entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, p in sorted(entries):
            if total <= self.max_bytes:
                break
            if p.name in self._in_use:
                continue
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            total -= size
            removed.append(p.name)
        return removed


def remove_leftovers(folder: Path, prefix: str, idle: float = LEFTOVER_IDLE) -> int:
    """Remove temp files named ``PREFIX<anything>.<pid>.<anything>`` (downloads, archives
    in the making) that a killed worker left: their process is gone *and* nothing wrote
    them for ``idle`` seconds (a worker in another container on a shared cache may have a
    pid this one cannot see). Returns how many went."""
    removed, cutoff = 0, time.time() - idle
    for p in folder.glob(prefix + "*"):
        pid = _pid_in(p.name)
        if pid is None or psutil.pid_exists(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            if p.is_file() and p.stat().st_mtime < cutoff:
                p.unlink()
                removed += 1
    return removed


def _pid_in(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
