"""Dispatch latency: job created (server clock) to child process started (the job's
``started_at``: the worker's clock when it started the process, on this one host), on an
idle long-polling worker; and, beside it, created to the start recorded by the server
(the time of the job's ``start`` event: the start report's round trip added). Jobs are
submitted one at a time so the worker is always waiting in its poll when the next one
arrives.

    .venv/bin/python bench/dispatch.py [--jobs 200] [--db sqlite|postgresql://...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _fleet import drop_pg_schema, fleet, fresh_pg_schema, percentile

from gpufleet.client import Client
from gpufleet.wire import JobSpecModel


def run(db: str | None, jobs: int) -> tuple[list[float], list[float]]:
    with fleet() as f:
        f.start_server(db)
        f.spawn("worker", "worker", "--name", "bench", "--work-dir", str(f.root / "work"))
        latencies: list[float] = []
        recorded: list[float] = []
        with Client(f.url, f.token()) as c:
            deadline = time.monotonic() + 30
            while not c.workers() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # the worker is in its long poll now
            for i in range(jobs + 5):
                job = c.submit(JobSpecModel(name=f"d{i}", command=["true"])).job
                done_by = time.monotonic() + 30
                while (d := c.job(job.id)).status not in ("succeeded", "failed"):
                    if time.monotonic() > done_by:
                        raise SystemExit(f"job {job.id} did not finish")
                    time.sleep(0.01)
                if i >= 5 and d.started_at is not None:  # the first five warm up
                    latencies.append((d.started_at - d.created_at).total_seconds() * 1000)
                    start = next(
                        e.data for e in c.events(job.id).events if e.data.get("event") == "start"
                    )
                    recorded.append((start["ts"] - d.created_at.timestamp()) * 1000)
                time.sleep(0.05)  # let the worker get back into its poll
        return latencies, recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    args = parser.parse_args()
    pg = args.db.startswith("postgres")
    db = fresh_pg_schema(args.db) if pg else None
    try:
        lat, recorded = run(db, args.jobs)
    finally:
        if db:
            drop_pg_schema(db)
    backend = "postgresql" if pg else "sqlite"
    print(
        f"dispatch latency ({backend}, {len(lat)} jobs): p50 {percentile(lat, 50):.1f} ms, "
        f"p99 {percentile(lat, 99):.1f} ms, mean {statistics.mean(lat):.1f} ms, "
        f"max {max(lat):.1f} ms"
    )
    print(
        f"  start recorded by the server: p50 {percentile(recorded, 50):.1f} ms, "
        f"p99 {percentile(recorded, 99):.1f} ms"
    )


if __name__ == "__main__":
    main()
