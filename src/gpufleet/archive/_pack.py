"""Writing archives: packages from folders, zips and files; artifacts from globs."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO

import zstandard

from gpufleet.errors import GpufleetError, UnsafeArchive

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

from gpufleet.archive._rules import (
    _LEVEL,
    _MAGIC,
    _UNLIMITED,
    DEFAULT_EXCLUDES,
    IGNORE_FILE,
    Packed,
    _Checker,
    _escaping_links,
    _link_problem,
    _name_problem,
    _normalize,
)

# --- packing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    """One entry to write: where its content comes from, with normalized metadata."""

    path: str
    kind: str
    mode: int = 0o755
    size: int = 0
    target: str = ""
    reader: Callable[[], IO[bytes]] | None = None


def _mode(st_mode: int) -> int:
    return 0o755 if st_mode & 0o111 else 0o644


def _special_name(st_mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(st_mode):
            return name
    return "special file"


def _open_regular(path: str, size: int) -> IO[bytes]:
    """Open a file the walk found, refusing if it became a link or changed size since."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        raise GpufleetError(f"{path} changed while it was being packed; pack again when it is done")
    return os.fdopen(fd, "rb")


def _relative_target(root: str, rel: str, target: str) -> str:
    """An absolute link target inside ``root`` made relative, so the tree can move."""
    if not target.startswith("/"):
        return target
    norm = os.path.normpath(target)
    # the folder may be reached through a link (/tmp -> /private/tmp): try both spellings
    for base in dict.fromkeys((root, os.path.realpath(root))):
        if norm == base or norm.startswith(base.rstrip("/") + "/"):
            return os.path.relpath(norm, os.path.join(base, os.path.dirname(rel)))
    return target


def _excluded(rel: str, name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, p) or ("/" in p and fnmatchcase(rel, p)) for p in patterns)


class _Tree:
    """Items read off a directory on disk, never following a symlink.

    What happens to an entry that cannot go in an archive is the caller's policy: pack_path
    refuses (the user can fix their folder); pack_outputs skips and reports it (a job's
    output is not under the user's control).
    """

    def __init__(self, root: Path, scope: str, refuse: bool, excludes: Sequence[str] = ()) -> None:
        self._root = os.path.abspath(root)
        self._scope = scope
        self._refuse = refuse
        self._excludes = excludes
        self._walked: set[str] = set()
        self.items: dict[str, _Item] = {}
        self.skipped: list[str] = []

    def problem(self, label: str, why: str) -> None:
        if self._refuse:
            raise UnsafeArchive(
                f"{os.path.join(self._root, label)}: {why}; remove it or list it in {IGNORE_FILE}"
            )
        self.skipped.append(f"{label}: {why}")

    def add_tree(self, top: str) -> None:
        """Add ``top`` ("" for the root) and, when it is a directory, everything below."""
        stack = [top]
        while stack:
            rel = stack.pop()
            if rel in self._walked:
                continue
            self._walked.add(rel)
            if rel == "" or self._add(rel):
                stack.extend(self._children(rel))

    def _children(self, rel: str) -> list[str]:
        with os.scandir(os.path.join(self._root, rel)) as it:
            names = [e.name for e in it]
        paths = [f"{rel}/{n}" if rel else n for n in names]
        return [p for p, n in zip(paths, names, strict=True) if not _excluded(p, n, self._excludes)]

    def _add(self, rel: str) -> bool:
        """Add one path; True when it is a directory to descend into."""
        path = os.path.join(self._root, rel)
        st = os.lstat(path)
        why = _name_problem(rel)
        if why:
            self.problem(rel, why)
        elif stat.S_ISDIR(st.st_mode):
            self.items[rel] = _Item(rel, "dir")
            return True
        elif stat.S_ISREG(st.st_mode):
            opener = partial(_open_regular, path, st.st_size)
            self.items[rel] = _Item(rel, "file", _mode(st.st_mode), st.st_size, reader=opener)
        elif stat.S_ISLNK(st.st_mode):
            self._link(rel, os.readlink(path))
        else:
            self.problem(rel, f"{_special_name(st.st_mode)} cannot go in an archive")
        return False

    def _link(self, rel: str, raw: str) -> None:
        target = _relative_target(self._root, rel, raw)
        if _link_problem(rel, target):
            self.problem(f"{rel} -> {raw}", f"link leaves {self._scope}")
        else:
            self.items[rel] = _Item(rel, "link", 0o777, target=target)

    def sorted_items(self) -> list[_Item]:
        """All items with their parent directories, sorted, minus links escaping via links."""
        for rel in list(self.items):
            parts = rel.split("/")
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                self.items.setdefault(parent, _Item(parent, "dir"))
        # dropping a link can change how others resolve, so repeat until none escapes
        while escaping := _escaping_links(
            {p: item.target for p, item in self.items.items() if item.kind == "link"}
        ):
            for rel, why in escaping.items():
                self.problem(f"{rel} -> {self.items.pop(rel).target}", why)
        return [self.items[p] for p in sorted(self.items)]


