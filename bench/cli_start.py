"""The CLI's start: wall time of whole ``gpufleet`` processes, as a user types them.

    .venv/bin/python bench/cli_start.py [--runs 10]

Times ``gpufleet --help`` and ``gpufleet jobs`` against a real local server (SQLite, no
jobs), each run a fresh process, the two commands taking turns. Prints the median and the
range of each, the modules ``gpufleet jobs`` spends most of its import time on
(``python -X importtime``), and its steps timed one after another in fresh processes
(the lowest of five): Typer and Rich, pydantic with a first model, the wire, the command's
own modules, and its call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _fleet import fleet

COMMANDS = {"gpufleet --help": ["--help"], "gpufleet jobs": ["jobs"]}


def wall(args: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "gpufleet", *args],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def slowest_imports(env: dict[str, str], top: int = 6) -> list[tuple[int, str]]:
    """(cumulative microseconds, module) of the slowest top-level imports of `jobs`."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gpufleet", "jobs"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    found = []
    for line in out.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split(":", 1)[1].split("|")
        # top-level imports only: a nested one is indented under the import that caused it
        if cumulative.strip().isdigit() and not name.startswith("  "):
            found.append((int(cumulative), name.strip()))
    return sorted(found, reverse=True)[:top]


STEPS = """
import sys, time
t = [time.perf_counter()]
import typer, rich.console, rich.table
t.append(time.perf_counter())
from pydantic import BaseModel
class First(BaseModel):
    x: int
t.append(time.perf_counter())
import gpufleet.wire
t.append(time.perf_counter())
import gpufleet.cli.jobs
t.append(time.perf_counter())
from gpufleet.client import Client
from gpufleet.config import load_token
with Client(sys.argv[1], load_token(sys.argv[1])) as c:
    c.jobs()
t.append(time.perf_counter())
print(" ".join(f"{(b - a) * 1000:.1f}" for a, b in zip(t, t[1:])))
"""
STEP_NAMES = (
    "Typer and Rich",
    "pydantic, first model",
    "the wire",
    "the command's modules",
    "the call",
)


def steps(env: dict[str, str], url: str, runs: int = 5) -> list[float]:
    """The lowest time of each step of `gpufleet jobs` over ``runs`` fresh processes."""
    seen: list[list[float]] = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", STEPS, url],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        seen.append([float(x) for x in out.split()])
    return [min(column) for column in zip(*seen, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    with fleet() as f:
        f.start_server(None)
        env = {**f.env, "GPUFLEET_SERVER": f.url}
        env.pop("PYTHONUNBUFFERED", None)
        for argv in COMMANDS.values():  # warm the page cache and the bytecode
            wall(argv, env)
        times: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for run in range(args.runs):
            order = list(COMMANDS.items())
            for name, argv in order if run % 2 == 0 else reversed(order):
                times[name].append(wall(argv, env))
        imports = slowest_imports(env)
        lowest = steps(env, f.url)
    for name, seconds in times.items():
        ms = [s * 1000 for s in seconds]
        print(
            f"CLI start, {name}: {statistics.median(ms):.0f} ms "
            f"({min(ms):.0f}-{max(ms):.0f}, {len(ms)} runs)"
        )
    print(
        "  slowest imports of `gpufleet jobs` (cumulative ms): "
        + ", ".join(f"{name} {us / 1000:.0f}" for us, name in imports)
    )
    print(
        "  `gpufleet jobs` step by step (ms, lowest of 5): "
        + ", ".join(f"{name} {ms:.0f}" for name, ms in zip(STEP_NAMES, lowest, strict=True))
    )
    if os.environ.get("GPUFLEET_SERVER"):
        print("  (GPUFLEET_SERVER in this environment was ignored: a local server was used)")


if __name__ == "__main__":
    main()
