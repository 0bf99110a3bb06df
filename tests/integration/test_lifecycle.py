"""A worker's life through the API (leave, remove, labels its token fixes), what a failed
attempt keeps, and a worker's slot held by the job aimed at it."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest

from gpufleet.domain.models import Role
from gpufleet.server.auth import Auth
from gpufleet.store import SqlStore
from tests.integration.helpers import (
    TESTCLIENT_ON_HTTPX,
    assert_error,
    bearer,
    claim,
    gpu,
    register,
    submit,
)

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

pytestmark = TESTCLIENT_ON_HTTPX


def _events(client: TestClient, admin: dict[str, str]) -> list[tuple[str, str]]:
    rows = client.get("/v1/audit", headers=admin).json()
    return [(a["event"], a["target"]) for a in rows if a["event"]]


def test_a_worker_that_leaves_is_offline_at_once_and_can_then_be_removed(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    assert w["status"] == "connecting"
    assert_error(client.delete(f"/v1/workers/{w['id']}", headers=admin), 409, None, "offline")
    held = submit(client, admin, name="held")
    assert claim(client, worker, w["id"])["job_id"] == held
    r = client.post(f"/v1/workers/{w['id']}/leave", json={"reason": "drained"}, headers=worker)
    assert r.status_code == 204, r.text
    gone = client.get(f"/v1/workers/{w['id']}", headers=admin).json()
    assert gone["status"] == "offline" and gone["offline_since"]
    job = client.get(f"/v1/jobs/{held}", headers=admin).json()  # it held a job: back, free
    assert job["status"] == "pending" and job["attempts"] == 0
    removed = client.delete(f"/v1/workers/{w['id']}", headers=admin)
    assert removed.status_code == 200 and removed.json()["name"] == "box"
    assert_error(client.get(f"/v1/workers/{w['id']}", headers=admin), 404)
    events = _events(client, admin)
    for kind in ("worker.registered", "worker.offline", "worker.removed"):
        assert (kind, w["id"]) in events, events


def test_labels_a_worker_token_fixes_are_the_workers_whatever_it_says(
    client: TestClient, store: SqlStore, admin: dict[str, str]
) -> None:
    token = Auth(store).create("nlp-box", Role.WORKER, ["default"], labels={"team": "nlp"})[1]
    headers = bearer(token)
    refused = client.post(
        "/v1/workers",
        json={
            "name": "liar",
            "labels": {"team": "cv"},
            "capability": {"hostname": "h", "cores": 1, "ram_mib": 1024},
        },
        headers=headers,
    )
    assert_error(refused, 403, "forbidden", "team=cv", "fixes team=nlp")
    assert_error(client.get("/v1/workers/liar", headers=admin), 404)
    w = register(client, headers, "nlp-box", labels={"team": "nlp", "site": "lab"})
    assert w["labels"] == {"team": "nlp", "site": "lab"} and w["fixed_labels"] == ["team"]
    quiet = register(client, headers, "quiet-box")  # declares nothing: still carries it
    assert quiet["labels"] == {"team": "nlp"}


def _finish(client: TestClient, worker: dict[str, str], job: str, **body: Any) -> Any:
    r = client.post(f"/v1/jobs/{job}/finish", json={"attempt": 1, **body}, headers=worker)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_failed_attempt_keeps_the_end_of_its_stderr_until_requeued(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box")
    job = submit(client, admin, max_attempts=1)
    claim(client, worker, w["id"])
    tail = ["Traceback (most recent call last):", "ValueError: bad\x00input"]
    done = _finish(client, worker, job, exit_code=3, stderr_tail=tail)
    assert done["status"] == "failed" and done["error"] == "exit code 3"
    detail = client.get(f"/v1/jobs/{job}", headers=admin).json()
    assert detail["stderr_tail"] == [tail[0], "ValueError: bad\ufffdinput"]
    assert detail["history"][0]["stderr_tail"] == detail["stderr_tail"]
    too_many = {"attempt": 1, "exit_code": 1, "stderr_tail": ["x"] * 21}
    assert_error(client.post(f"/v1/jobs/{job}/finish", json=too_many, headers=worker), 422)
    again = client.post(f"/v1/jobs/{job}/requeue", headers=admin).json()
    assert again["status"] == "pending" and again["stderr_tail"] == []


@pytest.mark.parametrize("queue", [False, True])
def test_a_job_aimed_at_a_worker_holds_its_slot(
    client: TestClient, admin: dict[str, str], worker: dict[str, str], queue: bool
) -> None:
    w = register(client, worker, "gpu-small", gpus=[gpu(0, 12)], cpu_slots=1)
    client.post(f"/v1/workers/{w['id']}/claim", json={"cpu_slots": 1, "wait": 0}, headers=worker)
    body = {"name": "mine", "command": ["t"], "requirements": {"worker": "gpu-small"}}
    first = client.post("/v1/jobs", json=body, headers=admin, params={"queue": queue})
    assert first.status_code == 201, first.text
    listed = client.get(f"/v1/workers/{w['id']}", headers=admin).json()
    assert listed["status"] == "reserved"
    second = client.post("/v1/jobs", json=body, headers=admin)
    error = assert_error(second, 409, "conflict", "gpu-small is reserved", "--queue")
    assert first.json()["job"]["id"] in error["message"]
    # a CPU job may still have the CPU slot; cancelling the first frees the GPU
    cpu = {**body, "requirements": {"worker": "gpu-small", "cpu_only": True}}
    assert client.post("/v1/jobs", json=cpu, headers=admin).status_code == 201
    client.post(f"/v1/jobs/{first.json()['job']['id']}/cancel", headers=admin)
    assert client.post("/v1/jobs", json=body, headers=admin).status_code == 201


def test_a_stopped_job_is_told_by_heartbeat_and_log_batch_and_ends_once(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    w = register(client, worker, "box", cpu_slots=2)
    jobs = [submit(client, admin, name=n) for n in ("keeps", "dies")]
    leases = [claim(client, worker, w["id"]) for _ in jobs]
    for lease in leases:
        client.post(f"/v1/jobs/{lease['job_id']}/start", json={"attempt": 1}, headers=worker)
        r = client.post(f"/v1/jobs/{lease['job_id']}/stop", json={"grace": 7}, headers=admin)
        assert r.status_code == 200 and r.json()["stop_requested_at"], r.text
    beat = {"leases": [{"job_id": j, "attempt": 1} for j in jobs]}
    orders = client.post(f"/v1/workers/{w['id']}/heartbeat", json=beat, headers=worker).json()
    assert {(o["order"], o["grace"]) for o in orders["orders"]} == {("stop", 7.0)}
    logs = {"attempt": 1, "lines": [{"line": "saving"}]}
    r = client.post(f"/v1/jobs/{jobs[0]}/output", json=logs, headers=worker)
    assert r.status_code == 204 and r.headers["gpufleet-stop"] == "7"
    kept = _finish(client, worker, jobs[0], exit_code=0)
    assert kept["status"] == "succeeded" and kept["stopped_early"]
    died = _finish(client, worker, jobs[1], exit_code=-2, error="killed by SIGINT")
    assert died["status"] == "failed" and died["attempts"] == 1  # attempts left: not retried
    again = client.post(f"/v1/jobs/{jobs[1]}/requeue", headers=admin).json()
    assert again["stop_requested_at"] is None and not again["stopped_early"]


def test_status_counts_the_slots_of_workers_not_offline_and_which_are_free(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """``free``: no job runs on the slot and none aimed at the worker holds it."""
    w = register(client, worker, "gpu2", gpus=[gpu(0), gpu(1)], cpu_slots=2)
    gone = register(client, worker, "laptop", cpu_slots=4)
    client.post(f"/v1/workers/{gone['id']}/leave", json={"reason": "x"}, headers=worker)
    submit(client, admin, name="on-gpu", requirements={"require_cuda": True})
    free = [{"index": i, "free_mib": 8 * 1024} for i in (0, 1)]
    poll = {"cpu_slots": 2, "gpus": free, "wait": 0}
    lease = client.post(f"/v1/workers/{w['id']}/claim", json=poll, headers=worker).json()
    assert len(lease["gpus"]) == 1, lease
    aimed = {"name": "aimed", "command": ["t"], "requirements": {"worker": "gpu2"}}
    assert client.post("/v1/jobs", json=aimed, headers=admin).status_code == 201
    status = client.get("/v1/status", headers=admin).json()
    assert status["workers"] == {"reserved": 1, "offline": 1}, status
    assert (status["gpus"], status["gpus_free"]) == (2, 0), status
    assert (status["cpu_slots"], status["cpu_slots_free"]) == (2, 2), status


def test_a_result_sent_after_its_attempt_ended_is_refused_and_kept_in_the_history(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """The worker's late word is what an operator needs after an incident: the 409 alone
    shows only in that worker's log. The attempt number counts on across a requeue."""
    w = register(client, worker, "box")
    job = submit(client, admin, max_attempts=1)
    claim(client, worker, w["id"])
    assert client.post(f"/v1/jobs/{job}/cancel", headers=admin).json()["attempt"] == 1
    late = {"attempt": 1, "exit_code": 0, "error": "saved model\x00"}
    for _ in range(2):  # the worker's retry changes nothing
        assert_error(client.post(f"/v1/jobs/{job}/finish", json=late, headers=worker), 409)
    [first] = client.get(f"/v1/jobs/{job}", headers=admin).json()["history"]
    assert first["outcome"] == "cancelled"
    assert first["late_result"].startswith("exit code 0 (saved model\ufffd), sent at 20")
    assert first["late_result"].endswith("; refused")

    again = client.post(f"/v1/jobs/{job}/requeue", headers=admin).json()
    assert (again["attempt"], again["attempts"]) == (1, 0)
    assert claim(client, worker, w["id"])["attempt"] == 2
    done = _finish(client, worker, job, attempt=2, exit_code=0)
    assert (done["attempt"], done["attempts"], done["status"]) == (2, 1, "succeeded")
    listed = client.get("/v1/jobs", headers=admin).json()
    assert [j["attempt"] for j in listed if j["id"] == job] == [2]
    history = client.get(f"/v1/jobs/{job}", headers=admin).json()["history"]
    assert [(a["attempt"], a["late_result"] is None) for a in history] == [(1, False), (2, True)]


def test_a_big_log_batch_sent_twice_is_stored_once_in_order(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """A batch larger than one store transaction takes (it is stored in parts) and a
    resend of it and of its second half, as after a lost answer: every line once."""
    w = register(client, worker, "box")
    job = submit(client, admin)
    claim(client, worker, w["id"])
    client.post(f"/v1/jobs/{job}/start", json={"attempt": 1}, headers=worker)
    lines = [{"line": f"line {i}"} for i in range(2_500)]
    lines.insert(1_700, {"stream": "progress", "line": '{"epoch": 2, "loss": 0.25}'})
    for first, batch in ((0, lines), (0, lines), (1_200, lines[1_200:])):
        body = {"attempt": 1, "lines": batch, "first": first}
        r = client.post(f"/v1/jobs/{job}/output", json=body, headers=worker)
        assert r.status_code == 204, r.text
    url = f"/v1/jobs/{job}/events?format=json&types=log,progress&limit=5000"
    stored = client.get(url, headers=admin).json()["events"]
    said = [e["data"].get("line", e["data"].get("record")) for e in stored]
    assert said == [*(f"line {i}" for i in range(1_700)), {"epoch": 2, "loss": 0.25}] + [
        f"line {i}" for i in range(1_700, 2_500)
    ]
    shown = client.get(f"/v1/jobs/{job}", headers=admin).json()
    assert shown["progress"]["epoch"] == 2 and shown["metrics"] == {"loss": 0.25}


def test_one_poll_fills_every_free_slot_and_never_one_twice(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """``most``: a worker with free slots gets up to that many leases in one answer, one
    per free slot (GPU jobs on different GPUs), and a later poll counts them as held."""
    w = register(client, worker, "gpu2", gpus=[gpu(0), gpu(1)], cpu_slots=2)
    cpu_jobs = [submit(client, admin, name=f"cpu{i}") for i in range(3)]
    gpu_jobs = [
        submit(client, admin, name=f"gpu{i}", requirements={"require_cuda": True}) for i in range(3)
    ]
    free = [{"index": i, "free_mib": 8 * 1024} for i in (0, 1)]
    poll = {"cpu_slots": 2, "gpus": free, "wait": 0, "most": 8}
    first = client.post(f"/v1/workers/{w['id']}/claim", json=poll, headers=worker).json()
    leases = [first, *first["more"]]
    assert all(lease["more"] == [] for lease in first["more"])
    got = {lease["job_id"]: lease["gpus"] for lease in leases}
    assert len(leases) == len(got) == 4, leases
    on_gpus = [g for job, g in got.items() if job in gpu_jobs]
    assert sorted(on_gpus) == [[0], [1]], got
    assert sum(job in cpu_jobs for job in got) == 2, got
    # every slot is held now: the same poll again gets nothing
    again = client.post(f"/v1/workers/{w['id']}/claim", json=poll, headers=worker)
    assert again.status_code == 204, again.text
    # one CPU job ends: one slot, one lease, even when more are asked for
    done = next(job for job in got if job in cpu_jobs)
    _finish(client, worker, done, exit_code=0)
    third = client.post(f"/v1/workers/{w['id']}/claim", json=poll, headers=worker).json()
    assert third["job_id"] in cpu_jobs and third["job_id"] not in got and third["more"] == []


def test_a_heartbeat_brings_an_offline_worker_back_and_says_so(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """Most heartbeats are one statement; one from a worker the server had marked offline
    takes the long way, which records its return."""
    w = register(client, worker, "box")
    beat = {"gpus": [], "draining": False}
    assert client.post(f"/v1/workers/{w['id']}/heartbeat", json=beat, headers=worker).is_success
    assert client.get(f"/v1/workers/{w['id']}", headers=admin).json()["status"] == "available"
    client.post(f"/v1/workers/{w['id']}/leave", json={"reason": "paused"}, headers=worker)
    assert client.get(f"/v1/workers/{w['id']}", headers=admin).json()["status"] == "offline"
    back = client.post(f"/v1/workers/{w['id']}/heartbeat", json=beat, headers=worker)
    assert back.status_code == 200 and back.json()["drain"] is False
    shown = client.get(f"/v1/workers/{w['id']}", headers=admin).json()
    assert shown["status"] == "available" and shown["offline_since"] is None
    assert ("worker.online", w["id"]) in _events(client, admin)
    # a worker draining by its own word is shown draining, heartbeat after heartbeat
    draining = {**beat, "draining": True}
    client.post(f"/v1/workers/{w['id']}/heartbeat", json=draining, headers=worker)
    assert client.get(f"/v1/workers/{w['id']}", headers=admin).json()["status"] == "draining"


def test_a_job_is_dated_from_when_its_worker_started_it_within_claim_and_report(
    client: TestClient, admin: dict[str, str], worker: dict[str, str]
) -> None:
    """The worker says when it started the process, by its clock; the job keeps that time
    when it lies between the claim and the report (a report that waited out a server
    outage, or only its round trip, must not make the job look started late), else the
    nearer end. A time without a zone is refused by name and starts nothing."""
    w = register(client, worker, "box", cpu_slots=4)
    jobs = [submit(client, admin, name=f"j{n}") for n in range(3)]
    leases = {claim(client, worker, w["id"])["job_id"] for _ in jobs}
    assert leases == set(jobs)

    def claimed_at(job: str) -> datetime:
        [attempt] = client.get(f"/v1/jobs/{job}", headers=admin).json()["history"]
        return datetime.fromisoformat(attempt["claimed_at"])

    def started_at(job: str) -> datetime:
        return datetime.fromisoformat(
            client.get(f"/v1/jobs/{job}", headers=admin).json()["started_at"]
        )

    def start(job: str, when: str) -> Any:
        body = {"attempt": 1, "started_at": when}
        return client.post(f"/v1/jobs/{job}/start", json=body, headers=worker)

    time.sleep(0.2)  # the report comes a while after the claim
    said = claimed_at(jobs[0]) + timedelta(seconds=0.1)
    assert start(jobs[0], said.isoformat()).status_code == 204
    assert abs(started_at(jobs[0]) - said) < timedelta(milliseconds=1)

    assert start(jobs[1], (claimed_at(jobs[1]) - timedelta(hours=1)).isoformat()).status_code == 204
    assert started_at(jobs[1]) == claimed_at(jobs[1])  # never before its claim

    naive = datetime.now().replace(tzinfo=None).isoformat()
    assert_error(start(jobs[2], naive), 422, None, "started_at")
    assert client.get(f"/v1/jobs/{jobs[2]}", headers=admin).json()["status"] == "claimed"
    before = datetime.now(UTC)
    assert start(jobs[2], (before + timedelta(hours=1)).isoformat()).status_code == 204
    assert before <= started_at(jobs[2]) <= datetime.now(UTC)  # never after the report
