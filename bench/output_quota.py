"""How fast one job printing as fast as it can grows the database: with the output quota
out of reach (as before there was one) and with the server's default quota (1 GiB an
attempt, 1 MiB/s beyond a 64 MiB burst). A real server and worker; the job prints lines
of 100 bytes, in writes of 1,000 lines, for ``--seconds``; the database's size is read
as the job starts and every second until it ends (SQLite: its file and write-ahead
log; PostgreSQL: its schema's tables and indexes). The last minute shows the rate past
the burst.

    .venv/bin/python bench/output_quota.py [--seconds 180] [--db sqlite|postgresql://...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _fleet import BenchFleet, database, fleet

from gpufleet.client import Client
from gpufleet.wire import JobSpecModel

FLOOD = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
chunk = ''.join(f'{n:09d} ' + 'x' * 90 + '\\n' for n in range(1000))
while time.monotonic() < end:
    sys.stdout.write(chunk)
    sys.stdout.flush()
"""
OUT_OF_REACH = {"OUTPUT_QUOTA": "1T", "OUTPUT_RATE": "1T", "OUTPUT_BURST": "1T"}
MIB = 1 << 20


def db_bytes(f: BenchFleet, db: str | None) -> int:
    """The database's size on disk now."""
    if db is None:
        data = f.root / "data"
        return sum(p.stat().st_size for p in data.glob("gpufleet.db*"))
    import psycopg

    base, _, schema = db.partition("?options=-csearch_path%3D")
    with psycopg.connect(base) as conn:
        row = conn.execute(
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 't', 'm')",
            (schema,),
        ).fetchone()
    return int(row[0] or 0) if row else 0


def flood(db: str | None, seconds: float, quota: dict[str, str]) -> tuple[float, float, int]:
    """MiB a minute the database grew while the job ran: over the whole run, and over its
    last minute (past any burst); the bytes of output the server dropped."""
    with fleet() as f:
        for key, value in quota.items():
            f.env[f"GPUFLEET_{key}"] = value
        f.start_server(db)
        f.spawn("worker", "worker", "--name", "w1", "--heartbeat", "1")
        with Client(f.url, f.token()) as c:
            cmd = ["python", "-c", FLOOD, str(seconds)]
            job_id = c.submit(JobSpecModel(name="flood", command=cmd)).job.id
            deadline = time.monotonic() + 60
            while c.job(job_id).status != "running" and time.monotonic() < deadline:
                time.sleep(0.05)
            samples = [(time.monotonic(), db_bytes(f, db))]
            deadline = samples[0][0] + seconds + 120
            while c.job(job_id).status == "running" and time.monotonic() < deadline:
                time.sleep(1.0)
                samples.append((time.monotonic(), db_bytes(f, db)))
            dropped = sum(a.output_dropped for a in c.job(job_id).history)
    return per_minute(samples), per_minute(_last_minute(samples)), dropped


def per_minute(samples: list[tuple[float, int]]) -> float:
    (t0, b0), (t1, b1) = samples[0], samples[-1]
    return (b1 - b0) / MIB / max(t1 - t0, 1e-9) * 60


def _last_minute(samples: list[tuple[float, int]]) -> list[tuple[float, int]]:
    end = samples[-1][0]
    return [s for s in samples if s[0] >= end - 60] or samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--db", default="sqlite")
    args = parser.parse_args()
    kind = "PostgreSQL" if args.db.startswith("postgres") else "SQLite"
    for label, quota in (("no quota (before)", OUT_OF_REACH), ("default quota (after)", {})):
        with database(args.db) as db:
            whole, last, dropped = flood(db, args.seconds, quota)
        print(
            f"{kind}, {label}: the database grew {whole:.0f} MiB a minute over the"
            f" {args.seconds:.0f} s job ({last:.0f} in its last minute);"
            f" {dropped / MIB:.0f} MiB of its output dropped"
        )


if __name__ == "__main__":
    main()
