"""Host declarations are visible: a manifest's ``[hosts.NAME]`` that narrows what a worker
offers shows in `workers`, `show`, `why` and `gpufleet hosts`, with the manifest file it
came from and the token that applied it.

The issue's case: a worker with two GPUs, another manifest declares ``cuda = false`` for
it, and a job aimed at it runs in a CPU slot while `workers` said two GPUs were free.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet

pytestmark = pytest.mark.e2e

WIDE = {"COLUMNS": "400"}  # one table row a line, whatever the cell's length
QUICK = ["--", sys.executable, "-c", "print('hello')"]
LAB = """
schema_version = 1
name = "lab-plan"
[hosts.gpu-big]
cuda = false
description = "kept for CPU work"
"""


def test_a_host_declaration_shows_in_workers_show_why_and_hosts(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_gpu_worker("gpu-big", [("RTX 4090", 24, 24), ("RTX 4090", 24, 24)])
    before = fleet.cli("workers", env=WIDE).stdout
    assert "offered" not in before and "RTX 4090 24.0/24 GiB, RTX 4090 24.0/24 GiB" in before

    lab = tmp_path / "lab.toml"
    lab.write_text(LAB)
    fleet.cli("apply", str(lab))

    # `workers`: what jobs get now, the declaration that narrowed it, then what it has
    listed = fleet.cli("workers", env=WIDE).stdout
    row = next(line for line in listed.splitlines() if "gpu-big" in line)
    assert "0 of 2 offered (cuda=false by hosts.gpu-big in lab.toml)" in row
    assert "detected: RTX 4090 24.0/24 GiB" in listed
    [w] = json.loads(fleet.cli("workers", "--json").stdout)
    assert w["gpus_offered"] == [] and w["slots"]["gpu"] == 0
    assert w["host"]["narrows"] == ["cuda=false"] and w["host"]["file"] == str(lab)
    assert "1 CPU (1 free), 0 GPU (0 free)" in fleet.cli("status").stdout

    # `gpufleet hosts`: every declaration, what it narrows, from where, when, by whom
    hosts = fleet.cli("hosts", env=WIDE).stdout
    row = next(line for line in hosts.splitlines() if "gpu-big" in line)
    for part in ("cuda=false", "lab-plan", str(lab), "admin"):
        assert part in row, hosts
    [h] = json.loads(fleet.cli("hosts", "--json").stdout)
    assert (h["name"], h["manifest"], h["applied_by"]) == ("gpu-big", "lab-plan", "admin")
    assert h["policy"]["declared"]["cuda"] is False and h["applied_at"]

    # `show` of the job aimed at it: in a CPU slot, and why
    aimed = fleet.cli("submit", "--worker", "gpu-big", *QUICK)
    job = aimed.stdout.split()[-1]
    assert (
        "warning: worker gpu-big has 2 GPU(s), but hosts.gpu-big in "
        f"{lab} declares cuda=false: it offers none of them, so this job runs in a CPU slot"
    ) in " ".join(aimed.stderr.split())
    fleet.wait_status(job, "succeeded")
    shown = fleet.cli("show", job, env=WIDE).stdout
    assert "(a CPU slot)" in shown
    assert "its worker offers less than it has: cuda=false by hosts.gpu-big in lab.toml" in shown

    # `why` of a GPU job that no worker can take: the declaration beside the reason
    gpu_job = fleet.cli("submit", "--require-cuda", *QUICK).stdout.split()[-1]
    why = fleet.cli("why", gpu_job, env=WIDE).stdout
    assert "needs a GPU" in why
    assert "its host declaration: cuda=false by hosts.gpu-big in lab.toml" in why
    [r] = json.loads(fleet.cli("why", gpu_job, "--json").stdout)["workers"]
    assert r["host"]["narrows"] == ["cuda=false"]


def test_hosts_without_declarations_says_so(fleet: Fleet) -> None:
    fleet.start_server()
    done = fleet.cli("hosts")
    assert done.stdout == "" and "no host declarations" in done.stderr
    assert json.loads(fleet.cli("hosts", "--json").stdout) == []
