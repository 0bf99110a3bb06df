"""Start a real server (and workers) for a benchmark; stop them afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpufleet.config import load_token


class BenchFleet:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {
            **os.environ,
            "GPUFLEET_CONFIG_DIR": str(root / "config"),
            "PYTHONUNBUFFERED": "1",
        }
        # An installed gpufleet has its bytecode compiled (pip does it); this checkout is
        # installed editable, so let the processes write theirs, whatever this shell says.
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["GPUFLEET_CONFIG_DIR"] = self.env["GPUFLEET_CONFIG_DIR"]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url = ""

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpufleet", *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def start_server(self, db: str | None, fair: bool = False) -> str:
        """A server on ``db`` (None: its own SQLite file); with ``fair``, under sharing
        rules that turn fair share on (three users of weights 2:1:1)."""
        args = ["server", "--port", "0", "--data-dir", str(self.root / "data")]
        if fair:
            rules = self.root / "sharing.toml"
            rules.write_text(FAIR_RULES)
            args += ["--sharing", str(rules)]
        name = "server" if not self.url else f"server-{len(self.procs)}"  # replicas
        proc = self.spawn(name, *args, *(["--db", db] if db else []))
        log = self.root / f"{name}.log"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            for line in log.read_text().splitlines():
                if "listening on" in line:
                    self.url = line.split("listening on ", 1)[1].split()[0]
                    self.env["GPUFLEET_SERVER"] = self.url
                    return self.url
            time.sleep(0.05)
        raise SystemExit(f"server did not start:\n{log.read_text()}")

    def token(self) -> str | None:
        return load_token(self.url)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()

    def owner_tokens(self, names: list[str]) -> list[str]:
        """An operator token for each name (the users a fair-share bench charges)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.token()}"}
        out = []
        with httpx.Client(base_url=self.url, headers=headers, timeout=60) as c:
            for name in names:
                r = c.post("/v1/tokens", json={"name": name, "role": "operator"})
                r.raise_for_status()
                out.append(r.json()["token"])
        return out


FAIR_RULES = """\
[fair_share]
half_life = "7d"

[users.alice]
weight = 2

[users.bob]
weight = 1

[users.carol]
weight = 1
"""
OWNERS = ["alice", "bob", "carol"]


@contextmanager
def fleet() -> Iterator[BenchFleet]:
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        f = BenchFleet(Path(tmp))
        try:
            yield f
        finally:
            f.stop()


@contextmanager
def database(db: str) -> Iterator[str | None]:
    """What a bench's ``--db`` names, for ``start_server``: None for SQLite (the server's
    own file), else a fresh PostgreSQL schema, dropped afterwards."""
    if not db.startswith("postgres"):
        yield None
        return
    url = fresh_pg_schema(db)
    try:
        yield url
    finally:
        drop_pg_schema(url)


def fresh_pg_schema(url: str) -> str:
    """A URL on a new, empty schema of the PostgreSQL database at ``url``."""
    import secrets

    import psycopg

    schema = "bench_" + secrets.token_hex(4)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return f"{url}?options=-csearch_path%3D{schema}"


def drop_pg_schema(url: str) -> None:
    import psycopg

    base, _, opts = url.partition("?options=-csearch_path%3D")
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {opts} CASCADE")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]
