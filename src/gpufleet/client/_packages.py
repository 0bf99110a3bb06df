"""Turning local folders and zips into job inputs: a deterministic archive uploaded once.

Building a package archive reads every byte, so the client remembers, per source path,
a fingerprint of what it saw (each entry's stat data: path, mode, size, mtime, ctime,
inode; see :mod:`gpufleet.archive._fingerprint`) and the blob that came out. An
unchanged folder is not re-read: its blob id is known, a ``HEAD`` confirms the server
has it, and nothing is sent. A shared-mount path's hash is remembered the same way.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from gpufleet import archive
from gpufleet.archive import Remembered
from gpufleet.client._client import Client
from gpufleet.domain.models import covering_mount
from gpufleet.errors import GpufleetError
from gpufleet.wire import InputModel, WorkerOut

if TYPE_CHECKING:  # a call that sends nothing does not import the transfers (httpx)
    from gpufleet.client._transfer import Progress, Sent

#: Steps the caller may show: ("pack", total bytes), ("upload", total bytes).
StepFactory = Callable[[str, str, int], "Progress"]


def _no_steps(_what: str, _label: str, _total: int) -> Progress:
    return lambda _n: None


@dataclass(frozen=True)
class PackageResult:
    input: InputModel
    sent: int  # body bytes uploaded (0: the server had it)
    reused: bool  # the fingerprint matched: nothing was re-read


def _cache_file(name: str) -> Path:
    return Path(platformdirs.user_cache_dir("gpufleet")) / name


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
    root: str = "",
) -> PackageResult:
    """Upload ``path`` (a folder, a zip or a file; of a zip, only its folder ``root`` when
    given) as a package input, unless the server already has the same content."""
    path = path.expanduser().resolve()
    if not path.exists():
        raise GpufleetError(f"package {path}: no such file or folder")
    remembered = remembered or Remembered(_cache_file("packages.json"))
    key = archive.fingerprint(path) + (f":{root}" if root else "")
    known = remembered.get(key)
    if known is not None:
        size = c.has_blob(known)
        if size is not None:
            return PackageResult(_blob_input(known, size, dest, path), 0, True)
    with tempfile.TemporaryDirectory(prefix="gpufleet-pkg-") as tmp:
        built = Path(tmp) / f"{path.name}{archive.SUFFIX}"
        with open(built, "wb") as f:
            archive.pack_path(path, f, root=root)
        size = built.stat().st_size
        sent = c.put_blob(built, progress=steps("upload", path.name, size))
    remembered.put(key, sent.sha256)
    return PackageResult(_blob_input(sent.sha256, size, dest, path), sent.sent, False)


def put_remembered(
    c: Client, path: Path, progress: Progress | None = None, remembered: Remembered | None = None
) -> Sent:
    """Upload a file as a blob, its hash remembered by the file's fingerprint (path, size,
    mtime, ctime and inode): an unchanged file is not read to hash it again (and is not
    sent when the server has it), a new one is hashed while it is sent. The server checks
    every byte it is sent against the hash, so a wrong memory cannot store a wrong blob."""
    memory = remembered or Remembered(_cache_file("blobs.json"))
    sent: list[Sent] = []

    def send(file: Path) -> str:  # a file not remembered: its hash is what the server named
        sent.append(c.put_blob(file, None, progress))
        return sent[0].sha256

    sha256, _ = archive.remembered_digest(path.expanduser().resolve(), memory, send)
    return sent[0] if sent else c.put_blob(path, sha256, progress)


def _blob_input(sha256: str, size: int, dest: str, path: Path) -> InputModel:
    return InputModel(kind="blob", ref=sha256, size=size, dest=dest, label=path.name)


def mounted(path: Path, dest: str | None, remembered: Remembered | None = None) -> InputModel:
    """A shared-mount path passed by reference, with the hash workers check it against
    (remembered by the tree's fingerprint: an unchanged tree is not read again)."""
    path = path.expanduser().resolve()
    memory = remembered or Remembered(_cache_file("mounts.json"))
    digest = archive.remembered_digest(path, memory, archive.tree_digest)[0]
    return InputModel(
        kind="path", ref=str(path), sha256=digest, dest=dest or path.name, label=str(path)
    )
