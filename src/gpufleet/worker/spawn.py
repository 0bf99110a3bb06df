"""Starting a job's process quickly, and never leaving it behind.

``asyncio.create_subprocess_exec`` under uvloop forks the whole worker (about 4-8 ms with
a worker's heap), and a ``preexec_fn`` forces a full fork under plain asyncio too. So the
worker runs on asyncio's own loop, and the job is started with no Python code in its
child and no program in between, which CPython does with ``vfork`` (about 0.5 ms of CPU
for ``true`` here).

The job still dies with the worker, however the worker ends (SIGKILL included): a small
*guard* process, started once per worker, holds the reading end of a pipe whose writing
end only the worker holds. The worker tells it each job's process group the moment the
job exists (before its event loop runs anything else, so no kill of the worker can fall
between the two) and again when the group has been reaped; when the pipe reaches its end
(the worker exited, or was killed), the guard kills every group it still holds, the job's
children included. A guard that dies is replaced at once and told every group. Where the
guard cannot be started, the job is started as before through ``setpriv --pdeathsig
KILL`` (util-linux; about 0.8 ms more CPU a job), or with a ``preexec_fn`` setting the
parent-death signal.

On Linux 5.3 or later the worker's loop learns of a job's exit from a pidfd (Python
3.11's asyncio would start a thread per child to wait for it); elsewhere the job is
started through asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from gpufleet.worker.isolation import SlotUser, is_secret_env

_PR_SET_PDEATHSIG = 1
GUARD_READY = 10.0  # seconds a new guard may take to say it is non-dumpable

#: The guard's program: process groups to kill, one a line (``+PGID`` watch, ``-PGID``
#: reaped), until its input ends; then it kills the groups it holds. The standard library
#: only (it runs with ``-I -S``). Non-dumpable, as the worker is.
GUARD = """
import os, signal
try:  # non-dumpable, as the worker: no process of its user can read or trace it
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
os.write(1, b"ready\\n")  # the worker starts no job before this: none sees it dumpable
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


