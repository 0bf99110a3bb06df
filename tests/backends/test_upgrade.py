"""Upgrading a database made by an earlier gpufleet: rows written then read back, and
filled in where the new schema needs them. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from gpufleet.store import SqlStore, open_store
from gpufleet.store.sql.store import _MIGRATIONS

T0 = 1_700_000_000.0


@pytest.fixture(params=["sqlite", "postgresql"])
def old(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    """A database at migration 0003 (before worker lifecycles and owners)."""
    url = (
        f"sqlite:///{tmp_path}/old.db"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    store = open_store(url)
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with store._write() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0003")
    try:
        yield store
    finally:
        store.close()


def _job(conn: sa.Connection, job_id: str, status: str, worker: str | None) -> None:
    spec = {"name": job_id, "command": ["true"], "requirements": {"worker": worker}}
    conn.execute(
        sa.text(
            "INSERT INTO jobs (id, name, status, spec, priority, pool, attempts, max_attempts, "
            "lease, gpus, created_at, waiting) VALUES (:id, :id, :status, :spec, 0, 'default', "
            "0, 3, 0, '[]', :t, 0)"
        ),
        {"id": job_id, "status": status, "spec": json.dumps(spec), "t": T0},
    )


def test_every_job_aimed_at_a_worker_is_found_by_it_after_the_upgrade(old: SqlStore) -> None:
    with old.engine.begin() as conn:
        for job_id, status, worker in (
            ("j-pending", "pending", "box"),
            ("j-running", "running", "box"),
            ("j-failed", "failed", "w-123456789abc"),
            ("j-free", "pending", None),
        ):
            _job(conn, job_id, status, worker)
        conn.execute(
            sa.text(
                "INSERT INTO workers (id, name, pool, labels, capability, cpu_slots, ephemeral, "
                "status, drain, gpu_stats, registered_at, last_heartbeat) VALUES ('w-1', 'box', "
                "'default', '{}', :cap, 1, false, :status, false, '[]', :t, :t)"
            ),
            {
                "t": T0,
                "status": "idle",
                "cap": json.dumps({"hostname": "b", "cores": 1, "ram_mib": 1}),
            },
        )
    old.migrate()
    targets = {
        j: (old.get_job(j) or pytest.fail(j)).target
        for j in ("j-pending", "j-running", "j-failed", "j-free")
    }
    assert targets == {
        "j-pending": "box",
        "j-running": "box",
        "j-failed": "w-123456789abc",
        "j-free": None,
    }
    w = old.get_worker("w-1")
    assert w is not None and w.status.value == "available"  # 'idle' is 'available' now
