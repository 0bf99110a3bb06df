"""What a job says about itself: why it failed (its stderr's last lines, a timeout, a
signal), the hyperparameters as its script expects them, what it waits for, and how
following it ends.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import Fleet, wait_for

pytestmark = pytest.mark.e2e

PY = sys.executable


def test_a_failed_job_shows_the_end_of_its_stderr(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1", "--slots", "3")
    script = (
        "import sys; print('loading data.csv [bold]as text[/bold]'); "
        "print('Traceback (most recent call last):', file=sys.stderr); "
        "print('ValueError: column label is missing', file=sys.stderr); sys.exit(3)"
    )
    failed = fleet.cli("submit", "--max-attempts", "1", "--", PY, "-c", script).stdout.split()[-1]
    timed = fleet.cli(
        "submit", "--max-attempts", "1", "--timeout", "1", "--", PY, "-c",
        "import time; time.sleep(30)",
    ).stdout.split()[-1]  # fmt: skip
    killed = fleet.cli(
        "submit", "--max-attempts", "1", "--", PY, "-c",
        "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
    ).stdout.split()[-1]  # fmt: skip

    job = fleet.wait_status(failed, "failed")
    assert job["error"] == "exit code 3"
    assert job["stderr_tail"][-2:] == [
        "Traceback (most recent call last):",
        "ValueError: column label is missing",
    ]
    assert not any("loading" in line for line in job["stderr_tail"])  # stdout is not stderr
    assert job["history"][0]["stderr_tail"] == job["stderr_tail"]
    shown = fleet.cli("show", failed).stdout
    assert "ValueError: column label is missing" in shown, shown
    listed = json.loads(fleet.cli("jobs", "--json").stdout)
    assert next(j for j in listed if j["id"] == failed)["stderr_tail"] == job["stderr_tail"]
    table = fleet.cli("jobs").stdout
    row = next(line for line in table.splitlines() if failed in line)
    assert "ValueError: column label is missing" in " ".join(table.split()), table
    assert "exit code 3" in row

    watched = fleet.cli("watch", failed, check=False)  # it has ended: one view, exit 1
    assert watched.returncode == 1
    assert "loading data.csv [bold]as text[/bold]" in watched.stdout  # shown, not styled
    assert "ValueError: column label is missing" in watched.stdout

    assert fleet.wait_status(timed, "failed")["error"] == "timed out after 1s"
    assert "timed out after 1s" in fleet.cli("show", timed).stdout
    assert fleet.wait_status(killed, "failed")["error"] == "killed by SIGSEGV"


def _plan(path: Path, jobs: str, top: str = "") -> Path:
    path.write_text(
        f'schema_version = 1\nname = "styles"\n{top}[defaults]\n'
        f"command = \"{PY} -c 'import sys; print(sys.argv[1:])'\"\n" + jobs
    )
    return path


HYPER = "hyper.batch_size = 1024\nhyper.use_amp = true\nhyper.no_cache = false\n"


def test_hyperparameters_reach_the_script_as_it_expects_them(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_worker("w1", "--slots", "2")
    plan = _plan(
        tmp_path / "plan.toml",
        f'[[jobs]]\nname = "dash"\n{HYPER}'
        f'[[jobs]]\nname = "verbatim"\nhyper_style = "verbatim"\n{HYPER}',
    )
    applied = json.loads(fleet.cli("apply", str(plan), "--json").stdout)
    assert len(applied["created"]) == 2 and applied["absent"] == []
    printed = {}
    for job_id in applied["created"]:
        job = fleet.wait_status(job_id, "succeeded")
        printed[job["name"]] = fleet.cli("logs", job_id).stdout.strip()
    assert printed["dash"] == "['--batch-size', '1024', '--use-amp']"
    assert printed["verbatim"] == (
        "['--batch_size', '1024', '--use_amp', 'true', '--no_cache', 'false']"
    )

    # The whole manifest can say it once; a job drops out of the plan: apply names it.
    ids = {fleet.job(i)["name"]: i for i in applied["created"]}
    whole = _plan(
        tmp_path / "whole.toml",
        f'[[jobs]]\nname = "verbatim"\n{HYPER}',
        'hyper_style = "verbatim"\n',
    )
    again = json.loads(fleet.cli("apply", str(whole), "--json").stdout)
    assert again["unchanged"] == [ids["verbatim"]] and again["absent"] == [ids["dash"]]
    said = fleet.cli("apply", str(whole))
    text = " ".join((said.stdout + said.stderr).split())
    assert ids["dash"] in text and "no longer" in text, text


def test_why_names_the_job_it_waits_for(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1", "--slots", "2")
    long_job = ["--", PY, "-c", "import time; time.sleep(60)"]
    prep = fleet.cli("submit", "--name", "prep", *long_job).stdout.split()[-1]
    fleet.wait_status(prep, "running")
    train = fleet.cli("submit", "--name", "train", "--input", "job:prep", "--", "true")
    train_id = train.stdout.split()[-1]
    why = json.loads(fleet.cli("why", train_id, "--json").stdout)
    summary = why["summary"]
    assert "claimable" not in summary, summary
    assert "job:prep" in summary and prep in summary and "running" in summary, summary
    assert "job:prep" in fleet.cli("why", train_id).stdout

    # Following a job that gets cancelled while it is followed ends with its status, and
    # a non-zero exit.
    argv = [PY, "-m", "gpufleet", "logs", "-f", prep]
    following = subprocess.Popen(
        argv, env=fleet.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            following.wait(2)  # the job runs: it keeps following
        fleet.cli("cancel", prep)
        _, said = following.communicate(timeout=30)
    finally:
        following.kill()
        following.wait(10)
    assert following.returncode != 0
    assert re.search(rf"job {prep} .*cancelled", said.strip().splitlines()[-1]), said
    # ... as does following one already cancelled.
    followed = fleet.cli("logs", "-f", prep, check=False)
    assert followed.returncode != 0
    assert re.search(rf"job {prep} .*cancelled", followed.stderr.strip().splitlines()[-1])
    done = fleet.cli("logs", "-f", train_id, check=False)
    assert done.returncode != 0 and "failed" in done.stderr


STUBBORN = (
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(60)"
)
TRAINER = """
import os, signal, sys, time
os.makedirs("outputs", exist_ok=True)
asked = []
signal.signal(signal.SIGINT, lambda *_: asked.append(True))
for epoch in range(600):
    if asked:
        open("outputs/model.txt", "w").write(f"weights after {epoch} epochs")
        print("saved at epoch", epoch, flush=True)
        sys.exit(0)
    print("epoch", epoch, flush=True)
    time.sleep(0.1)
