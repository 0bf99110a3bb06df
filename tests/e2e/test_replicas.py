"""Two servers on one PostgreSQL database: kill either one mid-run, and the CLI and the
workers carry on through the other (``--server URL1,URL2``); with ``--blob-store s3://``
they share blobs without sharing a data dir."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from gpufleet.wire import JobSpecModel
from tests.e2e.conftest import Fleet, Proc, free_port, wait_for
from tests.e2e.test_data import last_line, project
from tests.s3server import CREDENTIALS, S3Server

LEASE = 4.0


def _server(fleet: Fleet, pg_url: str, port: int = 0) -> tuple[Proc, str, list[str]]:
    """A server on the shared database (and data dir): its process, URL and argv."""
    url = fleet.start_server("--port", str(port), db=pg_url, lease_timeout=LEASE)
    assert fleet.server is not None
    return fleet.server, url, list(fleet._server_argv)


def _jobs(fleet: Fleet, names: list[str], effects: Path) -> list[str]:
    script = f'echo "$GPUFLEET_JOB_NAME $GPUFLEET_ATTEMPT" >> {effects}; sleep 1.5'
    with fleet.client() as c:  # through whichever server answers
        return [c.submit(JobSpecModel(name=n, command=[script], shell=True)).job.id for n in names]


def test_two_servers_on_one_database_carry_on_when_either_dies(
    pg_url: str, fleet: Fleet, tmp_path: Path
) -> None:
    a, url_a, argv_a = _server(fleet, pg_url, free_port())
    b, url_b, _ = _server(fleet, pg_url)
    both = f"{url_a},{url_b}"
    fleet.url = fleet.env["GPUFLEET_SERVER"] = both  # the admin token is saved for url_a
    fleet.start_worker("w1", "--slots", "2", "--server", both)
    fleet.start_worker("w2", "--slots", "2", "--server", f"{url_b},{url_a}")
    effects = tmp_path / "effects"

    first = _jobs(fleet, [f"a{n}" for n in range(6)], effects)
    wait_for(lambda: effects.exists() and len(effects.read_text().split("\n")) > 2, 30, "a start")
    a.signal(signal.SIGKILL)  # mid-run: jobs claimed through it, polls open on it
    a.popen.wait(10)
    for job_id in first:
        assert fleet.wait_status(job_id, "succeeded", "failed", timeout=60)["status"] == "succeeded"

    # A comes back (same port); now B dies, and everything goes through A.
    a2 = Proc(argv_a, fleet.env, tmp_path / "server-a2.log")
    fleet.procs.append(a2)
    wait_for(lambda: "listening on" in a2.text(), 30, "server A to come back")
    second = _jobs(fleet, [f"b{n}" for n in range(4)], effects)
    b.signal(signal.SIGKILL)
    b.popen.wait(10)
    for job_id in second:
        assert fleet.wait_status(job_id, "succeeded", "failed", timeout=60)["status"] == "succeeded"

    ran = effects.read_text().split("\n")[:-1]
    names = [line.split()[0] for line in ran]
    assert sorted(set(names)) == sorted([f"a{n}" for n in range(6)] + [f"b{n}" for n in range(4)])
    with fleet.client() as c:
        for job_id in first + second:  # what ran twice was a lost lease, in the history
            job = c.job(job_id)
            assert job.attempt == len(job.history)
            assert job.history[-1].outcome == "succeeded"
    for log in (a.text(), b.text(), a2.text()):
        assert "Traceback" not in log and "internal error" not in log, log


def test_two_servers_share_blobs_through_an_object_store_not_a_data_dir(
    pg_url: str, s3: S3Server, fleet: Fleet, tmp_path: Path
) -> None:
    """Each server has a data dir of its own; blobs live in one bucket. A package sent
    through A runs on a worker of B, its results come back through B, and a large blob put
    through A (a resumable, multipart upload) is read through B."""
    bucket = s3.bucket()
    fleet.env.update(CREDENTIALS)
    shared = ("--blob-store", f"s3://{bucket}/fleet", "--s3-endpoint", s3.endpoint)
    url_a = fleet.start_server("--data-dir", str(tmp_path / "a"), *shared, db=pg_url)
    url_b = fleet.start_server("--data-dir", str(tmp_path / "b"), *shared, db=pg_url)
    assert f"blobs: s3://{bucket}/fleet/" in fleet.server.text()  # type: ignore[union-attr]
    via_a, via_b = {"GPUFLEET_SERVER": f"{url_a},{url_b}"}, {"GPUFLEET_SERVER": f"{url_b},{url_a}"}
    fleet.url = fleet.env["GPUFLEET_SERVER"] = f"{url_a},{url_b}"  # the admin token is A's
    fleet.start_worker("wb", "--server", f"{url_b},{url_a}")  # B while B is up

    proj = project(tmp_path)
    job = last_line(
        fleet.cli("submit", "--package", str(proj), "--", "python", "train.py", env=via_a).stdout
    )
    assert fleet.wait_status(job, "succeeded", "failed")["status"] == "succeeded"
    fleet.cli("download", job, "-o", str(tmp_path / "results"), env=via_b)
    model = (tmp_path / "results" / "outputs" / "model.txt").read_text()
    assert model == "model of " + "digits " * 1000

    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(40 << 20))  # over the CLI's 32 MiB: a resumable session
    sha = fleet.cli("blobs", "put", str(big), env=via_a).stdout.strip()
    fleet.cli("blobs", "get", sha, "-o", str(tmp_path / "big.copy"), env=via_b)
    assert (tmp_path / "big.copy").read_bytes() == big.read_bytes()

    for data_dir in (tmp_path / "a", tmp_path / "b"):  # no blob bytes on either server's disk
        assert not [p for p in data_dir.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20]
    assert f"fleet/objects/{sha[:2]}/{sha}" in s3.keys(bucket)
    assert s3.unfinished(bucket) == [] and s3.keys(bucket, "fleet/uploads/") == []
    for proc in fleet.procs:
        assert "Traceback" not in proc.text(), proc.text()
