"""The chaos run at bench size: 1,000 jobs on 8 workers, 100 worker SIGKILLs, 50 pauses
past the lease and 20 server SIGKILLs (tests/chaos/harness.py says what is checked and
measured). Prints the figures docs/reliability.md gives; exits 1 if anything was lost,
recorded twice or corrupt, or a server answered 5xx or logged a traceback.

    .venv/bin/python bench/chaos.py                      # one server on SQLite
    .venv/bin/python bench/chaos.py --servers 2 --db postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from _fleet import drop_pg_schema, fresh_pg_schema
from tests.chaos.harness import Chaos, Plan, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--worker-kills", type=int, default=100)
    parser.add_argument("--pauses", type=int, default=50)
    parser.add_argument("--server-kills", type=int, default=20)
    parser.add_argument("--cancel-requeues", type=int, default=20)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lease", type=float, default=3.0)
    parser.add_argument("--keep", action="store_true", help="keep the run's logs")
    args = parser.parse_args()
    pg = args.db.startswith("postgres")
    if args.servers > 1 and not pg:
        parser.error("several servers share a PostgreSQL database: give --db postgresql://...")
    db = fresh_pg_schema(args.db) if pg else None
    plan = Plan(
        jobs=args.jobs,
        workers=args.workers,
        slots=args.slots,
        worker_kills=args.worker_kills,
        pauses=args.pauses,
        server_kills=args.server_kills,
        cancel_requeues=args.cancel_requeues,
        servers=args.servers,
        db=db,
        seed=args.seed,
        lease=args.lease,
        gap=(0.4, 1.6),
        deadline=3600,
    )
    root = Path(tempfile.mkdtemp(prefix="gpufleet-chaos-"))
    try:
        report = Chaos(plan, root).run()
    finally:
        if db:
            drop_pg_schema(db)
    print(summary(report, plan))
    for problem in [*report.lost, *report.twice, *report.corrupt, *report.server_errors][:40]:
        print("  ", problem)
    for problem in report.worker_errors[:20]:
        print("  ", problem)
    if args.keep or not report.ok():
        print(f"logs kept in {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if report.ok() else 1)


if __name__ == "__main__":
    main()
