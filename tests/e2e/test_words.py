"""What commands say, in plain words: `download` of a job that kept nothing, and who
submitted a job in `show`."""

from __future__ import annotations

import json
import sys

import pytest

from tests.e2e.conftest import Fleet

pytestmark = pytest.mark.e2e

QUICK = ["--", sys.executable, "-c", "print('hello')"]
LONG = ["--", sys.executable, "-c", "import time; time.sleep(600)"]


def test_download_of_a_job_without_outputs_says_so_plainly(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1", "--slots", "2")
    plain = fleet.cli("submit", *QUICK).stdout.split()[-1]
    fleet.wait_status(plain, "succeeded")
    done = fleet.cli("download", plain, check=False)
    assert done.returncode == 1
    assert done.stderr == (
        f"error: job {plain} (succeeded) wrote no files to its outputs folder (outputs/): "
        "nothing to download\n"
    )
    assert "outputs outputs" not in done.stderr

    named = fleet.cli("submit", "--output", "model/*.pt", *QUICK).stdout.split()[-1]
    fleet.wait_status(named, "succeeded")
    said = fleet.cli("download", named, check=False).stderr
    assert "left no outputs (no file matched model/*.pt): nothing to download" in said

    running = fleet.cli("submit", *LONG).stdout.split()[-1]
    fleet.wait_status(running, "running")
    said = fleet.cli("download", running, check=False).stderr
    assert f"job {running} (running) has no outputs yet: they are kept when it ends" in said
    fleet.cli("cancel", running)


def test_show_names_who_submitted_the_job(fleet: Fleet) -> None:
    fleet.start_server()
    job = fleet.cli("submit", *QUICK).stdout.split()[-1]
    me = json.loads(fleet.cli("whoami", "--json").stdout)
    shown = fleet.cli("show", job).stdout
    assert f"submitted by admin (token {me['id']})" in shown
    assert fleet.job(job)["submitted_by_name"] == "admin"
