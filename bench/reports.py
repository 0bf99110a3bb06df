"""What a worker's start and finish reports cost the server: one simulated worker claims
jobs a batch at a time and reports their start, then their end, in one
``POST /v1/reports`` each (as a worker with that many slots sends the reports that come
while one call is on its way), against a real server process. Prints the server's CPU
per job for those reports alone (the claims between them are not counted).

    .venv/bin/python bench/reports.py [--jobs 800] [--batch 8] [--db sqlite|postgresql://...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import httpx
import psutil
from _fleet import database, fleet

from gpufleet.client import Client
from gpufleet.wire import CapabilityModel, ClaimRequest, JobSpecModel, ManifestApply, WorkerRegister


def run(db: str | None, jobs: int, batch: int) -> tuple[float, float]:
    """The server's CPU a job for its reports (ms), and the wall time of the reports (s)."""
    with fleet() as f:
        url = f.start_server(db)
        token = f.token()
        cap = CapabilityModel(hostname="bench", cores=8, ram_mib=32768)
        with Client(url, token, timeout=300) as c:
            wid = c.register(WorkerRegister(name="sim", capability=cap, cpu_slots=batch)).id
            spec = JobSpecModel(name="r", command=["true"], manifest="r")
            specs = [spec.model_copy(update={"name": f"r{i}"}) for i in range(jobs)]
            c.apply(ManifestApply(name="r", jobs=specs))
        server = psutil.Process(f.procs[0].pid)
        cpu = wall = 0.0
        headers = {"Authorization": f"Bearer {token}"}
        poll = ClaimRequest(cpu_slots=1, wait=0).model_dump()
        with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
            for _ in range(jobs // batch):
                held: dict[str, str] = {}  # job id -> its attempt's secret
                for _ in range(batch):
                    r = http.post(f"/v1/workers/{wid}/claim", json=poll)
                    r.raise_for_status()
                    held[r.json()["job_id"]] = r.json()["secret"]
                before, t0 = sum(server.cpu_times()[:2]), time.perf_counter()
                for kind, extra in (("start", {}), ("finish", {"exit_code": 0})):
                    reports = [
                        {"kind": kind, "job_id": j, "attempt": 1, "secret": secret, **extra}
                        for j, secret in held.items()
                    ]
                    r = http.post("/v1/reports", json={"reports": reports})
                    r.raise_for_status()
                    bad = [x for x in r.json()["results"] if x["status"] not in (200, 204)]
                    if bad:
                        raise SystemExit(f"a report failed: {bad[0]}")
                wall += time.perf_counter() - t0
                cpu += sum(server.cpu_times()[:2]) - before
        done = jobs // batch * batch
        return cpu / done * 1000, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=800)
    parser.add_argument("--batch", type=int, default=8, help="jobs whose reports go together")
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    args = parser.parse_args()
    with database(args.db) as db:
        cpu, wall = run(db, args.jobs, args.batch)
    backend = "postgresql" if db else "sqlite"
    print(
        f"reports ({backend}, {args.jobs} jobs, start and finish in batches of {args.batch}): "
        f"server CPU {cpu:.2f} ms a job, {wall / args.jobs * 1000:.2f} ms of wall time a job"
    )


if __name__ == "__main__":
    main()
