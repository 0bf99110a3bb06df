"""schemathesis against the app's own /openapi.json: no request, however odd, gets a 5xx,
and a request the server refuses changes nothing.

Every operation is fuzzed once per caller role: as an admin (so calls reach the handlers),
as a submitter scoped to another pool and as a worker (so authorization refusals are
exercised too). Each (operation, role) gets a fresh app over its own copy of one migrated
and seeded SQLite file (the ``template`` and ``served`` fixtures), called in-process
through schemathesis' ASGI transport, which also runs the app's lifespan. Claim bodies get
``wait = 0`` so the long-poll never holds a test up, and the random phase aims calls on
one job or worker at those the template made (``_aim``). The boundary values of
schemathesis' coverage phase (about 2,400 calls, the same whoever sends them) go as admin
only, who reaches every handler; the other roles get the random phase, enough to meet
their role and pool checks on every operation.

Around every call the test reads the database (every table's rows, through the store's
engine; the ``audit`` table is left out, as it records refused calls too) and the blob
directory (file names and sizes). After a 4xx, and after any GET or HEAD, the two reads
must be equal; a failure names the call and the first table, row and field that changed.
Leases and heartbeats last an hour here (the ``settings`` fixture), so the lifespan's lease
sweeper has nothing to do and cannot change state between a call's two reads.

The schema is loaded at import from an app that is never served (the OpenAPI document does
not depend on the store). ``schemathesis.pytest.from_fixture`` would load it per test, but
4.32.5's lazy loader sets ``Node._nodeid``, which pytest 9.2 no longer has.

An event stream (``/v1/events``, and ``/v1/jobs/{ref}/events`` as SSE) does not end while
the fleet or its job lives, and schemathesis reads one until its timeout: 10 s by
default, which made the two streams' calls most of the module's time (``GET /v1/events``
alone took 70 s). The check needs only the answer's status and the state around it, both
known as the stream opens, so streams are read for ``GPUFLEET_FUZZ_STREAM_SECONDS`` (2 by
default; ``bench/fuzz.py`` reads them for 10).

The seed is fixed so a CI failure replays exactly; to explore, set ``GPUFLEET_FUZZ_SEED``
and raise ``GPUFLEET_FUZZ_EXAMPLES`` (``bench/fuzz.py`` does, and counts the calls in
``CALLS``). The examples bound the random phase, per operation and role: at 5 the module
takes 45 to 60 s on two busy cores on SQLite, two thirds of it the admin's boundary values
(at 20, about 15 s more), and about three times that on PostgreSQL.
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from sqlalchemy import MetaData

from gpufleet.domain.models import Role
from gpufleet.server import QueueSettings, create_app
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService, BlobSettings
from gpufleet.store import SqlStore, open_store
from gpufleet.store.blobfiles import BlobFiles
from tests.integration.helpers import TESTCLIENT_ON_HTTPX, bearer, gpu, job_body, worker_body

pytestmark = TESTCLIENT_ON_HTTPX

CLAIM = "/v1/workers/{worker_id}/claim"
SEED = int(os.environ.get("GPUFLEET_FUZZ_SEED", "0"))
EXAMPLES = int(os.environ.get("GPUFLEET_FUZZ_EXAMPLES", "5"))
STREAM_SECONDS = float(os.environ.get("GPUFLEET_FUZZ_STREAM_SECONDS", "2"))
CALLS: Counter[str] = Counter()  # calls made, by status class ("2xx", "4xx", "5xx")
ROLES = ("admin", "submitter", "worker")
# Tables a refused call may write to: the audit log records refused calls too. The job
# counts follow `jobs` (which is watched), and the server's sweep folds PostgreSQL's count
# deltas in at any time (a contract test keeps the counts equal to the jobs).
UNCHECKED_TABLES = frozenset({"audit", "job_counts", "job_count_deltas"})
BLOB_FILES = "blob files"

_DB = open_store("sqlite://")
_NOWHERE = BlobService(_DB, BlobFiles(Path("/nonexistent/gpufleet-schema-only")), BlobSettings())
_SCHEMA_ONLY = create_app(_DB, QueueSettings(), _NOWHERE)
schema = schemathesis.openapi.from_dict(
    _SCHEMA_ONLY.openapi(), config=schemathesis.Config(seed=SEED)
)
schema.app = _SCHEMA_ONLY  # selects the ASGI transport; each call passes the test's own app

# A read of the state: table (or BLOB_FILES) -> its rows, in key order.
Snapshot = dict[str, list[tuple[Any, ...]]]
# The same rows keyed for a diff: table -> row key -> the row's fields.
Keyed = dict[str, dict[tuple[Any, ...], dict[str, Any]]]


@dataclass(frozen=True)
class Watched:
    """A table read in full, in primary-key order."""

    name: str
    columns: tuple[str, ...]
    key: tuple[int, ...]  # positions of the primary key's columns (all columns: no key)

    @property
    def query(self) -> str:
        order = ", ".join(f'"{self.columns[i]}"' for i in self.key)
        return f'SELECT * FROM "{self.name}" ORDER BY {order}'


def _watched(store: SqlStore) -> list[Watched]:
    """Every table the migrations made (not only those the code names), bar the unchecked."""
    meta = MetaData()
    meta.reflect(store.engine)
    out = []
    for table in meta.sorted_tables:
        if table.name in UNCHECKED_TABLES:
            continue
        columns = tuple(c.name for c in table.columns)
        key = tuple(columns.index(c.name) for c in table.primary_key.columns)
        out.append(Watched(table.name, columns, key or tuple(range(len(columns)))))
    return out


@dataclass(frozen=True)
class Served:
    """The app under test, a caller's headers per role, and where its state lives."""

    app: FastAPI
    callers: dict[str, dict[str, str]]
    store: SqlStore
    tables: list[Watched]
    blob_root: Path
    targets: dict[str, tuple[str, ...]]

    def snapshot(self) -> Snapshot:
        # The DB-API connection under the engine: a tenth of the cost of SQLAlchemy rows,
        # which matters at two reads per generated call.
        raw = self.store.engine.raw_connection()
        try:
            cursor = raw.cursor()
            state = {
                t.name: [tuple(r) for r in cursor.execute(t.query).fetchall()] for t in self.tables
            }
            cursor.close()
        finally:
            raw.close()
        files = (p for p in self.blob_root.rglob("*") if p.is_file())
        state[BLOB_FILES] = sorted(
            (str(p.relative_to(self.blob_root)), p.stat().st_size) for p in files
        )
        return state

    def keyed(self, snapshot: Snapshot) -> Keyed:
        shapes = {t.name: (t.columns, t.key) for t in self.tables}
        shapes[BLOB_FILES] = (("file", "size"), (0,))
        out: Keyed = {}
        for where, rows in snapshot.items():
            columns, key = shapes[where]
            out[where] = {
                tuple(r[i] for i in key): dict(zip(columns, r, strict=True)) for r in rows
            }
        return out


