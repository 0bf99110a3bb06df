"""`make demo`: a local fleet on the embedded default, running real training jobs.

Starts `gpufleet server` (SQLite in a temporary data dir) and two `gpufleet worker`
processes (a "gpu-box" that simulates two GPUs, and a CPU-only "laptop"), applies
examples/lab-plan.toml (its code travels as a package), waits for every job, prints where
each ran, how long it took and its result, and downloads every job's artifact (trained
models, and the predictions of an inference job that used one) into a local folder whose
path it prints. `--keep` leaves the fleet running until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpufleet.client import Client
from gpufleet.config import load_token

HERE = Path(__file__).resolve().parent
console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "gpufleet", *argv], env=env, stdout=f, stderr=subprocess.STDOUT
        )


def wait_listening(proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "listening on" in line:
                return line.split("listening on ", 1)[1].split()[0]
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        time.sleep(0.05)
    raise SystemExit("the server did not start in time")


def wait_workers(client: Client, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(client.workers()) < count:
        if time.monotonic() > deadline:
            raise SystemExit("the workers did not register in time")
        time.sleep(0.1)


def result_of(client: Client, job_id: str) -> str:
    for line in reversed(client.logs(job_id).lines):
        if line.line.startswith('{"result"'):
            r = json.loads(line.line)["result"]
            return f"accuracy {r['accuracy']:.3f} (fit {r['fit_seconds']}s)"
    return "-"


def show(client: Client) -> bool:
    gpu_names = {w.id: {g.index: g.name for g in w.gpus} for w in client.workers()}
    table = Table(title="digits-lab", header_style="bold")
    for col in ("job", "status", "attempts", "worker", "device", "took", "result"):
        table.add_column(col)
    ok = True
    for j in client.jobs():
        ok &= j.status == "succeeded"
        names = gpu_names.get(j.worker_id or "", {})
        device = ", ".join(f"GPU{g} {names.get(g, '')}".strip() for g in j.gpus) or "CPU"
        took = "-"
        if j.started_at and j.finished_at:
            took = f"{(j.finished_at - j.started_at).total_seconds():.1f}s"
        colour = "green" if j.status == "succeeded" else "red"
        table.add_row(
            j.name,
            f"[{colour}]{j.status}[/{colour}]",
            str(j.attempts),
            j.worker or "-",
            device,
            took,
            result_of(client, j.id),
        )
    console.print(table)
    return ok


def download_all(client: Client, env: dict[str, str], where: Path) -> Path:
    """Every finished job's artifact, unpacked under ``where/JOB_NAME`` by the real CLI."""
    for j in client.jobs():
        if j.status == "succeeded":
            subprocess.run(
                [sys.executable, "-m", "gpufleet", "download", j.id, "-o", str(where / j.name)],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
            )
    return where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", action="store_true", help="leave the fleet running until Ctrl-C")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the jobs")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpufleet-demo-"))
    env = {**os.environ, "GPUFLEET_CONFIG_DIR": str(root / "config"), "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        server = start(
            ["server", "--port", "0", "--data-dir", str(root / "data")], env, root / "server.log"
        )
        procs.append(server)
        url = wait_listening(server, root / "server.log")
        env["GPUFLEET_SERVER"] = url
        console.print(f"server: {url} (SQLite in {root / 'data'}); logs in {root}")
        procs.append(
            start(
                [
                    "worker",
                    "--name",
                    "gpu-box",
                    "--simulate-gpus",
                    "RTX 4090:24,RTX 3060:12",
                    "--work-dir",
                    str(root / "work-gpu"),
                    "--cache-dir",
                    str(root / "cache-gpu"),
                ],
                env,
                root / "worker-gpu-box.log",
            )
        )
        procs.append(
            start(
                [
                    "worker",
                    "--name",
                    "laptop",
                    "--work-dir",
                    str(root / "work-laptop"),
                    "--cache-dir",
                    str(root / "cache-laptop"),
                ],
                env,
                root / "worker-laptop.log",
            )
        )
        with Client(url, _token(env, url)) as client:
            wait_workers(client, 2)
            subprocess.run(
                [sys.executable, "-m", "gpufleet", "apply", str(HERE / "lab-plan.toml")],
                env=env,
                check=True,
            )
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                jobs = client.jobs()
                if jobs and all(j.status in ("succeeded", "failed", "cancelled") for j in jobs):
                    break
                time.sleep(0.5)
            ok = show(client)
            results = download_all(client, env, root / "results")
        console.print(f"\nresults (models, metrics, predictions): {results}")
        if args.keep:
            console.print(
                f"\nThe fleet keeps running. In another shell:\n"
                f"  export GPUFLEET_SERVER={url} GPUFLEET_CONFIG_DIR={root / 'config'}\n"
                f"  .venv/bin/gpufleet jobs\nCtrl-C stops it."
            )
            stop = {signal.SIGINT, signal.SIGTERM}
            signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # so sigwait, not death, takes them
            signal.sigwait(stop)
        return 0 if ok else 1
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def _token(env: dict[str, str], url: str) -> str | None:
    os.environ["GPUFLEET_CONFIG_DIR"] = env["GPUFLEET_CONFIG_DIR"]
    return load_token(url)


if __name__ == "__main__":
    sys.exit(main())
