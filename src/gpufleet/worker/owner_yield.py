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
    path = work_dir / PID_FILE
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError) as exc:
        if isinstance(exc, PermissionError):
            return pid
        raise GpufleetError(
            f"no worker runs with the work dir {work_dir} ({path} names none that runs); "
            "give the worker's --work-dir"
        ) from exc
    return pid


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
    tmp = work_dir / f"{YIELD_FILE}.tmp"
    try:
        tmp.write_text(json.dumps({"nonce": nonce, "until": until}))
        tmp.replace(work_dir / YIELD_FILE)
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
