"""The chaos suite with checkpoints (issue 34), at CI size: 20 checkpointing trainings
under 10 worker SIGKILLs and 5 server SIGKILLs; every job ends with all its epochs, no
epoch is trained more than twice, and each kill costs at most one checkpoint interval
plus the lease (tests/chaos/training.py says how each is measured)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.training import TrainingChaos, TrainingPlan, summary

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]
SEED = int(os.environ.get("GPUFLEET_CHAOS_SEED", "12"))


def check(plan: TrainingPlan, root: Path) -> None:
    report = TrainingChaos(plan, root).train()
    text = summary(report, plan)
    print(text)
    problems = [*report.unfinished, *report.overtrained]
    problems += report.base.server_errors + report.base.worker_errors
    assert not problems, "\n".join(problems[:40]) + "\n" + text
    assert report.jobs == plan.jobs
    assert report.base.faults["worker SIGKILL"] == plan.worker_kills
    assert report.base.faults["server SIGKILL"] == plan.server_kills
    assert any(loss.kill == "worker SIGKILL" for loss in report.losses), "no kill hit a training"
    assert not report.over_bound, text


def test_checkpointed_jobs_on_one_server_on_sqlite(tmp_path: Path) -> None:
    check(TrainingPlan(seed=SEED), tmp_path)


def test_checkpointed_jobs_on_two_servers_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    check(TrainingPlan(seed=SEED, servers=2, db=pg_url), tmp_path)
