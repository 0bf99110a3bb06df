"""``gpufleet worker --yield``: the owner of a workstation gives it back at once, from
their own shell, with no token.

The two sides meet in the worker's work dir: the worker writes its pid to ``worker.pid``
when it starts. ``--yield`` writes ``owner-yield.json`` (until when; a nonce) and sends
the worker SIGUSR1; the worker (which also looks at the file at every heartbeat, should
the signal not be allowed) vacates every job, takes none until the file is gone or its
time is up, and answers in ``owner-yield.ack`` how many jobs it vacated. ``--unyield``
removes the file and signals again. Whoever may write the work dir may yield it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from gpufleet.errors import GpufleetError

PID_FILE = "worker.pid"
YIELD_FILE = "owner-yield.json"
ACK_FILE = "owner-yield.ack"
YIELD_SIGNAL = signal.SIGUSR1
ACK_WAIT = 10.0  # seconds the yielding command waits for the worker's answer


@dataclass(frozen=True)
class Yielded:
    """A yield in force: until when (epoch seconds; None: until ``--unyield``)."""

    nonce: str
    until: float | None

    def reason(self) -> str:
        if self.until is None:
            return "yielded to the owner (gpufleet worker --yield) until --unyield"
        left = max(0.0, self.until - time.time())
        return f"yielded to the owner (gpufleet worker --yield) for {left:.0f}s more"


def write_pid(work_dir: Path) -> None:
    (work_dir / PID_FILE).write_text(f"{os.getpid()}\n")


def remove_pid(work_dir: Path) -> None:
    path = work_dir / PID_FILE
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text().strip()) == os.getpid():
            path.unlink()


def read_yield(work_dir: Path, now: float) -> Yielded | None:
    """The yield in force in ``work_dir`` (None: none, or its time is up)."""
    try:
        data = json.loads((work_dir / YIELD_FILE).read_text())
        until = data.get("until")
        found = Yielded(str(data["nonce"]), None if until is None else float(until))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return None if found.until is not None and found.until <= now else found


def acknowledge(work_dir: Path, nonce: str, vacated: int) -> None:
    """The worker's answer to a yield: how many jobs it vacated."""
    tmp = work_dir / f"{ACK_FILE}.tmp"
    tmp.write_text(json.dumps({"nonce": nonce, "vacated": vacated}))
    tmp.replace(work_dir / ACK_FILE)


def _worker_pid(work_dir: Path) -> int:
    """The pid ``worker.pid`` names, once it is sure to be the worker's: the file is no
    link, and the process runs as the user who owns the file. A job runs as the worker's
    user (or as a slot user who cannot write the work dir): were it to name another
    process there, --yield (perhaps run as root) would signal that process for it."""
    path = work_dir / PID_FILE
    none_runs = (
        f"no worker runs with the work dir {work_dir} ({path} names none that runs); "
        "give the worker's --work-dir"
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            owner = os.fstat(fd).st_uid
            pid = int(os.read(fd, 64).decode().strip())
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:
        raise GpufleetError(none_runs) from exc
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass  # it runs as another user: its signal may be refused, the file is read
    except OSError as exc:
        raise GpufleetError(none_runs) from exc
    runs_as = _process_uid(pid)
    if runs_as != owner:
        raise GpufleetError(
            f"{path} names pid {pid}, a process of another user than the file's owner: "
            "not signalled (was the file replaced?); restart the worker to write it again"
        )
    return pid


def _process_uid(pid: int) -> int | None:
    """The real user id a process runs as (readable even for a worker that made itself
    non-dumpable), or None."""
    import psutil

    try:
        return int(psutil.Process(pid).uids().real)
    except (psutil.Error, OSError):
        return None


def _write_new(path: Path, text: str) -> None:
    """Write ``path`` through a new file of a random name beside it (never a link or a
    file someone left there, which a write would follow), then rename it in place."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _signal(pid: int) -> None:
    with contextlib.suppress(PermissionError):  # it reads the file at its next heartbeat
        os.kill(pid, YIELD_SIGNAL)


def ask_yield(work_dir: Path, seconds: float | None) -> int:
    """Yield the worker of ``work_dir`` (for ``seconds``; None: until unyielded); how
    many jobs it vacated. Raises when no worker runs there or it does not answer."""
    pid = _worker_pid(work_dir)
    nonce = secrets.token_hex(8)
    until = None if seconds is None else time.time() + seconds
    (work_dir / ACK_FILE).unlink(missing_ok=True)
    try:
        _write_new(work_dir / YIELD_FILE, json.dumps({"nonce": nonce, "until": until}))
    except OSError as exc:
        raise GpufleetError(
            f"cannot write {work_dir / YIELD_FILE} ({exc.strerror or exc}): run --yield as "
            "the worker's user"
        ) from exc
    _signal(pid)
    deadline = time.monotonic() + ACK_WAIT
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            ack = json.loads((work_dir / ACK_FILE).read_text())
            if ack["nonce"] == nonce:
                return int(ack["vacated"])
        time.sleep(0.1)
    raise GpufleetError(
        f"the worker (pid {pid}) did not answer within {ACK_WAIT:g}s; it yields at its "
        "next heartbeat"
    )


def ask_unyield(work_dir: Path) -> None:
    """End a yield: the worker of ``work_dir`` takes jobs again (as its policy allows)."""
    pid = _worker_pid(work_dir)
    (work_dir / YIELD_FILE).unlink(missing_ok=True)
    _signal(pid)
