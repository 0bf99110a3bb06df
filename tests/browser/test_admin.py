"""The dashboard's admin pages as their users see them: an admin adds a worker with a token
made on the page, an operator drains and removes it, and the jobs page pages through
more jobs than fit on one."""

from __future__ import annotations

import json
import sys
from typing import Any

from gpufleet.config import load_token
from gpufleet.wire import JobSpecModel
from tests.browser.conftest import Watched, sign_in
from tests.e2e.conftest import Fleet


def _make_token(page: Any, name: str, role: str, pools: str) -> str:
    page.fill("#t-name", name)
    page.select_option("#t-role", role)
    page.fill("#t-pools", pools)
    page.click("#token-form button[type=submit]")
    page.wait_for_selector(f"#secret h2:has-text('{name}')")
    return str(page.input_value("#new-token"))


def _click_twice(page: Any, scope: str, label: str) -> None:
    """A button that asks again before it acts."""
    button = page.locator(scope).get_by_role("button", name=label)
    button.click()
    page.locator(scope).get_by_role("button", name="Really").click()


def test_an_admin_adds_a_worker_and_an_operator_drains_and_removes_it(
    fleet: Fleet, watched: Watched, browser: Any
) -> None:
    fleet.start_server()
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    page.get_by_role("link", name="Tokens").click()
    page.wait_for_selector("#tokens tbody tr")

    secret = _make_token(page, "box-1", "worker", "default")
    command = page.inner_text("#start-command")
    assert f"gpufleet worker --server {fleet.url} --pool default --name box-1" in command
    assert command.startswith("read -rs GPUFLEET_TOKEN && export GPUFLEET_TOKEN")
    assert secret.startswith("gf_") and secret not in command  # in no argv
    assert secret not in page.url
    watched.shot("token-created")
    page.get_by_role("button", name="Done").click()
    assert page.locator("#new-token").count() == 0
    assert secret not in page.content()  # shown once: the list has only its first characters
    assert "box-1" in page.inner_text("#tokens")

    # a worker started with it (from its environment; no other token to fall back on)
    empty = fleet.root / "no-config"
    empty.mkdir()
    fleet.start_worker(
        "box-1", env_extra={"GPUFLEET_TOKEN": secret, "GPUFLEET_CONFIG_DIR": str(empty)}
    )
    operator = _make_token(page, "ops", "operator", "")
    assert page.locator("#start-command").count() == 0  # a worker's alone

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    try:
        ops = Watched(context.new_page())
        sign_in(ops, fleet, operator)
        op = ops.page
        assert not op.is_visible("#nav-tokens")  # an admin's page
        op.goto(f"{fleet.url}/#/workers")
        card = "article[data-worker='box-1']"
        op.wait_for_selector(f"{card} .status.available")
        assert op.locator(card).get_by_role("button", name="Remove").count() == 0
        assert "null" not in op.inner_text("main")
        _click_twice(op, card, "Drain")
        # it finishes what it runs (nothing), leaves, and shows offline: now it may go
        op.wait_for_selector(f"{card} .status.offline", timeout=30_000)
        ops.shot("worker-drained")
        _click_twice(op, card, "Remove")
        op.wait_for_selector(card, state="detached")
        workers = json.loads(fleet.cli("workers", "--json").stdout)
        assert "box-1" not in [w["name"] for w in workers]
        assert ops.errors == []

        # the admin rotates the worker's token and revokes the operator's
        page.reload()
        page.wait_for_selector("#tokens tbody tr")
        _click_twice(page, "tr[data-token='box-1']", "Rotate")
        page.wait_for_selector("#secret h2:has-text('rotated')")
        assert page.input_value("#new-token") not in ("", secret)
        page.get_by_role("button", name="Done").click()
        _click_twice(page, "tr[data-token='ops']", "Revoke")
        page.wait_for_selector("tr[data-token='ops'].revoked")
        watched.shot("tokens")
        op.reload()  # the operator's session ended with its token
        op.wait_for_selector("#token")
    finally:
        context.close()
    assert watched.errors == [] and watched.dialogs == []


def test_the_jobs_page_pages_through_120_jobs_and_its_pager_says_no_null(
    fleet: Fleet, watched: Watched
) -> None:
    fleet.start_server()
    with fleet.client() as c:
        specs = [JobSpecModel(name=f"job-{i:03d}", command=["true"]) for i in range(120)]
        ids = [c.submit(spec).job.id for spec in specs]
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    page.goto(f"{fleet.url}/#/jobs")
    seen: list[str] = []
    pages = ["jobs 1 to 50 of 120", "jobs 51 to 100 of 120", "jobs 101 to 120 of 120"]
    for n, shown in enumerate(pages):
        page.wait_for_function(
            "t => document.querySelector('#page-range')?.innerText === t", arg=shown
        )
        seen += page.eval_on_selector_all("td.name .mono", "els => els.map(e => e.textContent)")
        assert "null" not in page.inner_text(".pager")
        if n == 0:
            watched.shot("jobs-pager")
        if n < 2:
            page.click("#older")
    assert seen == ids[::-1]  # every job once, newest first
    assert page.locator("#older").count() == 0  # the last page
    page.click("#newer")
    page.wait_for_function(
        "() => document.querySelector('#page-range')?.innerText === 'jobs 51 to 100 of 120'"
    )
    # one page: no pager at all
    page.goto(f"{fleet.url}/#/jobs?name=job-007")
    page.wait_for_selector("main caption:has-text('1 matching jobs')")
    assert page.inner_text(".pager") == ""
    assert watched.errors == []


def test_a_clone_of_a_job_aimed_at_a_busy_worker_is_a_new_job(
    fleet: Fleet, watched: Watched
) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with fleet.client() as c:
        spec = JobSpecModel(name="aimed", command=sleeper, requirements={"worker": "w1"})
        aimed = c.submit(spec).job.id
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    page.goto(f"{fleet.url}/#/jobs/{aimed}")
    page.wait_for_selector(".job-head[data-status=running]", timeout=30_000)

    def clone(worker: str) -> dict[str, Any]:
        page.goto(f"{fleet.url}/#/jobs/{aimed}")
        page.get_by_role("button", name="Clone…").click()
        page.wait_for_selector("#clone-form")
        assert page.input_value("#clone-worker") == ""  # any worker that fits, unless kept
        page.select_option("#clone-worker", worker)
        page.get_by_role("button", name="Submit the clone").click()
        page.wait_for_function(  # the new job's page, or the form's error
            "id => !location.hash.endsWith(id) || document.querySelector('#clone-form .error')"
            "?.textContent",
            arg=aimed,
        )
        assert page.locator("#clone-form").count() == 0, page.inner_text("#clone-form .error")
        return fleet.job(page.url.rsplit("/", 1)[1])

    # kept on w1, which is busy: it waits there (not 409)
    kept = clone("w1")
    assert kept["status"] == "pending" and kept["spec"]["requirements"]["worker"] == "w1"
    # the default: any worker that fits
    free = clone("")
    assert free["spec"]["requirements"]["worker"] is None
    watched.shot("clone-aimed")
    with fleet.client() as c:
        c.cancel(aimed)  # the worker stops at once, not after its grace
    assert watched.errors == []
