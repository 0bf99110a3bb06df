"""A built environment's files on disk: sealed read-only, surveyed (size and a digest of
every entry's path, type, size, mtime and mode), and removed again.

The digest is what :meth:`EnvCache.intact` compares: a job that runs as the worker's own
user (or root) may chmod its way past the seal, but cannot write a file, add one or
change a mode without changing the survey.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

#: The file that lets a job add packages of its own at run time (see
#: :data:`JOB_SITE_PTH`); its name sorts first among .pth files.
JOB_SITE_FILE = "_gpufleet_job_site.pth"
#: The variable naming a job's own package folder.
JOB_SITE_VAR = "GPUFLEET_JOB_SITE"
#: One line, run by ``site`` at start-up: puts ``$GPUFLEET_JOB_SITE`` first on sys.path
#: (as PYTHONPATH would) when it names a folder.
JOB_SITE_PTH = (
    "import os, sys; p = os.environ.get('GPUFLEET_JOB_SITE'); "
    "p and os.path.isdir(p) and p not in sys.path and sys.path.insert(0, p)\n"
)


@dataclass(frozen=True)
class Survey:
    """What an environment holds: bytes on disk (each inode once) and the digest of its
    entries."""

    size: int
    digest: str
    entries: int


def site_packages(venv: Path) -> Path:
    """The venv's site-packages (``lib/pythonX.Y/site-packages``)."""
    found = sorted(venv.glob("lib/python*/site-packages"))
    if not found:
        raise FileNotFoundError(f"no lib/python*/site-packages in {venv}")
    return found[0]


def add_job_site(venv: Path) -> Path:
    """Write the .pth that adds ``$GPUFLEET_JOB_SITE`` to sys.path; its path."""
    path = site_packages(venv) / JOB_SITE_FILE
    path.write_text(JOB_SITE_PTH)
    return path


def seal(root: Path) -> None:
    """Take write permission away from everyone, on every file and folder under ``root``
    and ``root`` itself; everyone may read (and run what its owner may run): with
    ``--run-as`` jobs run as other users. Links are left alone (their modes mean nothing)."""
    for folder, dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                mode = stat.S_IMODE(st.st_mode)
                run = 0o111 if mode & stat.S_IXUSR else 0
                if mode != 0o444 | run:  # a chmod moves the ctime a survey records
                    os.chmod(path, 0o444 | run)
        for name in dirs:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o555)
    os.chmod(root, 0o555)


def unseal_folders(root: Path) -> None:
    """Give the owner write permission on every folder under ``root`` again, so that a
    worker not running as root can rename and remove the tree."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(root, 0o755)
    for folder, dirs, _ in os.walk(root):
        for name in dirs:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o755)


def remove_tree(root: Path) -> None:
    """Remove a (maybe sealed) tree; nothing when it is not there."""
    if not os.path.lexists(root):
        return
    unseal_folders(root)
    shutil.rmtree(root, ignore_errors=True)


def survey(root: Path, code_only: bool = False) -> Survey:
    """Walk ``root`` in a fixed order: its size in bytes on disk (like ``du``) and a
    digest of each entry's relative path, type, size, mtime, ctime and mode. With
    ``code_only``: no ``__pycache__`` folder nor what it holds, and no folder's times
    (compiling bytecode adds to folders): what compiling must leave as it was."""
    digest = hashlib.sha256()
    seen: set[tuple[int, int]] = set()
    size = entries = 0
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        if code_only:
            dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in [*sorted(files), *dirs]:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            # ctime too: a job may put an mtime back, but a change's ctime it cannot
            when = f"{st.st_mtime_ns}\0{st.st_ctime_ns}"
            if code_only and stat.S_ISDIR(st.st_mode):
                when = ""
            line = f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{st.st_size}\0{when}"
            digest.update(f"{line}\0{stat.S_IMODE(st.st_mode)}\n".encode(errors="surrogateescape"))
            entries += 1
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                size += st.st_blocks * 512
    # The top folder's mode, not its mtime: renaming it into the cache may change that,
    # and an entry added to it shows up as an entry anyway.
    digest.update(f".\0{stat.S_IMODE(os.lstat(root).st_mode)}\n".encode())
    return Survey(size, digest.hexdigest(), entries)
