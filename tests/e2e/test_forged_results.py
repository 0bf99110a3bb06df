"""A worker's token alone cannot write a job's results: each attempt's writes need the
secret its claim gave the worker, which the worker keeps in memory and no job sees.

The test holds a worker token itself (as a job that stole it would) while a real worker
enrolled with that token runs a real job, and tries to forge that job's result."""

from __future__ import annotations

import httpx

from tests.e2e.conftest import Fleet


def test_a_stolen_worker_token_cannot_finish_or_write_another_jobs_attempt(
    fleet: Fleet,
) -> None:
    fleet.start_server()
    made = fleet.cli("tokens", "create", "--name", "box-1", "--role", "worker")
    token = made.stdout.strip().splitlines()[-1]
    fleet.start_worker("box-1", env_extra={"GPUFLEET_TOKEN": token})
    job_id = fleet.cli("submit", "--", "sleep", "600").stdout.split()[-1]
    fleet.wait_status(job_id, "running")
    stolen = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=fleet.url, headers=stolen, timeout=10) as c:
        for kind, body in (
            ("finish", {"attempt": 1, "exit_code": 0}),
            ("finish", {"attempt": 1, "exit_code": 0, "secret": "gl_" + "A" * 43}),
            ("output", {"attempt": 1, "lines": [{"line": "forged"}]}),
            ("release", {"attempt": 1}),
        ):
            r = c.post(f"/v1/jobs/{job_id}/{kind}", json=body)
            assert r.status_code == 403, (kind, r.text)
            assert "secret" in r.json()["error"]["message"]
        batch = {"reports": [{"kind": "finish", "job_id": job_id, "attempt": 1, "exit_code": 0}]}
        r = c.post("/v1/reports", json=batch)
        assert r.status_code == 200 and r.json()["results"][0]["status"] == 403, r.text
    job = fleet.job(job_id)
    assert job["status"] == "running" and job["attempt"] == 1, job
    logs = fleet.cli("logs", job_id).stdout
    assert "forged" not in logs
    fleet.cli("cancel", job_id)
