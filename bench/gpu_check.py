"""A real GPU, end to end: a server and a worker of this checkout on a machine with an
NVIDIA GPU and PyTorch, the real NVML (no fake driver), and three checks.

    make gpu-check                       # wheels, a venv over the machine's torch, this
    make gpu-wheels                      # on a machine with a registry: the wheels alone
    python bench/gpu_check.py [--dry-run] [--hold 8]

``make gpu-check`` builds wheels of gpufleet and its dependencies (``make gpu-wheels``,
into build/gpu-wheels; set GPU_PLATFORM to build them for another Python, e.g.
``GPU_PLATFORM="--python-version 3.12 --implementation cp --platform
manylinux_2_28_x86_64 --platform manylinux2014_x86_64"``), makes a venv with
``--system-site-packages`` over the machine's own PyTorch (GPU_PYTHON, default python3),
installs the wheels into it with ``--no-index`` and runs this script there. A machine that
reaches no package registry needs only this checkout and build/gpu-wheels carried to it.
Never run in CI: it needs a GPU.

The checks, each printed PASS or FAIL with its figures:

1. ``capability``: the worker registered with the GPU(s) NVML found, each with its name
   and total memory, and the driver's version (``gpufleet workers --json``).
2. ``pinned``: a ``--require-cuda`` job that prints ``CUDA_VISIBLE_DEVICES`` and
   ``torch.cuda.device_count()``, then allocates 1 GiB and holds it (``--hold`` seconds),
   sees exactly its pinned GPU, and ``gpufleet show JOB --json`` reports its GPU memory
   (``gpu_mib`` > 0) while it runs.
3. ``gpu_oom``: a job that allocates 1 GiB more than the GPU holds fails, and its
   attempt's cause in ``gpufleet show --json`` is ``gpu_oom``. It also says whether
   ``gpufleet.domain.oom.gpu_oom`` recognises PyTorch's line in the attempt's stderr.

``--dry-run`` stops after check 1; with ``--fake-nvml`` (dry runs only) the worker's
GPUs come from the fake driver of tests/fake_nvml, so the rest of the script runs on a
machine without a GPU. With OUT set, a JSON summary is written to $OUT/gpu-check.json
and the server's and worker's logs beside it. Exits 1 on any FAIL; every process it
started is stopped, whatever happens. It takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _fleet import BenchFleet, fleet

from gpufleet.domain.oom import gpu_oom, total_gib, tried_gib

ROOT = Path(__file__).resolve().parents[1]
FAKE_NVML = ROOT / "tests" / "fake_nvml"
FAKE_GPUS = [{"name": "NVIDIA H200 (fake)", "total_mib": 143771, "free_mib": 143000}]
WORKER = "gpu-check"

PINNED = """
import os, time, torch
print("CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), flush=True)
print("device_count=%d" % torch.cuda.device_count(), flush=True)
held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("allocated_gib=%.2f" % (torch.cuda.memory_allocated() / 2**30), flush=True)
time.sleep(HOLD)
"""
TOO_BIG = """
import torch
total = torch.cuda.get_device_properties(0).total_memory
print("total_gib=%.2f" % (total / 2**30), flush=True)
torch.empty(total + (1 << 30), dtype=torch.uint8, device="cuda")
"""


class Checks:
    """Each check's verdict and figures, printed as it is made."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def record(self, name: str, passed: bool, **figures: Any) -> bool:
        self.results.append({"check": name, "passed": passed, **figures})
        said = ", ".join(f"{k}={v!r}" for k, v in figures.items())
        print(f"{'PASS' if passed else 'FAIL'} {name}: {said}", flush=True)
        return passed

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r["passed"] for r in self.results)


def gpufleet(f: BenchFleet, *args: str, timeout: float = 60) -> str:
    """What ``gpufleet ARGS`` prints; raises, with its stderr, when it fails."""
    res = subprocess.run(
        [sys.executable, "-m", "gpufleet", *args],
        env=f.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if res.returncode != 0:
        raise RuntimeError(f"gpufleet {' '.join(args)} exited {res.returncode}: {res.stderr}")
    return res.stdout


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)
    return value


def start(f: BenchFleet, fake: bool) -> None:
    """A server on SQLite and 127.0.0.1 (a free port), and one worker, registered."""
    f.start_server(None)
    if fake:
        path = os.pathsep.join(p for p in (str(FAKE_NVML), f.env.get("PYTHONPATH", "")) if p)
        f.env.update(PYTHONPATH=path, FAKE_NVML_GPUS=json.dumps(FAKE_GPUS))
    work = f.root / "work"
    worker = f.spawn("worker", "worker", "--name", WORKER, "--heartbeat", "0.5",
                     "--work-dir", str(work))  # fmt: skip
    log = f.root / "worker.log"
    wait_for(
        lambda: "registered" in log.read_text() or worker.poll() is not None,
        60,
        "the worker to register",
    )
    if worker.poll() is not None:
        raise RuntimeError(f"the worker exited {worker.returncode}:\n{log.read_text()}")


def check_capability(f: BenchFleet, checks: Checks, fake: bool) -> None:
    workers = json.loads(gpufleet(f, "workers", "--json"))
    mine = next(w for w in workers if w["name"] == WORKER)
    cap = mine["capability"]
    gpus = [
        {"index": g["index"], "name": g["name"], "total_gib": round(g["total_mib"] / 1024, 2)}
        for g in mine["gpus"]
    ]
    driver = cap.get("driver_version")
    real = not mine["gpus_simulated"] and "fake" not in (driver or "")
    passed = (
        bool(gpus)
        and all(g["name"] and g["total_gib"] > 0 for g in gpus)
        and bool(driver)
        and (real or fake)
    )
    checks.record(
        "capability",
        passed,
        gpus=gpus,
        driver_version=driver,
        cuda_version=cap.get("cuda_version"),
        torch_version=cap.get("torch_version"),
        real_nvml=real,
    )


