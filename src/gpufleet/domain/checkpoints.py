"""Checkpoints: a job's checkpoint folder kept on the server as snapshots.

A job may name a folder (``checkpoint_dir``, relative to its directory). While it runs,
its worker sends each file of that folder once, content-addressed, and records a
:class:`Snapshot`: the files and their hashes, the time, and how far the job was
(its last ``epoch`` and ``step``). The server keeps the last few; any later attempt finds
the latest restored into its folder before its command starts (``GPUFLEET_RESUMED``).

Nothing here does I/O: the worker (:mod:`gpufleet.worker.checkpoints`) looks at files,
the server keeps records.
"""

from __future__ import annotations

import posixpath
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

#: The environment variables a job's process finds: its checkpoint folder (absolute), and
#: on an attempt that found a snapshot restored, "1" and the snapshot's progress.
DIR_ENV = "GPUFLEET_CHECKPOINT_DIR"
RESUMED_ENV = "GPUFLEET_RESUMED"
EPOCH_ENV = "GPUFLEET_RESUMED_EPOCH"
STEP_ENV = "GPUFLEET_RESUMED_STEP"
SNAPSHOT_ENV = "GPUFLEET_RESUMED_SNAPSHOT"

#: Snapshots of a job the server keeps unless its settings say otherwise.
KEEP = 3
#: The most files one snapshot may list, and the longest path in it.
MOST_FILES = 10_000
MOST_PATH = 1000
#: The grace signal a job gets when gpufleet ends it to free its slot, unless its spec
#: names another, and the seconds it has to save before SIGKILL.
GRACE_SIGNAL: Final = "SIGTERM"
GRACE_SECONDS = 30.0
MOST_GRACE = 3600
#: Signals a job may ask for as its grace signal (Slurm's ``--signal`` takes the same).
GRACE_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")

#: Names a checkpoint sync skips: files still being written by the usual savers
#: (PyTorch and Lightning write a temporary name and rename it; editors leave swap files).
TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".swp", "~", ".lock")
TEMP_PREFIXES = (".tmp", "tmp_", ".~")


def grace_signal(name: str) -> signal.Signals:
    """The signal a job's ``grace_signal`` names ("SIGTERM", "TERM" or "15")."""
    text = name.strip().upper()
    if text.isdigit():
        number = signal.Signals(int(text))
        text = number.name
    if not text.startswith("SIG"):
        text = "SIG" + text
    if text not in GRACE_SIGNALS:
        raise ValueError(
            f"{name!r} is not a grace signal gpufleet sends; one of {', '.join(GRACE_SIGNALS)}"
        )
    return signal.Signals[text]


def is_temporary(name: str) -> bool:
    """Whether a file name looks like one being written (never synced)."""
    base = posixpath.basename(name)
    return base.endswith(TEMP_SUFFIXES) or base.startswith(TEMP_PREFIXES)


def path_problem(path: str) -> str | None:
    """What is wrong with a snapshot file's path (relative, '/'-separated, inside the
    folder), or None."""
    if not path or len(path) > MOST_PATH:
        return f"a file path must have 1 to {MOST_PATH} characters"
    if "\0" in path or "\\" in path:
        return f"{path[:80]!r}: a file path has no NUL and no backslash"
    if (
        path.startswith("/")
        or posixpath.normpath(path) != path
        or path.split("/")[0] in ("..", ".")
    ):
        return f"{path[:80]!r}: a file path is relative, normalized, and stays in the folder"
    return None


@dataclass(frozen=True)
class SnapFile:
    """One file of a snapshot: its path in the folder, its content's hash and size."""

    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Snapshot:
    """A job's checkpoint folder at one moment, complete on the server."""

    id: int
    job_id: str
    attempt: int
    created_at: float
    files: tuple[SnapFile, ...]
    progress: Mapping[str, Any]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def epoch(self) -> int | None:
        value = self.progress.get("epoch")
        return int(value) if isinstance(value, int) else None

    @property
    def step(self) -> int | None:
        value = self.progress.get("step")
        return int(value) if isinstance(value, int) else None


def progress_of(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How far a job was after ``records`` (oldest first): its last ``epoch`` and
    ``step`` (and their totals), as a snapshot keeps them."""
    out: dict[str, int] = {}
    for record in records:
        for key in ("epoch", "epochs", "step", "steps"):
            value = record.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = value
    return out


def resumed_env(snapshot: Snapshot | None) -> dict[str, str]:
    """What a job's process finds of the snapshot restored for it (nothing: none was)."""
    if snapshot is None:
        return {}
    env = {RESUMED_ENV: "1", SNAPSHOT_ENV: str(snapshot.id)}
    if snapshot.epoch is not None:
        env[EPOCH_ENV] = str(snapshot.epoch)
    if snapshot.step is not None:
        env[STEP_ENV] = str(snapshot.step)
    return env
