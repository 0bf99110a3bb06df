"""Running one job as a child process in its own process group.

The child's stdout and stderr are read by the event loop (never blocking it); a kill
always targets the whole group, so a training script's data-loader processes die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpufleet.domain.models import HyperStyle, hyper_flags
from gpufleet.worker.capability import job_path
from gpufleet.worker.isolation import SlotUser, kill_user
from gpufleet.worker.lines import LINE_LIMIT, Lines, OnLine
from gpufleet.worker.spawn import Started, reaped, spawn

READ_SIZE = 1 << 16  # bytes of a job's output read at one go
PGID_MARKER = ".gpufleet-pgid"
DRAIN_IDLE = 5.0  # seconds a pipe may give nothing, once its job ended, before it is left
DRAIN_MOST = 60.0  # seconds its output is read at most once the job ended


def build_argv(
    command: list[str], hyper: dict[str, Any], shell: bool, style: HyperStyle = HyperStyle.DASH
) -> list[str]:
    flags = hyper_flags(hyper, style)
    if shell:
        line = " ".join([command[0], *(shlex.quote(a) for a in flags)])
        return ["/bin/sh", "-c", line]
    return [*command, *flags]


def job_env(
    base: Mapping[str, str], spec_env: Mapping[str, str], gpus: list[int], extra: Mapping[str, str]
) -> dict[str, str]:
    """The child's environment: ours, the job's, its GPUs pinned, and our Python first on PATH
    so ``python`` in a job command is the interpreter gpufleet runs in."""
    env = dict(base)
    env.update(spec_env)
    env.update(extra)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = job_path(env.get("PATH", os.defpath))
    return env


class JobProcess:
    """A started child process group and the tasks pumping its output."""

    def __init__(
        self,
        proc: Started,
        pumps: list[asyncio.Task[None]],
        read: _Read,
        user: SlotUser | None = None,
    ) -> None:
        self.proc = proc
        self.pumps = pumps
        self.read = read
        self.user = user  # the slot user it runs as (--run-as), else the worker's

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(
        cls,
        argv: list[str],
        cwd: Path,
        env: Mapping[str, str],
        on_line: OnLine,
        user: SlotUser | None = None,
        on_bar: OnLine | None = None,
    ) -> JobProcess:
        """Start ``argv``; its output lines go to ``on_line``, and the states of a line it
        redraws in place (a progress bar) to ``on_bar`` while it is unfinished (none
        without one)."""
        proc = await spawn(argv, cwd, env, LINE_LIMIT, user)
        stdout, stderr = proc.stdout, proc.stderr
        assert stdout is not None and stderr is not None
        # A marker a restarted worker uses to find what a killed one left behind.
        with contextlib.suppress(OSError):  # best effort: only a later cleanup needs it
            write_marker(cwd / PGID_MARKER, f"{proc.pid} {os.getpid()}")  # group, worker
        read = _Read()
        pumps = [
            asyncio.create_task(_pump(stdout, "stdout", on_line, on_bar or _ignored, read)),
            asyncio.create_task(_pump(stderr, "stderr", on_line, on_bar or _ignored, read)),
        ]
        return cls(proc, pumps, read, user)

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (negative: killed by that signal), or None on timeout."""
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            return None

    async def stop(self, grace: float = 5.0) -> int:
        """SIGTERM the group, then SIGKILL it after ``grace`` seconds."""
        self.signal_group(signal.SIGTERM)
        code = await self.wait(grace)
        if code is None:
            self.signal_group(signal.SIGKILL)
            code = await self.proc.wait()
        return code

    async def reap(self, cwd: Path) -> None:
        """After the main process ended: kill what it left in its group, and read its
        output to the end. The job is over when its main process exits, even if a process
        it left holds the pipes; once the group is killed, the pipes end when what is in
        them has been read, however long that takes while lines keep coming. Only a pipe
        that gives nothing for ``DRAIN_IDLE`` seconds, or still gives after ``DRAIN_MOST``
        (held by a process that left the group), is left unread. A pump's own failure is
        raised here. A job run as a slot user loses every process of that user, also
        those that left its group."""
        self.signal_group(signal.SIGKILL)
        if self.user is not None:
            await asyncio.to_thread(kill_user, self.user)
        reaped(self.proc.pid)
        (cwd / PGID_MARKER).unlink(missing_ok=True)
        pending: set[asyncio.Task[None]] = set(self.pumps)
        seen, until = -1, time.monotonic() + DRAIN_MOST
        try:
            while pending and self.read.lines != seen:
                seen, left = self.read.lines, until - time.monotonic()
                if left <= 0:
                    break
                _, pending = await asyncio.wait(pending, timeout=min(DRAIN_IDLE, left))
        finally:
            for task in self.pumps:
                task.cancel()
            self.proc.close()
        for task in self.pumps:
            if task.done() and not task.cancelled() and (failed := task.exception()):
                raise failed


