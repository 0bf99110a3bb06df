"""Dispatch under a log flood: dispatch latency (job created to started, server clock)
to one worker while a job on another worker prints 20,000 lines a second, against the
same with no flood. Worker A (pool ``flood``) runs the flood job; worker B (pool
``default``) runs short jobs (``true``) submitted one at a time, as in
bench/dispatch.py. Also how many lines a second the server stored of the flood.

    .venv/bin/python bench/log_flood.py [--jobs 100] [--rate 20000] [--db sqlite|postgresql://...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import psutil
from _fleet import drop_pg_schema, fleet, fresh_pg_schema, percentile

from gpufleet.client import Client
from gpufleet.wire import JobSpecModel

# The flood: RATE lines a second of 80 characters, written every 10 ms in one write, for
# at most SECONDS seconds; every EVERY lines a progress record of how many it has
# printed (step) and when (t, its clock): the newest one the server holds says how many
# lines it has stored, and how far behind the job it is.
FLOOD = """
import sys, time
rate, seconds, every = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
out, start, n = sys.stdout, time.monotonic(), 0
while (now := time.monotonic() - start) < seconds:
    lines = []
    while n < int(now * rate):
        lines.append(f"{n:09d} " + "x" * 70 + "\\n")
        n += 1
        if n % every == 0:
            lines.append('::gpufleet:: {"step": %d, "t": %.3f}\\n' % (n, time.time()))
    out.write("".join(lines))
    out.flush()
    time.sleep(0.01)
"""
EVERY = 2000  # flood lines between progress records
WAIT = 30.0  # seconds any one wait of this script may take


@dataclass
class Stored:
    at: float  # this script's clock (time.time) when read
    lines: int  # the flood's lines the server held (to within EVERY)
    printed_at: float  # when the job printed the newest of them (its clock)


def wait_for(what: str, ok: Any, seconds: float = WAIT) -> Any:
    deadline = time.monotonic() + seconds
    while not (got := ok()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not after {seconds:g} s")
        time.sleep(0.02)
    return got


@dataclass
class Dispatch:
    """Milliseconds from created to started of each job, and the two parts of it: to
    claimed (the server wakes worker B's poll and hands the job over), and from there to
    started (worker B starts the process and reports it)."""

    total: list[float] = field(default_factory=list)
    claim: list[float] = field(default_factory=list)
    start: list[float] = field(default_factory=list)


def ms(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds() * 1000


def dispatch(c: Client, jobs: int) -> Dispatch:
    """Dispatch of ``jobs`` jobs (``true``) in pool default, submitted one at a time,
    after five to warm up."""
    out = Dispatch()
    for i in range(jobs + 5):
        job = c.submit(JobSpecModel(name=f"d{i}", command=["true"])).job
        d = wait_for(
            f"job {job.id} to finish",
            lambda j=job.id: (d := c.job(j)).status in ("succeeded", "failed") and d,
        )
        if i >= 5 and d.started_at is not None and d.history:
            out.total.append(ms(d.created_at, d.started_at))
            out.claim.append(ms(d.created_at, d.history[-1].claimed_at))
            out.start.append(ms(d.history[-1].claimed_at, d.started_at))
        time.sleep(0.05)  # let the worker get back into its poll
    return out


def stored(c: Client, job_id: str) -> Stored:
    p = c.job(job_id).progress or {}
    return Stored(time.time(), int(p.get("step", 0)), float(p.get("t", 0.0)))


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def run(db: str | None, jobs: int, rate: int) -> dict[str, Any]:
    with fleet() as f:
        f.start_server(db)
        f.spawn(
            "worker-a", "worker", "--name", "a", "--pool", "flood", "--work-dir", str(f.root / "a")
        )
        f.spawn("worker-b", "worker", "--name", "b", "--work-dir", str(f.root / "b"))
        server, worker_a = (psutil.Process(p.pid) for p in f.procs[:2])
        out: dict[str, Any] = {}
        with Client(f.url, f.token()) as c:
            wait_for("two workers", lambda: len(c.workers()) >= 2)
            time.sleep(0.5)  # the workers are in their long polls now
            out["quiet"] = dispatch(c, jobs)
            cmd = [sys.executable, "-c", FLOOD, str(rate), "600", str(EVERY)]
            flood = c.submit(JobSpecModel(name="flood", command=cmd, pool="flood")).job
            try:
                wait_for("the flood's first lines stored", lambda: stored(c, flood.id).lines)
                time.sleep(3.0)  # in full flow
                before, cpu = stored(c, flood.id), cpu_seconds([server, worker_a])
                out["flood"] = dispatch(c, jobs)
                after, cpu = stored(c, flood.id), cpu_seconds([server, worker_a]) - cpu
            finally:
                c.cancel(flood.id)
            wait_for("the flood cancelled", lambda: c.job(flood.id).status == "cancelled")
        seconds = after.at - before.at
        out["stored"] = (after.lines - before.lines) / seconds
        out["printed"] = (after.lines - before.lines) / (after.printed_at - before.printed_at)
        out["lag"] = (before.at - before.printed_at, after.at - after.printed_at)
        out["cpu"] = cpu / seconds
        out["seconds"] = seconds
        return out


def summary(d: Dispatch) -> str:
    lat = d.total
    return (
        f"p50 {percentile(lat, 50):.1f} ms, p99 {percentile(lat, 99):.1f} ms, "
        f"mean {statistics.mean(lat):.1f} ms, max {max(lat):.1f} ms "
        f"(to claimed p50/p99 {percentile(d.claim, 50):.1f}/{percentile(d.claim, 99):.1f}, "
        f"claimed to started {percentile(d.start, 50):.1f}/{percentile(d.start, 99):.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--rate", type=int, default=20_000, help="the flood's lines a second")
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    args = parser.parse_args()
    pg = args.db.startswith("postgres")
    db = fresh_pg_schema(args.db) if pg else None
    try:
        r = run(db, args.jobs, args.rate)
    finally:
        if db:
            drop_pg_schema(db)
    quiet, flood = r["quiet"], r["flood"]
    slower = percentile(flood.total, 50) / percentile(quiet.total, 50) - 1
    slower99 = percentile(flood.total, 99) / percentile(quiet.total, 99) - 1
    print(
        f"dispatch to worker B ({'postgresql' if pg else 'sqlite'}, {len(quiet.total)} jobs each)\n"
        f"  no flood:           {summary(quiet)}\n"
        f"  {args.rate:,} lines/s: {summary(flood)}\n"
        f"  slower by {slower:+.1%} at p50, {slower99:+.1%} at p99\n"
        f"the flood over {r['seconds']:.1f} s: the server stored {r['stored']:,.0f} lines/s "
        f"(the job printed {r['printed']:,.0f} lines/s); the newest stored line was "
        f"{r['lag'][0]:.1f} s old at the start and {r['lag'][1]:.1f} s at the end; "
        f"server + worker A CPU {r['cpu']:.2f} core"
    )


if __name__ == "__main__":
    main()
