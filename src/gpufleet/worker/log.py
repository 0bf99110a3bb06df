"""The worker's own log: one timestamped line at a time on its stdout."""

from __future__ import annotations

import time

from gpufleet.terminal import visible
from gpufleet.tokens import redact


def say(msg: str) -> None:
    """A line of the worker's log (never a token: anything token-shaped is cut). It
    names jobs that others submitted: their control characters are shown as escapes."""
    print(f"{time.strftime('%H:%M:%S')} {visible(redact(msg))}", flush=True)
