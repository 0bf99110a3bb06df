"""Job environments on the dashboard: a real worker builds a job's environment with the
real uv from a folder of wheels the test writes (nothing else is contacted); the pages
show the build while it runs, what the environment is built from, what each attempt ran
with, what each worker has built, and an environment failure as such. A requirement
whose marker holds markup is shown as text.

uv is slowed for one step (``pip sync`` waits a few seconds, then runs the real uv), so
the build is still going when the pages look: the worker finds uv through the ``uv``
package, and a stand-in package first on its PYTHONPATH names a wrapper script instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gpufleet.config import load_token
from tests.browser.conftest import Watched, sign_in
from tests.e2e.conftest import Fleet, Proc, wait_for
from tests.wheels import make_wheel, slow_uv

#: What the jobs run: the version of gfdemo they see.
PRINT = "import gfdemo; print('VERSION', gfdemo.__version__)"
#: Seconds uv's install step waits: past the worker's first "building environment (Ns)".
SLOW_SYNC = 8
#: A requirement that passes (the marker is true on Linux) with markup in its marker.
MARKED = 'gfdemo==1.0; python_version > "3" and sys_platform != "<b>x</b>"'


@pytest.fixture
def envbox(fleet: Fleet, tmp_path: Path) -> tuple[Fleet, Proc]:
    """A server and one worker that builds jobs' environments from a folder of wheels."""
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "gfdemo", "1.0")
    make_wheel(wheels, "gfdemo", "1.1")
    fleet.env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    fleet.start_server()
    path = (str(slow_uv(tmp_path / "slow-uv", SLOW_SYNC)), fleet.env.get("PYTHONPATH"))
    worker = fleet.start_worker(
        "envbox",
        "--env-find-links",
        str(wheels),
        "--env-cache-dir",
        str(tmp_path / "envs"),
        env_extra={"PYTHONPATH": os.pathsep.join(p for p in path if p)},
    )
    return fleet, worker


def _submit(fleet: Fleet, *args: str) -> str:
    out = fleet.cli("submit", *args, "--", "python", "-c", PRINT)
    return out.stdout.strip().splitlines()[-1]


def _building(fleet: Fleet, job: str) -> bool:
    with fleet.client() as c:
        progress = c.job(job).progress or {}
    return str(progress.get("message", "")).startswith("building environment")


def _built_count(fleet: Fleet, name: str) -> int:
    with fleet.client() as c:
        (w,) = [w for w in c.workers() if w.name == name]
    return len(w.environments)


def test_the_pages_show_a_jobs_environment_its_build_and_what_workers_built(
    envbox: tuple[Fleet, Proc], watched: Watched
) -> None:
    fleet, worker = envbox
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    job = _submit(fleet, "--name", "env-demo", "--with", "gfdemo==1.0")

    # while it builds: the jobs list and the job's page say so, the time ticking on
    wait_for(lambda: _building(fleet, job), 60, "the worker to start building")
    page.goto(f"{fleet.url}/#/jobs")
    building = page.locator("td .env-building")
    building.wait_for()
    first = building.inner_text()
    assert first.startswith("building environment · ")
    page.wait_for_function(
        "t => document.querySelector('td .env-building').textContent !== t", arg=first
    )
    watched.shot("jobs-building-environment")
    page.goto(f"{fleet.url}/#/jobs/{job}")
    page.wait_for_selector("#progress .env-building")
    assert "building environment · " in page.inner_text("#progress")
    assert "building environment" in page.inner_text("tr[data-attempt='1'] td.env")
    watched.shot("job-building-environment")

    # once it ran: what it is built from, and what the attempt ran with
    page.wait_for_selector(".job-head[data-status=succeeded]", timeout=60_000)
    page.wait_for_selector("tr[data-attempt='1'] td.env .env-used")
    spec = page.inner_text("#env-spec")
    assert "gfdemo==1.0" in spec and "the worker's own" in spec
    used = page.inner_text("tr[data-attempt='1'] td.env")
    assert "built in " in used and f"Python {sys.version_info[0]}." in used
    assert "gfdemo 1.0" in used  # the versions it ran with
    page.wait_for_selector("#log .line.env")  # the build's lines, marked [env]
    assert "VERSION 1.0" in page.inner_text("#log")
    watched.shot("job-environment")

    # a requirement with markup in its marker: shown as text, never as HTML
    marked = _submit(fleet, "--name", "env-marked", "--with", MARKED)
    assert fleet.wait_status(marked, "succeeded", "failed", timeout=90)["status"] == "succeeded"
    page.goto(f"{fleet.url}/#/jobs/{marked}")
    page.wait_for_selector("tr[data-attempt='1'] td.env .env-used")
    assert MARKED in page.inner_text("#env-spec")
    assert "gfdemo 1.0" in page.inner_text("tr[data-attempt='1'] td.env")
    assert page.locator("main b").count() == 0

    # a requirement no wheel satisfies: the job fails as an environment failure
    bad = _submit(fleet, "--name", "env-missing", "--with", "gfdemo==9.9")
    assert fleet.wait_status(bad, "succeeded", "failed", timeout=90)["failure"] == "environment"
    page.goto(f"{fleet.url}/#/jobs/{bad}")
    page.wait_for_selector(".job-head[data-status=failed]")
    assert page.inner_text(".job-head .status.failure") == "environment failure"
    assert "building" not in page.inner_text("#progress")  # the build's last word is stale
    failed = page.inner_text("tr[data-attempt='1']")
    assert "environment failure" in failed and "not built" in failed
    assert "gfdemo" in failed  # uv's words, in the error or its stderr tail
    watched.shot("job-environment-failure")
    page.goto(f"{fleet.url}/#/jobs")
    page.wait_for_selector("td.name a")
    assert "environment failure" in page.inner_text("main")

    # the worker's card: what it has built, folded to a count and a size
    wait_for(lambda: _built_count(fleet, "envbox") == 2, 30, "the heartbeat to list both")
    page.goto(f"{fleet.url}/#/workers")
    card = "article[data-worker='envbox']"
    summary = page.locator(f"{card} details.envs summary")
    summary.wait_for()
    assert summary.inner_text().startswith("2 environments, ")
    assert not page.is_visible(f"{card} details.envs li")
    summary.click()
    built_from = page.locator(f"{card} details.envs .env-describe").all_inner_texts()
    assert sorted(built_from) == sorted(["--with gfdemo==1.0", f"--with {MARKED}"])  # as text
    lines = page.locator(f"{card} details.envs li").all_inner_texts()
    assert all(f"Python {sys.version_info[0]}." in x and "KiB" in x for x in lines)
    assert all("last used" in x and "s ago" in x for x in lines)
    assert page.locator("main b").count() == 0
    watched.shot("workers-environments")
    assert watched.errors == [] and watched.dialogs == []
    assert worker.popen.poll() is None
