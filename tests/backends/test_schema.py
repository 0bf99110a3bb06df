"""The schema the migrations build is the one ``store/schema.py`` declares, and rows an
earlier gpufleet wrote read back after an upgrade, including JSON with keys this version
does not know and values the API now refuses. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext

from gpufleet.domain.models import JobStatus, WorkerStatus
from gpufleet.store import SqlStore, json_columns, open_store, schema
from gpufleet.store.sql.store import _MIGRATIONS

T0 = 1_700_000_000.0
EARLIER = sorted(p.name[:4] for p in (_MIGRATIONS / "versions").glob("0*.py"))[:-1]
# A spec as an older gpufleet wrote it, with a key this one does not know and a number of
# attempts over what the API accepts today (100).
SPEC = {
    "name": "train",
    "command": ["python", "train.py"],
    "pool": "default",
    "max_attempts": 500,
    "requirements": {"gpu_count": 1, "a_newer_field": True},
    "a_field_of_the_future": {"x": 1},
}
CAPABILITY = {
    "hostname": "box",
    "cores": 4,
    "ram_mib": 1024,
    "gpus": [{"index": 0, "name": "A100", "total_mib": 40960, "free_mib": 40960, "fan": 3}],
    "something_new": "yes",
}
ROWS: dict[str, dict[str, object]] = {
    "workers": {
        "id": "w-old",
        "name": "box",
        "pool": "default",
        "labels": '{"zone": "a"}',
        "capability": json.dumps(CAPABILITY),
        "cpu_slots": 1,
        "ephemeral": False,
        "status": "idle",  # the word before "available" (0004 renamed it)
        "drain": False,
        "gpu_stats": json.dumps(CAPABILITY["gpus"]),
        "registered_at": T0,
        "last_heartbeat": T0,
    },
    "jobs": {
        "id": "j-old",
        "name": "train",
        "status": "succeeded",
        "spec": json.dumps(SPEC),
        "priority": 0,
        "pool": "default",
        "attempts": 1,
        "max_attempts": 500,
        "lease": 1,
        "worker_id": "w-old",
        "gpus": "[0]",
        "created_at": T0,
        "claimed_at": T0,
        "started_at": T0,
        "finished_at": T0 + 5,
        "exit_code": 0,
        "waiting": 0,
    },
    "attempts": {
        "job_id": "j-old",
        "attempt": 1,
        "worker_id": "w-old",
        "worker_name": "box",
        "gpus": "[0]",
        "claimed_at": T0,
        "started_at": T0,
        "finished_at": T0 + 5,
        "exit_code": 0,
        "outcome": "succeeded",
    },
    "hosts": {
        "name": "box",
        "manifest": "plan",
        "policy": json.dumps({"name": "box", "priority": 2, "an_old_knob": 1}),
        "updated_at": T0,
    },
    "job_logs": {"job_id": "j-old", "attempt": 1, "stream": "stdout", "line": "hi", "ts": T0},
    "tokens": {
        "id": "t-old",
        "name": "ci",
        "role": "submitter",
        "pool": "default",
        "hash": "0" * 64,
        "created_at": T0,
    },
    "audit": {
        "at": T0,
        "address": "127.0.0.1",
        "method": "POST",
        "path": "/v1/jobs",
        "status": 201,
    },
    "blobs": {"sha256": "a" * 64, "size": 3, "created_at": T0},
    "artifacts": {
        "job_id": "j-old",
        "attempt": 1,
        "sha256": "a" * 64,
        "size": 3,
        "files": '[{"path": "model.pt", "size": 3}]',
        "file_count": 1,
        "bytes": 3,
        "created_at": T0,
    },
}


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/s.db"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def store(url: str) -> Iterator[SqlStore]:
    s = open_store(url)
    try:
        yield s
    finally:
        s.close()


def _upgrade(store: SqlStore, revision: str) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def test_the_migrated_schema_is_the_declared_one(store: SqlStore) -> None:
    store.migrate()
    with store.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        differences = compare_metadata(context, schema.metadata)
    assert differences == []


@pytest.mark.parametrize("revision", EARLIER)
def test_rows_written_at_an_earlier_revision_read_back_after_upgrading(
    store: SqlStore, revision: str
) -> None:
    _upgrade(store, revision)
    tables = sa.MetaData()
    tables.reflect(store.engine)
    written = set(tables.tables) & set(ROWS)
    rows = {
        **ROWS,
        "workers": {**ROWS["workers"], "status": "idle" if revision < "0004" else "available"},
    }
    with store.engine.begin() as conn:
        for name, row in rows.items():
            if name in tables.tables:
                have = {c.name for c in tables.tables[name].columns}
                conn.execute(
                    tables.tables[name].insert(), {k: v for k, v in row.items() if k in have}
                )
    store.migrate()

    job = store.get_job("j-old")
    assert job is not None and job.status is JobStatus.SUCCEEDED
    assert job.spec.command == ("python", "train.py")
    assert job.spec.max_attempts == 500 and job.spec.requirements.gpu_count == 1
    assert [a.outcome for a in store.attempts("j-old")] == ["succeeded"]
    assert [j.id for j in store.list_jobs()] == ["j-old"]
    assert store.job_counts() == {"succeeded": 1}  # jobs from before the counts are counted
    worker = store.get_worker("w-old")
    assert worker is not None and worker.status is WorkerStatus.AVAILABLE
    assert [g.name for g in worker.capability.gpus] == ["A100"]
    assert worker.gpu_stats[0].free_mib == 40960
    assert json_columns.host_policy({h.name: h.policy for h in store.hosts()}["box"]).priority == 2
    assert [r.line for r in store.logs("j-old", 0, 10, ("stdout",))] == ["hi"]
    if "tokens" in written:
        assert [t.name for t in store.list_tokens()] == ["ci"]
    if "artifacts" in written:
        artifact = store.artifact("j-old")
        assert artifact is not None and artifact.file_count == 1


def test_log_lines_and_audit_records_number_on_past_two_to_the_31(store: SqlStore) -> None:
    """A busy server writes billions of log lines over its life: their numbers (and the
    audit log's) are 64-bit, on a database upgraded from one where they were not."""
    _upgrade(store, "0005")
    store.migrate()
    past = 2**31 + 7
    line = {"job_id": "j-1", "attempt": 1, "stream": "stdout", "ts": T0}
    with store.engine.begin() as conn:
        if store.dialect == "postgresql":
            for table in ("job_logs", "audit"):
                conn.execute(sa.text(f"SELECT setval('{table}_seq_seq', {past})"))
        else:  # SQLite numbers on from the largest rowid
            conn.execute(schema.job_logs.insert(), {**line, "seq": past, "line": "zero"})
            conn.execute(schema.audit.insert(), {"seq": past, "at": T0, "address": "-"})
        # as the store appends: numbered by the database
        conn.execute(schema.job_logs.insert(), [{**line, "line": n} for n in ("one", "two")])
    store.insert_audit([{"at": T0, "address": "127.0.0.1", "method": "POST", "status": 201}])
    assert [(r.line, r.seq) for r in store.logs("j-1", past, 10)] == [
        ("one", past + 1),
        ("two", past + 2),
    ]
    assert [a.seq for a in store.audit(0, 10, after=past)] == [past + 1]
