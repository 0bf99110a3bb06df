"""Bounded disk on a worker: a finished job's work dir is kept a while, then removed.

A job runs in ``WORK_DIR/JOB-ATTEMPT``; after it ends (its outputs uploaded, or not) the
folder stays for ``keep`` seconds, for whoever wants to look at what it left, then goes.
The age is the folder's modification time, which the worker touches when the job ends.
Folders of jobs this worker still runs are never touched, nor anything not named like a
job's folder (the cache, files of the operator's).
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Collection
from pathlib import Path

JOB_DIR = re.compile(r"^j-[0-9a-f]+-\d+$")


def job_dir_name(job_id: str, attempt: int) -> str:
    """The folder of one attempt of a job under the work dir (and of its unsent output)."""
    return f"{job_id}-{attempt}"


def prune_work_dirs(
    work_dir: Path, keep: float, busy: Collection[str], now: float | None = None
) -> int:
    """Remove job folders in ``work_dir`` ended over ``keep`` seconds ago and not in
    ``busy`` (folder names); how many went."""
    cutoff = (time.time() if now is None else now) - keep
    removed = 0
    for p in work_dir.iterdir() if work_dir.is_dir() else ():
        if not JOB_DIR.match(p.name) or p.name in busy or not p.is_dir():
            continue
        try:
            if p.stat().st_mtime >= cutoff:
                continue
        except FileNotFoundError:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed += 1
    return removed
