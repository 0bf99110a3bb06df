"""Keeping a job away from its worker's secrets, and from the other jobs on its machine.

Two layers, as HTCondor has them:

- The worker holds its token in memory only. At start it drops every secret variable
  from its environment and makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), as
  its job guard does: a process of the same Unix user can then read neither their
  ``/proc/PID/environ`` (which still shows the environment they were started with) nor
  their ``/proc/PID/mem``, nor ptrace them. ``execve`` makes a process dumpable again,
  so jobs are unaffected.
- With ``--run-as``, jobs run as other Unix users, one per running job (*slot users*).
  A job then cannot read the worker's configuration, credentials, cache or work-dir
  root (private to the worker's user), nor another job's folder (each 0700, owned by its
  own job's user). When a job ends every process of its user is killed, so nothing it
  left behind meets the next job that user runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.errors import ConfigError

_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
#: Capabilities a worker that is not root needs for --run-as: set the job's user and
#: group, own its folder, signal its processes, and read and remove what it left.
NEEDED_CAPS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
}
#: Variables that name the worker's user's own folders: a job of another user gets none.
USER_DIRS = (
    "XDG_CONFIG_HOME",
    "XDG_CACHE_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_RUNTIME_DIR",
    "MAIL",
)
#: Kills every process of the user it runs as (``kill(-1)`` spares only itself); the
#: kernel signals them all in one pass, so a process forking meanwhile cannot escape.
#: The shell's own ``kill``: every user may run /bin/sh (not so every Python).
_KILL_ALL = ["/bin/sh", "-c", "kill -s KILL -- -1 2>/dev/null; exit 0"]


def is_secret_env(name: str) -> bool:
    """Whether an environment variable of the worker holds a secret that neither job code
    nor the guard may see: its token, a share token, a session string, a token file's
    path."""
    upper = name.upper()
    return upper.startswith("GPUFLEET_") and ("TOKEN" in upper or upper == "GPUFLEET_SESSION")


def drop_secret_env(env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Remove the secret variables from ``env`` (the worker's own environment, once its
    options hold the token); the names removed."""
    gone = [name for name in env if is_secret_env(name)]
    for name in gone:
        del env[name]
    return gone


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def make_undumpable() -> bool:
    """Make this process non-dumpable (Linux; elsewhere nothing): its /proc files become
    root's, and a process of the same user can no longer read its memory or environment,
    nor ptrace it. Whether it is now."""
    libc = _libc()
    if libc is None:
        return False
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    return dumpable() is False


def dumpable() -> bool | None:
    """This process's dumpable flag (None where there is none: not Linux)."""
    libc = _libc()
    if libc is None:
        return None
    return bool(libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0))


# --------------------------------------------------------------------------- slot users


@dataclass(frozen=True)
class SlotUser:
    """A Unix user jobs of this worker run as, one running job at a time."""

    name: str
    uid: int
    gid: int
    home: str


def slot_users(names: Sequence[str]) -> tuple[SlotUser, ...]:
    """The ``--run-as`` users, looked up; ConfigError naming the one that is wrong (no such
    user, root, the worker's own user, named twice)."""
    import pwd

    found: list[SlotUser] = []
    for name in names:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise ConfigError(
                f"--run-as {name}: no such user on this machine; create the slot users "
                "first (gpufleet worker install --slot-users N creates gpufleet-slot1..N)"
            ) from None
        if entry.pw_uid == 0 or entry.pw_uid == os.geteuid():
            who = "root" if entry.pw_uid == 0 else "the worker's own user"
            raise ConfigError(f"--run-as {name}: that is {who}; jobs must run as other users")
        if any(u.uid == entry.pw_uid for u in found):
            raise ConfigError(f"--run-as {name}: that user (uid {entry.pw_uid}) is named twice")
        found.append(SlotUser(name, entry.pw_uid, entry.pw_gid, entry.pw_dir))
    return tuple(found)


def missing_privileges(
    status: Path = Path("/proc/self/status"), euid: int | None = None
) -> list[str]:
    """The capabilities this process lacks for ``--run-as`` (none for root)."""
    if (os.geteuid() if euid is None else euid) == 0:
        return []
    effective = 0
    with contextlib.suppress(OSError, ValueError):
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                effective = int(line.split()[1], 16)
    return [name for name, bit in NEEDED_CAPS.items() if not effective >> bit & 1]


def check_run_as(users: Sequence[SlotUser], most_jobs: int) -> None:
    """Refuse to start a ``--run-as`` worker that could not do it: not root (nor the
    capabilities), or fewer users than jobs it may run at once."""
    lacking = missing_privileges()
    if lacking:
        raise ConfigError(
            f"--run-as needs the worker to run as root (or with {', '.join(NEEDED_CAPS)}): it "
            f"starts jobs as other users and owns their folders; it runs as uid "
            f"{os.geteuid()}, without {', '.join(lacking)}"
        )
    if len(users) < most_jobs:
        raise ConfigError(
            f"--run-as gives {len(users)} user(s), but this worker runs up to {most_jobs} "
            "jobs at once (its CPU slots and GPUs): give one user per slot"
        )


def check_reachable(folder: Path, users: Iterable[SlotUser]) -> None:
    """ConfigError when a slot user could not reach its job's folder under ``folder``:
    every folder above it must let others (or that user) pass through."""
    users = list(users)
    for above in reversed(folder.absolute().parents):
        st = above.stat()
        for user in users:
            if not _may_pass(st, user):
                raise ConfigError(
                    f"--run-as: user {user.name} cannot reach the work dir {folder}: "
                    f"{above} is mode {stat.S_IMODE(st.st_mode):04o} (owner uid {st.st_uid}); "
                    "put the work dir where other users may pass through (folders of mode "
                    "0711 or 0755), e.g. /var/lib/gpufleet/worker/work"
                )


def _may_pass(st: os.stat_result, user: SlotUser) -> bool:
    if st.st_uid == user.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == user.gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


class SlotUsers:
    """Which slot users run a job now: each running job has one no other job has."""

    def __init__(self, users: Sequence[SlotUser]) -> None:
        self.users = tuple(users)
        self.busy: set[str] = set()

    def take(self) -> SlotUser:
        """The first free user (there is one: the worker runs no more jobs than users)."""
        user = next(u for u in self.users if u.name not in self.busy)
        self.busy.add(user.name)
        return user

    def give(self, user: SlotUser) -> None:
        self.busy.discard(user.name)


def set_up_run_as(
    users: Sequence[SlotUser], work_dir: Path, progress: str, cache_dir: Path | None
) -> list[str]:
    """Ready a ``--run-as`` worker: what it writes from now on is its own (umask 077;
    jobs get 022), its files closed to jobs, the work dir within their reach (else
    ConfigError), and nothing left running by its users' earlier jobs. Warnings for
    what it cannot fix."""
    os.umask(0o077)
    work_dir.mkdir(parents=True, exist_ok=True)
    check_reachable(work_dir, users)
    private_root(work_dir, work_dir / progress)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache_dir.chmod(0o700)
    for user in users:  # what jobs of an earlier worker left running
        kill_user(user)
    warnings = []
    if not links_protected():
        warnings.append(
            "fs.protected_hardlinks is 0, so a job could hard-link a file of the worker's "
            "into its outputs; set it to 1 (sysctl fs.protected_hardlinks=1)"
        )
    if not runs_python(users[0]):
        warnings.append(
            f"{users[0].name} cannot run {sys.executable}, so jobs that run `python` fail; "
            "install gpufleet where every user may read it"
        )
    return warnings


def private_root(work_dir: Path, progress: Path) -> None:
    """The worker's own files under its work dir, closed to jobs: the work dir itself
    0711 (jobs pass through to their folders, but cannot list it), its progress folder
    0711 too (each job reaches its own file), everything else the worker made there
    0700 or 0600. Job folders of slot users stay theirs."""
    work_dir.chmod(0o711)
    progress.mkdir(exist_ok=True)
    progress.chmod(0o711)
    for entry in work_dir.iterdir():
        st = entry.lstat()
        if entry != progress and st.st_uid == os.geteuid() and not stat.S_ISLNK(st.st_mode):
            entry.chmod(stat.S_IMODE(st.st_mode) & 0o700)


JOB_TMP = ".tmp"  # a slot user's job's TMPDIR, in its folder


def give_tree(root: Path, user: SlotUser) -> None:
    """Make ``root`` and everything in it ``user``'s (links themselves, never followed):
    a job's folder with the inputs staged into it, and its own temp folder (``TMPDIR``:
    slot users share /tmp, where one job's files would meet the next's)."""
    (root / JOB_TMP).mkdir(mode=0o700, exist_ok=True)
    os.lchown(root, user.uid, user.gid)
    for folder, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            os.lchown(os.path.join(folder, name), user.uid, user.gid)


def make_private_file(path: Path, user: SlotUser) -> None:
    """Create ``path`` empty, mode 0600, owned by ``user`` (the job's progress file:
    the job writes it, the worker reads it). Never through a link or over a file that
    is there."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(fd, user.uid, user.gid)
    finally:
        os.close(fd)


def job_user_env(env: Mapping[str, str], user: SlotUser, workdir: Path) -> dict[str, str]:
    """A job's environment as its slot user's: its own HOME (its folder, where the user
    has no home of its own), USER and LOGNAME, its temp folder in its own folder (TMPDIR,
    TMP, TEMP), and none of the worker's user's folders."""
    out = {k: v for k, v in env.items() if k not in USER_DIRS}
    home = Path(user.home)
    has_home = home.is_dir() and home.stat().st_uid == user.uid
    out.update(HOME=str(home if has_home else workdir), USER=user.name, LOGNAME=user.name)
    tmp = str(workdir / JOB_TMP)
    out.update(TMPDIR=tmp, TMP=tmp, TEMP=tmp)
    return out


def kill_user(user: SlotUser) -> None:
    """Kill every process of ``user``: what a job of theirs left running (a daemon that
    left its process group) must not meet the next job that user runs."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            _KILL_ALL,
            user=user.uid,
            group=user.gid,
            extra_groups=[],
            env={},
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )


def runs_python(user: SlotUser) -> bool:
    """Whether ``user`` can run this worker's Python, which a job's ``python`` is (a
    folder above it closed to others, such as /root, keeps it from them)."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", ""],
            user=user.uid,
            group=user.gid,
            extra_groups=[],
            env={},
            cwd="/",
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def links_protected(sysctl: Path = Path("/proc/sys/fs/protected_hardlinks")) -> bool:
    """Whether the kernel refuses a hard link to a file the linker does not own (else a
    job could link a file of the worker's into its outputs). True where it cannot tell."""
    try:
        return sysctl.read_text().strip() != "0"
    except OSError:
        return True