def _ignore_patterns(folder: Path) -> list[str]:
    """Patterns from the folder's .gpufleetignore: one a line, '#' starts a comment."""
    path = folder / IGNORE_FILE
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [p for line in lines if (p := line.strip().strip("/")) and not p.startswith("#")]


def _zip_item(label: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> _Item:
    name = info.filename.rstrip("/") if info.is_dir() else info.filename
    why = _name_problem(name)
    if why:
        raise UnsafeArchive(f"{label} {info.filename!r}: {why}")
    path = _normalize(name)
    mode = info.external_attr >> 16  # unix st_mode, when the zip was made on unix
    if info.is_dir() or stat.S_ISDIR(mode):
        return _Item(path, "dir")
    if stat.S_ISLNK(mode):
        target = zf.read(info).decode("utf-8", "surrogateescape")
        if _link_problem(path, target):
            raise UnsafeArchive(f"{label} {info.filename!r}: link to {target!r} leaves the zip")
        return _Item(path, "link", 0o777, target=target)
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
        raise UnsafeArchive(f"{label} {info.filename!r}: {_special_name(mode)} not allowed")
    return _Item(path, "file", _mode(mode), info.file_size, reader=partial(zf.open, info))


def _zip_items(src: Path, zf: zipfile.ZipFile, root: str = "") -> list[_Item]:
    label = f"{src}: entry"
    items: dict[str, _Item] = {}
    for info in zf.infolist():
        item = _zip_item(label, zf, info)
        if root:  # only what lies under the folder ``root``, which becomes the root
            if item.path != root and not item.path.startswith(root + "/"):
                continue
            item = replace(item, path=item.path[len(root) + 1 :])
            if item.kind == "link" and _link_problem(item.path, item.target):
                raise UnsafeArchive(f"{label} {info.filename!r}: link leaves {root}/")
        if not item.path and item.kind == "dir":
            continue  # "./": the root itself
        if item.path in items:
            raise UnsafeArchive(f"{label} {info.filename!r}: duplicate name")
        items[item.path] = item
    for path in list(items):
        parts = path.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            items.setdefault(parent, _Item(parent, "dir"))  # zips often list only files
    return [items[p] for p in sorted(items)]


@contextmanager
def _sources(src: Path, excludes: Sequence[str], root: str = "") -> Iterator[list[_Item]]:
    """The sorted items that pack_path writes for ``src``: a folder, a .zip or one file
    (for a zip, only its folder ``root`` when given)."""
    try:
        st = src.stat()
    except FileNotFoundError:
        raise GpufleetError(
            f"{src} does not exist; pass a folder, a .zip file or a single file to pack"
        ) from None
    if stat.S_ISDIR(st.st_mode):
        tree = _Tree(src, "the folder", True, [*excludes, *_ignore_patterns(src)])
        tree.add_tree("")
        yield tree.sorted_items()
    elif stat.S_ISREG(st.st_mode) and src.suffix.lower() == ".zip":
        with zipfile.ZipFile(src) as zf:
            yield _zip_items(src, zf, root.strip("/"))
    elif stat.S_ISREG(st.st_mode):
        opener = partial(_open_regular, os.path.realpath(src), st.st_size)
        yield [_Item(src.name, "file", _mode(st.st_mode), st.st_size, reader=opener)]
    else:
        raise UnsafeArchive(f"{src}: {_special_name(st.st_mode)} cannot be packed")


@contextmanager
def _packing(src: Path) -> Iterator[None]:
    try:
        yield
    except zipfile.BadZipFile as exc:
        raise GpufleetError(f"{src} is not a valid zip file: {exc}") from exc
    except OSError as exc:
        raise GpufleetError(f"could not pack {src}: {exc}") from exc


def _check_items(items: Sequence[_Item], label: str) -> Packed:
    # the same rules scan applies, so what packs here unpacks on the worker
    checker = _Checker(label, _UNLIMITED, _UNLIMITED.max_bytes)
    for item in items:
        checker.add(item.path, item.kind, item.size, item.target)
    return checker.finish()


def _write_tar(items: Sequence[_Item], sink: BinaryIO | io.BufferedIOBase) -> None:
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for item in items:
            info = tarfile.TarInfo(item.path)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = item.mode
            if item.kind == "dir":
                info.type = tarfile.DIRTYPE
            elif item.kind == "link":
                info.type = tarfile.SYMTYPE
                info.linkname = item.target
            else:
                info.size = item.size
            if item.reader is None:
                tar.addfile(info)
                continue
            with item.reader() as data:
                tar.addfile(info, data)


def _write_archive(items: Sequence[_Item], out: BinaryIO) -> None:
    # threads=0 compresses on this thread alone: the same input always gives the same frame
    compressor = zstandard.ZstdCompressor(level=_LEVEL, threads=0)
    with compressor.stream_writer(out, closefd=False) as zstream:
        _write_tar(items, zstream)


def pack_path(
    src: Path, out: BinaryIO, excludes: Sequence[str] = DEFAULT_EXCLUDES, root: str = ""
) -> Packed:
    """Write a deterministic archive of ``src`` to ``out``.

    ``src`` is a folder (its contents become the archive root), a .zip file (its entries
    become the root; with ``root``, the entries of that folder of the zip) or a single
    regular file (stored under its name). Names matching an
    exclude pattern, or one from the folder's ``.gpufleetignore`` (patterns with a "/" match
    the whole relative path), are left out. Raises :class:`UnsafeArchive` naming the path for
    symlinks leaving ``src``, special files and unsafe zip entries.
    """
    with _packing(src), _sources(src, excludes, root) as items:
        packed = _check_items(items, f"{src}: entry")
        _write_archive(items, out)
    return packed


def _pattern_parts(pattern: str) -> list[str]:
    why = _name_problem(pattern) if pattern else None
    if why:
        raise UnsafeArchive(
            f"output pattern {pattern!r}: {why}; patterns are relative to the job directory"
        )
    return [part for part in pattern.split("/") if part not in ("", ".")]


def _real_dir_names(path: str) -> list[str]:
    """Names in ``path`` when it is a real directory (not a link to one), else none."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return []
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _part_matches(part: str, name: str) -> bool:
    # like glob: wildcards do not match hidden names unless the pattern asks for a dot
    if _MAGIC.search(part) and name.startswith(".") and not part.startswith("."):
        return False
    return fnmatchcase(name, part)


def _glob(root: str, parts: Sequence[str]) -> set[str]:
    """Relative paths under ``root`` matching the pattern parts, never through a symlink."""
    found: set[str] = set()
    seen: set[tuple[str, int]] = set()
    stack: list[tuple[str, int]] = [("", 0)]
    while stack:
        rel, i = stack.pop()
        if (rel, i) in seen:
            continue
        seen.add((rel, i))
        if i == len(parts):
            found.add(rel)
            continue
        names = _real_dir_names(os.path.join(root, rel)) if rel else os.listdir(root)
        paths = {name: f"{rel}/{name}" if rel else name for name in names}
        if parts[i] == "**":
            stack.append((rel, i + 1))
            stack.extend((p, i) for n, p in paths.items() if not n.startswith("."))
        else:
            stack.extend((p, i + 1) for n, p in paths.items() if _part_matches(parts[i], n))
    return found


def pack_outputs(workdir: Path, patterns: Sequence[str], out: BinaryIO) -> Packed:
    """Write a deterministic archive of a job's artifacts to ``out``.

    Each pattern is a glob relative to ``workdir`` ("outputs", "*.pt", "model/**"); a
    matched directory brings its whole subtree and parents of matches come along as
    directories. Symlinks leaving ``workdir`` and special files are skipped and listed in
    :attr:`Packed.skipped`. No match gives an archive with no entries.
    """
    parts = [_pattern_parts(pattern) for pattern in patterns]
    if not workdir.is_dir():
        raise GpufleetError(f"job directory {workdir} does not exist or is not a directory")
    tree = _Tree(workdir, "the job directory", False)
    with _packing(workdir):
        for rel in sorted({m for p in parts for m in _glob(os.path.abspath(workdir), p)}):
            tree.add_tree(rel)
        items = tree.sorted_items()
        packed = _check_items(items, f"{workdir}: output")
        _write_archive(items, out)
    return replace(packed, skipped=tuple(sorted(tree.skipped)))


class _HashSink(io.BufferedIOBase):
    """A write-only stream that only hashes what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer, /) -> int:
        view = memoryview(data)
        self.digest.update(view)
        return view.nbytes


def tree_digest(root: Path) -> str:
    """SHA-256 (hex) of a folder's or file's content: the uncompressed tar stream that
    :func:`pack_path` would build (same excludes), hashed on the fly."""
    sink = _HashSink()
    with _packing(root), _sources(root, DEFAULT_EXCLUDES) as items:
        _check_items(items, f"{root}: entry")
        _write_tar(items, sink)
    return sink.digest.hexdigest()
