"""The chaos suite at CI size: real servers and workers, faults from a seeded schedule,
and nothing lost, recorded twice or corrupt (tests/chaos/harness.py says what each
means). ``bench/chaos.py`` runs the same at bench size; docs/reliability.md has its
figures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.harness import Chaos, Plan, summary

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]
SEED = int(os.environ.get("GPUFLEET_CHAOS_SEED", "12"))


def check(plan: Plan, root: Path) -> None:
    report = Chaos(plan, root).run()
    print(summary(report, plan))
    problems = [*report.lost, *report.twice, *report.corrupt]
    problems += report.server_errors + report.worker_errors
    assert report.ok(), "\n".join(problems[:40])
    assert report.jobs == plan.jobs
    # every fault of the schedule was dealt
    assert report.faults["worker SIGKILL"] == plan.worker_kills
    assert report.faults["worker SIGSTOP past the lease"] == plan.pauses
    assert report.faults["server SIGKILL"] == plan.server_kills
    # a live worker stops an attempt whose lease lapsed, and a killed worker's job is
    # requeued within the lease and 2 s, or 2 s after a server is back if none ran
    assert report.overlap_live <= plan.heartbeat + 1.0, summary(report, plan)
    assert report.requeued, "no SIGKILL hit a running attempt"
    assert max(report.requeued_server_up, default=0) <= plan.lease + 2.0, summary(report, plan)
    assert max(report.overdue, default=0) <= 2.0, summary(report, plan)


def test_one_server_on_sqlite(tmp_path: Path) -> None:
    check(Plan(seed=SEED), tmp_path)


def test_two_servers_on_postgresql_with_the_workers_split_between_them(
    pg_url: str, tmp_path: Path
) -> None:
    check(Plan(seed=SEED, servers=2, db=pg_url), tmp_path)
