"""Heartbeats of a large fleet: N simulated workers (10,000 by default), each with one
GPU, heartbeat a real server process every 30 s over HTTP, spread evenly over the
interval as real workers' start times spread them. The server's CPU (user + system, from
the kernel) is read over the measured window, and each heartbeat's latency on the client.

    .venv/bin/python bench/heartbeats.py [--workers 10000] [--interval 30] [--seconds 60]
                                        [--db sqlite|postgresql://...]

The workers register first (32 at a time; not measured), each sending a first heartbeat
that takes it from connecting to available, so the window measures a running fleet, whose
heartbeats change nothing but liveness and GPU readings. Each heartbeat carries the
worker's GPU reading (memory and utilisation), as a worker's does, and no running lease.
The load side uses aiohttp (see bench/claims.py for why); its own CPU is printed too,
since on a 2-core machine it shares the CPU with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import aiohttp
import psutil
from _fleet import database, fleet, percentile

from gpufleet.wire import CapabilityModel, GpuModel, HeartbeatRequest, WorkerRegister

GIB_MIB = 1024
CONCURRENT = 64  # heartbeats in flight at most (a late one is sent as soon as one returns)


def gpu(index: int, free_mib: int, util: int | None = None) -> GpuModel:
    return GpuModel(
        index=index,
        name="NVIDIA RTX 4090",
        total_mib=24 * GIB_MIB,
        free_mib=free_mib,
        uuid=f"GPU-{index}",
        util_percent=util,
    )


async def register_all(session: aiohttp.ClientSession, n: int) -> list[str]:
    ids: list[str] = [""] * n
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        cap = CapabilityModel(
            hostname=f"sim-{i}", cores=16, ram_mib=64 * GIB_MIB, gpus=[gpu(0, 24 * GIB_MIB)]
        )
        body = WorkerRegister(name=f"sim-{i}", capability=cap, cpu_slots=2)
        async with gate:
            async with session.post("/v1/workers", json=body.model_dump(mode="json")) as r:
                if r.status != 201:
                    raise SystemExit(f"register sim-{i}: HTTP {r.status} {await r.text()}")
                ids[i] = (await r.json())["id"]
            # its first heartbeat takes it from connecting to available (a real worker's
            # first poll does too): the measured window sees a fleet that runs
            first = HeartbeatRequest(gpus=[gpu(0, 24 * GIB_MIB)]).model_dump(mode="json")
            async with session.post(f"/v1/workers/{ids[i]}/heartbeat", json=first) as r:
                if r.status != 200:
                    raise SystemExit(f"first heartbeat of sim-{i}: HTTP {r.status}")

    await asyncio.gather(*(one(i) for i in range(n)))
    return ids


async def beat_for(
    session: aiohttp.ClientSession, ids: list[str], interval: float, seconds: float
) -> tuple[list[float], int]:
    """Heartbeat every worker once per ``interval``, each at its own phase, for
    ``seconds``; the latencies (seconds) and the number of failed heartbeats."""
    latencies: list[float] = []
    failed = 0
    gate = asyncio.Semaphore(CONCURRENT)
    rng = random.Random(1)
    phases = sorted((rng.random() * interval, w) for w in ids)
    start = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()

    async def beat(worker_id: str) -> None:
        nonlocal failed
        reading = gpu(0, rng.randrange(1, 24) * GIB_MIB, rng.randrange(0, 101))
        body = HeartbeatRequest(gpus=[reading]).model_dump(mode="json")
        async with gate:
            sent = time.perf_counter()
            async with session.post(f"/v1/workers/{worker_id}/heartbeat", json=body) as r:
                await r.read()
                if r.status != 200:
                    failed += 1
                    return
            latencies.append(time.perf_counter() - sent)

    rounds = 0
    while time.monotonic() - start < seconds:
        base = start + rounds * interval
        for phase, worker_id in phases:
            due = base + phase
            if due - start >= seconds:
                break
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(beat(worker_id))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        rounds += 1
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=30)
        for task in late:  # unanswered 30 s after the window: failed
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        failed += len(late)
    return latencies, failed


async def measure(
    url: str, token: str | None, workers: int, interval: float, seconds: float, server_pid: int
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    conn = aiohttp.TCPConnector(limit=CONCURRENT + 8)
    async with aiohttp.ClientSession(url, headers=headers, connector=conn) as session:
        t0 = time.monotonic()
        ids = await register_all(session, workers)
        took = time.monotonic() - t0
        print(f"registered {workers} workers, each with a first heartbeat, in {took:.0f} s")
        server, me = psutil.Process(server_pid), psutil.Process()
        cpu0, mine0, wall0 = sum(server.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.monotonic()
        latencies, failed = await beat_for(session, ids, interval, seconds)
        wall = time.monotonic() - wall0
        cores = (sum(server.cpu_times()[:2]) - cpu0) / wall
        client_cores = (sum(me.cpu_times()[:2]) - mine0) / wall
    ms = [s * 1000 for s in latencies]
    print(
        f"heartbeats: {workers} workers every {interval:g} s, {len(ms)} heartbeats in "
        f"{wall:.0f} s ({len(ms) / wall:.0f}/s), {failed} failed; server CPU {cores:.2f} "
        f"core; latency p50 {statistics.median(ms):.1f} ms, p99 {percentile(ms, 99):.1f} ms, "
        f"max {max(ms):.1f} ms (load generator: {client_cores:.2f} core)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between beats")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to measure")
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    args = parser.parse_args()
    with database(args.db) as db, fleet() as f:
        f.start_server(db)
        pid = f.procs[0].pid
        asyncio.run(measure(f.url, f.token(), args.workers, args.interval, args.seconds, pid))


if __name__ == "__main__":
    main()
