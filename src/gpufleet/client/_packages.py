"""Turning local folders and zips into job inputs: a deterministic archive uploaded once.

Building a package archive reads every byte, so the client remembers, per source path,
a fingerprint of what it saw (each file's path, size, mtime and mode, as ``make`` and
``rsync`` judge change) and the blob that came out. An unchanged folder is not re-read:
its blob id is known, a ``HEAD`` confirms the server has it, and nothing is sent.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from gpufleet import archive
from gpufleet.client._client import Client
from gpufleet.client._transfer import Progress
from gpufleet.domain.models import covering_mount
from gpufleet.errors import GpufleetError
from gpufleet.wire import InputModel, WorkerOut

MAX_REMEMBERED = 1000
#: Steps the caller may show: ("pack", total bytes), ("upload", total bytes).
StepFactory = Callable[[str, str, int], Progress]


def _no_steps(_what: str, _label: str, _total: int) -> Progress:
    return lambda _n: None


@dataclass(frozen=True)
class PackageResult:
    input: InputModel
    sent: int  # body bytes uploaded (0: the server had it)
    reused: bool  # the fingerprint matched: nothing was re-read


def fingerprint(path: Path) -> str:
    """A digest of the stat data of every file under ``path``."""
    h = hashlib.sha256(str(path).encode())
    for p in sorted(_walk(path)):
        st = p.lstat()
        line = f"{p.relative_to(path.parent)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}\n"
        h.update(line.encode())
    return h.hexdigest()


def _walk(path: Path) -> Iterable[Path]:
    if not path.is_dir():
        yield path
        return
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            yield Path(root) / name


class Remembered:
    """fingerprint -> blob id, in the user's cache dir."""

    def __init__(self, file: Path | None = None) -> None:
        self.file = file or Path(platformdirs.user_cache_dir("gpufleet")) / "packages.json"

    def load(self) -> dict[str, str]:
        try:
            data = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> str | None:
        value = self.load().get(key)
        return value if isinstance(value, str) else None

    def put(self, key: str, sha256: str) -> None:
        data = self.load()
        data[key] = sha256
        while len(data) > MAX_REMEMBERED:
            data.pop(next(iter(data)))
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.file)


def workers_sharing(path: Path, workers: list[WorkerOut], pool: str) -> list[str]:
    """Names of the workers of ``pool`` that declared a mount holding ``path``: offline
    ones too, so a worker restarting (or one that left after a drain) does not cost a copy
    of a shared dataset; the job then waits for a worker that has the mount."""
    names = []
    for w in workers:
        if w.pool != pool:
            continue
        if covering_mount(str(path), w.capability.mounts) is not None:
            names.append(w.name)
    return names


def package(
    c: Client,
    path: Path,
    dest: str = ".",
    steps: StepFactory = _no_steps,
    remembered: Remembered | None = None,
) -> PackageResult:
    """Upload ``path`` (a folder, a zip or a file) as a package input, unless the server
    already has the same content."""
    path = path.expanduser().resolve()
    if not path.exists():
        raise GpufleetError(f"package {path}: no such file or folder")
    remembered = remembered or Remembered()
    key = fingerprint(path)
    known = remembered.get(key)
    if known is not None:
        size = c.has_blob(known)
        if size is not None:
            return PackageResult(_blob_input(known, size, dest, path), 0, True)
    with tempfile.TemporaryDirectory(prefix="gpufleet-pkg-") as tmp:
        built = Path(tmp) / f"{path.name}{archive.SUFFIX}"
        with open(built, "wb") as f:
            archive.pack_path(path, f)
        size = built.stat().st_size
        sent = c.put_blob(built, progress=steps("upload", path.name, size))
    remembered.put(key, sent.sha256)
    return PackageResult(_blob_input(sent.sha256, size, dest, path), sent.sent, False)


def _blob_input(sha256: str, size: int, dest: str, path: Path) -> InputModel:
    return InputModel(kind="blob", ref=sha256, size=size, dest=dest, label=path.name)


def mounted(path: Path, dest: str | None) -> InputModel:
    """A shared-mount path passed by reference, with the hash workers check it against."""
    path = path.expanduser().resolve()
    digest = archive.tree_digest(path)
    return InputModel(
        kind="path", ref=str(path), sha256=digest, dest=dest or path.name, label=str(path)
    )
