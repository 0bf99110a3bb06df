"""Why the worker ends a job: a kill overrides an early stop, a job is killed once, and
the words its log says come from the stop reason."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gpufleet.wire import JobSpecModel, Lease, LeaseOrder
from gpufleet.worker.backlog import Backlog
from gpufleet.worker.jobs import JobRunner
from gpufleet.worker.options import WorkerOptions
from gpufleet.worker.running import Outcome, Running, StopReason
from gpufleet.worker.stopping import Stopper


def _run(tmp_path: Path, job_id: str = "j-1") -> Running:
    lease = Lease(
        job_id=job_id,
        attempt=1,
        spec=JobSpecModel(name="j", command=["x"]),
        gpus=[],
        lease_timeout=30,
    )
    return Running(lease, Backlog(tmp_path / "spill" / job_id))


def _runner(tmp_path: Path) -> JobRunner:
    opts = WorkerOptions(
        server="http://server",
        token=None,
        name="w",
        labels={},
        cpu_slots=1,
        ephemeral=False,
        heartbeat=5.0,
        work_dir=tmp_path,
        drain_grace=0.0,
    )
    unused: Any = None  # what these rules never reach: clients, stager, reports
    return JobRunner(
        opts,
        unused,
        unused,
        stager=unused,
        slots=unused,
        reports=unused,
        envs=unused,
        users=None,
        spawn=lambda coro: coro.close(),
        retrying=unused,
    )


def test_a_kill_overrides_an_early_stop_and_a_stop_never_overrides_a_kill(
    tmp_path: Path,
) -> None:
    stopper = Stopper(lambda coro: coro.close())
    stopped, killed = _run(tmp_path, "j-1"), _run(tmp_path, "j-2")
    stopper.stop_early(stopped, grace=5.0)
    assert stopped.stop_reason is StopReason.STOP and stopped.keeps_outputs
    stopper.kill(stopped, StopReason.DRAIN)
    assert stopped.stop_reason is StopReason.DRAIN and not stopped.keeps_outputs
    stopper.kill(killed, StopReason.CANCEL)
    stopper.stop_early(killed, grace=5.0)
    stopper.kill(killed, StopReason.LOST)  # killed once: the first reason stays
    assert killed.stop_reason is StopReason.CANCEL and killed.abandoned


def test_a_kill_while_the_environment_is_built_cancels_the_build(tmp_path: Path) -> None:
    async def scenario() -> None:
        run = _run(tmp_path)
        run.building = asyncio.create_task(asyncio.sleep(60))
        Stopper(lambda coro: coro.close()).kill(run, StopReason.CANCEL)
        with pytest.raises(asyncio.CancelledError):
            await run.building

    asyncio.run(scenario())


def test_heartbeat_orders_renew_stop_and_kill_a_job_once(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    run = runner.running[("j-1", 1)] = _run(tmp_path)
    later = run.renewed + 5
    runner.obey(LeaseOrder(job_id="j-1", attempt=1, order="continue"), sent=later)
    runner.obey(LeaseOrder(job_id="j-9", attempt=1, order="cancel"), sent=0.0)  # not here
    assert run.stop_reason is None and run.renewed == later
    runner.obey(LeaseOrder(job_id="j-1", attempt=1, order="stop", grace=7.0), sent=0.0)
    assert (run.stop_reason, run.stop_grace) == (StopReason.STOP, 7.0)
    runner.obey(LeaseOrder(job_id="j-1", attempt=1, order="cancel"), sent=0.0)
    assert run.stop_reason is StopReason.CANCEL


def test_a_job_whose_attempt_is_over_at_the_server_reports_nothing_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = _runner(tmp_path)
    run = _run(tmp_path)
    run.stop_reason = StopReason.LOST
    asyncio.run(runner.report(run, Outcome(None, "killed")))  # its client is never called
    assert "job j-1: stopped (lost); not reporting a result" in capsys.readouterr().out


def test_a_failed_outcome_is_one_with_a_nonzero_exit_or_an_error() -> None:
    assert not Outcome(0).failed
    assert Outcome(1).failed and Outcome(None).failed and Outcome(0, "artifact not kept").failed