def first_change(before: Keyed, after: Keyed) -> str | None:
    """The first difference, in table and row order, as a sentence; None if there is none."""
    for where in sorted(before.keys() | after.keys()):
        old, new = before.get(where, {}), after.get(where, {})
        for key in sorted(old.keys() | new.keys(), key=repr):
            if key not in new:
                return f"{where}: row {key} removed (was {old[key]})"
            if key not in old:
                return f"{where}: row {key} added: {new[key]}"
            if old[key] != new[key]:
                fields = {
                    c: (v, new[key].get(c)) for c, v in old[key].items() if v != new[key].get(c)
                }
                return f"{where}: row {key} changed (field: (before, after)): {fields}"
    return None


@dataclass(frozen=True)
class Template:
    """A migrated database with the fuzz's callers and a little state, which each test
    copies (migrating and seeding per test would cost a quarter of the module's time)."""

    url: str  # a SQLite file each test copies, or a PostgreSQL schema of one test
    callers: dict[str, dict[str, str]]
    tables: list[Watched]
    targets: dict[str, tuple[str, ...]]  # "jobs" and "workers": refs to aim calls at


def _seed(url: str, blobs_dir: Path) -> Template:
    """Worker ``w`` is enrolled with the fuzzing worker token (which may act as it), ``g``
    with the admin's (which that token may not act as), both in pool ``default``. Job ``j``
    waits in ``default``, job ``o`` in ``other``, the only pool the submitter may use."""
    store = open_store(url)
    store.migrate()
    auth = Auth(store)
    callers = {
        "admin": bearer(auth.create("fuzz-admin", Role.ADMIN)[1]),
        "submitter": bearer(auth.create("fuzz-submitter", Role.SUBMITTER, pools=["other"])[1]),
        "worker": bearer(auth.create("fuzz-worker", Role.WORKER, pools=["default"])[1]),
    }
    blobs = BlobService(store, BlobFiles(blobs_dir), BlobSettings())
    admin, submitter, worker = callers["admin"], callers["submitter"], callers["worker"]
    try:
        with asgi.get_client(create_app(store, QueueSettings(), blobs)) as session:
            w = session.post("/v1/workers", json=worker_body("w"), headers=worker)
            g = session.post("/v1/workers", json=worker_body("g", gpus=[gpu()]), headers=admin)
            j = session.post("/v1/jobs", json=job_body("j"), headers=admin)
            o = session.post("/v1/jobs", json=job_body("o", pool="other"), headers=submitter)
    finally:
        asgi.shutdown_lifespans()
    made = (w, g, j, o)
    assert [r.status_code for r in made] == [201] * 4, [r.text for r in made]
    jobs = (j.json()["job"]["id"], o.json()["job"]["id"])
    tables = _watched(store)
    store.close()  # on SQLite, the last connection's close folds the WAL into the file
    return Template(url, callers, tables, {"jobs": jobs, "workers": ("w", "g")})


