"""Build and unpack gpufleet's package and artifact archives, safely.

A gpufleet archive is a PAX tar stream in one zstd frame (level 3, single-threaded). Entries
are sorted by path, directories come before their contents, and owners, times and permission
bits are normalized, so the same content always gives the same bytes and the same SHA-256.

Reading never trusts the archive. :func:`scan` and :func:`extract` put every member through
one set of rules (``_Checker``) and refuse with :class:`UnsafeArchive` anything that could
write outside the target, create a device, or expand past :class:`Limits`. :func:`extract`
unpacks into a hidden directory next to the target and renames it into place only once the
whole archive passed, so a refused or damaged archive leaves nothing behind.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import shutil
import stat
import sys
import tarfile
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO, NoReturn, Self

import zstandard

from gpufleet.errors import GpufleetError, InsufficientStorage, UnsafeArchive

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

SUFFIX = ".tar.zst"
DEFAULT_EXCLUDES: tuple[str, ...] = (".git", "__pycache__", "*.pyc", ".DS_Store")
IGNORE_FILE = ".gpufleetignore"

_LEVEL = 3
_WINDOW = 1 << 27  # 128 MiB, what zstd itself allows by default; bounds decoder memory
_CHUNK = 1 << 20
_META_MAX = 1 << 20  # tar headers (pax records, long names) allowed between two members' data
_ENTRY_OVERHEAD = 16 << 10  # header and padding bytes credited per entry toward the total
_MAX_HOPS = 40  # symlinks followed while resolving one target, as Linux does
_DRIVE = re.compile(r"^[A-Za-z]:")
_MAGIC = re.compile(r"[*?[]")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_TAR_KINDS = {
    tarfile.REGTYPE: "file",
    tarfile.AREGTYPE: "file",
    tarfile.CONTTYPE: "file",
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "link",
}
_TAR_REFUSED = {
    tarfile.LNKTYPE: "hard link",
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "fifo",
}


@dataclass(frozen=True)
class Limits:
    """How much one archive may unpack to; past these it is refused as a bomb."""

    max_bytes: int = 1 << 40  # total unpacked file bytes
    max_files: int = 1_000_000  # entries of any kind
    max_ratio: float = 200.0  # unpacked / compressed ...
    ratio_floor: int = 1 << 30  # ... only enforced past this many unpacked bytes

    def allowed(self, compressed_size: int | None) -> int:
        """The unpacked-byte cap for an archive of ``compressed_size`` bytes (None: unknown)."""
        if compressed_size is None:
            return self.max_bytes
        by_ratio = int(self.max_ratio * compressed_size)
        return min(self.max_bytes, max(self.ratio_floor, by_ratio))


_UNLIMITED = Limits(max_bytes=sys.maxsize, max_files=sys.maxsize)


@dataclass(frozen=True, slots=True)
class Entry:
    """One archive member: POSIX relative path, size (files only) and kind."""

    path: str
    size: int
    kind: str  # "file" | "dir" | "link"


@dataclass(frozen=True)
class Packed:
    """What an archive holds: its entries, how many regular files and their total bytes."""

    entries: tuple[Entry, ...]
    files: int
    bytes: int
    skipped: tuple[str, ...] = ()  # pack_outputs only: "path: why it was left out"


# --- the rules -----------------------------------------------------------------------------


def _name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a path inside an archive, or None when it can."""
    if not name:
        return "empty name"
    if "\x00" in name:
        return "NUL byte in name"
    if name.startswith("/"):
        return "absolute path"
    if name.startswith("\\") or _DRIVE.match(name):
        return "Windows absolute path"
    if "\\" in name:
        return "backslash in name (a Windows path)"
    if ".." in name.split("/"):
        return "'..' component"
    return None


def _normalize(name: str) -> str:
    # "a//b", "./a" and "a/." all name "a/b" or "a"; one spelling keeps the duplicate check honest
    return "/".join(part for part in name.split("/") if part not in ("", "."))


def _link_problem(path: str, target: str) -> str | None:
    """Why a symlink at ``path`` to ``target`` is unsafe, judged lexically from its folder."""
    if not target or "\x00" in target:
        return "empty or NUL link target"
    if target.startswith(("/", "\\")) or _DRIVE.match(target):
        return f"absolute link target {target!r}"
    depth = path.count("/")
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return f"link target {target!r} leaves the archive root"
        elif part not in ("", "."):
            depth += 1
    return None


