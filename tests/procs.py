"""Real processes for the e2e and chaos suites (and bench/chaos.py): start one with its
output in a log file, signal it, stop it (SIGTERM, then SIGKILL), wait for a condition
within a bound."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Proc:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.file = log.open("wb")
        self.popen = subprocess.Popen(argv, env=env, stdout=self.file, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        self.signal(signal.SIGKILL)
        self.popen.wait(10)
        self.file.close()

    def stop(self, timeout: float = 10.0) -> int:
        self.signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait(5)
        self.file.close()
        return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which this sandbox's init may not reap, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def listening(proc: Proc) -> str | None:
    """The URL a ``gpufleet server`` process says it listens on, once it does."""
    if proc.popen.poll() is not None:
        raise AssertionError(f"server exited early:\n{proc.text()}")
    for line in proc.text().splitlines():
        if "listening on" in line:
            return line.split("listening on ", 1)[1].split()[0]
    return None
