"""Claim throughput: 16 simulated workers claim from a queue of pending jobs as fast as
they can, over HTTP against a real server process.

    .venv/bin/python bench/claims.py [--jobs 3000] [--workers 16] [--db sqlite|postgresql://...]
        [--servers 2] [--fair off|on|both]

The jobs are queued by three users, a third each; ``--fair both`` measures with fair share
off, then on (weights 2:1:1).

With ``--servers N`` (PostgreSQL) N server processes share the database and the claimers
are spread over them, as behind a load balancer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import aiohttp
import psutil
from _fleet import OWNERS, drop_pg_schema, fleet, fresh_pg_schema

from gpufleet.client import Client
from gpufleet.wire import (
    CapabilityModel,
    ClaimRequest,
    JobSpecModel,
    Lease,
    ManifestApply,
    WorkerRegister,
)


async def claimer(
    session: aiohttp.ClientSession,
    worker_id: str,
    leases: list[str],
    wait: float,
    last: list[float],
    jobs: int,
) -> None:
    body = ClaimRequest(cpu_slots=1, wait=wait).model_dump()
    empty = 0
    while True:
        async with session.post(f"/v1/workers/{worker_id}/claim", json=body) as resp:
            if resp.status == 204:
                # On PostgreSQL a row another claimer is looking at is skipped, not waited
                # for; a real worker polls again, and so does this one while jobs remain.
                empty += 1
                if len(leases) >= jobs or empty > 50:
                    return
                await asyncio.sleep(0.01)
                continue
            empty = 0
            if resp.status != 200:
                raise SystemExit(f"claim failed: HTTP {resp.status} {await resp.text()}")
            leases.append(Lease.model_validate_json(await resp.read()).job_id)
            last[0] = time.perf_counter()


async def claim_all(
    urls: list[str], token: str | None, worker_ids: list[str], wait: float, jobs: int
) -> tuple[list[str], float]:
    # aiohttp, not the SDK's httpx, on the load side: httpx's async client spends about
    # 2 ms of CPU a request, which on a 2-core machine would measure the client.
    leases: list[str] = []
    last = [0.0]  # when the latest lease arrived
    headers = {"Authorization": f"Bearer {token}"}
    sessions = [aiohttp.ClientSession(url, headers=headers) for url in urls]
    try:
        started = time.perf_counter()
        await asyncio.gather(
            *(
                claimer(sessions[i % len(sessions)], w, leases, wait, last, jobs)
                for i, w in enumerate(worker_ids)
            )
        )
        # Up to the last lease: with --wait the final polls then idle on an empty queue.
        return leases, last[0] - started
    finally:
        for session in sessions:
            await session.close()


def index_reads(db: str) -> int:
    """Index entries of the ``jobs`` table read so far in the schema of ``db``."""
    import psycopg

    base, _, schema = db.partition("?options=-csearch_path%3D")
    with psycopg.connect(base, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes "
            "WHERE schemaname = %s AND relname = 'jobs'",
            (schema,),
        ).fetchone()
    return int(row[0]) if row else 0


def run(
    db: str | None, jobs: int, workers: int, wait: float, servers: int = 1, fair: bool = False
) -> tuple[list[str], float, str]:
    """The leases, the seconds they took, and what the claims cost: the server's CPU, and
    on PostgreSQL the index entries of ``jobs`` read (a claim that walks the queue reads
    thousands)."""
    with fleet() as f:
        urls = [f.start_server(db, fair=fair)]
        token = f.token()
        owners = f.owner_tokens(OWNERS)
        urls += [f.start_server(db, fair=fair) for _ in range(servers - 1)]
        cap = CapabilityModel(hostname="bench", cores=8, ram_mib=32768)
        # The claimers never finish what they claim; the server takes a worker's claimed
        # jobs out of its free slots, so each gets slots enough to hold its whole share.
        slots = min(1024, -(-jobs // workers) + 1)
        with Client(urls[0], token, timeout=300) as c:
            ids = [
                c.register(WorkerRegister(name=f"sim-{i}", capability=cap, cpu_slots=slots)).id
                for i in range(workers)
            ]
        # Queued by three users, a third each: with fair share on, claims alternate.
        for n, owner in enumerate(owners):
            with Client(urls[0], owner, timeout=300) as c:
                name = f"bench-{OWNERS[n]}"
                specs = [
                    JobSpecModel(name=f"c{i}", command=["true"], manifest=name)
                    for i in range(n, jobs, len(owners))
                ]
                c.apply(ManifestApply(name=name, jobs=specs))
        procs = [psutil.Process(p.pid) for p in f.procs]

        def server_cpu() -> float:
            return sum(sum(p.cpu_times()[:2]) for p in procs)

        if db:
            time.sleep(1.5)  # the apply's reads published first (within a second)
        cpu_before, reads_before = server_cpu(), index_reads(db) if db else 0
        leases, seconds = asyncio.run(claim_all(urls, token, ids, wait, jobs))
        cpu = (server_cpu() - cpu_before) / max(1, len(leases)) * 1000
        cost = f"server CPU {cpu:.2f} ms a claim (all servers)"
        if db:
            time.sleep(1.5)  # PostgreSQL publishes a backend's statistics within a second
            reads = (index_reads(db) - reads_before) / max(1, len(leases))
            cost += f", {reads:.0f} index entries of jobs read a claim"
        return leases, seconds, cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="long-poll seconds per claim; > 0 makes every claimer a waiting worker that "
        "others are ranked against (the last poll waits this long on an empty queue)",
    )
    parser.add_argument(
        "--servers", type=int, default=1, help="server processes sharing a PostgreSQL database"
    )
    parser.add_argument(
        "--fair",
        default="off",
        choices=["off", "on", "both"],
        help="fair share off, on (three users weighted 2:1:1), or both, one after the other",
    )
    args = parser.parse_args()
    for fair in {"off": [False], "on": [True], "both": [False, True]}[args.fair]:
        measure(parser, args, fair)


def measure(parser: argparse.ArgumentParser, args: argparse.Namespace, fair: bool) -> None:
    pg = args.db.startswith("postgres")
    if args.servers > 1 and not pg:
        parser.error("--servers > 1 needs --db postgresql://... (servers share PostgreSQL)")
    db = fresh_pg_schema(args.db) if pg else None
    try:
        leases, seconds, cost = run(db, args.jobs, args.workers, args.wait, args.servers, fair)
    finally:
        if db:
            drop_pg_schema(db)
    backend = "postgresql" if pg else "sqlite"
    claimed = len(leases)
    if claimed != args.jobs or len(set(leases)) != claimed:
        raise SystemExit(f"claimed {claimed} ({len(set(leases))} distinct) of {args.jobs} jobs")
    print(
        f"claim throughput ({backend}, {args.servers} server(s), {args.workers} workers, "
        f"{claimed} jobs, fair share {'on' if fair else 'off'}): "
        f"{claimed / seconds:.0f} claims/s ({seconds:.2f} s); {cost}"
    )


if __name__ == "__main__":
    main()
