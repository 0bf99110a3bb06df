"""Reading archives: scan (check only) and extract (check, then unpack)."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO

import zstandard

from gpufleet.errors import GpufleetError, InsufficientStorage, UnsafeArchive

if TYPE_CHECKING:
    pass

from gpufleet.archive._rules import (
    _CHUNK,
    _NO_SPACE,
    _WINDOW,
    Entry,
    Limits,
    Packed,
    _Checker,
    _Member,
    _Meter,
    _tar_kind,
)


def _copy_to_fd(src: IO[bytes], fd: int) -> None:
    while chunk := src.read(_CHUNK):
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


class _Writer:
    """Creates checked members under a fresh directory, never following a symlink.

    _Checker has already ruled out parents that are links or files, and the directory is
    new and ours, so every parent on the way is a directory this writer made.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._dirs: set[str] = {""}

    def add(self, entry: Entry, info: tarfile.TarInfo, data: IO[bytes] | None) -> None:
        parent = entry.path.rpartition("/")[0]
        if parent not in self._dirs:  # most members live in a folder already made
            parts = parent.split("/")
            for i in range(1, len(parts) + 1):
                self._mkdir("/".join(parts[:i]))
        path = os.path.join(self._root, entry.path)
        if entry.kind == "dir":
            self._mkdir(entry.path)
        elif entry.kind == "link":
            os.symlink(info.linkname, path)
        elif data is not None:
            self._file(path, 0o755 if info.mode & 0o111 else 0o644, data)

    def _mkdir(self, rel: str) -> None:
        if rel in self._dirs:
            return
        path = os.path.join(self._root, rel)
        os.mkdir(path, 0o755)
        os.chmod(path, 0o755)  # not the umask's call: a worker unpacks for other users' jobs
        self._dirs.add(rel)

    def _file(self, path: str, mode: int, data: IO[bytes]) -> None:
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, mode)
        try:
            os.fchmod(fd, mode)
            _copy_to_fd(data, fd)
        finally:
            os.close(fd)


def _read(
    src: BinaryIO, limits: Limits, compressed_size: int | None, out: _Writer | None
) -> Packed:
    cap = limits.allowed(compressed_size)
    checker = _Checker("archive member", limits, cap)
    decompressor = zstandard.ZstdDecompressor(max_window_size=_WINDOW)
    with decompressor.stream_reader(src, closefd=False) as raw:
        meter = _Meter(raw, cap)
        with tarfile.open(fileobj=meter, mode="r|", tarinfo=_Member) as tar:
            # TarFile keeps every member it reads; streaming never needs them again, so drop
            # them to keep memory flat on archives with a million entries
            seen: list[tarfile.TarInfo] = vars(tar)["members"]
            while (info := tar.next()) is not None:
                seen.clear()
                kind = _tar_kind(info)
                entry = checker.add(info.name, kind, info.size, info.linkname)
                data_end = info.offset_data + (info.size if kind == "file" else 0)
                meter.allow(data_end, len(checker.entries))
                if out is not None and entry is not None:
                    out.add(entry, info, tar.extractfile(info) if kind == "file" else None)
    return checker.finish()


@contextmanager
def _reading(dest: Path | None) -> Iterator[None]:
    """Turn what a damaged stream or a full disk raises into errors that say where."""
    where = f"the archive for {dest}" if dest else "the archive"
    try:
        yield
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise UnsafeArchive(f"{where} is not a valid gpufleet archive: {exc}") from exc
    except OSError as exc:
        if dest and exc.errno in _NO_SPACE:
            raise InsufficientStorage(
                f"no space left on device while unpacking into {dest}; nothing was kept. "
                "Free some space (or point the worker's cache at a larger disk) and retry"
            ) from exc
        raise GpufleetError(f"could not read {where}: {exc}") from exc


def scan(src: BinaryIO, limits: Limits = Limits(), compressed_size: int | None = None) -> Packed:
    """Read a whole archive stream and apply every safety rule, writing nothing.

    ``compressed_size`` (when known) lets :class:`Limits` cap the expansion ratio.
    Raises :class:`UnsafeArchive` on the first member that breaks a rule.
    """
    with _reading(None):
        return _read(src, limits, compressed_size, None)


def extract(
    src: BinaryIO, dest: Path, limits: Limits = Limits(), compressed_size: int | None = None
) -> Packed:
    """Unpack an archive into ``dest``, which must not exist yet; all or nothing.

    Members are written into a hidden directory next to ``dest`` that is renamed to ``dest``
    at the end; on any error it is removed. Raises :class:`UnsafeArchive` for unsafe or
    corrupt archives and :class:`InsufficientStorage` when the disk fills up.
    """
    if os.path.lexists(dest):
        raise GpufleetError(
            f"{dest} already exists; extract only unpacks into a new directory, "
            "so remove it or choose another path"
        )
    with _reading(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        with _reading(dest):
            packed = _read(src, limits, compressed_size, _Writer(tmp))
            os.chmod(tmp, 0o755)
            if os.path.lexists(dest):
                raise GpufleetError(f"{dest} appeared while unpacking into it; nothing was kept")
            os.rename(tmp, dest)
    except BaseException:
        # whatever happened, a half-unpacked tree must never be mistaken for a whole one
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return packed