@pytest.fixture(scope="module")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    path = tmp_path_factory.mktemp("fuzz") / "db.sqlite"
    made = _seed(f"sqlite:///{path}", path.with_name("blobs"))
    assert not path.with_name("db.sqlite-wal").exists()
    return made


@pytest.fixture
def template(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Template:
    """On SQLite, one template file per module, copied by each test; on PostgreSQL, a
    fresh schema per test, seeded alike."""
    if backend == "sqlite":
        made: Template = request.getfixturevalue("sqlite_template")
        return made
    return _seed(request.getfixturevalue("pg_url"), tmp_path / "template-blobs")


@pytest.fixture(name="settings")  # the conftest's name; ``settings`` here is hypothesis'
def long_leases() -> QueueSettings:
    """Leases and heartbeats that last longer than the module runs, even on a busy machine:
    the lease sweeper then has nothing to do (the template's workers heartbeated when it
    was made), so it never changes state between a call's two reads."""
    return QueueSettings(lease_timeout=3600.0, retry_backoff=10.0)


@pytest.fixture
def store(template: Template, tmp_path: Path) -> Iterator[SqlStore]:
    """The conftest's store, copied from the template instead of migrated anew (on
    PostgreSQL, the test's own template)."""
    if template.url.startswith("sqlite:"):
        shutil.copyfile(template.url.removeprefix("sqlite:///"), tmp_path / "db.sqlite")
        store = open_store(f"sqlite:///{tmp_path}/db.sqlite")
    else:
        store = open_store(template.url)
    yield store
    store.close()


@pytest.fixture
def served(app: FastAPI, store: SqlStore, template: Template) -> Iterator[Served]:
    """The test's app over its copy of the template."""
    with asgi.get_client(app):  # starts the lifespan before the first read, and leaves it on
        pass
    try:
        blob_root = app.state.gpufleet.services.blobs.storage.root
        yield Served(app, template.callers, store, template.tables, blob_root, template.targets)
    finally:
        # The ASGI transport keeps a started lifespan (the lease sweeper) until told to stop.
        asgi.shutdown_lifespans()


def _is_error_body(body: Any) -> bool:
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    error = body["error"]
    return isinstance(error, dict) and set(error) == {"code", "message", "detail"}


def _aim(case: schemathesis.Case, targets: dict[str, tuple[str, ...]]) -> None:
    """Point a random-phase call on one job or worker at one the server has (picked by a
    hash of the rest of the call, so a seed replays): random names only ever meet a 404,
    and the pool, enrollment and lease checks behind it are where a refusal could leave
    something half done. The coverage phase keeps its odd names."""
    parts = case.operation.path.split("/")  # /v1/KIND/..., or /metrics
    kind, params = parts[2 if len(parts) > 2 else 1], case.path_parameters
    if case.meta is None or case.meta.phase.name != "fuzzing" or kind not in targets:
        return
    for name in params or {}:
        pick = zlib.crc32(repr((name, case.query, case.body)).encode()) % len(targets[kind])
        params[name] = targets[kind][pick]


def _describe(case: schemathesis.Case, role: str, status: int) -> str:
    return (
        f"{case.method} {case.formatted_path} as {role} -> {status}; "
        f"query={case.query!r} headers={case.headers!r} body={case.body!r}"
    )


# database=None: the seed alone decides what runs (no replay of examples saved on this machine).
@pytest.mark.parametrize("role", ROLES)
@schema.parametrize()
@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
)
def test_no_request_gets_a_server_error_and_a_refused_one_changes_nothing(
    case: schemathesis.Case, role: str, served: Served
) -> None:
    if role != "admin" and case.meta is not None and case.meta.phase.name == "coverage":
        return  # boundary values go as admin only (see the module docstring)
    _aim(case, served.targets)
    if case.operation.path == CLAIM and isinstance(case.body, dict):
        case.body["wait"] = 0
    before = served.snapshot()
    # A stream is read for STREAM_SECONDS (the module docstring says why).
    stream = {"timeout": STREAM_SECONDS} if case.operation.path.endswith("/events") else {}
    # call() adds to the dict it gets, so it gets a copy.
    response = case.call(headers=dict(served.callers[role]), app=served.app, **stream)
    CALLS[f"{response.status_code // 100}xx"] += 1
    case.validate_response(response, checks=[not_a_server_error])
    status = response.status_code
    if status >= 400 and case.method != "HEAD":  # a HEAD answer has no body
        assert _is_error_body(response.json()), (_describe(case, role, status), response.text)
    if status >= 400 or case.method in ("GET", "HEAD"):
        after = served.snapshot()
        if after != before:
            change = first_change(served.keyed(before), served.keyed(after))
            pytest.fail(f"{_describe(case, role, status)} changed {change}")


