"""One job's run on a worker: its state while it runs (:class:`Running`), why the worker
ended it (:class:`StopReason`) and how it ended (:class:`Outcome`)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpufleet.domain import progress
from gpufleet.domain.checkpoints import progress_of
from gpufleet.domain.models import GpuInfo
from gpufleet.wire import BAR_END, STDERR_TAIL_CHARS, STDERR_TAIL_LINES, Lease, Restored
from gpufleet.worker.adapters import Adapter
from gpufleet.worker.backlog import Backlog
from gpufleet.worker.checkpoints import FolderSync
from gpufleet.worker.envphase import ENV_MARK, Prepared
from gpufleet.worker.isolation import SlotUser
from gpufleet.worker.log import say
from gpufleet.worker.progress import Progress, ProgressFile
from gpufleet.worker.runner import JobProcess

#: Seconds after an adapter's epoch end before the checkpoint folder is synced: Lightning
#: runs its checkpoint callbacks after the others (sleap-nn's progress one among them).
ADAPTER_SYNC_DELAY = 1.0


class StopReason(enum.Enum):
    """Why the worker ended a job, or asked it to end. The value is the word its log and
    the job's error use: "stopped (cancel) before starting"."""

    CANCEL = "cancel"  # the server said kill it: cancelled, or its lease lost there
    LOST = "lost"  # its lease is stale (409), or unrenewed for a lease: self-fenced
    DRAIN = "drain"  # the worker drained past its grace: the job is handed back
    TIMEOUT = "timeout"  # it ran past its timeout
    STOP = "stop"  # asked to finish early (`gpufleet stop`): it keeps its outputs
    PAUSE = "pause"  # `gpufleet pause`: vacated (grace signal, checkpoint), then held
    OWNER = "owner"  # the workstation's owner came back (or yielded it): vacated, requeued
    PREEMPT = "preempt"  # making way for a job of a higher priority: vacated, queued again


@dataclass(frozen=True)
class Outcome:
    """How a job's run ended: its exit code (None: its process never ran) and why it
    failed (None: it did not)."""

    exit_code: int | None
    error: str | None = None

    @property
    def failed(self) -> bool:
        """Whether it failed: then its last stderr lines go with its result."""
        return self.exit_code != 0 or bool(self.error)


