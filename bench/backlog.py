"""A worker cut off from its server while its job prints 1 GB of output (10 million lines
of 100 bytes): how much its memory grows, and what the server shows once back. The same
run as tests/e2e/test_backlog.py, at bench size.

    .venv/bin/python bench/backlog.py [--lines 10000000] [--backlog 256M]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from tests.e2e.conftest import Fleet
from tests.e2e.test_backlog import cut_off_while_printing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=10_000_000)
    parser.add_argument("--backlog", default="256M", help="the worker's --log-backlog")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-backlog-") as tmp:
        root = Path(tmp)
        (root / "config").mkdir()
        os.environ["GPUFLEET_CONFIG_DIR"] = str(root / "config")
        fleet = Fleet(root, root / "config")
        started = time.monotonic()
        try:
            got = cut_off_while_printing(fleet, root, args.lines, args.backlog)
        finally:
            fleet.stop_all()
    print(
        f"{args.lines:,} lines ({args.lines * 100 / 1e9:.2f} GB) printed while cut off,"
        f" --log-backlog {args.backlog}: the worker's memory grew {got['grew'] / 2**20:.1f}"
        f" MiB at most; the server kept {got['kept']:,} lines (the newest) and"
        f" {got['markers']} marker line(s); {time.monotonic() - started:.0f}s"
    )


if __name__ == "__main__":
    main()