def submit(f: BenchFleet, name: str, script: str, *flags: str) -> str:
    out = gpufleet(f, "submit", "--require-cuda", "--name", name, *flags, "--",
                   sys.executable, "-c", script)  # fmt: skip
    return out.split()[-1]


def show(f: BenchFleet, job: str) -> dict[str, Any]:
    detail: dict[str, Any] = json.loads(gpufleet(f, "show", job, "--json"))
    return detail


def printed(f: BenchFleet, job: str) -> dict[str, str]:
    """The job's ``key=value`` lines."""
    from gpufleet.client import Client

    with Client(f.url, f.token()) as c:
        lines = [line.line for line in c.logs(job).lines]
    return dict(line.split("=", 1) for line in lines if "=" in line and " " not in line)


def check_pinned(f: BenchFleet, checks: Checks, hold: float) -> None:
    script = PINNED.replace("HOLD", repr(hold))
    flags = ("--max-attempts", "1", "--timeout", str(hold + 120))
    job = submit(f, "gpu-check-pinned", script, *flags)
    most_mib = 0
    deadline = time.monotonic() + hold + 180
    while time.monotonic() < deadline:
        detail = show(f, job)
        most_mib = max(most_mib, detail.get("gpu_mib") or 0)
        if detail["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.5)
    seen = printed(f, job)
    pinned = [str(g) for g in detail.get("gpus", [])]
    visible = seen.get("CUDA_VISIBLE_DEVICES")
    checks.record(
        "pinned",
        detail["status"] == "succeeded"
        and seen.get("device_count") == "1"
        and visible == ",".join(pinned)
        and most_mib > 0,
        job=job,
        status=detail["status"],
        pinned_gpus=pinned,
        CUDA_VISIBLE_DEVICES=visible,
        device_count=seen.get("device_count"),
        allocated_gib=seen.get("allocated_gib"),
        most_gpu_mib_in_show=most_mib,
        error=detail.get("error"),
    )


def _attempts(detail: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's attempts: ``history`` today (``attempts`` is their count), or a list
    named ``attempts`` should ``show --json`` come to give one."""
    listed = detail.get("attempts")
    history: list[dict[str, Any]] = listed if isinstance(listed, list) else detail["history"]
    return history


def check_gpu_oom(f: BenchFleet, checks: Checks) -> None:
    job = submit(f, "gpu-check-oom", TOO_BIG, "--max-attempts", "2", "--timeout", "300")
    detail = wait_for(
        lambda: (d := show(f, job))["status"] in ("failed", "succeeded", "cancelled") and d,
        300,
        "the out-of-memory job to end",
        every=0.5,
    )
    attempts = _attempts(detail)
    last = attempts[-1] if attempts else {}
    tail = last.get("stderr_tail") or []
    line = gpu_oom(tail)
    checks.record(
        "gpu_oom",
        detail["status"] == "failed" and last.get("cause") == "gpu_oom",
        job=job,
        status=detail["status"],
        attempts=len(attempts),
        causes=[a.get("cause", "<no cause field>") for a in attempts],
        error=detail.get("error"),
        oom_line=line,
        tried_gib=tried_gib(line or ""),
        total_gib=total_gib(line or ""),
        domain_oom_recognises_stderr=line is not None,
        stderr_tail_end=tail[-3:],
    )


def save(f: BenchFleet, checks: Checks, dry_run: bool) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    summary = {"passed": checks.passed, "dry_run": dry_run, "checks": checks.results}
    Path(out, "gpu-check.json").write_text(json.dumps(summary, indent=2, default=str))
    for log in ("server.log", "worker.log"):
        if (f.root / log).exists():
            shutil.copy(f.root / log, Path(out, f"gpu-check-{log}"))


def run(args: argparse.Namespace) -> Checks:
    checks = Checks()
    with fleet() as f:
        try:
            start(f, args.fake_nvml)
            check_capability(f, checks, args.fake_nvml)
            if not args.dry_run:
                check_pinned(f, checks, args.hold)
                check_gpu_oom(f, checks)
        except Exception as e:  # a check that could not be made is a FAIL, with why
            checks.record("error", False, what=f"{type(e).__name__}: {e}")
            for log in ("server.log", "worker.log"):
                text = (f.root / log).read_text(errors="replace") if (f.root / log).exists() else ""
                print(f"--- {log} (its end)\n{text[-3000:]}", file=sys.stderr)
        finally:
            save(f, checks, args.dry_run)
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="stop after starting the server and worker and reading its GPUs",
    )
    parser.add_argument(
        "--fake-nvml",
        action="store_true",
        help="the fake driver of tests/fake_nvml (with --dry-run only)",
    )
    parser.add_argument("--hold", type=float, default=8.0,
                        help="seconds the pinned job holds its 1 GiB (default 8)")  # fmt: skip
    args = parser.parse_args()
    if args.fake_nvml and not args.dry_run:
        parser.error("--fake-nvml checks nothing real: use it with --dry-run")
    # SIGTERM ends the run as Ctrl-C does, so the processes it started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    checks = run(args)
    verdict = "PASS" if checks.passed else "FAIL"
    print(f"{verdict}: {len(checks.results)} check(s) in {time.monotonic() - started:.0f}s")
    sys.exit(0 if checks.passed else 1)


if __name__ == "__main__":
    main()
