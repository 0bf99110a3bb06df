"""What a folder holds, judged without reading it: a fingerprint of its entries' stat data,
and a small file that remembers which digest a fingerprint had.

Reading a large shared dataset to hash it costs minutes; its stat data costs milliseconds.
A fingerprint covers every entry's path, type, mode, size, mtime, ctime, inode and device
(the root's path too). A content change that keeps all of them is not seen: writing a
file changes its mtime and ctime, and while a program can set mtime back (``touch -d``),
only the system clock moves ctime, so that takes root (or a clock set back, or a write
to the raw device). Over NFS, a client's attribute cache may show a file's old stat data
for up to ``actimeo`` seconds (3 to 60 by default) after another machine changed it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

MAX_REMEMBERED = 1000


def fingerprint(path: Path) -> str:
    """A digest of the stat data of ``path`` and every entry under it (links not followed)."""
    h = hashlib.sha256(str(path).encode())
    entries = [path]
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            entries.extend(Path(root) / name for name in dirs + files)
    for p in sorted(entries):
        st = p.lstat()
        fields = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        h.update(f"{p.relative_to(path.parent)}\0{fields}\n".encode())
    return h.hexdigest()


class Remembered:
    """fingerprint -> digest, in a JSON file (the newest MAX_REMEMBERED kept). A file that
    cannot be read is an empty memory, never an error."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def load(self) -> dict[str, str]:
        try:
            data = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> str | None:
        value = self.load().get(key)
        return value if isinstance(value, str) else None

    def put(self, key: str, digest: str) -> None:
        data = self.load()
        data.pop(key, None)
        data[key] = digest
        while len(data) > MAX_REMEMBERED:
            data.pop(next(iter(data)))
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_name(f".{self.file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.file)


def remembered_digest(
    path: Path, memory: Remembered, digest: Callable[[Path], str]
) -> tuple[str, bool]:
    """``digest(path)``, or the digest remembered for the fingerprint ``path`` has now;
    and whether it was remembered. A digest is remembered only when the fingerprint was
    the same before and after reading (a folder changing while it was read is not)."""
    before = fingerprint(path)
    known = memory.get(before)
    if known is not None:
        return known, True
    value = digest(path)
    if fingerprint(path) == before:
        memory.put(before, value)
    return value, False
