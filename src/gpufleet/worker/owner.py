"""The workstation's owner comes first: a worker under an owner policy
(:mod:`gpufleet.domain.owner`) looks at every heartbeat at what runs on its GPUs and at
its user, and makes way.

- A GPU where processes no job of this worker started use more than the policy allows is
  the owner's: it is not offered in claims from that heartbeat on.
- A job on such a GPU is suspended (SIGSTOP to its process group, SIGCONT once the GPU is
  free again, vacated past ``suspend_limit``) or vacated (grace signal, checkpoint, back
  to the queue, its attempt not counted) once the foreign process has stayed ``delay``
  seconds. A suspended job is still running as far as the server knows: its lease lives
  on with the worker's heartbeats.
- While the user is active (the idle rule), outside the policy's hours, on battery, or
  yielded (``gpufleet worker --yield``), it claims nothing new; running jobs go on (a
  yield vacates them).

The policy file is read again when it changes; one that no longer parses is refused
(said once) and the last good one kept.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Set
from datetime import datetime
from pathlib import Path

from gpufleet.domain.owner import (
    ForeignProcess,
    OwnerPolicy,
    OwnerState,
    idle_reason,
    load_policy,
    state_lines,
)
from gpufleet.errors import ConfigError
from gpufleet.wire import OwnerStateModel
from gpufleet.worker.jobs import JobRunner
from gpufleet.worker.log import say
from gpufleet.worker.nvml import GpuReading
from gpufleet.worker.owner_sources import (
    IdleSource,
    is_ours,
    on_battery,
    process_name,
    process_uid,
)
from gpufleet.worker.owner_yield import Yielded, acknowledge, read_yield
from gpufleet.worker.running import Running, StopReason
from gpufleet.worker.slots import Slots

Key = tuple[str, int]


class OwnerWatch:
    """The owner's rules on one worker. ``path``: its policy file (None: no policy;
    only ``--yield`` applies)."""

    def __init__(self, path: Path | None, work_dir: Path, jobs: JobRunner, slots: Slots) -> None:
        self.path = path
        self.work_dir = work_dir
        self.jobs = jobs
        self.slots = slots
        self.policy: OwnerPolicy | None = None
        self.read_at: float | None = None  # the policy file's mtime when it was read
        if path is not None:
            self.policy = load_policy(path)  # at start, a bad file stops the worker
            self.read_at = _mtime(path)
        self.idle = IdleSource(self.policy.input_dir if self.policy else None)
        self.seen: dict[int, float] = {}  # GPU: since when (monotonic) it is the owner's
        self.suspended: dict[Key, float] = {}  # job: since when (monotonic) it is stopped
        self.yielded: Yielded | None = None
        self.answered: str | None = None  # the nonce of the yield last acknowledged
        self.state = OwnerState()
        self.said: tuple[str, ...] = ()
        self.unheard = False  # the server predates owner policies: heartbeats say nothing
        if self.policy is not None:
            say(f"owner policy {path}: {self.summary(self.policy)}")

    def summary(self, p: OwnerPolicy) -> str:
        rules = [
            f"a GPU with {'any' if not p.foreign_gpu_mib else f'over {p.foreign_gpu_mib} MiB of'} "
            f"foreign use is the owner's; its job is "
            f"{'suspended' if p.on_return == 'suspend' else 'vacated'} after {p.delay:g}s"
        ]
        if p.idle_minutes is not None:
            rules.append(f"jobs start once the user is idle {p.idle_minutes:g} min "
                         f"(by {self.idle.describe()})")  # fmt: skip
        if p.hours:
            rules.append(f"in hours {p.hours_text()}")
        if not p.on_battery:
            rules.append("none on battery")
        return "; ".join(rules)

    # ---- at every heartbeat --------------------------------------------------------------

    async def look(self, readings: dict[int, GpuReading]) -> None:
        """Read the machine (in a thread: /proc, loginctl, the battery) and act on it."""
        runs = list(self.jobs.running.values())
        groups = [r.proc.pid for r in runs if r.proc is not None]
        users = {r.user.uid for r in runs if r.user is not None}
        foreign, reasons = await asyncio.to_thread(self.sense, readings, groups, users)
        self.apply(foreign, reasons, time.monotonic())

    def sense(
        self, readings: dict[int, GpuReading], groups: list[int], users: set[int] | None = None
    ) -> tuple[tuple[ForeignProcess, ...], list[str]]:
        """The foreign processes on the GPUs, and why no job may start now."""
        self.reload()
        reasons = []
        self.yielded = read_yield(self.work_dir, time.time())
        if self.yielded is not None:
            reasons.append(self.yielded.reason())
        p = self.policy
        if p is None:
            return (), reasons
        if p.idle_minutes is not None:
            why = idle_reason(self.idle.seconds(), p.idle_minutes)
            reasons += [why] if why else []
        if not p.in_hours(datetime.now()):
            reasons.append(f"outside hours {p.hours_text()}")
        if not p.on_battery and on_battery():
            reasons.append("on battery")
        return foreign_processes(readings, groups, users or set()), reasons

    def reload(self) -> None:
        """Read the policy file again if it changed; a bad one is refused, once."""
        if self.path is None or (mtime := _mtime(self.path)) == self.read_at:
            return
        self.read_at = mtime
        try:
            self.policy = load_policy(self.path)
        except ConfigError as exc:
            say(f"{exc.message}; keeping the policy read before")
            return
        self.idle = IdleSource(self.policy.input_dir)
        say(f"owner policy {self.path} read again: {self.summary(self.policy)}")

    def apply(self, foreign: tuple[ForeignProcess, ...], reasons: list[str], now: float) -> None:
        """Take the owner's GPUs out of claims, close claims for ``reasons``, and make
        way on the owner's GPUs (as of monotonic ``now``)."""
        owned = self.owned_gpus(foreign)
        for gpu in owned:
            self.seen.setdefault(gpu, now)
        for gpu in set(self.seen) - set(owned):
            del self.seen[gpu]
        self.state = OwnerState(tuple(reasons), foreign, owned)
        if set(owned) != self.slots.owned or bool(reasons) != self.slots.closed:
            self.slots.owned, self.slots.closed = set(owned), bool(reasons)
            self.slots.changed.set()  # a poll with the GPUs left, or none
        lines = tuple(state_lines(self.state))
        if lines != self.said:
            say("owner: " + ("; ".join(lines) if lines else "taking jobs again"))
            self.said = lines
        self.answer_yield()
        self.make_way(now)

    def owned_gpus(self, foreign: tuple[ForeignProcess, ...]) -> tuple[int, ...]:
        if self.policy is None:
            return ()
        gpus = sorted({f.gpu for f in foreign})
        return tuple(
            g
            for g in gpus
            if self.policy.owners(
                sum(f.mib for f in foreign if f.gpu == g), sum(1 for f in foreign if f.gpu == g)
            )
        )

    def report(self) -> OwnerStateModel | None:
        """What the heartbeat tells the server (None: no policy and no yield)."""
        if self.unheard or (self.policy is None and self.yielded is None):
            return None
        return OwnerStateModel.from_domain(self.state)

    # ---- making way ------------------------------------------------------------------------

    def make_way(self, now: float) -> None:
        """Suspend or vacate the jobs on the owner's GPUs once the delay is up; resume the
        suspended ones whose GPUs are free again."""
        if self.policy is None:
            return
        for key, run in list(self.jobs.running.items()):
            blocked = [self.seen[g] for g in run.lease.gpus if g in self.seen]
            if key in self.suspended:
                self.suspended_job(key, run, bool(blocked), now)
            elif blocked and not run.killing and now - min(blocked) >= self.policy.delay:
                self.make_way_for(key, run, now)
        for key in set(self.suspended) - set(self.jobs.running):
            del self.suspended[key]

    def make_way_for(self, key: Key, run: Running, now: float) -> None:
        assert self.policy is not None
        job = run.lease.job_id
        if self.policy.on_return == "suspend" and run.proc is not None:
            say(f"job {job}: suspended (SIGSTOP) while the owner uses its GPU")
            run.proc.signal_group(signal.SIGSTOP)
            self.suspended[key] = now
            return
        say(f"job {job}: vacated for the workstation's owner")
        self.jobs.stopper.vacate(run, StopReason.OWNER)

    def suspended_job(self, key: Key, run: Running, blocked: bool, now: float) -> None:
        """A suspended job: resumed when its GPUs are free again or something else ends it
        (it must run to take its signals), vacated past the policy's suspend limit."""
        assert self.policy is not None
        job = run.lease.job_id
        over = now - self.suspended[key] >= self.policy.suspend_limit
        if blocked and not over and not run.killing:
            return
        del self.suspended[key]
        if run.proc is not None:
            run.proc.signal_group(signal.SIGCONT)
        if run.killing:
            return
        if blocked:
            say(f"job {job}: suspended over {self.policy.suspend_limit:g}s; vacating it")
            self.jobs.stopper.vacate(run, StopReason.OWNER)
        else:
            say(f"job {job}: resumed (SIGCONT): its GPU is free again")

    # ---- gpufleet worker --yield -------------------------------------------------------------

    def answer_yield(self) -> None:
        """A new yield: vacate every job now, and say how many."""
        if self.yielded is None or self.yielded.nonce == self.answered:
            return
        self.answered = self.yielded.nonce
        vacated = 0
        for key, run in list(self.jobs.running.items()):
            if key in self.suspended and run.proc is not None:
                run.proc.signal_group(signal.SIGCONT)
            if not run.killing:
                self.jobs.stopper.vacate(run, StopReason.OWNER)
                vacated += 1
        say(f"yielded to the owner: vacated {vacated} job(s); taking none until --unyield")
        try:
            acknowledge(self.work_dir, self.yielded.nonce, vacated)
        except OSError as exc:
            say(f"could not answer the yield in {self.work_dir}: {exc}")

    def on_signal(self) -> None:
        """SIGUSR1: a yield (or its end) was asked: look now, not at the next heartbeat."""
        self.yielded = read_yield(self.work_dir, time.time())
        reasons = [r for r in self.state.reasons if not r.startswith("yielded")]
        if self.yielded is not None:
            reasons.insert(0, self.yielded.reason())
        self.apply(self.state.foreign, reasons, time.monotonic())


def foreign_processes(
    readings: dict[int, GpuReading], groups: list[int], users: Set[int] = frozenset()
) -> tuple[ForeignProcess, ...]:
    """The processes on each GPU that are not in a job of this worker (``groups``: its
    jobs' process groups), nor the worker itself, nor run by a slot user of a running
    job (``users``, with --run-as): a job that leaves its process group (``setsid``) is
    still the job's, and cannot pass for the owner to have the jobs beside it vacated."""
    found = []
    me = os.getpid()
    for gpu, reading in sorted(readings.items()):
        for pid, mib in reading.processes or ():
            if pid != me and not is_ours(pid, groups) and process_uid(pid) not in users:
                found.append(ForeignProcess(gpu, pid, process_name(pid), mib))
    return tuple(found)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
