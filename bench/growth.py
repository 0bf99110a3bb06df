"""How cost grows with the queue: the same calls against a real server holding 1,000,
10,000 and 100,000 pending jobs, each size on a fresh server and database.

    .venv/bin/python bench/growth.py [--sizes 1000,10000,100000] [--calls 20]
                                     [--db sqlite|postgresql://...] [--fair off|on|both]

The jobs are queued by three users in turn (alice, bob, carol). ``--fair both`` measures
each size with fair share off and on (weights 2:1:1), side by side: with it on, a claim
reads each user's queue apart (one index seek per user) and ranks them by standing.

For each size it times, over HTTP from this process (httpx, one connection):

- ``apply``: the N jobs, as manifests of 10,000 jobs each (the total, and per 1,000
  jobs): the one call whose cost may grow with N;
- ``claim``: one claim of a registered worker with free slots (``wait=0``), which ranks
  the pool's queue from its front;
- ``jobs page``: the first page of the jobs list, newest first, 50 rows (what the
  dashboard and ``gpufleet jobs --limit 50`` ask for);
- ``status``: the fleet's counts (``gpufleet status``);
- ``why``: why the job in the middle of the queue waits, with its place in the queue.

Each figure is the median of ``--calls`` calls, in milliseconds, after one untimed call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import httpx
from _fleet import OWNERS, database, fleet

from gpufleet.wire import CapabilityModel, JobSpecModel, ManifestApply, WorkerRegister

PER_MANIFEST = 10_000
CALLS = ("claim", "jobs page", "status", "why")


def timed(fn: Callable[[], httpx.Response], calls: int) -> float:
    """Median milliseconds of ``calls`` calls of ``fn`` (after one untimed call)."""
    fn().raise_for_status()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn().raise_for_status()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def one_size(db: str | None, n: int, calls: int, fair: bool = False) -> dict[str, float]:
    """The figures for ``n`` jobs queued by three users (alice, bob, carol, in turn), with
    fair share on (``fair``) or off."""
    with fleet() as f:
        f.start_server(db, fair=fair)
        headers = {"Authorization": f"Bearer {f.token()}"}
        owners = f.owner_tokens(OWNERS)
        with httpx.Client(base_url=f.url, headers=headers, timeout=600) as c:
            cap = CapabilityModel(hostname="bench", cores=8, ram_mib=32768)
            body = WorkerRegister(name="w", capability=cap, cpu_slots=calls + 2)
            worker = c.post("/v1/workers", json=body.model_dump(mode="json")).json()["id"]
            per = min(PER_MANIFEST, -(-n // len(owners)))
            t0 = time.perf_counter()
            for at in range(0, n, per):
                name = f"m{at // per}"
                jobs = [
                    JobSpecModel(name=f"j{i:06d}", command=["true"], manifest=name)
                    for i in range(at, min(n, at + per))
                ]
                plan = ManifestApply(name=name, jobs=jobs).model_dump(mode="json")
                who = {"Authorization": f"Bearer {owners[(at // per) % len(owners)]}"}
                c.post("/v1/manifests", json=plan, headers=who).raise_for_status()
            apply_s = time.perf_counter() - t0
            middle = c.get("/v1/jobs", params={"limit": 1, "name": f"j{n // 2:06d}"})
            middle_id = middle.json()[0]["id"]
            claim = {"cpu_slots": 1, "wait": 0}
            out = {
                "apply (s)": apply_s,
                "apply per 1k jobs (ms)": apply_s / n * 1000 * 1000,
                "claim": timed(lambda: c.post(f"/v1/workers/{worker}/claim", json=claim), calls),
                "jobs page": timed(
                    lambda: c.get("/v1/jobs", params={"order": "newest", "limit": 50}), calls
                ),
                "status": timed(lambda: c.get("/v1/status"), calls),
                "why": timed(lambda: c.get(f"/v1/jobs/{middle_id}/why"), calls),
            }
            return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    parser.add_argument(
        "--fair",
        default="off",
        choices=["off", "on", "both"],
        help="fair share off, on (three users weighted 2:1:1), or both side by side",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.fair]
    pg = args.db.startswith("postgres")
    results: dict[tuple[int, bool], dict[str, float]] = {}
    for n in sizes:
        for fair in modes:
            with database(args.db) as db:
                got = results[(n, fair)] = one_size(db, n, args.calls, fair)
            mode = "fair share on" if fair else "fair share off"
            print(f"  {n:,} jobs, {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()))
    backend = "postgresql" if pg else "sqlite"
    print(f"cost as the queue grows ({backend}; ms, median of {args.calls} calls):")
    keys = list(next(iter(results.values())))
    cols = [(n, fair) for n in sizes for fair in modes]
    heads = [
        f"{n:,}" + ("" if len(modes) == 1 else (" fair" if fair else " fifo")) for n, fair in cols
    ]
    print(f"  {'':24}" + "".join(f"{h:>16}" for h in heads))
    for k in keys:
        print(f"  {k:24}" + "".join(f"{results[c][k]:>16.1f}" for c in cols))


if __name__ == "__main__":
    main()
