"""Starting a job's process quickly.

``asyncio.create_subprocess_exec`` under uvloop forks the whole worker (about 4-8 ms with
a worker's heap), and a ``preexec_fn`` forces a full fork under plain asyncio too. So the
worker runs on asyncio's own loop, and the job is started with no Python code in its
child and no program in between, which CPython does with ``vfork`` (about 0.5 ms of CPU
for ``true`` here).

The job still dies with the worker, however the worker ends (SIGKILL included): a small
*guard* process, started once per worker, holds the reading end of a pipe whose writing
end only the worker holds. The worker tells it each job's process group as the job
starts and again when the group has been reaped; when the pipe reaches its end (the
worker exited, or was killed), the guard kills every group it still holds, the job's
children included. Where the guard cannot be started, the job is started as before
through ``setpriv --pdeathsig KILL`` (util-linux; about 0.8 ms more CPU a job), or with a
``preexec_fn`` setting the parent-death signal.

Python 3.11's asyncio waits for each child in a thread of its own (``ThreadedChildWatcher``:
a thread started per job, 0.3-1.3 ms of the spawn here); :func:`watch_children` has the
worker's loop wait on a pidfd instead, as Python 3.12 does by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path

_PR_SET_PDEATHSIG = 1

#: The guard's program: process groups to kill, one a line (``+PGID`` watch, ``-PGID``
#: reaped), until its input ends; then it kills the groups it holds. Only the standard
#: library's built-ins (it runs with ``-I -S``).
GUARD = """
import os, signal
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups = set()
rest = b""
while True:
    try:
        chunk = os.read(0, 65536)
    except InterruptedError:
        continue
    if not chunk:
        break
    *lines, rest = (rest + chunk).split(b"\\n")
    for line in lines:
        if line[:1] == b"+":
            groups.add(int(line[1:]))
        elif line[:1] == b"-":
            groups.discard(int(line[1:]))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


def is_secret_env(name: str) -> bool:
    """Whether an environment variable of the worker holds a secret that neither job code
    nor the guard may see: its token, a share token, a session string, a token file's
    path."""
    upper = name.upper()
    return upper.startswith("GPUFLEET_") and ("TOKEN" in upper or upper == "GPUFLEET_SESSION")


class Guard:
    """The worker's side of the guard process (see the module's text). ``groups`` are the
    process groups it was told to watch and not yet told were reaped: when the guard
    process is gone (someone killed it), the next call starts a new one and tells it
    them all."""

    def __init__(self) -> None:
        self.groups: set[int] = set()
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", GUARD],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for the worker does not reach it
            close_fds=True,
            env={k: v for k, v in os.environ.items() if not is_secret_env(k)},
        )  # its pipe's write end is not inheritable (PEP 446): jobs never hold it open
        assert proc.stdin is not None
        os.write(proc.stdin.fileno(), b"".join(b"+%d\n" % g for g in self.groups))
        return proc

    def ensure(self) -> bool:
        """Whether the guard runs, started (and told every group) when it does not."""
        if self.proc is not None and self.proc.poll() is None:
            return True
        try:
            self.proc = self._start()
        except OSError:
            self.proc = None
            return False
        return True

    def _say(self, line: bytes) -> None:
        for _ in range(2):  # a guard gone since it was last seen is replaced once
            if not self.ensure():
                break
            assert self.proc is not None and self.proc.stdin is not None
            try:
                os.write(self.proc.stdin.fileno(), line)
                return
            except BrokenPipeError:
                self.proc = None
        raise OSError(errno.EPIPE, "the guard process cannot be started")

    def watch(self, group: int) -> None:
        self.groups.add(group)
        self._say(b"+%d\n" % group)

    def reaped(self, group: int) -> None:
        if group in self.groups:
            self.groups.discard(group)
            with contextlib.suppress(OSError):
                self._say(b"-%d\n" % group)

    def close(self) -> None:
        """End the guard: it kills the groups still watched and exits."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        self.groups.clear()


_guard = Guard()


def stop_guard() -> None:
    """Kill the jobs this process started that are still running, and end the guard (a
    worker calls it as it exits; the guard would notice the exit anyway)."""
    _guard.close()


def reaped(pid: int) -> None:
    """The job started as ``pid`` and its process group are gone: the guard forgets it."""
    _guard.reaped(pid)


def _die_with_worker() -> None:
    """In the child, before exec: on Linux, get SIGKILL when the worker dies, so a
    killed worker leaves no orphan holding a GPU (its lease is requeued elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def watch_children(loop: asyncio.AbstractEventLoop) -> bool:
    """On Python 3.11 with Linux 5.3 or later, let ``loop`` learn of its children's exits
    from pidfds (no thread per child); whether it does. Call it in the main thread, before
    the loop starts a child. Python 3.12 does this by itself (and deprecates the call)."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an older kernel, or a sandbox that forbids the call
        return False
    watcher = asyncio.PidfdChildWatcher()
    asyncio.set_child_watcher(watcher)
    watcher.attach_loop(loop)
    return True


@cache
def _setpriv() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    return shutil.which("setpriv")


def _resolve(program: str, cwd: Path, env: Mapping[str, str]) -> str:
    """``program`` as the path exec would run, looked up as exec would (the job's PATH;
    a name with a slash relative to the job's directory). Raises what exec would."""
    path = str(cwd / program) if "/" in program else shutil.which(program, path=env.get("PATH"))
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    return path


def launch_argv(argv: list[str], cwd: Path, env: Mapping[str, str]) -> list[str]:
    """The command line that starts ``argv`` with the parent-death signal set: through
    setpriv where there is one, else ``argv`` itself (then a ``preexec_fn`` sets it)."""
    setpriv = _setpriv()
    if setpriv is None:
        return argv
    return [setpriv, "--pdeathsig", "KILL", "--", _resolve(argv[0], cwd, env), *argv[1:]]


def _guarded() -> bool:
    """Whether the guard runs (it is started on first use); else jobs are started with
    the parent-death signal set."""
    return _guard.ensure()


async def spawn(
    argv: list[str], cwd: Path, env: Mapping[str, str], limit: int
) -> asyncio.subprocess.Process:
    """Start ``argv`` in its own session (a process group the worker can signal whole),
    with stdin closed and stdout and stderr piped to the process's readers. The guard
    kills the group if the worker dies; tell :func:`reaped` once the group is gone."""
    guarded = _guarded()
    launch = argv if guarded else launch_argv(argv, cwd, env)
    proc = await asyncio.create_subprocess_exec(
        *launch,
        cwd=str(cwd),
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        preexec_fn=None if guarded or launch is not argv else _die_with_worker,
        limit=limit,
    )
    if guarded:
        try:
            _guard.watch(proc.pid)  # the group's id is the job's pid (a new session)
        except OSError:  # no guard now: the job is not left running untracked
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return proc