class _Exit:
    """Calls ``then`` once, when process ``pid`` (a child of ours) has ended: its pidfd
    turns readable on ``loop``. Raises OSError where there are no pidfds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pid: int, then: Callable[[], None]):
        self.loop = loop
        self._fd = os.pidfd_open(pid)
        loop.add_reader(self._fd, self._ended, then)

    def _ended(self, then: Callable[[], None]) -> None:
        self.cancel()
        then()

    def cancel(self) -> None:
        """Stop watching (also after the loop closed)."""
        if self._fd < 0:
            return
        if not self.loop.is_closed():
            self.loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1


class Guard:
    """The worker's side of the guard process (see the module's text). ``groups`` are the
    process groups it was told to watch and not yet told were reaped: a new guard
    process (the last one died, or stopped reading) is told them all as it starts."""

    def __init__(self) -> None:
        self.groups: set[int] = set()
        self.proc: subprocess.Popen[bytes] | None = None
        self._follow: _Exit | None = None  # the loop's watch for the guard's end
        self._later: asyncio.TimerHandle | None = None  # a replacement put off
        self._started = 0.0

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", GUARD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for the worker does not reach it
            close_fds=True,
            env={k: v for k, v in os.environ.items() if not is_secret_env(k)},
        )  # its pipes are not inheritable (PEP 446): jobs never hold them open
        assert proc.stdin is not None and proc.stdout is not None
        # Until it says it is non-dumpable, a job of the worker's user could read it: the
        # job that needs it starts after that (a loaded machine took long enough to show).
        ready, _, _ = select.select([proc.stdout], [], [], GUARD_READY)
        if ready:
            proc.stdout.read(6)
        proc.stdout.close()
        os.write(proc.stdin.fileno(), b"".join(b"+%d\n" % g for g in self.groups))
        os.set_blocking(proc.stdin.fileno(), False)  # a guard that stops reading is replaced
        return proc

    def ensure(self) -> bool:
        """Whether the guard runs, started (and told every group) when it does not."""
        if self.proc is None or self.proc.poll() is not None:
            self._unfollow()
            if self.proc is not None:
                _retire(self.proc)
            try:
                self.proc = self._start()
            except OSError:
                self.proc = None
                return False
            self._started = time.monotonic()
        self._follow_exit()
        return True

    def _follow_exit(self) -> None:
        """Have the running event loop replace the guard as soon as it dies, so the jobs
        running then are guarded again without waiting for the next job's start."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._follow is not None and self._follow.loop is loop:
            return
        self._unfollow()
        assert self.proc is not None
        proc = self.proc
        with contextlib.suppress(AttributeError, OSError):  # no pidfds: at the next use
            self._follow = _Exit(loop, proc.pid, lambda: self._died(proc))

    def _unfollow(self) -> None:
        follow, self._follow = self._follow, None
        if follow is not None:
            follow.cancel()

    def _died(self, proc: subprocess.Popen[bytes]) -> None:
        self._follow = None
        if proc is not self.proc:
            return
        _retire(proc)
        self.proc = None
        # replaced now; one that died as it started, a second after its start (at most
        # one new guard a second, whatever keeps killing them)
        wait = self._started + 1.0 - time.monotonic()
        if wait <= 0:
            self.ensure()
        else:
            self._later = asyncio.get_running_loop().call_later(wait, self._replace)

    def _replace(self) -> None:
        self._later = None
        if self.proc is None:
            self.ensure()

    def _say(self, line: bytes) -> None:
        for _ in range(2):  # a guard gone since it was last seen is replaced once
            if not self.ensure():
                break
            assert self.proc is not None and self.proc.stdin is not None
            try:
                os.write(self.proc.stdin.fileno(), line)  # a line is written whole or not
                return
            except BlockingIOError:  # its pipe is full: it stopped reading (frozen)
                _retire(self.proc, kill=True)  # the next is told every group, this one's too
            except BrokenPipeError:
                _retire(self.proc)
        raise OSError(errno.EPIPE, "the guard process cannot be started")

    def watch(self, group: int) -> None:
        self.groups.add(group)
        try:
            self._say(b"+%d\n" % group)
        except OSError:  # not watched: no later guard may kill it (its pid may be reused)
            self.groups.discard(group)
            raise

    def reaped(self, group: int) -> None:
        if group in self.groups:
            self.groups.discard(group)
            with contextlib.suppress(OSError):
                self._say(b"-%d\n" % group)

    def close(self) -> None:
        """End the guard: it kills the groups still watched and exits."""
        if self._later is not None:
            self._later.cancel()
            self._later = None
        self._unfollow()
        proc, self.proc = self.proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        self.groups.clear()


def _retire(proc: subprocess.Popen[bytes], kill: bool = False) -> None:
    """Let go of a guard process that died (or, with ``kill``, that stopped reading)."""
    if kill:
        with contextlib.suppress(OSError):
            proc.kill()
    proc.wait()
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.close()


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


@cache
def _pidfds() -> bool:
    """Whether this system has pidfds (Linux 5.3 or later, not forbidden by a sandbox)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
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


class Child:
    """A started job as the worker's loop sees it (the part of asyncio's ``Process`` the
    worker uses): its pid, its output as stream readers, and its exit code once known.
    Unlike asyncio's, :meth:`wait` returns at the process's exit, not at its output's
    end, which a process it left may hold off; the runner reads what is left after
    (:meth:`JobProcess.reap`)."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self.pid = popen.pid
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._popen = popen
        self._exited: asyncio.Future[int] = loop.create_future()
        self._loop = loop
        self._pipes: list[asyncio.BaseTransport] = []
        _Exit(loop, popen.pid, self._ended)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _ended(self) -> None:
        try:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped by someone else: its code is lost
            code = 255
        self._popen.returncode = code
        if not self._exited.done():
            self._exited.set_result(code)

    async def wait(self) -> int:
        """The exit code (negative: killed by that signal). Cancelling a wait (a
        timeout) leaves the exit to be seen by the next."""
        return await asyncio.shield(self._exited)

    async def connect(self, limit: int) -> None:
        """Read the job's stdout and stderr through the loop."""
        self.stdout = await self._read(self._popen.stdout, limit)
        self.stderr = await self._read(self._popen.stderr, limit)

    async def _read(self, pipe: Any, limit: int) -> asyncio.StreamReader:
        reader = asyncio.StreamReader(limit, loop=self._loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=self._loop)
        transport, _ = await self._loop.connect_read_pipe(lambda: protocol, pipe)
        self._pipes.append(transport)
        return reader

    def close(self) -> None:
        """Stop reading the job's output (pipes still held by a process it left)."""
        for pipe in self._pipes:
            pipe.close()


