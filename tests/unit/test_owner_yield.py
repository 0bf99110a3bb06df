"""``gpufleet worker --yield`` against a job that writes the worker's work dir (it runs
as the worker's user): it can neither make --yield signal another process nor make it
write through a link it planted (--yield may run as the owner, or as root)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.errors import GpufleetError
from gpufleet.worker import owner_yield
from gpufleet.worker.owner_yield import PID_FILE, YIELD_FILE, ask_yield

NOBODY = 65534


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this test's user that would die of SIGUSR1 (its default)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_pid_file_naming_another_users_process_is_not_signalled(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    pid_file = tmp_path / PID_FILE
    if os.geteuid() == 0:
        # The job's user (nobody) wrote the file; it names root's process.
        pid_file.write_text(f"{child.pid}\n")
        os.chown(pid_file, NOBODY, NOBODY)
        victim: int = child.pid
    else:
        # This user's file names pid 1 (root's, where the test does not run as root).
        if owner_yield._process_uid(1) in (None, os.geteuid()):
            pytest.skip("pid 1 runs as this user here")
        pid_file.write_text("1\n")
        victim = 1
    with pytest.raises(GpufleetError, match="another user than the file's owner"):
        ask_yield(tmp_path, None)
    assert child.poll() is None  # not signalled
    assert not (tmp_path / YIELD_FILE).exists()
    assert victim in (child.pid, 1)


def test_a_link_planted_where_the_yield_is_written_is_not_followed(
    tmp_path: Path, child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The child stands in for the worker; it is not signalled here and never answers.
    work = tmp_path / "work"
    work.mkdir()
    (work / PID_FILE).write_text(f"{child.pid}\n")
    victim = tmp_path / "owners-file"
    victim.write_text("keep me\n")
    for name in (f"{YIELD_FILE}.tmp", YIELD_FILE):
        (work / name).symlink_to(victim)
    monkeypatch.setattr(owner_yield, "ACK_WAIT", 0.2)
    monkeypatch.setattr(owner_yield, "_signal", lambda pid: None)
    with pytest.raises(GpufleetError, match="did not answer"):
        ask_yield(work, 60)
    assert victim.read_text() == "keep me\n"
    written = work / YIELD_FILE
    assert not written.is_symlink() and '"nonce"' in written.read_text()
    assert sorted(p.name for p in work.iterdir()) == sorted(
        [PID_FILE, YIELD_FILE, f"{YIELD_FILE}.tmp"]
    )