"""


def test_stop_lets_a_job_finish_early_and_keep_what_it_made(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    fleet.start_worker("w1", "--slots", "2", heartbeat=5.0)  # a log batch carries the stop
    trainer = fleet.cli("submit", "--", PY, "-c", TRAINER).stdout.split()[-1]
    stubborn = fleet.cli("submit", "--", PY, "-c", STUBBORN).stdout.split()[-1]
    fleet.wait_status(stubborn, "running")
    with fleet.client() as c:
        wait_for(lambda: "epoch 3" in fleet.cli("logs", trainer).stdout, 20, "a few epochs")
        wait_for(lambda: c.logs(stubborn).lines, 20, "the stubborn job's first line")

    asked = json.loads(fleet.cli("stop", trainer, "--json").stdout)
    assert asked["status"] == "running" and asked["stop_requested_at"]
    done = fleet.wait_status(trainer, "succeeded", "failed", timeout=30)
    assert done["status"] == "succeeded" and done["stopped_early"], done
    assert done["history"][0]["outcome"] == "stopped"
    assert "saved at epoch" in fleet.cli("logs", trainer).stdout
    assert "stopped early" in fleet.cli("show", trainer).stdout
    fleet.cli("download", trainer, "-o", str(tmp_path / "model"))
    assert (tmp_path / "model" / "outputs" / "model.txt").read_text().startswith("weights after")

    # A job that ignores SIGINT gets SIGTERM after the grace, fails, and is not retried.
    fleet.cli("stop", stubborn, "--grace", "1")
    failed = fleet.wait_status(stubborn, "failed", timeout=30)
    assert failed["error"] == "killed by SIGTERM" and failed["attempts"] == 1, failed
    assert not failed["stopped_early"]

    # Nothing runs to stop in a pending or finished job.
    pending = fleet.cli("submit", "--gpus", "1", "--", "true").stdout.split()[-1]
    refused = fleet.cli("stop", pending, check=False)
    assert refused.returncode != 0 and "cancel it instead" in refused.stderr
    refused = fleet.cli("stop", trainer, check=False)
    assert refused.returncode != 0 and "it has ended" in refused.stderr
