"""gpufleet.worker.isolation: the worker's secrets kept from its jobs, its slot users."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpufleet.errors import ConfigError
from gpufleet.worker.isolation import (
    SlotUser,
    SlotUsers,
    check_reachable,
    check_run_as,
    drop_secret_env,
    missing_privileges,
    slot_users,
)
from gpufleet.worker.runner import read_marker, write_marker
from gpufleet.worker.spawn import GUARD

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def test_the_worker_drops_its_secrets_from_its_environment() -> None:
    env = {"GPUFLEET_TOKEN": "gf_x", "GPUFLEET_SHARE_TOKEN": "gf_y", "GPUFLEET_SERVER": "u"}
    env |= {"GPUFLEET_SESSION": "gfs1_z", "PATH": "/bin"}
    assert sorted(drop_secret_env(env)) == [
        "GPUFLEET_SESSION",
        "GPUFLEET_SHARE_TOKEN",
        "GPUFLEET_TOKEN",
    ]
    assert env == {"GPUFLEET_SERVER": "u", "PATH": "/bin"}


@linux
def test_the_worker_makes_itself_non_dumpable() -> None:
    code = (
        "from gpufleet.worker.isolation import dumpable, make_undumpable\n"
        "print(dumpable(), make_undumpable(), dumpable())"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert ran.stdout.split() == ["True", "True", "False"]


@linux
def test_the_guard_process_is_non_dumpable() -> None:
    # The guard's own program, as the worker starts it, then a question to the kernel once
    # its input ends (it has nothing to kill).
    program = GUARD + "\nimport ctypes\nprint(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))\n"
    ran = subprocess.run(
        [sys.executable, "-I", "-S", "-c", program],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    # it says it is ready (non-dumpable) first, and the kernel agrees (0: not dumpable)
    assert ran.stdout.split() == ["ready", "0"]


def test_slot_users_must_exist_and_be_neither_root_nor_named_twice() -> None:
    with pytest.raises(ConfigError, match="--run-as no-such-gf-user: no such user"):
        slot_users(["no-such-gf-user"])
    with pytest.raises(ConfigError, match="--run-as root: that is root"):
        slot_users(["root"])
    with pytest.raises(ConfigError, match=r"--run-as nobody: that user .* is named twice"):
        slot_users(["nobody", "nobody"])
    assert [u.name for u in slot_users(["nobody"])] == ["nobody"]


def test_run_as_needs_root_or_the_capabilities(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tgpufleet\nCapEff:\t00000000000000c0\n")  # SETGID and SETUID
    lacking = missing_privileges(status, euid=1000)
    assert lacking == ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL"]
    status.write_text("CapEff:\t000001ffffffffff\n")
    assert missing_privileges(status, euid=1000) == []
    assert missing_privileges(tmp_path / "none", euid=0) == []


def test_run_as_needs_a_user_per_job_it_may_run() -> None:
    users = [SlotUser("a", 5001, 5001, "/"), SlotUser("b", 5002, 5002, "/")]
    if os.geteuid() == 0:
        with pytest.raises(ConfigError, match="gives 2 user"):
            check_run_as(users, 3)
        check_run_as(users, 2)
    else:
        with pytest.raises(ConfigError, match="needs the worker to run as root"):
            check_run_as(users, 2)


def test_slot_users_cannot_reach_a_work_dir_under_a_closed_folder() -> None:
    top = Path(tempfile.mkdtemp(prefix="gpufleet-reach-"))  # in /tmp: others pass through
    top.chmod(0o711)
    try:
        closed = top / "closed"
        (closed / "work").mkdir(parents=True)
        closed.chmod(0o700)
        user = SlotUser("a", 5001, 5001, "/")
        with pytest.raises(ConfigError, match=f"user a cannot reach the work dir .*: {closed} is"):
            check_reachable(closed / "work", [user])
        closed.chmod(0o711)
        check_reachable(closed / "work", [user])
    finally:
        shutil.rmtree(top)


def test_each_running_job_has_a_slot_user_no_other_has() -> None:
    pool = SlotUsers([SlotUser("a", 5001, 5001, "/"), SlotUser("b", 5002, 5002, "/")])
    first, second = pool.take(), pool.take()
    assert {first.name, second.name} == {"a", "b"}
    pool.give(first)
    assert pool.take() == first


def test_the_pgid_marker_is_never_written_through_a_link_nor_read_from_a_pipe(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    marker = tmp_path / "job" / ".gpufleet-pgid"
    marker.parent.mkdir()
    marker.symlink_to(victim)  # put there by a job hoping the worker writes through it
    write_marker(marker, "12 34")
    assert victim.read_text() == "keep" and not marker.is_symlink()
    assert read_marker(marker) == "12 34"
    marker.unlink()
    os.mkfifo(marker)  # would hang a worker that reads it at start
    with pytest.raises(ValueError, match="is not a file"):
        read_marker(marker)
