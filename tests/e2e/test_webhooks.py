"""Webhooks with real ``gpufleet server`` and ``gpufleet worker`` processes: a receiver on
loopback (allowed with ``--webhook-allow 127.0.0.1``) gets a job's end and failure,
signed; one that answers 500 is tried again, by the server started again if the first
stopped meanwhile; ``submit --notify`` tells of one job; and the URL and secret appear in
no answer and no line of the server's log. (A preemption's
delivery is shown in tests/integration/test_webhooks.py, at the service level: the
preemption itself is another branch's.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpufleet.client import verify_webhook
from tests.e2e.conftest import Fleet, free_port, wait_for
from tests.hook_receiver import receiver

SECRET = "e2e-receiver-secret-0123456789abcdef"
PATH = "/services/T0000/B0000/TOPSECRETPATH"


def _submit(fleet: Fleet, name: str, *cmd: str, extra: tuple[str, ...] = ()) -> str:
    res = fleet.cli("submit", "--name", name, "--max-attempts", "1", *extra, "--", *cmd)
    return res.stdout.strip().splitlines()[-1]


def test_a_receiver_gets_end_and_failure_signed_and_a_500_is_retried(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server("--webhook-allow", "127.0.0.1")
    fleet.start_worker("w1")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    with receiver(PATH) as r:
        added = fleet.cli("webhooks", "add", r.url, "--secret-file", str(secret_file))
        assert SECRET not in added.stdout + added.stderr
        listed = fleet.cli("webhooks", "list", "--json").stdout
        assert json.loads(listed)[0]["host"] == "127.0.0.1"
        assert "TOPSECRETPATH" not in listed and SECRET not in listed
        r.mode = "500"  # the first delivery fails; its retry comes within a few seconds
        good = _submit(fleet, "good", "python", "-c", "pass")
        fleet.wait_status(good, "succeeded")
        r.wait(1, 20)
        r.mode = "ok"
        bad = _submit(fleet, "bad", "python", "-c", "import sys; sys.exit(3)")
        fleet.wait_status(bad, "failed")
        got = r.wait(3, 30)
        time.sleep(1)  # nothing more comes: each event delivered once when answered 200
        got = list(r.got)
    for g in got:
        assert verify_webhook(SECRET, g.headers, g.body), g.headers
    events = [(g.data["gpufleet"]["job"], g.data["gpufleet"]["event"]) for g in got]
    assert events.count((good, "succeeded")) == 2  # answered 500, then again: 200
    assert events.count((bad, "failed")) == 1
    first, again = (g.at for g in got if g.data["gpufleet"]["job"] == good)
    assert again - first >= 1.5  # a backoff (2 to 6 s for the first), not at once
    log = Path(fleet.root / "server.log").read_text()
    assert "TOPSECRETPATH" not in log and SECRET not in log


def test_submit_notify_tells_of_one_job(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server("--webhook-allow", "127.0.0.1")
    fleet.start_worker("w1")
    with receiver(PATH) as r:
        res = fleet.cli("submit", "--notify", r.url, "--", "python", "-c", "pass")
        job = res.stdout.strip().splitlines()[-1]
        made = res.stderr.split("shown once: ", 1)[1].split()[0]
        assert made.startswith("gw_")
        fleet.wait_status(job, "succeeded")
        got = r.wait(1, 30)
        other = _submit(fleet, "other", "python", "-c", "pass")
        fleet.wait_status(other, "succeeded")
        time.sleep(1.5)
        got = list(r.got)
    assert [g.data["gpufleet"]["job"] for g in got] == [job]
    assert verify_webhook(made, got[0].headers, got[0].body)
    shown = fleet.cli("show", job, "--json").stdout
    assert "TOPSECRETPATH" not in shown and made not in shown
    log = Path(fleet.root / "server.log").read_text()
    assert "TOPSECRETPATH" not in log and made not in log


def test_a_destination_the_server_refuses_is_named(fleet: Fleet) -> None:
    url = fleet.start_server()
    port = url.rsplit(":", 1)[1]
    for bad in ("http://127.0.0.1:9/x", f"http://127.0.0.1:{port}/v1/jobs"):
        res = fleet.cli("webhooks", "add", bad, check=False)
        assert res.returncode != 0
        assert "url" in res.stderr and "refused" in res.stderr, res.stderr


@pytest.mark.slow
def test_a_delivery_due_when_the_server_stops_is_sent_after_it_starts(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server("--webhook-allow", "127.0.0.1", "--port", str(free_port()))
    fleet.start_worker("w1")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    with receiver(PATH) as r:
        fleet.cli("webhooks", "add", r.url, "--secret-file", str(secret_file))
        r.mode = "500"
        job = _submit(fleet, "good", "python", "-c", "pass")
        fleet.wait_status(job, "succeeded")
        r.wait(1, 20)  # tried once, answered 500: due again in 2 to 6 s
        fleet.restart_server()
        back = time.time()  # the first server is gone: what comes now, the second sent
        r.mode = "ok"
        wait_for(lambda: any(g.at >= back for g in r.got), 30, "the delivery after a restart")
        got = [g for g in r.got if g.at >= back]
    assert [g.data["gpufleet"]["job"] for g in got] == [job]
    assert verify_webhook(SECRET, got[0].headers, got[0].body)