@pytest.mark.parametrize("role", ROLES)
def test_fuzz_tokens_get_past_auth(served: Served, role: str) -> None:
    """The fuzz above means something only if its tokens are valid: each role is let in
    where it may go and refused (403, not 401) where it may not."""
    with asgi.get_client(served.app) as session:
        session.headers.update(served.callers[role])
        r = session.get("/v1/blobs")  # every role may list blobs
        assert r.status_code == 200, r.text
        r = session.get("/v1/tokens")  # admins only
        assert r.status_code == (200 if role == "admin" else 403), r.text


def test_a_change_is_named_by_table_row_and_field() -> None:
    """The snapshot check reports what changed, so a failure says where to look."""
    before: Keyed = {"jobs": {("j-1",): {"id": "j-1", "status": "pending"}}}
    assert first_change(before, before) is None
    after: Keyed = {"jobs": {("j-1",): {"id": "j-1", "status": "cancelled"}}}
    assert first_change(before, after) == (
        "jobs: row ('j-1',) changed (field: (before, after)): {'status': ('pending', 'cancelled')}"
    )
    grown: Keyed = {"jobs": {**before["jobs"], ("j-2",): {"id": "j-2"}}}
    assert first_change(before, grown) == "jobs: row ('j-2',) added: {'id': 'j-2'}"
    assert first_change(grown, before) == "jobs: row ('j-2',) removed (was {'id': 'j-2'})"


def test_the_snapshot_sees_a_write_and_a_blob_file(served: Served) -> None:
    """The check can fail: a row written or a file dropped in the blob directory shows."""
    before = served.snapshot()
    assert before["jobs"] and before["tokens"] and "audit" not in before
    Auth(served.store).create("another", Role.OPERATOR)
    change = first_change(served.keyed(before), served.keyed(served.snapshot()))
    assert change is not None and change.startswith("tokens: row ('t-") and "'another'" in change
    before = served.snapshot()
    (served.blob_root / "tmp" / "stray").write_bytes(b"x")
    change = first_change(served.keyed(before), served.keyed(served.snapshot()))
    assert change == "blob files: row ('tmp/stray',) added: {'file': 'tmp/stray', 'size': 1}"
