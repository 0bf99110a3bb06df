"""A worker's life as an operator sees it (offline, removed, audited), labels an admin
fixes, who may steer whose jobs, and a session string that carries a user's whole journey.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpufleet.config import load_token
from tests.e2e.conftest import PYTHON, Fleet, Proc, wait_for

pytestmark = pytest.mark.e2e

LONG = ["--", sys.executable, "-c", "import time; time.sleep(60)"]


def _workers(fleet: Fleet) -> dict[str, dict[str, Any]]:
    """``workers --json`` by name (through the SDK: the CLI's own output is checked where
    it is the point)."""
    with fleet.client() as c:
        return {w.name: w.model_dump(mode="json") for w in c.workers()}


def _events(fleet: Fleet) -> list[tuple[str, str]]:
    """The lifecycle events in the audit log: (event, target)."""
    rows = json.loads(fleet.cli("audit", "--json").stdout)
    return [(r["event"], r["target"]) for r in rows if r["event"]]


def test_workers_go_offline_are_removed_and_every_step_is_audited(fleet: Fleet) -> None:
    fleet.start_server("--ephemeral-ttl", "2")
    keeper = fleet.start_worker("keeper")
    once = fleet.start_worker("once", "--ephemeral")
    ids = {name: w["id"] for name, w in _workers(fleet).items()}

    # Only an offline worker can be removed.
    refused = fleet.cli("workers", "rm", "keeper", check=False)
    assert refused.returncode != 0
    assert "keeper is available" in refused.stderr and "offline" in refused.stderr

    # An ephemeral worker runs its job, leaves (offline at once, not draining), and is
    # removed after --ephemeral-ttl.
    job = fleet.cli("submit", "--worker", "once", "--", "true").stdout.split()[-1]
    fleet.wait_status(job, "succeeded")
    assert once.popen.wait(30) == 0
    assert _workers(fleet)["once"]["status"] == "offline"
    wait_for(lambda: "once" not in _workers(fleet), 20, "the ephemeral worker to be removed")

    # A drained persistent worker shows offline once it exits, and how long it is gone.
    drained = json.loads(fleet.cli("drain", "keeper", "--json").stdout)
    assert drained["status"] in ("draining", "offline")
    assert keeper.popen.wait(30) == 0
    gone = _workers(fleet)["keeper"]
    assert gone["status"] == "offline" and gone["offline_since"], gone
    assert re.search(r"keeper .*offline .*gone \d+s", fleet.cli("workers").stdout)
    removed = json.loads(fleet.cli("workers", "rm", "keeper", "--json").stdout)
    assert removed["id"] == ids["keeper"]
    assert "keeper" not in _workers(fleet)

    # A worker killed mid-job loses its lease: the job is requeued, and that is audited.
    lost = fleet.start_worker("lost")
    job = fleet.cli("submit", "--worker", "lost", *LONG).stdout.split()[-1]
    fleet.wait_status(job, "running")
    lost.signal(signal.SIGKILL)
    fleet.wait_status(job, "pending", timeout=30)

    events = _events(fleet)
    lost_id = _workers(fleet)["lost"]["id"]
    for expected in (
        ("worker.registered", ids["keeper"]),
        ("worker.registered", ids["once"]),
        ("worker.offline", ids["once"]),
        ("worker.removed", ids["once"]),
        ("worker.offline", ids["keeper"]),
        ("worker.removed", ids["keeper"]),
        ("lease.lost", job),
        ("worker.offline", lost_id),
    ):
        assert expected in events, (expected, events)
    table = fleet.cli("audit").stdout
    assert "worker.removed" in table and "lease.lost" in table


def _bare_worker(fleet: Fleet, name: str, token: str, *args: str) -> Proc:
    argv = [PYTHON, "-m", "gpufleet", "worker", "--name", name, "--heartbeat", "0.5"]
    argv += ["--work-dir", str(fleet.root / "work" / name), *args]
    proc = Proc(argv, {**fleet.env, "GPUFLEET_TOKEN": token}, fleet.root / f"w-{name}.log")
    fleet.procs.append(proc)
    return proc


def test_labels_an_admin_fixes_cannot_be_changed_by_the_worker(fleet: Fleet) -> None:
    fleet.start_server()
    made = fleet.cli(
        "tokens", "create", "--name", "nlp-box", "--role", "worker", "--label", "team=nlp",
        "--json",
    )  # fmt: skip
    created = json.loads(made.stdout)
    token = created["token"]
    assert created["labels"] == {"team": "nlp"}

    liar = _bare_worker(fleet, "liar", token, "--labels", "team=cv")
    assert liar.popen.wait(30) != 0
    assert "fixes team=nlp" in " ".join(liar.text().split()), liar.text()
    assert "liar" not in _workers(fleet)

    fleet.start_worker("nlp-box", "--labels", "site=lab", env_extra={"GPUFLEET_TOKEN": token})
    row = _workers(fleet)["nlp-box"]
    assert row["labels"] == {"team": "nlp", "site": "lab"} and row["fixed_labels"] == ["team"]
    # Once a token fixes team in the pool, another worker cannot just say team=nlp.
    other = _bare_worker(fleet, "other", load_token(fleet.url) or "", "--labels", "team=nlp")
    assert other.popen.wait(30) != 0
    assert "fixed by worker tokens" in " ".join(other.text().split()), other.text()
    fleet.start_worker("plain", "--labels", "site=lab")  # keys no token fixes are its own
    job = fleet.cli("submit", "--label", "team=nlp", "--", "true").stdout.split()[-1]
    assert fleet.wait_status(job, "succeeded")["worker"] == "nlp-box"
    listed = fleet.cli("workers").stdout
    assert re.search(r"nlp-box .*team=nlp\*", listed), listed


def _token(fleet: Fleet, name: str, *args: str) -> str:
    return fleet.cli("tokens", "create", "--name", name, *args).stdout.strip()


def test_a_submitter_steers_only_the_jobs_it_submitted(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1", "--slots", "2")
    alice = {"GPUFLEET_TOKEN": _token(fleet, "alice", "--role", "submitter")}
    bob = {"GPUFLEET_TOKEN": _token(fleet, "bob", "--role", "submitter")}
    lab_op = {"GPUFLEET_TOKEN": _token(fleet, "lab", "--role", "operator", "--pool", "default")}

    job = fleet.cli("submit", *LONG, env=alice).stdout.split()[-1]
    fleet.wait_status(job, "running")
    shown = json.loads(fleet.cli("show", job, "--json", env=bob).stdout)  # bob may look
    assert (
        shown["submitted_by"] == json.loads(fleet.cli("whoami", "--json", env=alice).stdout)["id"]
    )
    for steer in ("cancel", "stop"):
        refused = fleet.cli(steer, job, env=bob, check=False)
        assert refused.returncode != 0 and "submitted by another token" in refused.stderr
    assert fleet.job(job)["status"] == "running" and not fleet.job(job)["stop_requested_at"]

    cancelled = json.loads(fleet.cli("cancel", job, "--json", env=alice).stdout)
    assert cancelled["status"] == "cancelled"
    refused = fleet.cli("requeue", job, env=bob, check=False)
    assert refused.returncode != 0 and "submitted by another token" in refused.stderr
    again = json.loads(fleet.cli("requeue", job, "--json", env=alice).stdout)
    assert again["status"] == "pending"

    # An operator of the pool may act on anyone's job there.
    fleet.wait_status(job, "running")
    assert json.loads(fleet.cli("cancel", job, "--json", env=lab_op).stdout)["status"] == (
        "cancelled"
    )


def test_a_session_string_carries_the_whole_journey(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    share = _token(fleet, "share", "--role", "submitter")
    proc = fleet.start_worker("shared", "--share-token", env_extra={"GPUFLEET_SHARE_TOKEN": share})
    wait_for(lambda: "session string" in proc.text(), 20, "the session file")
    path = re.search(r"not printed here\): (\S+)", proc.text())
    assert path is not None
    session = Path(path.group(1)).read_text().strip()
    # Nothing else configured: the session names the server, the worker and the token.
    bare = {
        "GPUFLEET_CONFIG_DIR": str(tmp_path / "empty"),
        "GPUFLEET_SERVER": "http://nowhere.invalid",
        "GPUFLEET_SESSION": session,
    }
    script = (
        "import os; os.makedirs('outputs'); "
        "open('outputs/model.txt', 'w').write('weights'); print('trained')"
    )
    job = fleet.cli("submit", "--", sys.executable, "-c", script, env=bare).stdout.split()[-1]
    followed = fleet.cli("logs", "-f", job, env=bare)
    assert "trained" in followed.stdout
    watched = fleet.cli("watch", job, env=bare).stdout
    assert job in watched and "succeeded" in watched and "trained" in watched, watched
    assert json.loads(fleet.cli("show", job, "--json", env=bare).stdout)["worker"] == "shared"
    assert "shared" in fleet.cli("why", job, env=bare).stdout
    fleet.cli("download", job, "-o", str(tmp_path / "got"), env=bare)
    assert (tmp_path / "got" / "outputs" / "model.txt").read_text() == "weights"
    long_job = fleet.cli("submit", *LONG, env=bare).stdout.split()[-1]
    fleet.wait_status(long_job, "running")
    fleet.cli("stop", long_job, "--grace", "1", env=bare)  # SIGINT: Python's default dies
    assert fleet.wait_status(long_job, "failed")["error"] == "killed by SIGINT"
    long_job = fleet.cli("submit", *LONG, env=bare).stdout.split()[-1]
    fleet.wait_status(long_job, "running")
    fleet.cli("cancel", long_job, env=bare)
    assert fleet.job(long_job)["status"] == "cancelled"
    # The same commands take the string as --session @FILE, too.
    (tmp_path / "session").write_text(session)
    at_file = {k: v for k, v in bare.items() if k != "GPUFLEET_SESSION"}
    shown = fleet.cli("show", job, "--session", f"@{tmp_path / 'session'}", "--json", env=at_file)
    assert json.loads(shown.stdout)["status"] == "succeeded"


def test_commands_that_act_answer_in_json(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    made = json.loads(fleet.cli("tokens", "create", "--name", "t", "--json").stdout)
    assert made["token"].startswith("gf_") and made["role"] == "worker"
    rotated = json.loads(fleet.cli("tokens", "rotate", made["id"], "--json").stdout)
    assert rotated["id"] == made["id"] and rotated["token"] != made["token"]
    revoked = json.loads(fleet.cli("tokens", "revoke", made["id"], "--json").stdout)
    assert revoked["id"] == made["id"] and revoked["revoked_at"]
    job = fleet.cli("submit", *LONG).stdout.split()[-1]
    fleet.wait_status(job, "running")
    assert json.loads(fleet.cli("cancel", job, "--json").stdout)["status"] == "cancelled"
    assert json.loads(fleet.cli("requeue", job, "--json").stdout)["status"] == "pending"
    status = fleet.cli("status").stdout
    assert "free" in status and "not running a job" in status, status
    fleet.cli("cancel", job)  # the worker then stops at once, not after a drain


def test_two_processes_polling_as_one_worker_back_off_and_are_told(fleet: Fleet) -> None:
    """The same --name and token on two machines (a cloned image): each new poll ends
    the other's. They must not spin on each other, and the log must say why."""
    fleet.start_server()
    token = _token(fleet, "clone", "--role", "worker")
    twins = []
    for n in range(2):
        argv = [PYTHON, "-m", "gpufleet", "worker", "--name", "twin", "--heartbeat", "0.5"]
        argv += ["--work-dir", str(fleet.root / "work" / f"twin{n}")]
        env = {**fleet.env, "GPUFLEET_TOKEN": token}
        twins.append(Proc(argv, env, fleet.root / f"twin{n}.log"))
        fleet.procs.append(twins[-1])
    for twin in twins:
        wait_for(lambda t=twin: "registered" in t.text(), 30, "a twin to register")
    said = "another process may be polling as this worker"
    wait_for(lambda: all(said in t.text() for t in twins), 30, "both twins to say why")
    # Backing off, they leave the server idle: twins ending each other's polls at once
    # would keep it claiming flat out.
    assert fleet.server is not None
    server = psutil.Process(fleet.server.popen.pid)
    before = sum(server.cpu_times()[:2])
    time.sleep(3.0)
    used = sum(server.cpu_times()[:2]) - before
    assert used < 0.5, f"the server spent {used:.2f}s of CPU in 3s on the twins' polls"
    job = fleet.cli("submit", "--", "true").stdout.split()[-1]
    assert fleet.wait_status(job, "succeeded")["worker"] == "twin"  # still works
