"""Starting a job's process quickly, and watching it from the event loop.

``asyncio.create_subprocess_exec`` under uvloop forks the whole worker (about 4-8 ms with
a worker's heap), and a ``preexec_fn`` forces a full fork under plain asyncio too. Here
the child is started by :class:`subprocess.Popen` with no Python code in the child, which
CPython does with ``vfork`` (about 0.3 ms). The child still dies with the worker: on
Linux it is started through ``setpriv --pdeathsig KILL`` (util-linux), which sets the
parent-death signal and then execs the job in the same process; without setpriv a
``preexec_fn`` does it, as before. Its exit is seen through a pidfd (Linux 5.3+), else by
a thread that waits for it; its pipes are read by the event loop.
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
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_worker() -> None:
    """In the child, before exec: on Linux, get SIGKILL when the worker dies, so a
    killed worker leaves no orphan holding a GPU (its lease is requeued elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


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


class Child:
    """A started process, as the event loop sees it: its pid, its exit code once it has
    ended (negative: killed by that signal), and :meth:`wait`."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        loop = asyncio.get_running_loop()
        self._done: asyncio.Future[int] = loop.create_future()
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # not Linux 5.3+: a thread waits instead
            waiting = loop.run_in_executor(None, popen.wait)
            waiting.add_done_callback(lambda f: self._settle(f.result()))
        else:
            loop.add_reader(fd, self._readable, loop, fd)

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def _readable(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        code = self.popen.poll()
        if code is None:
            return
        loop.remove_reader(fd)
        os.close(fd)
        self._settle(code)

    def _settle(self, code: int) -> None:
        if not self._done.done():
            self._done.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


async def spawn(
    argv: list[str], cwd: Path, env: Mapping[str, str], limit: int
) -> tuple[Child, asyncio.StreamReader, asyncio.StreamReader]:
    """Start ``argv`` in its own session (a process group the worker can signal whole),
    with stdin closed and stdout and stderr piped to the two readers it returns."""
    launch = launch_argv(argv, cwd, env)
    popen = subprocess.Popen(
        launch,
        cwd=str(cwd),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=None if launch is not argv else _die_with_worker,
    )
    loop = asyncio.get_running_loop()
    child = Child(popen)
    return child, await _reader(loop, popen.stdout, limit), await _reader(loop, popen.stderr, limit)


async def _reader(loop: asyncio.AbstractEventLoop, pipe: Any, limit: int) -> asyncio.StreamReader:
    """A stream reader over a child's pipe, read by the event loop."""
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader
