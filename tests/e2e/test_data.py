"""The data plane end to end: packages in, artifacts out, dependencies between jobs,
a worker's cache, shared mounts, and an upload that survives a cut connection."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from gpufleet.config import load_token
from tests.e2e.conftest import Fleet, wait_for

TRAIN = """
import pathlib, sys
data = pathlib.Path("data.txt").read_text()
out = pathlib.Path("outputs"); out.mkdir(exist_ok=True)
(out / "model.txt").write_text("model of " + data)
print("trained on", len(data), "bytes")
"""
INFER = """
import pathlib
model = pathlib.Path("inputs/train/outputs/model.txt").read_text()
out = pathlib.Path("outputs"); out.mkdir(exist_ok=True)
(out / "predictions.txt").write_text("predicted with " + model)
"""


def project(root: Path, data: str = "digits " * 1000) -> Path:
    proj = root / "proj"
    proj.mkdir(parents=True, exist_ok=True)
    (proj / "data.txt").write_text(data)
    (proj / "train.py").write_text(TRAIN)
    (proj / "infer.py").write_text(INFER)
    return proj


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_package_is_sent_once_cached_by_the_worker_and_results_come_back(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    proj = project(tmp_path)
    first = fleet.cli("submit", "--package", str(proj), "--", "python", "train.py")
    assert "bytes sent" in first.stderr and " 0 bytes sent" not in first.stderr
    job1 = last_line(first.stdout)
    assert fleet.wait_status(job1, "succeeded", "failed")["status"] == "succeeded"
    second = fleet.cli("submit", "--package", str(proj), "--", "python", "train.py")
    assert "unchanged, 0 bytes sent" in second.stderr, second.stderr
    job2 = last_line(second.stdout)
    assert fleet.wait_status(job2, "succeeded", "failed")["status"] == "succeeded"
    assert "downloaded" in fleet.cli("logs", job1).stderr
    assert "cache hit" in fleet.cli("logs", job2).stderr, "the second job must not download"

    shown = fleet.job(job1)
    assert shown["artifact"]["file_count"] == 1
    assert shown["artifact"]["files"] == [{"path": "outputs/model.txt", "size": 9 + 7000}]
    got = fleet.cli("download", job1, "-o", str(tmp_path / "results"))
    assert "1 file(s)" in got.stdout
    model = (tmp_path / "results" / "outputs" / "model.txt").read_text()
    assert model == "model of " + "digits " * 1000
    # downloading again into the same folder never overwrites a file
    again = fleet.cli("download", job1, "-o", str(tmp_path / "results"), check=False)
    assert again.returncode != 0 and "model.txt" in again.stderr


def test_a_job_gets_the_artifact_of_the_job_it_waits_for(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    proj = project(tmp_path)
    train = last_line(
        fleet.cli(
            "submit", "--name", "train", "--package", str(proj), "--", "python", "train.py"
        ).stdout
    )
    infer = last_line(
        fleet.cli(
            "submit",
            "--name",
            "infer",
            "--package",
            str(proj),
            "--input",
            "job:train",
            "--",
            "python",
            "infer.py",
        ).stdout
    )
    shown = fleet.job(infer)
    assert shown["status"] == "pending" and shown["waiting"] == 1
    assert shown["depends_on"] == [{"job_id": train, "name": "train", "status": "pending"}]
    fleet.start_worker("w1")
    assert fleet.wait_status(infer, "succeeded", "failed")["status"] == "succeeded"
    fleet.cli("download", infer, "-o", str(tmp_path / "out"))
    predictions = (tmp_path / "out" / "outputs" / "predictions.txt").read_text()
    assert predictions.startswith("predicted with model of digits")


def test_a_failed_dependency_fails_the_waiting_job_with_the_reason(fleet: Fleet) -> None:
    fleet.start_server()
    bad = last_line(
        fleet.cli(
            "submit",
            "--name",
            "bad",
            "--max-attempts",
            "1",
            "--",
            "python",
            "-c",
            "raise SystemExit(3)",
        ).stdout
    )
    child = last_line(
        fleet.cli("submit", "--name", "child", "--input", "job:bad", "--", "true").stdout
    )
    fleet.start_worker("w1")
    failed = fleet.wait_status(child, "failed")
    assert "dependency bad" in failed["error"] and "failed" in failed["error"]
    assert failed["history"] == [], "the waiting job never ran"
    refused = fleet.cli("requeue", child, check=False)
    assert refused.returncode == 1 and "requeue that job first" in refused.stderr
    assert fleet.job(bad)["status"] == "failed"
    unknown = fleet.cli("submit", "--input", "job:nope", "--", "true", check=False)
    assert unknown.returncode == 1 and "no job 'nope'" in unknown.stderr


def test_submit_wait_follows_the_job_and_downloads_its_results(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    proj = project(tmp_path)
    res = fleet.cli(
        "submit",
        "--wait",
        "--results",
        str(tmp_path / "r"),
        "--package",
        str(proj),
        "--",
        "python",
        "train.py",
    )
    assert "trained on 7000 bytes" in res.stdout
    assert "results in" in res.stderr
    assert (tmp_path / "r" / "outputs" / "model.txt").is_file()
    failing = fleet.cli(
        "submit",
        "--wait",
        "--max-attempts",
        "1",
        "--",
        "python",
        "-c",
        "raise SystemExit(2)",
        check=False,
    )
    assert failing.returncode == 1 and "failed" in failing.stderr


def test_a_shared_mount_is_passed_by_reference_and_checked_by_hash(
    fleet: Fleet, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    dataset = shared / "digits"
    dataset.mkdir(parents=True)
    (dataset / "train.csv").write_text("1,2,3\n")
    fleet.start_server()
    # a worker without the mount registers first: it must never be handed the job
    fleet.start_worker("spot", "--slots", "4")
    fleet.start_worker("w1", "--mount", str(shared))
    res = fleet.cli(
        "submit",
        "--package",
        f"data={dataset}",
        "--",
        "python",
        "-c",
        "import pathlib; print(pathlib.Path('data/train.csv').read_text())",
    )
    assert "passed by reference" in res.stderr
    job = last_line(res.stdout)
    done = fleet.wait_status(job, "succeeded", "failed")
    assert (done["status"], done["attempts"], done["worker"]) == ("succeeded", 1, "w1"), done
    assert "1,2,3" in fleet.cli("logs", job).stdout
    why = fleet.cli("why", job).stdout
    assert "spot" in why and "no --mount" in why
    assert json.loads(fleet.cli("blobs", "ls", "--json").stdout) == [], "nothing was copied"
    # the shared copy changes between submit and run: the job is refused, not run on it
    fleet.cli("drain", "w1")
    changed = last_line(fleet.cli("submit", "--package", f"data={dataset}", "--", "true").stdout)
    (dataset / "train.csv").write_text("4,5,6\n")
    fleet.start_worker("w2", "--mount", str(shared))
    failed = fleet.wait_status(changed, "failed", timeout=60)
    assert "does not match what was submitted" in failed["error"]


def test_an_upload_cut_mid_way_resumes_from_the_committed_offset(
    fleet: Fleet, tmp_path: Path
) -> None:
    url = fleet.start_server()
    token = load_token(url)
    auth = {"Authorization": f"Bearer {token}"}
    data = os.urandom(8 << 20)
    sha = hashlib.sha256(data).hexdigest()
    with httpx.Client(base_url=url, headers=auth) as http:
        up = http.post("/v1/uploads", json={"sha256": sha, "size": len(data)}).json()
        # send the request head and half the body, then drop the connection
        host = urlsplit(url)
        with socket.create_connection((host.hostname, host.port)) as s:
            head = (
                f"PATCH /v1/uploads/{up['id']} HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {token}\r\nUpload-Offset: 0\r\n"
                f"Content-Length: {len(data)}\r\n\r\n"
            )
            s.sendall(head.encode() + data[: 3 << 20])
            # cut once the server is writing (cut at once, it may stop before a byte)
            wait_for(  # bounded generously: a loaded CI machine once took over 10 s
                lambda: http.get(f"/v1/uploads/{up['id']}").json()["offset"] > 0,
                30,
                "the server to write the first bytes",
            )
        seen: list[int] = []

        def settled() -> int | None:  # the server has noticed the cut and stopped writing
            seen.append(http.get(f"/v1/uploads/{up['id']}").json()["offset"])
            time.sleep(0.2)
            return seen[-1] if len(seen) > 1 and seen[-1] == seen[-2] > 0 else None

        offset = wait_for(settled, 10, "the server to commit what it received")
        # what the server received and committed before it saw the connection go; the
        # rest of the bytes in flight are sent again
        assert 0 < offset <= 3 << 20
        done = http.patch(
            f"/v1/uploads/{up['id']}",
            content=data[offset:],
            headers={"Upload-Offset": str(offset)},
        )
        assert done.json()["complete"] is True
        assert http.get(f"/v1/blobs/{sha}").content == data


def test_a_job_asking_for_no_outputs_keeps_none_and_says_nothing_about_them(
    fleet: Fleet,
) -> None:
    from gpufleet.wire import JobSpecModel, ManifestApply

    fleet.start_server()
    fleet.start_worker("w1")
    make = ["sh", "-c", "mkdir -p outputs && echo made > outputs/model.txt"]
    with fleet.client() as c:
        c.apply(
            ManifestApply(
                name="outs",
                jobs=[
                    JobSpecModel(name="keeps-none", command=make, outputs=[], manifest="outs"),
                    JobSpecModel(name="asks-for-x", command=make, outputs=["x"], manifest="outs"),
                ],
            )
        )
        wait_for(
            lambda: [j.status for j in c.jobs()] == ["succeeded", "succeeded"], 30, "both jobs"
        )
    none = json.loads(fleet.cli("show", "keeps-none", "--json").stdout)
    assert none["artifact"] is None
    said = fleet.cli("logs", "keeps-none")
    assert "[gpufleet]" not in said.stdout + said.stderr
    # a job whose outputs matched nothing is told so (on stderr, as the job's own was)
    assert "[gpufleet] outputs x matched no files" in fleet.cli("logs", "asks-for-x").stderr
