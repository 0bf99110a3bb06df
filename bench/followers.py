"""Followers of one job: the server's CPU while 200 clients follow a running job's event
stream (``GET /v1/jobs/{ref}/events``, Server-Sent Events), against the same job with
nobody following. The job prints 200 lines a second and a progress record every second.
Each follower counts the events it gets and checks their ids only ever increase; at the
end every follower must have had every event of the job's log, once.

    .venv/bin/python bench/followers.py [--followers 200] [--window 8] [--from-now]
        [--db sqlite|postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import httpx
import psutil
from _fleet import drop_pg_schema, fleet, fresh_pg_schema

from gpufleet.client import Client
from gpufleet.wire import JobSpecModel

# The job: RATE lines a second (60 characters each) and one progress record a second,
# for SECONDS seconds, flushed every 10 ms.
JOB = """
import json, sys, time
rate, seconds = int(sys.argv[1]), float(sys.argv[2])
start, n, second = time.monotonic(), 0, 0
while (now := time.monotonic() - start) < seconds:
    while n < int(now * rate):
        print(f"line {n:08d} " + "x" * 46)
        n += 1
    if int(now) > second:
        second = int(now)
        print("::gpufleet:: " + json.dumps({"step": n, "loss": 1 / (1 + second)}))
    sys.stdout.flush()
    time.sleep(0.01)
"""
ID = re.compile(rb"^id: (\d+)$", re.MULTILINE)
WAIT = 30.0  # seconds any one wait of this script may take
SETTLE = 2.0  # seconds between catching up and the window


@dataclass
class Follower:
    events: int = 0
    chunks: int = 0  # reads that brought events: about one a batch the server sent
    last: int = 0
    disorder: int = 0  # ids that did not increase (a duplicate, or one out of order)
    ended: bool = False
    error: str | None = None


def cpu_seconds(proc: psutil.Process) -> float:
    """CPU time (user + system) of ``proc``, its children, and its reaped children."""
    t = proc.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            c = child.cpu_times()
            total += c.user + c.system
    return total


async def measure(proc: psutil.Process, seconds: float) -> tuple[float, float]:
    """The CPU seconds ``proc`` used over a window of ``seconds``, and the window's length."""
    cpu, started = cpu_seconds(proc), time.monotonic()
    await asyncio.sleep(seconds)
    return cpu_seconds(proc) - cpu, time.monotonic() - started


async def follow(http: httpx.AsyncClient, path: str, me: Follower) -> None:
    """Read one event stream to its end, counting events and checking their ids."""
    try:
        async with http.stream("GET", path) as resp:
            if resp.status_code != 200:
                me.error = f"HTTP {resp.status_code} {(await resp.aread())[:200]!r}"
                return
            rest = b""
            async for chunk in resp.aiter_raw():
                # complete events end with a blank line; keep what follows the last one
                done, _, rest = (rest + chunk).rpartition(b"\n\n")
                me.chunks += b"\nid: " in b"\n" + done
                for m in ID.finditer(done):
                    seq = int(m[1])
                    me.disorder += seq <= me.last
                    me.last = max(me.last, seq)
                    me.events += 1
                if b"event: end\n" in done:
                    me.ended = True
                    return
    except httpx.HTTPError as exc:
        me.error = f"{type(exc).__name__}: {exc}"


def totals(followers: list[Follower]) -> tuple[int, int]:
    return sum(f.events for f in followers), sum(f.chunks for f in followers)


async def observe(
    c: Client,
    token: str | None,
    job_id: str,
    server: psutil.Process,
    n: int,
    window: float,
    from_now: bool,
) -> dict[str, float]:
    """Server CPU with no follower, then with ``n`` of them, over ``window`` seconds each;
    then cancel the job and check what every follower got."""
    figures: dict[str, float] = {}
    figures["idle_cpu"], figures["idle_wall"] = await measure(server, window)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    timeout = httpx.Timeout(60.0, connect=10.0, pool=10.0)  # a ping comes every 15 s
    async with httpx.AsyncClient(
        base_url=c.server, headers=headers, limits=limits, timeout=timeout
    ) as http:
        followers = [Follower() for _ in range(n)]
        # caught up: every follower has had the records the job had when they started
        had, target = await asyncio.to_thread(log_size, c, job_id)
        path = f"/v1/jobs/{job_id}/events" + (f"?after={target}" if from_now else "")
        cpu0, t0 = cpu_seconds(server), time.monotonic()
        tasks = [asyncio.create_task(follow(http, path, f)) for f in followers]
        while time.monotonic() - t0 < WAIT and not all(f.last >= target for f in followers):
            if all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        figures["catchup_cpu"] = cpu_seconds(server) - cpu0
        figures["catchup_wall"] = time.monotonic() - t0
        await asyncio.sleep(SETTLE)
        events, chunks = totals(followers)
        figures["cpu"], figures["wall"] = await measure(server, window)
        after = totals(followers)
        figures["window_events"], figures["window_chunks"] = after[0] - events, after[1] - chunks
        await asyncio.to_thread(c.cancel, job_id)
        _, pending = await asyncio.wait(tasks, timeout=WAIT)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    total, _ = await asyncio.to_thread(log_size, c, job_id)
    check(followers, total - had if from_now else total)
    figures["events"] = total - had if from_now else total
    return figures


