"""What a job writes is bounded, and a server whose disk fills up says so: real server and
worker processes, a real (small) disk."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.config import load_token
from gpufleet.domain.quota import MARKER
from gpufleet.wire import CapabilityModel, ClaimRequest, WorkerRegister
from tests.e2e.conftest import Fleet, wait_for

CHATTY = (
    "import sys\n"
    "for n in range(3000):\n"
    "    print(f'{n:05d} ' + 'x' * 200)\n"
    "print('done', file=sys.stderr)\n"
)


def test_a_job_over_its_output_quota_runs_on_and_its_logs_end_in_the_marker(
    fleet: Fleet,
) -> None:
    fleet.start_server("--output-quota", "64K", "--output-rate", "1M", "--output-burst", "1M")
    fleet.start_worker("w1")
    res = fleet.cli("submit", "--name", "chatty", "--", "python", "-c", CHATTY)
    job_id = res.stdout.strip().splitlines()[-1]
    job = fleet.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert job["status"] == "succeeded" and job["exit_code"] == 0  # it ran to its end
    [attempt] = job["history"]
    assert attempt["output_dropped"] > 500_000  # 3,000 lines of 200 bytes, 64 KiB kept

    out = [json.loads(x) for x in fleet.cli("logs", job_id, "--json").stdout.splitlines()]
    assert out[-1]["stream"] == "stderr"
    assert out[-1]["line"].startswith(MARKER) and "output quota of 64 KiB" in out[-1]["line"]
    assert [x["line"][:5] for x in out[:-1]] == [f"{n:05d}" for n in range(len(out) - 1)]
    assert "done" not in {x["line"] for x in out}  # what came after the cut was dropped
    assert re.search(r"output cut: [\d.]+ KiB dropped", fleet.cli("show", job_id).stdout)

    with fleet.client() as c:
        events = c.events(job_id).events
    cuts = [e.data for e in events if e.type == "state" and e.data["event"] == "output_cut"]
    assert len(cuts) == 1 and "output quota of 64 KiB" in str(cuts[0]["why"])
    assert events[-1].type == "state" and events[-1].data["status"] == "succeeded"


# ---- a full database disk ----------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path, database: str | None) -> Iterator[Path]:
    """A 24 MiB tmpfs, mounted for the test and unmounted after it (root only), for a
    server's SQLite database."""
    if database:
        pytest.skip(
            "the database is PostgreSQL, not on this disk: tests/integration/test_quota.py "
            "has PostgreSQL raise disk_full"
        )
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        # lazily if something still holds it (a server the test could not stop)
        if subprocess.run(["umount", str(where)], timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], timeout=30, check=True)


def fill(disk: Path) -> Path:
    """A file that takes every byte left on ``disk``."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            for _ in range(1024):  # 1 GiB at most: the disk is far smaller
                f.write(b"\0" * (1 << 20))
        except OSError:
            return filler
    raise AssertionError(f"{disk} did not fill up")


def assert_no_space(r: httpx.Response) -> None:
    """507 with Retry-After, in the one JSON error shape, with no traceback."""
    assert r.status_code == 507, (r.status_code, r.text)
    assert r.headers["retry-after"].isdigit()
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "detail"}
    assert body["error"]["code"] == "insufficient_storage", body
    assert "disk is full" in body["error"]["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text


def submit_until_full(api: httpx.Client) -> httpx.Response:
    """Submit jobs until one finds the disk full (each one that goes in grows the
    database's write-ahead log, into space there is none of); that answer."""
    for n in range(200):
        r = api.post("/v1/jobs", json={"name": f"filler-{n}", "command": ["true"]})
        if r.status_code != 201:
            return r
    raise AssertionError("200 submits went in on a full disk")


def test_a_full_database_disk_answers_507_and_health_is_degraded_until_space_is_freed(
    fleet: Fleet, small_disk: Path
) -> None:
    try:
        _full_disk_scenario(fleet, small_disk)
    finally:
        fleet.stop_all()  # before the disk is unmounted


def _full_disk_scenario(fleet: Fleet, disk: Path) -> None:
    fleet.start_server("--data-dir", str(disk / "data"))
    headers = {"Authorization": f"Bearer {load_token(fleet.url)}"}
    with fleet.client() as c, httpx.Client(base_url=fleet.url, headers=headers) as api:
        cap = CapabilityModel(hostname="box", cores=4, ram_mib=4096)
        w = c.register(WorkerRegister(name="box", capability=cap))
        fleet.cli("submit", "--name", "held", "--", "sleep", "600")
        lease = c.claim(w.id, ClaimRequest(cpu_slots=1, wait=5))
        assert lease is not None
        beat: dict[str, Any] = {"leases": [{"job_id": lease.job_id, "attempt": lease.attempt}]}
        assert api.get("/v1/health").json()["status"] == "ok"

        filler = fill(disk)
        assert_no_space(submit_until_full(api))
        assert_no_space(api.post(f"/v1/workers/{w.id}/heartbeat", json=beat))
        blob = os.urandom(1 << 20)  # the blobs live on the full disk too
        assert_no_space(api.put(f"/v1/blobs/{hashlib.sha256(blob).hexdigest()}", content=blob))

        def degraded() -> dict[str, Any] | None:
            # a write that fails, then health: a background commit that found room (an
            # audit batch of a few rows) may clear the flag between two calls, so ask again
            if api.post(f"/v1/workers/{w.id}/heartbeat", json=beat).status_code != 507:
                return None  # it found room this time: fail one again
            health = api.get("/v1/health")
            assert health.status_code == 200, health.text
            said: dict[str, Any] = health.json()
            return said if said["status"] == "degraded" else None

        said = wait_for(degraded, 10, "health to say degraded while writes fail")
        assert any("disk is full" in p for p in said["problems"])

        os.unlink(filler)
        assert api.post(f"/v1/workers/{w.id}/heartbeat", json=beat).status_code == 200
        r = api.post("/v1/jobs", json={"name": "after", "command": ["true"]})
        assert r.status_code == 201, r.text
        wait_for(lambda: api.get("/v1/health").json()["status"] == "ok", 5, "health ok again")
    log = (fleet.root / "server.log").read_text()
    assert "database or disk is full" in log and "Traceback" not in log  # one line a call
