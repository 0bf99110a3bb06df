"""Starting a job's process quickly.

``asyncio.create_subprocess_exec`` under uvloop forks the whole worker (about 4-8 ms with
a worker's heap), and a ``preexec_fn`` forces a full fork under plain asyncio too. So the
worker runs on asyncio's own loop, and the child is started with no Python code in it,
which CPython does with ``vfork`` (about 0.3 ms). The child still dies with the worker: on
Linux it is started through ``setpriv --pdeathsig KILL`` (util-linux), which sets the
parent-death signal and then execs the job in the same process; without setpriv a
``preexec_fn`` does it, as before (and the spawn is slower).

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
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path

_PR_SET_PDEATHSIG = 1


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


async def spawn(
    argv: list[str], cwd: Path, env: Mapping[str, str], limit: int
) -> asyncio.subprocess.Process:
    """Start ``argv`` in its own session (a process group the worker can signal whole),
    with stdin closed and stdout and stderr piped to the process's readers."""
    launch = launch_argv(argv, cwd, env)
    return await asyncio.create_subprocess_exec(
        *launch,
        cwd=str(cwd),
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        preexec_fn=None if launch is not argv else _die_with_worker,
        limit=limit,
    )
