"""Entries, limits and the safety rules every archive member goes through."""

from __future__ import annotations

import errno
import io
import re
import sys
import tarfile
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, NoReturn, Self

from gpufleet.errors import UnsafeArchive

if TYPE_CHECKING:
    pass


SUFFIX = ".tar.zst"
DEFAULT_EXCLUDES: tuple[str, ...] = (".git", "__pycache__", "*.pyc", ".DS_Store")
IGNORE_FILE = ".gpufleetignore"

_LEVEL = 3
_WINDOW = 1 << 27  # 128 MiB, what zstd itself allows by default; bounds decoder memory
_CHUNK = 1 << 20
# No system makes longer paths (Linux's PATH_MAX); nothing real nests deeper.
MAX_NAME = 4096
MAX_DEPTH = 256
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
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
        return f"name longer than {MAX_NAME} bytes"
    parts = name.split("/")
    if ".." in parts:
        return "'..' component"
    if len(parts) > MAX_DEPTH:
        return f"more than {MAX_DEPTH} levels of folders"
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
        # The tree of names, one node per (parent node, name): placing a member costs one
        # step per level, not a string per parent (a deep name must not cost quadratic time).
        self._nodes: dict[tuple[int, str], int] = {}
        self._kinds: dict[int, str] = {}  # node -> kind of the member that named it
        self._implied: set[int] = set()  # nodes that earlier members live in
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
        node = 0  # the archive root
        for depth, part in enumerate(parts[:-1]):
            node = self._node(name, node, part)
            held = self._kinds.get(node)
            if held in ("link", "file"):
                parent = "/".join(parts[: depth + 1])
                self.refuse(name, f"its parent {parent!r} is a {held} in this archive")
            self._implied.add(node)
        node = self._node(name, node, parts[-1])
        if node in self._kinds:
            self.refuse(name, "duplicate name")
        if kind != "dir" and node in self._implied:
            self.refuse(name, "earlier members use this name as a directory")
        self._kinds[node] = kind

    def _node(self, name: str, parent: int, part: str) -> int:
        node = self._nodes.get((parent, part))
        if node is None:
            if len(self._nodes) >= 2 * self._limits.max_files:
                self.refuse(name, f"more than {2 * self._limits.max_files} paths")
            node = self._nodes[(parent, part)] = len(self._nodes) + 1
        return node

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