class _Read:
    """How many reads a job's pumps have made: whether its output still comes."""

    lines = 0


def _ignored(stream: str, line: str) -> None:
    """A bar state nobody asked for."""


async def _pump(
    reader: asyncio.StreamReader, stream: str, on_line: OnLine, on_bar: OnLine, read: _Read
) -> None:
    """Lines to ``on_line``, and the states of a line redrawn in place (a progress bar)
    to ``on_bar`` while it stays unfinished (see :mod:`gpufleet.worker.lines`). A pump
    must never stop early, or the child blocks on write: a line longer than the buffer
    is passed on in pieces, none of it dropped."""
    lines = Lines(stream, on_line, on_bar)
    while True:
        wait = lines.due(time.monotonic())
        try:
            if wait is None:
                chunk = await reader.read(READ_SIZE)
            else:  # a bar's state is due: read until then (a cancelled read loses nothing)
                chunk = await asyncio.wait_for(reader.read(READ_SIZE), wait)
        except TimeoutError:
            lines.bar()
            continue
        if not chunk:  # the end; a last line without newline is finished as it stands
            lines.end()
            return
        read.lines += 1
        lines.feed(chunk, time.monotonic())


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(code: int, oom: bool = False) -> str | None:
    """None for success, else why the process ended in words. ``oom``: the kernel's OOM
    killer killed a process while the job ran (see :func:`oom_kills`)."""
    if code == 0:
        return None
    if code < 0:
        said = f"killed by {_signal_name(-code)}"
        if oom and -code == signal.SIGKILL:
            said += ": out of memory (the kernel's OOM killer killed it)"
        return said
    if 128 < code <= 128 + 64:  # a shell reports a child killed by signal N as 128+N
        said = f"exit code {code} (128+{_signal_name(code - 128)}: a process it ran was killed)"
        if oom and code - 128 == signal.SIGKILL:
            said += "; out of memory (the kernel's OOM killer ran)"
        return said
    return f"exit code {code}"


VMSTAT = Path("/proc/vmstat")


def oom_kills(vmstat: Path = VMSTAT) -> int:
    """How many processes the kernel's OOM killer has killed since boot (Linux 4.13+; 0
    where it cannot tell). Read before and after a job: a job that died of SIGKILL while
    it grew means it ran out of memory."""
    try:
        for line in vmstat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def kill_leftovers(work_dir: Path) -> int:
    """Kill job processes a previous worker on this work dir left running (it was killed
    before it could, and its guard with it). A group whose leader is still the child of
    the worker that started it is that live worker's job, and is left alone; of the
    others, only processes in the recorded group that carry that job's GPUFLEET_JOB_ID
    are killed, so a reused pid is never hit. Returns how many were killed."""
    import psutil

    killed = 0
    for marker in work_dir.glob(f"*/{PGID_MARKER}"):
        job_id = marker.parent.name.rsplit("-", 1)[0]
        try:
            pgid, *worker = (int(n) for n in read_marker(marker).split())
        except (OSError, ValueError):
            continue
        if _run_by_worker(pgid, worker[0] if worker else None):
            continue
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                if os.getpgid(proc.pid) == pgid and proc.environ().get("GPUFLEET_JOB_ID") == job_id:
                    proc.kill()
                    killed += 1
        marker.unlink(missing_ok=True)
    return killed


def write_marker(path: Path, text: str) -> None:
    """Write a new file in a job's folder, never through a link or into a file the job
    put there (its folder may be another user's, and the worker root)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_marker(path: Path) -> str:
    """A marker's text, if it is a small regular file (not a link, nor a pipe a job
    made there to hang the worker's start)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a file")
        return f.read(64).decode("ascii")


def _run_by_worker(pgid: int, worker: int | None) -> bool:
    """Whether the group's leader runs, as the child of ``worker`` (a marker of an older
    worker names none: then whether the leader runs at all, as its parent-death signal
    ended it with its worker)."""
    import psutil

    try:
        leader = psutil.Process(pgid)
        if os.getpgid(pgid) != pgid or leader.status() == psutil.STATUS_ZOMBIE:
            return False
        return worker is None or leader.ppid() == worker
    except (psutil.Error, ProcessLookupError):
        return False
