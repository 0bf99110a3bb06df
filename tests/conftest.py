"""Shared fixtures: markers by folder, a PostgreSQL schema per test, a free config dir."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.s3server import CREDENTIALS, S3Server

PG_URL = os.environ.get("GPUFLEET_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
# The databases the integration and e2e suites run on, each a parameter of their tests:
# `make test` runs them on SQLite, `make test-postgresql` (in CI) on PostgreSQL.
BACKENDS = os.environ.get("GPUFLEET_TEST_BACKENDS", "sqlite").replace(" ", "").split(",")
FOLDER_MARKS = {"unit", "service", "contract", "backends", "integration", "e2e"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in FOLDER_MARKS:
            item.add_marker(getattr(pytest.mark, folder))
        if _needs_postgresql(item):
            item.add_marker(pytest.mark.pg)


def _needs_postgresql(item: pytest.Item) -> bool:
    """A test that asks for PostgreSQL by name: ``pg_url``, or the store suite's
    PostgreSQL store (``make test`` leaves them to ``make test-postgresql``)."""
    spec = getattr(item, "callspec", None)
    store = spec.params.get("store") if spec is not None else None
    return "pg_url" in getattr(item, "fixturenames", ()) or store == "postgresql"


@pytest.fixture(autouse=True)
def _isolated_config(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """No test reads or writes the real user config (tokens, settings) or cache."""
    cfg = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("GPUFLEET_CONFIG_DIR", str(cfg))
    # ... nor the user's cache (remembered package hashes)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    for key in list(os.environ):
        if key.startswith("GPUFLEET_") and key not in ("GPUFLEET_CONFIG_DIR", "GPUFLEET_TEST_PG"):
            monkeypatch.delenv(key)
    return cfg


def _pg_available() -> str | None:
    try:
        import psycopg

        with psycopg.connect(
            PG_URL.replace("postgresql://", "postgresql://", 1), connect_timeout=3
        ):
            return None
    except Exception as exc:  # any failure means: no usable server here
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The PostgreSQL URL; CI requires the server, a dev machine without it skips."""
    problem = _pg_available()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"CI requires PostgreSQL at {PG_URL}: {problem}")
        pytest.skip(f"no PostgreSQL at {PG_URL} ({problem})")
    return PG_URL


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A URL whose connections use a fresh schema, dropped after the test."""
    import psycopg

    schema = "t_" + secrets.token_hex(6)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    yield f"{pg_server}?options=-csearch_path%3D{schema}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The database a test's server runs on: "sqlite" or "postgresql"."""
    if request.param not in ("sqlite", "postgresql"):
        pytest.fail(f"GPUFLEET_TEST_BACKENDS: unknown backend {request.param!r}")
    return str(request.param)


@pytest.fixture
def database(backend: str, request: pytest.FixtureRequest) -> str | None:
    """The ``--db`` URL of the test's server: None (SQLite in its data dir), or a fresh
    PostgreSQL schema, dropped after the test (set up before, and so torn down after, the
    fixtures that use it)."""
    return str(request.getfixturevalue("pg_url")) if backend == "postgresql" else None


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3-protocol server (moto's server mode) on loopback, for the test session."""
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The S3 server, with its credentials in this process's environment (as a server
    started with ``--blob-store s3://`` reads them)."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    return s3_server