def check(followers: list[Follower], expected: int) -> None:
    """Every follower had every event once, in order, and its stream ended."""
    errors = [f.error for f in followers if f.error]
    if errors:
        raise SystemExit(f"{len(errors)} follower(s) failed, first: {errors[0]}")
    short = sum(1 for f in followers if f.events != expected or not f.ended)
    disorder = sum(f.disorder for f in followers)
    if short or disorder:
        raise SystemExit(
            f"{short} follower(s) missed events or did not end ({expected} expected); "
            f"{disorder} id(s) out of order or repeated"
        )


def log_size(c: Client, job_id: str) -> tuple[int, int]:
    """How many records the job's log holds now, and the newest one's number."""
    total, after = 0, 0
    for _ in range(10_000):
        page = c.events(job_id, after=after, limit=1000)
        if not page.events:
            return total, after
        total, after = total + len(page.events), page.next
    raise SystemExit("the job's log did not end")


def run(db: str | None, n: int, window: float, rate: int, from_now: bool) -> dict[str, float]:
    with fleet() as f:
        f.start_server(db)
        f.spawn("worker", "worker", "--name", "bench", "--work-dir", str(f.root / "work"))
        server = psutil.Process(f.procs[0].pid)
        token = f.token()
        with Client(f.url, token) as c:
            deadline = time.monotonic() + WAIT
            while not c.workers() and time.monotonic() < deadline:
                time.sleep(0.05)
            # at most: the warm-up, both windows, catching up and settling, and a margin
            seconds = 3 + 2 * window + WAIT + SETTLE + 10
            cmd = [sys.executable, "-c", JOB, str(rate), str(seconds)]
            job = c.submit(JobSpecModel(name="followed", command=cmd)).job
            deadline = time.monotonic() + WAIT
            while c.job(job.id).status != "running":
                if time.monotonic() > deadline:
                    raise SystemExit(f"job {job.id} did not start")
                time.sleep(0.05)
            time.sleep(3.0)  # the worker's first batches are in
            figures = asyncio.run(observe(c, token, job.id, server, n, window, from_now))
            if (status := c.job(job.id).status) != "cancelled":
                raise SystemExit(f"job {job.id} ended {status} before it was cancelled")
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--followers", type=int, default=200)
    parser.add_argument("--window", type=float, default=8.0, help="seconds measured")
    parser.add_argument("--rate", type=int, default=200, help="the job's lines a second")
    parser.add_argument(
        "--from-now", action="store_true", help="follow from the log's end, not its start"
    )
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    args = parser.parse_args()
    pg = args.db.startswith("postgres")
    db = fresh_pg_schema(args.db) if pg else None
    try:
        fig = run(db, args.followers, args.window, args.rate, args.from_now)
    finally:
        if db:
            drop_pg_schema(db)
    backend = "postgresql" if pg else "sqlite"
    idle = fig["idle_cpu"] / fig["idle_wall"]
    busy = fig["cpu"] / fig["wall"]
    events = fig["window_events"] / fig["wall"] / args.followers
    batches = fig["window_chunks"] / fig["wall"] / args.followers
    start = "the end" if args.from_now else "the start"
    print(
        f"{args.followers} followers of one job ({backend}, {args.rate} lines/s): "
        f"server CPU {busy:.3f} core with them, {idle:.3f} core with none "
        f"(+{busy - idle:.3f} core; {args.window:g} s windows)\n"
        f"  each follower got {events:.0f} events/s in {batches:.1f} batches/s in the window, "
        f"and all {fig['events']:.0f} events of the job's log from {start}, ids increasing, "
        f"none twice\n"
        f"  catching up from {start} of the log: {fig['catchup_cpu']:.2f} CPU seconds over "
        f"{fig['catchup_wall']:.2f} s"
    )


if __name__ == "__main__":
    main()
