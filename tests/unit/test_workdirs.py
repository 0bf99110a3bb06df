"""A worker's disk stays bounded: finished jobs' work dirs go after the retention."""

from __future__ import annotations

import os
from pathlib import Path

from gpufleet.worker.workdirs import prune_work_dirs

NOW = 1_800_000_000.0


def _dir(root: Path, name: str, age_hours: float) -> Path:
    p = root / name
    (p / "sub").mkdir(parents=True)
    (p / "sub" / "model.pt").write_bytes(b"x" * 10)
    when = NOW - age_hours * 3600
    os.utime(p, (when, when))
    return p


def test_only_finished_job_dirs_past_the_retention_are_removed(tmp_path: Path) -> None:
    old = _dir(tmp_path, "j-0a1b-1", 30)
    recent = _dir(tmp_path, "j-0a1b-2", 2)
    running = _dir(tmp_path, "j-ffff-1", 100)
    cache = _dir(tmp_path, "cache", 100)
    mine = _dir(tmp_path, "notes", 100)
    gone = prune_work_dirs(tmp_path, 24 * 3600, busy={"j-ffff-1"}, now=NOW)
    assert gone == 1 and not old.exists()
    assert all(p.exists() for p in (recent, running, cache, mine))
    assert prune_work_dirs(tmp_path / "missing", 0, busy=(), now=NOW) == 0
