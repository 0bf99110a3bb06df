"""Fair share end to end, scaled down: three users (weights 2:1:1) queue 30 short GPU jobs
each; two real workers with two simulated GPUs each (the fake NVML) run them through a
real server holding the sharing file. While all three still have jobs waiting, the
GPU-seconds each gets follow its weight within 20 %; `gpufleet usage` shows the same."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

import pytest

from gpufleet.client import Client
from gpufleet.wire import JobSpecModel, RequirementsModel, TokenCreate
from tests.e2e.conftest import Fleet, wait_for

WEIGHTS = {"alice": 2, "bob": 1, "carol": 1}
JOBS = 30
RULES = """\
[fair_share]
half_life = "10m"

[users.alice]
weight = 2

[users.bob]
weight = 1

[users.carol]
weight = 1
"""
TWO_GPUS = [("NVIDIA GeForce RTX 4090", 24, 23), ("NVIDIA GeForce RTX 4090", 24, 23)]


def _ts(value: str | None) -> float:
    assert value is not None
    return datetime.fromisoformat(value).timestamp()


@pytest.mark.slow
def test_three_users_share_four_gpus_by_their_weights(fleet: Fleet, tmp_path: Path) -> None:
    rules = tmp_path / "sharing.toml"
    rules.write_text(RULES)
    fleet.start_server("--sharing", str(rules))
    with fleet.client() as admin:
        tokens = {
            u: admin.create_token(TokenCreate(name=u, role="submitter")).token for u in WEIGHTS
        }
    job = JobSpecModel(
        name="short",
        command=[sys.executable, "-c", "import time; time.sleep(1.2)"],
        requirements=RequirementsModel(gpu_count=1),
    )
    owner: dict[str, str] = {}
    for n in range(JOBS):  # queued in turn, so age alone would share them equally
        for user, token in tokens.items():
            with Client(fleet.url, token) as c:
                owner[c.submit(job.model_copy(update={"name": f"{user}-{n}"})).job.id] = user
    for name in ("gpu-a", "gpu-b"):
        fleet.start_gpu_worker(name, TWO_GPUS)
    with fleet.client() as c:
        wait_for(
            lambda: all(j.status == "succeeded" for j in c.jobs(limit=200) if j.id in owner),
            240,
            "every job to succeed",
        )
        spans = {
            j: [(_ts(a["started_at"]), _ts(a["finished_at"])) for a in fleet.job(j)["history"]]
            for j in owner
        }
        usage = json.loads(fleet.cli("usage", "--window", "1h", "--json").stdout)
    # The contended window: until the first user's last job started (its queue emptied).
    start = min(s for runs in spans.values() for s, _ in runs)
    last_start = {
        u: max(s for j, runs in spans.items() if owner[j] == u for s, _ in runs) for u in WEIGHTS
    }
    end = min(last_start.values())
    used = dict.fromkeys(WEIGHTS, 0.0)
    for j, runs in spans.items():
        for s, f in runs:
            used[owner[j]] += max(0.0, min(f, end) - max(s, start))
    total = sum(used.values())
    for user, weight in WEIGHTS.items():
        share = weight / sum(WEIGHTS.values())
        assert abs(used[user] / total - share) <= 0.2 * share, (used, end - start)
    rows = {r["owner"]: r for r in usage["rows"]}
    assert usage["fair_share"] is True and set(rows) == set(WEIGHTS)
    for user, weight in WEIGHTS.items():
        assert rows[user]["weight"] == weight and rows[user]["gpu_hours"] > 0
