"""Job-type adapters: a tool's own progress channel and its own way to stop, around the
job's process.

A plain job reports progress through ``GPUFLEET_PROGRESS_FILE`` or ``::gpufleet::``
lines and is stopped early with SIGINT. A job with an adapter (``spec.adapter``) also
gets what its tool speaks: the SLEAP adapters (:mod:`gpufleet.worker.sleap`) bind
sleap-nn's ZMQ sockets and read its ``--gui`` lines. The worker calls, in order:
:meth:`Adapter.open` (before the process starts), :meth:`Adapter.argv`, then
:meth:`Adapter.line` for each output line and :meth:`Adapter.stop` on ``gpufleet stop``,
and :meth:`Adapter.close` once the process has ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpufleet.errors import GpufleetError

#: Where an adapter sends each progress record (already checked, in its stored form).
Emit = Callable[[dict[str, Any]], None]


class AdapterError(GpufleetError):
    """The adapter cannot run on this worker (a missing module, no port); the attempt
    fails with this message."""

    code = "adapter_error"


class Adapter:
    """The plain process: no channel of its own, stopped with SIGINT."""

    async def open(self) -> None:
        """Get ready before the process starts (bind sockets)."""

    def argv(self, argv: list[str]) -> list[str]:
        """The command line, with what the adapter adds (its ports)."""
        return argv

    def line(self, stream: str, line: str) -> bool:
        """Whether an output line was the tool's progress (then it is not output)."""
        return False

    def stop(self) -> bool:
        """Ask the job, in its tool's own way, to finish early and keep what it made.
        False: it has no way; the worker sends SIGINT."""
        return False

    async def close(self) -> None:
        """The process has ended: take what its channel still holds, then let go."""