def _resolve_problem(links: Mapping[str, str], path: str) -> str | None:
    """Follow the link at ``path`` through the archive's other links, as the kernel would.

    Each link alone passes the lexical check, yet "a/b/c -> ../.." with "e -> a/b/c/.."
    leaves the root once c is followed; only resolving over all links together sees that.
    """
    stack = path.split("/")[:-1]
    pending = deque(links[path].split("/"))
    hops = 0
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                return "link resolves outside the archive root through other links"
            stack.pop()
            continue
        stack.append(part)
        target = links.get("/".join(stack))
        if target is None:
            continue
        hops += 1
        if hops > _MAX_HOPS or target.startswith("/"):
            return "link loop or link chain leaving the archive root"
        stack.pop()
        pending.extendleft(reversed(target.split("/")))
    return None


def _escaping_links(links: Mapping[str, str]) -> dict[str, str]:
    """The links (sorted) that leave the root only by way of other links, with why."""
    found = {path: _resolve_problem(links, path) for path in sorted(links)}
    return {path: why for path, why in found.items() if why}


class _Checker:
    """The rules every member passes, in archive order: for packing, scan and extract."""

    def __init__(self, label: str, limits: Limits, cap: int) -> None:
        self._label = label
        self._limits = limits
        self._cap = cap
        self._kinds: dict[str, str] = {}
        self._implied: set[str] = set()  # directories that earlier members live in
        self.links: dict[str, str] = {}
        self.entries: list[Entry] = []
        self.files = 0
        self.bytes = 0

    def refuse(self, name: str, rule: str) -> NoReturn:
        raise UnsafeArchive(f"{self._label} {name!r}: {rule}", detail={"path": name, "rule": rule})

    def add(self, raw: str, kind: str, size: int = 0, target: str = "") -> Entry | None:
        """Check one member; its Entry, or None for the root directory itself ("./")."""
        problem = _name_problem(raw)
        if problem:
            self.refuse(raw, problem)
        name = _normalize(raw)
        if not name:
            if kind == "dir":
                return None
            self.refuse(raw, "names the archive root itself")
        size = size if kind == "file" else 0
        self._count(name, kind, size)
        self._place(name, kind)
        if kind == "link":
            problem = _link_problem(name, target)
            if problem:
                self.refuse(name, problem)
            self.links[name] = target
        entry = Entry(name, size, kind)
        self.entries.append(entry)
        return entry

    def _count(self, name: str, kind: str, size: int) -> None:
        if len(self.entries) >= self._limits.max_files:
            self.refuse(name, f"more than {self._limits.max_files} entries")
        self.files += kind == "file"
        self.bytes += size
        if self.bytes > self._cap:
            # checked on the declared size, before any of this member's data is decompressed
            self.refuse(
                name,
                f"unpacked size passes the limit of {self._cap} bytes "
                "(a decompression bomb, or an archive too large for this machine's limits)",
            )

    def _place(self, name: str, kind: str) -> None:
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            held = self._kinds.get(parent)
            if held in ("link", "file"):
                self.refuse(name, f"its parent {parent!r} is a {held} in this archive")
            self._implied.add(parent)
        if name in self._kinds:
            self.refuse(name, "duplicate name")
        if kind != "dir" and name in self._implied:
            self.refuse(name, "earlier members use this name as a directory")
        self._kinds[name] = kind

    def finish(self) -> Packed:
        """Run the whole-archive rules and return what was checked."""
        for path, why in _escaping_links(self.links).items():
            self.refuse(path, why)
        return Packed(tuple(self.entries), self.files, self.bytes)


# --- reading -------------------------------------------------------------------------------


# the zero block that ends an archive; a real tarfile class that typeshed leaves out
_EOF_HEADER: type[tarfile.HeaderError] = vars(tarfile)["EOFHeaderError"]


class _Member(tarfile.TarInfo):
    """A TarInfo that will not let a damaged or missing header pass for the end.

    tarfile quietly ends the archive at a bad header after the first one; a gpufleet archive
    always ends with a zero block, so anything else is truncation or corruption.
    """

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> Self:
        try:
            return super().fromtarfile(tar)
        except _EOF_HEADER:
            raise  # a zero block: the archive ends here, as it should
        except tarfile.HeaderError as exc:
            raise tarfile.ReadError(f"damaged or missing tar header ({exc})") from None


