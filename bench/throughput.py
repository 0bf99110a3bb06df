"""End-to-end throughput: N trivial process jobs (``true``) on 2 workers x 4 slots, and,
side by side in the same run, RQ with 2 forking workers running the same process
(``subprocess.run(["true"])``) against this machine's redis-server.

Both sides start their workers first and let them sit idle, then queue all N jobs at once
(gpufleet: one manifest apply; RQ: one pipelined enqueue), and the clock runs from the
queueing until the last job has finished. Runs alternate (gpufleet, RQ, RQ, gpufleet,
...), because this machine's speed drifts; each side's figure is the median of its runs,
with the range.

    .venv/bin/python bench/throughput.py [--jobs 400] [--runs 3] [--db sqlite|postgresql://...]
    (RQ side: pip install rq redis; a redis-server on 127.0.0.1:6379; --no-rq skips it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import psutil
from _fleet import database, fleet

from gpufleet.client import Client
from gpufleet.wire import JobSpecModel, ManifestApply

WAIT = 300.0  # seconds any one run may take
WORKERS, SLOTS = 2, 4


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` and their children (the jobs) so far."""
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system + t.children_user + t.children_system
    return total


def gpufleet_run(db: str | None, jobs: int, cpu: dict[str, list[float]]) -> float:
    with fleet() as f:
        f.start_server(db)
        for i in range(WORKERS):
            work = str(f.root / f"work{i}")
            f.spawn(f"w{i}", "worker", "--name", f"w{i}", "--slots", str(SLOTS), "--work-dir", work)
        with Client(f.url, f.token()) as c:
            deadline = time.monotonic() + 30
            while len(c.workers()) < WORKERS:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the workers did not register: see {f.root}/w0.log")
                time.sleep(0.05)
            time.sleep(1.0)  # every worker is in its long poll
            name = f"tp{time.time_ns()}"
            plan = ManifestApply(
                name=name,
                jobs=[
                    JobSpecModel(name=f"t{i}", command=["true"], outputs=[], manifest=name)
                    for i in range(jobs)
                ],
            )
            server = psutil.Process(f.procs[0].pid)
            workers = [psutil.Process(p.pid) for p in f.procs[1:]]
            server0, workers0 = cpu_seconds([server]), cpu_seconds(workers)
            start = time.perf_counter()
            c.apply(plan)
            deadline = time.monotonic() + WAIT
            while (done := c.status().jobs.get("succeeded", 0)) < jobs:
                if failed := c.status().jobs.get("failed", 0):
                    raise SystemExit(f"gpufleet: {failed} job(s) failed: see {f.root}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"gpufleet: {done} of {jobs} done after {WAIT}s")
                time.sleep(0.1)  # more often costs the server measurably
            took = time.perf_counter() - start
            cpu["server"].append((cpu_seconds([server]) - server0) / jobs * 1000)
            cpu["workers"].append((cpu_seconds(workers) - workers0) / jobs * 1000)
            return took


def rq_run(jobs: int) -> float:
    import redis
    from rq import Queue

    conn = redis.Redis(host="127.0.0.1", port=6379)
    name = f"bench-{os.getpid()}-{time.time_ns()}"
    queue = Queue(name, connection=conn)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    rq = shutil.which("rq", path=str(Path(sys.executable).parent)) or "rq"
    procs = [
        subprocess.Popen(
            [rq, "worker", "--url", "redis://127.0.0.1:6379", "--quiet", name],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(WORKERS)
    ]
    try:
        time.sleep(2.0)  # the workers are up and waiting
        start = time.perf_counter()
        with conn.pipeline() as pipe:
            for _ in range(jobs):
                queue.enqueue("_rq_jobs.run_true", pipeline=pipe)
            pipe.execute()
        deadline = time.monotonic() + WAIT
        while (done := queue.finished_job_registry.count) < jobs:
            if queue.failed_job_registry.count:
                raise SystemExit("RQ: a job failed")
            if time.monotonic() > deadline:
                raise SystemExit(f"RQ: {done} of {jobs} done after {WAIT}s")
            time.sleep(0.02)
        return time.perf_counter() - start
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)
        queue.delete(delete_jobs=True)


def figure(rates: list[float]) -> str:
    return f"{statistics.median(rates):.0f} jobs/s ({min(rates):.0f}-{max(rates):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    parser.add_argument("--no-rq", action="store_true", help="gpufleet only")
    args = parser.parse_args()
    ours: list[float] = []
    cpu: dict[str, list[float]] = {"server": [], "workers": []}
    theirs: list[float] = []
    for run in range(args.runs):
        order = ["gpufleet", "rq"] if run % 2 == 0 else ["rq", "gpufleet"]
        for side in order:
            if side == "rq":
                if not args.no_rq:
                    theirs.append(args.jobs / rq_run(args.jobs))
                continue
            with database(args.db) as db:
                ours.append(args.jobs / gpufleet_run(db, args.jobs, cpu))
    backend = "postgresql" if args.db.startswith("postgres") else "sqlite"
    line = (
        f"throughput, {args.jobs} jobs of `true`, {WORKERS} workers x {SLOTS} slots ({backend}): "
    )
    line += f"gpufleet {figure(ours)}"
    if theirs:
        ratio = statistics.median(ours) / statistics.median(theirs)
        line += f"; RQ {WORKERS} forking workers {figure(theirs)}; ratio {ratio:.2f}x"
    print(line)
    server, workers = statistics.median(cpu["server"]), statistics.median(cpu["workers"])
    print(
        f"  CPU a job (median of runs): server {server:.2f} ms, the 2 workers with their jobs "
        f"{workers:.2f} ms; the server alone on one core could run {1000 / server:.0f} jobs/s"
    )


if __name__ == "__main__":
    main()