@dataclass
class Running:
    """One job this worker runs: its lease, its process, and what it has said so far."""

    lease: Lease
    backlog: Backlog  # output not yet sent: bounded in memory, then on disk
    proc: JobProcess | None = None
    stop_reason: StopReason | None = None  # set when the worker ends it or asks it to
    killing: bool = False
    stop_grace: float = 60.0  # a stop: seconds after SIGINT before SIGTERM
    # The job's last stderr lines: what a failed job says about why (shown by `show`).
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    # When the server last renewed the lease, on this worker's monotonic clock: the claim's
    # answer, then the send time of each heartbeat answered with the lease held (the
    # server's renewal came after it, so the lease lives at least a lease from here).
    renewed: float = field(default_factory=time.monotonic)
    progress_file: ProgressFile | None = None  # GPUFLEET_PROGRESS_FILE, once it is named
    user: SlotUser | None = None  # the slot user it runs as (--run-as)
    adapter: Adapter = field(default_factory=Adapter)  # the job type's own channel and stop
    env: Prepared | None = None  # the Python environment it runs in, held while it runs
    building: asyncio.Task[Prepared] | None = None  # getting it: cancelled by a kill
    # why it failed, when the worker knows a class ("environment"), and whether that
    # failure would happen the same way on every worker (then it is not retried)
    failure: str | None = None
    final: bool = False

    # its checkpoint folder's sync (None: it names none), the snapshot restored before it
    # started, and how far it last said it was (kept with each snapshot)
    sync: FolderSync | None = None
    restored: Restored | None = None
    latest: dict[str, int] = field(default_factory=dict)
    # the most GPU memory its processes held at a heartbeat (NVML), of its GPUs' total
    gpu_peak_mib: int = 0
    gpu_total_mib: int = 0

    def __post_init__(self) -> None:
        self.progress = Progress(
            lambda record: self.backlog.add("progress", record),
            lambda message: self.backlog.add("stderr", f"[gpufleet] {message}"),
            self._seen,
        )

    def _seen(self, record: dict[str, Any]) -> None:
        """A progress record the job wrote: how far it is, and a sync it asks for."""
        self.latest.update(progress_of([record]))
        if record.get(progress.CHECKPOINT) and self.sync is not None:
            self.sync.wanted.set()

    def read_progress(self, final: bool = False) -> None:
        """Take what the job appended to its progress file since the last read."""
        if self.progress_file is not None:
            for line in self.progress_file.read(final):
                self.progress.line(line, "GPUFLEET_PROGRESS_FILE")

    def record(self, record: dict[str, Any]) -> None:
        """A progress record from the job's adapter; one that asks for a checkpoint (an
        epoch's end) syncs the folder ``ADAPTER_SYNC_DELAY`` later, once the framework's
        own checkpoint callback, which runs after the progress one, has saved."""
        self.latest.update(progress_of([record]))
        if record.get(progress.CHECKPOINT) and self.sync is not None:
            asyncio.get_running_loop().call_later(ADAPTER_SYNC_DELAY, self.sync.wanted.set)
        self.backlog.add("progress", progress.encode(record))

    def _adapted(self, stream: str, line: str) -> bool:
        """Whether the adapter took the line as progress. The line's reader must never
        stop (the job would block on a full pipe), whatever the line holds."""
        try:
            return self.adapter.line(stream, line)
        except Exception as exc:  # an adapter's bug: the line stays output
            say(f"job {self.lease.job_id}: adapter could not read a line: {exc!r}")
            return False

    def on_line(self, stream: str, line: str) -> None:
        if self._adapted(stream, line):
            return
        if line.startswith(progress.MARK):
            self.read_progress()  # what the file has came first: records stay in order
        if self.progress.marked(line):
            return
        self.backlog.add(stream, line)
        if stream == "stderr":
            self.tail.append(line[:STDERR_TAIL_CHARS])

    def on_bar(self, stream: str, state: str) -> None:
        """The latest state of a line the job redraws in place (a progress bar), not yet
        finished: stored with a carriage return at its end (a finished line never has
        one), in place of the state before it when that one is not sent yet. A state the
        job's adapter takes as progress is a record, as a finished line would be; an
        unfinished progress mark waits for its end."""
        if self._adapted(stream, state) or state.startswith(progress.MARK):
            return
        self.backlog.update(stream, state + BAR_END)

    def env_line(self, line: str) -> None:
        """A line of the environment's build (uv's, or the worker's about it), marked."""
        self.backlog.add("stderr", ENV_MARK + line)
        self.tail.append((ENV_MARK + line)[:STDERR_TAIL_CHARS])

    @property
    def killed(self) -> bool:
        """Whether the worker has ended the job (a kill, its timeout), not only asked it
        to stop: a kill overrides a stop, and a job killed is not killed again."""
        return self.stop_reason is not None and self.stop_reason is not StopReason.STOP

    @property
    def abandoned(self) -> bool:
        """Whether its attempt is over at the server (cancelled there, or its lease lost):
        the job is killed, and no result is reported."""
        return self.stop_reason in (StopReason.CANCEL, StopReason.LOST)

    @property
    def keeps_outputs(self) -> bool:
        """Whether its outputs are collected: a job that ran to its end, its timeout or
        an early stop keeps them; one killed for any other reason keeps nothing."""
        return self.stop_reason in (None, StopReason.TIMEOUT, StopReason.STOP)

    def gpu_reading(self, mib: int | None, gpus: Sequence[GpuInfo]) -> int | None:
        """What NVML said its processes hold now (MiB), kept as its peak beside its
        GPUs' total memory; passed on, for its heartbeat."""
        if mib is not None:
            self.gpu_peak_mib = max(self.gpu_peak_mib, mib)
            self.gpu_total_mib = sum(g.total_mib for g in gpus if g.index in self.lease.gpus)
        return mib

    def note(self, message: str) -> None:
        """A line from the worker itself in the job's output."""
        self.backlog.add("stderr", f"[gpufleet] {message}")

    def downloading(self, record: dict[str, Any], line: str | None, finished: bool) -> None:
        """How far the download of the job's inputs is: a progress record, and a line of
        the worker's own in its output (a bar's state until ``finished``)."""
        self.record(record)
        if line is not None:
            said = f"[gpufleet] {line}"
            if finished:
                self.backlog.add("stderr", said)
            else:
                self.on_bar("stderr", said)
