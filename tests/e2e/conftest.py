"""Real ``gpufleet server`` and ``gpufleet worker`` processes on loopback.

Every process a test starts is stopped by the fixture (SIGTERM, then SIGKILL), and every
wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet.client import Client
from gpufleet.config import load_token
from gpufleet.wire import TokenCreate
from tests.procs import Proc, alive, free_port, listening, wait_for

__all__ = ["PYTHON", "Fleet", "Proc", "alive", "free_port", "wait_for"]

PYTHON = sys.executable
FAKE_NVML = str(Path(__file__).parents[1] / "fake_nvml")


class Fleet:
    """A server and its workers, all started as real processes in ``root``."""

    def __init__(self, root: Path, config_dir: Path, database: str | None = None) -> None:
        self.root = root
        self.database = database  # the servers' --db unless a test names one
        self.env = {**os.environ, "GPUFLEET_CONFIG_DIR": str(config_dir), "PYTHONUNBUFFERED": "1"}
        self.procs: list[Proc] = []
        self.url = ""
        self.server: Proc | None = None
        self.ca: Path | None = None  # the CA file the test's own client trusts (https)

    def start_server(self, *args: str, lease_timeout: float = 3.0, db: str | None = None) -> str:
        argv = [
            PYTHON,
            "-m",
            "gpufleet",
            "server",
            "--port",
            "0",
            "--data-dir",
            str(self.root / "data"),
            "--lease-timeout",
            str(lease_timeout),
            "--retry-backoff",
            "0.2",
            *args,
        ]
        if db or self.database:
            argv += ["--db", db or str(self.database)]
        self._server_argv = argv
        log, n = self.root / "server.log", 1
        while log.exists():  # a second server of the fleet logs to a file of its own
            n += 1
            log = self.root / f"server.{n}.log"
        self.server = proc = Proc(argv, self.env, log)
        self.procs.append(proc)
        self.url = wait_for(lambda: listening(proc), 30, "the server to listen")
        self.env["GPUFLEET_SERVER"] = self.url
        return self.url

    def restart_server(self, down_for: float = 0.0) -> None:
        """Stop the server, stay down ``down_for`` seconds, start it again as it was (give
        it a fixed --port, so workers find it again)."""
        assert self.server is not None
        self.server.stop()
        time.sleep(down_for)
        proc = self.server = Proc(self._server_argv, self.env, self.root / "server.restarted.log")
        self.procs.append(proc)
        wait_for(lambda: listening(proc), 30, "the restarted server to listen")

    def start_worker(
        self,
        name: str,
        *args: str,
        heartbeat: float = 0.5,
        env_extra: dict[str, str] | None = None,
    ) -> Proc:
        argv = [
            PYTHON,
            "-m",
            "gpufleet",
            "worker",
            "--name",
            name,
            "--heartbeat",
            str(heartbeat),
            "--work-dir",
            str(self.root / "work" / name),
            *args,
        ]
        env = {**self.env, **(env_extra or {})}
        if "--pool" in args and "GPUFLEET_TOKEN" not in env:
            env["GPUFLEET_TOKEN"] = self.worker_token(name, args[args.index("--pool") + 1])
        log = self.root / f"worker-{name}.log"
        n = 1
        while log.exists():  # a restarted worker of the same name keeps the old log
            n += 1
            log = self.root / f"worker-{name}.{n}.log"
        proc = Proc(argv, env, log)
        self.procs.append(proc)
        wait_for(
            lambda: "registered" in proc.text() or proc.popen.poll() is not None,
            30,
            f"worker {name} to register",
        )
        assert proc.popen.poll() is None, proc.text()
        return proc

    def worker_token(self, name: str, pool: str) -> str:
        """A new worker token of ``pool`` (the local server saves one of pool default
        only, for this machine's workers)."""
        with self.client() as c:
            return c.create_token(TokenCreate(name=name, role="worker", pools=[pool])).token

    def start_gpu_worker(
        self, name: str, gpus: list[tuple[str, int, int]], *args: str, **kw: Any
    ) -> Proc:
        """A worker whose GPUs come from the fake ``pynvml`` (tests/fake_nvml) put first on
        its PYTHONPATH: each GPU as (name, total GiB, free GiB). The worker runs its real
        NVML code; only the driver boundary is fake."""
        described = [
            {"name": model, "total_mib": total * 1024, "free_mib": free * 1024}
            for model, total, free in gpus
        ]
        path = os.pathsep.join(p for p in (FAKE_NVML, self.env.get("PYTHONPATH", "")) if p)
        extra = {"PYTHONPATH": path, "FAKE_NVML_GPUS": json.dumps(described)}
        return self.start_worker(name, *args, env_extra={**extra, **kw.pop("env_extra", {})}, **kw)

    def cli(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 60,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(
            [PYTHON, "-m", "gpufleet", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and res.returncode != 0:
            raise AssertionError(
                f"gpufleet {' '.join(args)} exited {res.returncode}:\n{res.stderr}"
            )
        return res

    def client(self) -> Client:
        token = load_token(self.url)
        return Client(self.url, token, ca=self.ca)

    def job(self, job_id: str) -> dict[str, Any]:
        trust = ("--ca", str(self.ca)) if self.ca else ()
        return json.loads(self.cli("show", job_id, "--json", *trust).stdout)

    def wait_status(self, job_id: str, *statuses: str, timeout: float = 30) -> dict[str, Any]:
        """The job once it is in one of ``statuses``, as `gpufleet show --json` prints it
        (read through the SDK: a CLI start per poll would only slow the tests)."""
        with self.client() as c:
            found = wait_for(
                lambda: (d := c.job(job_id)).status in statuses and d,
                timeout,
                f"{job_id} to be {statuses}",
            )
            detail: dict[str, Any] = found.model_dump(mode="json")
        return detail

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def fleet(database: str | None, tmp_path: Path, _isolated_config: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, _isolated_config, database)
    try:
        yield f
    finally:
        f.stop_all()
