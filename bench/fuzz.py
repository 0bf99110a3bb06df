"""schemathesis at bench size: the fuzz suite (tests/integration/test_fuzz.py) with more
examples per operation and role, on SQLite or PostgreSQL. Every call is checked as in CI:
no 5xx, an error answer in the error shape, and a refused call (or a read) changes no
table row and no blob file. Prints how many calls were made, by status class.

    .venv/bin/python bench/fuzz.py [--examples 1000] [--backend sqlite|postgresql] [--seed 1]
                                   [--stream-seconds 10]

About 110,000 calls at --examples 1000 (89,000 at 800: the coverage phase's boundary
values, some 2,400, plus the random phase, per operation and role; some operations run
out of new examples sooner).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--stream-seconds", type=float, default=10.0, help="how long an event stream is read"
    )
    args = parser.parse_args()
    os.environ["GPUFLEET_FUZZ_EXAMPLES"] = str(args.examples)
    os.environ["GPUFLEET_FUZZ_SEED"] = str(args.seed)
    os.environ["GPUFLEET_FUZZ_STREAM_SECONDS"] = str(args.stream_seconds)
    os.environ["GPUFLEET_TEST_BACKENDS"] = args.backend
    os.chdir(ROOT)
    started = time.monotonic()
    code = pytest.main(
        ["-q", "-p", "no:cacheprovider", "-o", "timeout=0", "tests/integration/test_fuzz.py"]
    )
    seconds = time.monotonic() - started
    calls = sys.modules["tests.integration.test_fuzz"].CALLS
    total = sum(calls.values())
    by_class = ", ".join(f"{k} {v}" for k, v in sorted(calls.items()))
    print(
        f"schemathesis on {args.backend}, seed {args.seed}, {args.examples} examples per"
        f" operation and role: {total} calls ({by_class}) in {seconds:.0f}s;"
        f" {'no 5xx, nothing a refused call changed' if code == 0 else 'FAILURES above'}"
    )
    sys.exit(int(code))


if __name__ == "__main__":
    main()
