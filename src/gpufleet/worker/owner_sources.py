"""What an owner policy reads from the machine: how long its user has been idle
(logind, else the input devices), whether it runs on battery, and whose a GPU process is.

Each is a small function or class over the real system, bounded in time; the tests point
the input devices at a folder whose files' times they set, so the real code runs.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

LOGINCTL_TIMEOUT = 2.0  # seconds a loginctl call may take
INPUT_DIR = Path("/dev/input")
GRAPHICAL = ("x11", "wayland", "mir", "tty")
MOST_ANCESTORS = 64  # parents followed up from a GPU process to find a job's


def logind_idle(now: float, run: Callable[[list[str]], str] | None = None) -> float | None:
    """Seconds the machine's users have been idle by logind's IdleHint and IdleSinceHint
    (0 when a session is active now); None when logind does not say (no loginctl, no
    local session with a hint)."""
    run = run or _loginctl
    try:
        listed = run(["list-sessions", "--no-legend"])
    except (OSError, subprocess.SubprocessError):
        return None
    idle_since: list[float] = []
    for line in listed.splitlines()[:100]:
        session = line.split()[0] if line.split() else ""
        try:
            shown = _properties(run(["show-session", session, "-p", "IdleHint", "-p",
                                     "IdleSinceHint", "-p", "Type", "-p", "Remote"]))  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            continue
        if shown.get("Remote") == "yes" or shown.get("Type") not in GRAPHICAL:
            continue
        if shown.get("IdleHint") == "no":
            return 0.0
        since = shown.get("IdleSinceHint", "0")
        if shown.get("IdleHint") == "yes" and since.isdigit() and int(since) > 0:
            idle_since.append(int(since) / 1e6)
    if not idle_since:
        return None
    return max(0.0, now - max(idle_since))


def _loginctl(args: list[str]) -> str:
    done = subprocess.run(
        ["loginctl", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=LOGINCTL_TIMEOUT,
    )
    return done.stdout


def _properties(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def input_idle(folder: Path, now: float) -> float | None:
    """Seconds since an input device under ``folder`` (``event*``) was last touched
    (the newer of its access and change times); None when none can be read."""
    newest = None
    try:
        entries = sorted(folder.glob("event*"))[:256]
    except OSError:
        return None
    for entry in entries:
        try:
            st = entry.stat()
        except OSError:
            continue
        touched = max(st.st_atime, st.st_mtime)
        newest = touched if newest is None else max(newest, touched)
    return None if newest is None else max(0.0, now - newest)


class IdleSource:
    """How long the machine's user has been idle. With ``input_dir`` (the policy's),
    only those input devices tell it; else logind's idle hint, and the input devices
    under /dev/input when logind does not say. None: neither can tell."""

    def __init__(self, input_dir: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.input_dir = input_dir
        self.clock = clock

    def seconds(self) -> float | None:
        now = self.clock()
        if self.input_dir is not None:
            return input_idle(self.input_dir, now)
        found = logind_idle(now)
        return found if found is not None else input_idle(INPUT_DIR, now)

    def describe(self) -> str:
        if self.input_dir is not None:
            return f"input devices under {self.input_dir}"
        return f"logind's idle hint, else input devices under {INPUT_DIR}"


def on_battery() -> bool:
    """Whether this machine runs on battery now (psutil; no battery: False)."""
    import psutil

    try:
        battery = psutil.sensors_battery()
    except (OSError, RuntimeError, AttributeError):
        return False
    return battery is not None and battery.power_plugged is False


def process_name(pid: int) -> str | None:
    """A process's name (``/proc/PID/comm``), when it can be read."""
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()[:64] or None
    except OSError:
        return None


def process_uid(pid: int) -> int | None:
    """The real user id a process runs as (``/proc/PID/status``), when it can be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(errors="replace").splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the name, which may hold spaces
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def is_ours(pid: int, groups: Iterable[int]) -> bool:
    """Whether ``pid`` belongs to a job of this worker: in one of its process ``groups``
    (a job's pid is its group's), or a descendant of a job's process."""
    roots = set(groups)
    try:
        if os.getpgid(pid) in roots:
            return True
    except OSError:  # gone, or in another PID namespace: not a job of ours
        return False
    at: int | None = pid
    for _ in range(MOST_ANCESTORS):
        if at is None or at <= 1:
            return False
        if at in roots:
            return True
        at = _parent(at)
    return False