class _Exits(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol for a job's process, telling of its exit as it happens."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class _Process(asyncio.subprocess.Process):
    """asyncio's process where there are no pidfds, whose :meth:`wait` returns at the
    exit as :class:`Child`'s does (asyncio's waits for the pipes' end too, which a process
    the job left may hold off for as long as it runs)."""

    _protocol: _Exits
    _transport: asyncio.SubprocessTransport

    async def wait(self) -> int:
        await asyncio.shield(self._protocol.exited)
        code = self.returncode
        assert code is not None  # known once exited
        return code

    def close(self) -> None:
        """Stop reading the job's output (pipes still held by a process it left)."""
        self._transport.close()


#: A started job: a :class:`Child`, or asyncio's process where there are no pidfds.
Started = Child | _Process


def _as_user(user: SlotUser | None) -> dict[str, Any]:
    """Popen's options that start a job as its slot user (none of the worker's groups,
    the usual umask rather than the worker's private one). CPython forks rather than
    vforks then: only ``--run-as`` workers pay for it."""
    if user is None:
        return {}
    return {"user": user.uid, "group": user.gid, "extra_groups": [], "umask": 0o022}


async def spawn(
    argv: list[str], cwd: Path, env: Mapping[str, str], limit: int, user: SlotUser | None = None
) -> Started:
    """Start ``argv`` in its own session (a process group the worker can signal whole),
    with stdin closed and stdout and stderr piped to the process's readers; as ``user``
    when given. The guard kills the group if the worker dies; tell :func:`reaped` once
    the group is gone."""
    guarded = _guarded()
    launch = argv if guarded else launch_argv(argv, cwd, env)
    options: dict[str, Any] = {
        "cwd": str(cwd),
        "env": dict(env),
        "stdin": subprocess.DEVNULL,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "start_new_session": True,
        "preexec_fn": None if guarded or launch is not argv else _die_with_worker,
        **_as_user(user),
    }
    if not _pidfds():
        return await _spawn_by_asyncio(launch, options, limit, guarded)
    return await _spawn_child(launch, options, limit, guarded)


async def _spawn_by_asyncio(
    launch: list[str], options: dict[str, Any], limit: int, guarded: bool
) -> _Process:
    """Where there are no pidfds: asyncio starts the job and waits for it (and the guard
    is told only once asyncio has connected its pipes: a worker killed between the two
    leaves this job to the restarted worker's clean-up)."""
    loop = asyncio.get_running_loop()
    transport, exits = await loop.subprocess_exec(lambda: _Exits(limit, loop), *launch, **options)
    proc = _Process(transport, exits, loop)
    if guarded:
        try:  # a new session's group id is its leader's pid
            _guard.watch(proc.pid)
        except OSError:  # the guard cannot be told: not left running untracked
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return proc


async def _spawn_child(
    launch: list[str], options: dict[str, Any], limit: int, guarded: bool
) -> Child:
    """Start the job with Popen and follow its exit through a pidfd; a job whose start
    fails halfway (no guard, cancelled, out of descriptors) is killed, not left running."""
    popen = subprocess.Popen(launch, bufsize=0, **options)
    child: Child | None = None
    try:
        if guarded:
            _guard.watch(popen.pid)  # before anything yields to the loop
        child = Child(popen, asyncio.get_running_loop())
        await child.connect(limit)
    except BaseException:  # no guard, cancelled, out of descriptors: not left running
        with contextlib.suppress(OSError):
            os.killpg(popen.pid, signal.SIGKILL)
        if child is None:  # no loop waits for it: reaped here (killed, it ends at once)
            popen.wait()
        if child is None or child.stdout is None:  # the pipes the loop did not take
            _close(popen.stdout)
        if child is None or child.stderr is None:
            _close(popen.stderr)
        reaped(popen.pid)
        raise
    return child


def _close(pipe: Any) -> None:
    if pipe is not None:
        with contextlib.suppress(OSError):
            pipe.close()
