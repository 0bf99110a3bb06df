"""The job RQ's workers run in bench/throughput.py: the same process gpufleet runs."""

from __future__ import annotations

import subprocess


def run_true() -> None:
    subprocess.run(["true"], check=True)
