"""The dashboard as a user sees it: sign in, watch a job live, stop one, and nothing a job
wrote runs as script."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from gpufleet.config import load_token
from gpufleet.wire import JobSpecModel
from tests.browser.conftest import Watched, sign_in
from tests.e2e.conftest import Fleet

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = textwrap.dedent(
    """
    import json, time
    for epoch in range(1, 31):
        print("::gpufleet:: " + json.dumps({"epoch": epoch, "epochs": 30, "loss": 1.0 / epoch}))
        print(f"epoch {epoch} done, loss {1.0 / epoch:.4f}", flush=True)
        time.sleep(0.1)
    """
)

# Trains until asked to stop (SIGINT), then saves its model and exits 0.
STOPPABLE = textwrap.dedent(
    """
    import pathlib, time
    step = 0
    try:
        while True:
            step += 1
            print(f"step {step}", flush=True)
            time.sleep(0.1)
    except KeyboardInterrupt:
        pathlib.Path("out").mkdir(exist_ok=True)
        pathlib.Path("out/model.txt").write_text(f"weights after {step} steps")
        print("stopped: saved out/model.txt", flush=True)
    """
)


def _submit(fleet: Fleet, **spec: Any) -> str:
    with fleet.client() as c:
        return c.submit(JobSpecModel(**spec)).job.id


def _status(w: Watched) -> str:
    return str(w.page.get_attribute(".job-head", "data-status"))


def test_a_job_goes_from_pending_to_succeeded_live_with_its_curve_and_logs(
    fleet: Fleet, watched: Watched
) -> None:
    fleet.start_server()
    job = _submit(fleet, name="mnist-30", command=[sys.executable, "-c", EPOCHS])
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    page.goto(f"{fleet.url}/#/jobs/{job}")
    page.wait_for_selector(".job-head[data-status=pending]")
    page.wait_for_selector("#why table, #why p")  # why it waits: no worker yet
    assert "Why is it waiting" in page.inner_text("#why")
    assert "null" not in page.inner_text("#why")  # no worker to list: nothing, not "null"
    page.evaluate("window.__sameDocument = true")  # gone if the page reloads

    fleet.start_worker("w1")
    page.wait_for_selector(".job-head[data-status=running]", timeout=30_000)
    page.wait_for_selector("#log .line", timeout=30_000)
    first_lines = page.locator("#log .line").count()
    watched.shot("job-running")
    page.wait_for_selector(".job-head[data-status=succeeded]", timeout=30_000)
    page.wait_for_function(
        "() => document.querySelector('#chart').dataset.points === '30'", timeout=10_000
    )
    page.wait_for_function(
        "() => document.querySelector('#log').innerText.includes('epoch 30 done')", timeout=10_000
    )
    assert page.evaluate("window.__sameDocument") is True
    assert first_lines < 30  # the lines arrived as the job printed them, not at the end
    assert page.locator("#log .line").count() == 30  # progress lines are not log text
    assert "::gpufleet::" not in page.inner_text("#log")
    timeline = page.inner_text("#timeline")
    for status in ("pending", "running", "succeeded"):
        assert status in timeline
    assert page.locator("#chart canvas").count() >= 1  # uPlot drew it
    watched.shot("job-succeeded")

    page.goto(f"{fleet.url}/#/jobs")
    page.wait_for_selector("td.name a")
    assert "mnist-30" in page.inner_text("main")
    watched.shot("jobs")

    # a GPU worker joins (its GPUs from the fake NVML): the pages show it without a reload
    page.goto(f"{fleet.url}/#/")
    page.wait_for_selector(".cards .card")
    gpus = [
        {"name": "NVIDIA RTX 4090", "total_mib": 24564, "free_mib": 6100, "util": 87},
        {"name": "NVIDIA RTX 4090", "total_mib": 24564, "free_mib": 24000, "util": 3},
    ]
    fleet.start_gpu_worker("gpu-box", [], env_extra={"FAKE_NVML_GPUS": json.dumps(gpus)})
    page.wait_for_selector(".gpu [aria-valuetext='utilisation 87 %']", timeout=20_000)
    assert "NVIDIA RTX 4090" in page.inner_text("main")
    # GPU 0's 18 GiB and 87 % are no job of gpufleet's: the page says so; GPU 1 is idle
    busy, idle = ".gpu[data-gpu='gpu-box/0']", ".gpu[data-gpu='gpu-box/1']"
    assert page.inner_text(f"{busy} .other") == "used by other processes: 18.0 GiB, 87 %"
    assert page.locator(f"{idle} .other").count() == 0
    watched.shot("fleet")
    page.goto(f"{fleet.url}/#/workers")
    page.wait_for_selector("article.worker")
    assert "w1" in page.inner_text("main") and "gpu-box" in page.inner_text("main")
    card = page.inner_text("article[data-worker='gpu-box']")
    assert "No gpufleet job." in card
    assert "GPU 0 is used by other processes: 18.0 GiB, 87 %" in card
    watched.shot("workers")

    # a manifest's [hosts.gpu-box] takes its GPUs from jobs: the card says so, and where
    lab = fleet.root / "lab<b>.toml"
    lab.write_text('schema_version = 1\nname = "lab"\n[hosts.gpu-box]\ncuda = false\n')
    fleet.cli("apply", str(lab))
    page.reload()
    said = "0 of 2 GPUs offered (cuda=false by hosts.gpu-box in lab<b>.toml)"
    page.wait_for_selector("article[data-worker='gpu-box'] dd.offered")
    assert page.inner_text("article[data-worker='gpu-box'] dd.offered") == said
    assert page.locator("article[data-worker='gpu-box'] .gpu.not-offered").count() == 2
    assert page.locator("main b").count() == 0  # the file's name is text
    assert page.locator("article[data-worker='w1'] .offered").count() == 0
    page.goto(f"{fleet.url}/#/")
    page.wait_for_selector("td .offered")
    assert said in page.inner_text("td .offered")
    assert watched.errors == [] and watched.dialogs == []


def test_stop_button_ends_a_long_job_succeeded_early_with_its_artifact(
    fleet: Fleet, watched: Watched
) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    job = _submit(
        fleet, name="long-train", command=[sys.executable, "-c", STOPPABLE], outputs=["out/*"]
    )
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    page.goto(f"{fleet.url}/#/jobs/{job}")
    page.wait_for_selector(".job-head[data-status=running]", timeout=30_000)
    page.wait_for_selector("#log .line")
    page.get_by_role("button", name="Stop (keep outputs)").click()
    page.wait_for_selector(".job-head[data-status=succeeded]", timeout=30_000)
    page.wait_for_selector("#artifact-link", timeout=10_000)
    assert "stopped early" in page.inner_text(".job-head")
    assert "saved out/model.txt" in page.inner_text("#log")
    with page.expect_download() as download:
        page.click("#artifact-link")
    assert download.value.path().stat().st_size > 0
    detail = fleet.job(job)
    assert detail["status"] == "succeeded" and detail["stopped_early"] is True
    assert watched.errors == []


def test_a_job_named_like_html_with_script_output_runs_no_script(
    fleet: Fleet, watched: Watched
) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    name = "<img src=x onerror=alert(1)>"
    evil = (
        "print('<script>alert(2)</script>'); "
        "print('<img src=x onerror=alert(3)>'); "
        "print('::gpufleet:: ' + __import__('json').dumps({'message': '<b onmouseover=alert(4)>'}))"
    )
    job = _submit(fleet, name=name, command=[sys.executable, "-c", evil])
    fleet.wait_status(job, "succeeded")
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    page.goto(f"{fleet.url}/#/jobs/{job}")
    page.wait_for_selector("#log .line")
    page.wait_for_function(
        "() => document.querySelector('#log').innerText.includes('alert(3)')", timeout=10_000
    )
    assert page.inner_text(".job-head h1") == name  # shown as text
    assert "<script>alert(2)</script>" in page.inner_text("#log")
    assert page.locator("main img, main script, main b").count() == 0
    page.goto(f"{fleet.url}/#/jobs")
    page.wait_for_selector("td.name a")
    assert name in page.inner_text("main")
    page.goto(f"{fleet.url}/#/")
    page.wait_for_selector(".cards .card")
    page.wait_for_timeout(300)
    assert watched.dialogs == []  # no alert ran
    assert page.locator("main img").count() == 0
    watched.shot("escaped")
    assert watched.errors == []


def test_a_submitter_sees_only_its_pools(fleet: Fleet, watched: Watched) -> None:
    fleet.start_server()
    fleet.start_worker("w-vision", "--pool", "vision")
    fleet.start_worker("w-nlp", "--pool", "nlp")
    mine = _submit(fleet, name="vision-job", command=["true"], pool="vision")
    theirs = _submit(fleet, name="nlp-secret-job", command=["true"], pool="nlp")
    made = fleet.cli(
        "tokens", "create", "--name", "alice", "--role", "submitter", "--pool", "vision", "--json"
    )
    token = json.loads(made.stdout)["token"]
    fleet.wait_status(mine, "succeeded")
    fleet.wait_status(theirs, "succeeded")
    sign_in(watched, fleet, token)
    page = watched.page
    assert "alice" in page.inner_text("#who")
    page.goto(f"{fleet.url}/#/jobs")
    page.wait_for_selector("td.name a")
    text = page.inner_text("main")
    assert "vision-job" in text and "nlp-secret-job" not in text
    page.goto(f"{fleet.url}/#/workers")
    page.wait_for_selector("article.worker")
    text = page.inner_text("main")
    assert "w-vision" in text and "w-nlp" not in text
    assert page.get_by_role("button", name="Drain").count() == 0  # operators drain
    assert not page.is_visible("#nav-tokens")  # and admins make tokens
    # what the page does not offer, the server refuses (the session's CSRF token and all)
    with fleet.client() as c:
        worker_id = next(w.id for w in c.workers() if w.name == "w-vision")
    refused = page.evaluate(
        """async (id) => {
            const me = await (await fetch("/v1/session")).json();
            const headers = { "X-CSRF-Token": me.csrf, "Content-Type": "application/json" };
            const drain = await fetch(`/v1/workers/${id}/drain`, { method: "POST", headers });
            const remove = await fetch(`/v1/workers/${id}`, { method: "DELETE", headers });
            const body = JSON.stringify({ name: "mine", role: "worker", pools: ["vision"] });
            const token = await fetch("/v1/tokens", { method: "POST", headers, body });
            return [drain.status, remove.status, token.status];
        }""",
        worker_id,
    )
    assert refused == [403, 403, 403]
    assert fleet.job(mine)["status"] == "succeeded"

    # a clone of its job, with a new command and priority: the same pool, a new job
    page.goto(f"{fleet.url}/#/jobs/{mine}")
    page.get_by_role("button", name="Clone…").click()
    page.wait_for_selector("#clone-form")
    assert page.input_value("#clone-name") == "vision-job"
    assert page.input_value("#clone-priority") == "0"
    page.fill("#clone-priority", "7")
    page.fill("#clone-argv li:nth-child(1) textarea", "echo")
    page.get_by_role("button", name="Add an argument").click()
    page.fill("#clone-argv li:nth-child(2) textarea", "cloned <b>")
    page.fill("#clone-ram", "0.5")
    watched.shot("clone")
    page.get_by_role("button", name="Submit the clone").click()
    page.wait_for_function(
        f"() => location.hash.startsWith('#/jobs/') && !location.hash.endsWith('{mine}')"
    )
    clone = page.evaluate("decodeURIComponent(location.hash.slice('#/jobs/'.length))")
    page.wait_for_selector(".job-head h1")
    detail = fleet.job(clone)
    assert detail["priority"] == 7 and detail["pool"] == "vision"
    assert detail["spec"]["command"] == ["echo", "cloned <b>"]
    assert detail["spec"]["requirements"]["min_ram_gib"] == 0.5
    assert detail["name"] == "vision-job"
    page.goto(f"{fleet.url}/#/jobs/{theirs}")
    page.wait_for_selector("main h1")
    assert "no job" in page.inner_text("main")  # as if it did not exist
    watched.shot("submitter")
    assert watched.errors == []


LOUD = textwrap.dedent(
    """
    import sys
    for i in range(6000):
        print(f"line {i}")
    print("x" * 10000)
    sys.stdout.write("fetch 10%\\rfetch 50%\\rfetch 100%\\n")
    print("the end", flush=True)
    """
)


# A bar redrawn every 0.1 s for 3 s (the worker passes a state on every 0.5 s), with
# stderr lines between its states; the page opens before it starts.
BARS = textwrap.dedent(
    """
    import sys, time
    time.sleep(1)
    for i in range(31):
        print(f"bar {i}/30", end="\\r", flush=True)
        if i % 3 == 0 and i < 30:
            print(f"note {i}", file=sys.stderr, flush=True)
        time.sleep(0.1)
    print(flush=True)
    print("bars done", file=sys.stderr, flush=True)
    """
)


def test_the_log_view_keeps_5000_lines_cuts_long_ones_and_scrolls_back(
    fleet: Fleet, watched: Watched
) -> None:
    fleet.start_server()
    job = _submit(fleet, name="loud", command=[sys.executable, "-c", LOUD])
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    page.goto(f"{fleet.url}/#/jobs/{job}")
    page.wait_for_selector(".job-head[data-status=pending]")
    fleet.start_worker("w1")
    page.wait_for_function(
        "() => document.querySelector('#log').innerText.includes('the end')", timeout=30_000
    )
    lines = page.locator("#log .line")
    assert lines.count() == 5000  # 6,003 lines came; the page keeps the newest 5,000
    assert lines.first.inner_text() == "line 1003"
    assert "more characters cut" in page.inner_text("#log .line:has(.cut)")
    assert lines.nth(4998).inner_text() == "fetch 100%"  # a CR progress bar's last state
    # scrolling to the top fetches the lines before; the view stops following
    page.eval_on_selector("#log", "el => { el.scrollTop = 0; }")
    page.wait_for_function(
        "() => document.querySelector('#log .line').innerText === 'line 503'", timeout=10_000
    )
    assert lines.count() == 5000
    assert page.get_by_role("button", name="Jump to latest").is_visible()
    page.get_by_role("button", name="Jump to latest").click()
    page.wait_for_function(
        "() => document.querySelector('#log').innerText.includes('the end')", timeout=10_000
    )

    # a carriage-return bar on stdout with stderr lines between its states: one line stays
    bars = _submit(fleet, name="bars", command=[sys.executable, "-c", BARS])
    page.goto(f"{fleet.url}/#/jobs/{bars}")
    page.wait_for_selector(".job-head[data-status=succeeded]", timeout=30_000)
    page.wait_for_function(
        "() => document.querySelector('#log').innerText.includes('bars done')", timeout=10_000
    )
    shown = page.eval_on_selector_all("#log .line", "els => els.map(e => e.textContent)")
    assert [t for t in shown if t.startswith("bar ")] == ["bar 30/30"], shown
    assert [t for t in shown if t.startswith("note ")] == [f"note {i}" for i in range(0, 30, 3)]
    assert watched.errors == []


def test_pause_and_resume_buttons_and_the_curve_goes_on_from_the_checkpoint(
    fleet: Fleet, watched: Watched
) -> None:
    """Paused at epoch 2 or later, resumed from its checkpoint: the curve has each of the
    8 epochs once, the resumed attempt's points in place of the first's."""
    train = ROOT / "examples" / "checkpoints" / "train.py"
    fleet.start_server()
    fleet.start_worker("w1")
    argv = [sys.executable, str(train), "--epochs", "8", "--epoch-seconds", "0.5"]
    job = _submit(fleet, name="pausable", command=argv, checkpoint_dir="ck", grace_period=5)
    sign_in(watched, fleet, load_token(fleet.url) or "")
    page = watched.page
    page.goto(f"{fleet.url}/#/jobs/{job}")
    page.wait_for_selector(".job-head[data-status=running]", timeout=30_000)
    page.wait_for_function(
        "() => Number(document.querySelector('#chart').dataset.points) >= 2", timeout=30_000
    )
    page.get_by_role("button", name="Pause").click()
    page.wait_for_selector(".job-head[data-status=paused]", timeout=15_000)
    watched.shot("job-paused")
    page.get_by_role("button", name="Resume").click()
    page.wait_for_selector(".job-head[data-status=succeeded]", timeout=60_000)
    page.wait_for_function(
        "() => document.querySelector('#chart').dataset.points === '8'", timeout=10_000
    )
    detail = fleet.job(job)
    assert [h["cause"] for h in detail["history"]] == ["paused", None]
    assert detail["history"][1]["restored"] is not None
    assert watched.errors == []
