"""Ending a running job's process: a kill (SIGTERM, then SIGKILL), or a stop that asks
the job to finish early and keep what it made."""

from __future__ import annotations

import signal

from gpufleet.domain.checkpoints import grace_signal
from gpufleet.worker.calls import Spawn
from gpufleet.worker.log import say
from gpufleet.worker.runner import JobProcess
from gpufleet.worker.running import Running, StopReason


class Stopper:
    """Kills and stops jobs; the signals that follow later run through ``spawn``."""

    def __init__(self, spawn: Spawn) -> None:
        self.spawn = spawn

    def kill(self, run: Running, reason: StopReason, grace: float = 3.0) -> None:
        """SIGTERM the job's process group, SIGKILL it ``grace`` seconds later; once per
        job. A job whose process already ended keeps its result."""
        if run.proc is not None and run.proc.proc.returncode is not None:
            return
        if not run.killed:  # a kill overrides a stop: nothing is kept
            run.stop_reason = reason
        if run.proc is None and run.building is not None and not run.building.done():
            run.building.cancel()  # uv's process group is killed, its folders cleared
        if run.killing or run.proc is None:
            return
        run.killing = True
        run.proc.signal_group(signal.SIGTERM)
        self.spawn(self._kill_later(run.proc, grace))

    def vacate(self, run: Running, reason: StopReason) -> None:
        """End the job to free its slot, keeping its work: its grace signal (SIGTERM unless
        its spec names another) to its process group now, SIGKILL after its grace period;
        its last checkpoint is synced once it has ended. Once per job."""
        spec = run.lease.spec
        if run.proc is not None and run.proc.proc.returncode is not None:
            return
        if not run.killed:
            run.stop_reason = reason
        if run.proc is None and run.building is not None and not run.building.done():
            run.building.cancel()
        if run.killing or run.proc is None:
            return
        run.killing = True
        sig = grace_signal(spec.grace_signal)
        say(
            f"job {run.lease.job_id}: {sig.name} now, SIGKILL in {spec.grace_period:g}s "
            "unless it ends; its checkpoint is kept and it goes back to the queue"
        )
        run.proc.signal_group(sig)
        self.spawn(self._kill_later(run.proc, spec.grace_period))

    async def _kill_later(self, proc: JobProcess, grace: float = 3.0) -> None:
        if await proc.wait(grace) is None:
            proc.signal_group(signal.SIGKILL)

    def stop_early(self, run: Running, grace: float) -> None:
        """``gpufleet stop``: ask the job to finish and keep what it made. Its adapter's
        own stop (sleap-nn's stop command) or else SIGINT to its process group now; each
        ``grace`` seconds it still runs, the next step: SIGINT (after an adapter's stop),
        SIGTERM, and SIGKILL 3 s later. Its outputs are collected and its result reported
        as usual. Once per job."""
        if run.stop_reason is not None:
            return
        run.stop_reason, run.stop_grace = StopReason.STOP, grace
        say(f"job {run.lease.job_id}: asked to stop early (then {grace:g}s before each next step)")
        if run.proc is not None:  # else as soon as its process has started
            self.interrupt(run)

    def interrupt(self, run: Running) -> None:
        """The first step of a stop, for a job whose process has started."""
        assert run.proc is not None
        if run.adapter.stop():
            self.spawn(self._interrupt_later(run.proc, run.stop_grace))
            return
        run.proc.signal_group(signal.SIGINT)
        self.spawn(self._escalate(run.proc, run.stop_grace))

    async def _interrupt_later(self, proc: JobProcess, grace: float) -> None:
        if await proc.wait(grace) is None:
            proc.signal_group(signal.SIGINT)
            await self._escalate(proc, grace)

    async def _escalate(self, proc: JobProcess, grace: float) -> None:
        if await proc.wait(grace) is None:
            proc.signal_group(signal.SIGTERM)
            await self._kill_later(proc)