class _Meter:
    """The decompressed tar stream, cut off once it runs past what the members so far allow.

    Member data is bounded by the size check in _Checker before it is read; this bounds
    everything else (pax records, long names, junk) so memory and time never depend on what
    an archive declares.
    """

    def __init__(self, raw: BinaryIO, cap: int) -> None:
        self._raw = raw
        self._cap = cap
        self.count = 0
        self.limit = _META_MAX

    def allow(self, data_end: int, entries: int) -> None:
        total = self._cap + _META_MAX + entries * _ENTRY_OVERHEAD
        self.limit = min(data_end + _META_MAX, total)

    def read(self, size: int) -> bytes:
        data = self._raw.read(size)
        self.count += len(data)
        if self.count > self.limit:
            raise UnsafeArchive(
                f"the archive expands past {self.limit} bytes here: oversized tar headers, "
                "trailing data or a decompression bomb"
            )
        return data

    def write(self, data: bytes) -> int:
        raise io.UnsupportedOperation("read-only stream")

    def tell(self) -> int:
        return self.count

    def seek(self, pos: int) -> int:
        raise io.UnsupportedOperation("stream is not seekable")

    def close(self) -> None:
        """The underlying stream belongs to the caller."""


def _tar_kind(info: tarfile.TarInfo) -> str:
    kind = _TAR_KINDS.get(info.type)
    if kind is None:
        what = _TAR_REFUSED.get(info.type, f"member type {info.type!r}")
        raise UnsafeArchive(f"archive member {info.name!r}: {what} not allowed")
    if info.sparse is not None:
        raise UnsafeArchive(f"archive member {info.name!r}: sparse file not allowed")
    if info.mode & 0o7000:
        raise UnsafeArchive(f"archive member {info.name!r}: setuid, setgid or sticky bit")
    return kind


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
        parts = entry.path.split("/")
        for i in range(1, len(parts)):
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


def _zip_items(src: Path, zf: zipfile.ZipFile) -> list[_Item]:
    label = f"{src}: entry"
    items: dict[str, _Item] = {}
    for info in zf.infolist():
        item = _zip_item(label, zf, info)
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
def _sources(src: Path, excludes: Sequence[str]) -> Iterator[list[_Item]]:
    """The sorted items that pack_path writes for ``src``: a folder, a .zip or one file."""
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
            yield _zip_items(src, zf)
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


def pack_path(src: Path, out: BinaryIO, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> Packed:
    """Write a deterministic archive of ``src`` to ``out``.

    ``src`` is a folder (its contents become the archive root), a .zip file (its entries
    become the root) or a single regular file (stored under its name). Names matching an
    exclude pattern, or one from the folder's ``.gpufleetignore`` (patterns with a "/" match
    the whole relative path), are left out. Raises :class:`UnsafeArchive` naming the path for
    symlinks leaving ``src``, special files and unsafe zip entries.
    """
    with _packing(src), _sources(src, excludes) as items:
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


# --- after unpacking -----------------------------------------------------------------------


def _plan_merge(src: Path, target: Path, rel: str, moves: list[tuple[Path, Path]]) -> list[str]:
    """Fill ``moves`` for merging src into target; return the clashing relative paths."""
    clashes: list[str] = []
    for child in sorted(os.listdir(src)):
        here, there = src / child, target / child
        path = f"{rel}/{child}" if rel else child
        if not os.path.lexists(there):
            moves.append((here, there))
        elif here.is_dir() and there.is_dir() and not (here.is_symlink() or there.is_symlink()):
            clashes += _plan_merge(here, there, path, moves)
        else:
            clashes.append(path)
    return clashes


def merge_into(src_dir: Path, target: Path) -> None:
    """Move the entries of ``src_dir`` into ``target`` (created if needed), then remove
    ``src_dir``. Directories on both sides merge; any other clash raises
    :class:`GpufleetError` before anything is moved."""
    for path in (src_dir, target):
        if not path.is_dir() and (path is src_dir or os.path.lexists(path)):
            raise GpufleetError(f"cannot merge {src_dir} into {target}: {path} is not a directory")
    moves: list[tuple[Path, Path]] = []
    clashes = _plan_merge(src_dir, target, "", moves)
    if clashes:
        raise GpufleetError(
            f"cannot merge {src_dir} into {target}: both provide {', '.join(clashes)}; "
            "rename one of them",
            detail={"paths": clashes},
        )
    target.mkdir(parents=True, exist_ok=True)
    for here, there in moves:
        shutil.move(here, there)
    shutil.rmtree(src_dir)


# --- hashing -------------------------------------------------------------------------------


def copy_hashing(src: BinaryIO, dst: BinaryIO, chunk: int = _CHUNK) -> tuple[str, int]:
    """Copy ``src`` to ``dst``; return the SHA-256 (hex) and the number of bytes copied."""
    digest = hashlib.sha256()
    total = 0
    while data := src.read(chunk):
        digest.update(data)
        dst.write(data)
        total += len(data)
    return digest.hexdigest(), total


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while data := f.read(_CHUNK):
            digest.update(data)
    return digest.hexdigest()
