"""Telling a full disk from other failures (gpufleet.store.space), as each driver says it."""

from __future__ import annotations

import errno
import sqlite3

import psycopg
from sqlalchemy.exc import OperationalError

from gpufleet.store.space import Shortage, SpaceWatch, shortage


def test_sqlite_full_is_a_disk_shortage_wrapped_or_not() -> None:
    full = sqlite3.OperationalError("database or disk is full")
    assert shortage(full) == Shortage(True, "SQLite: database or disk is full")
    wrapped = OperationalError("INSERT INTO jobs ...", {}, full)
    assert shortage(wrapped) == Shortage(True, "SQLite: database or disk is full")
    assert shortage(sqlite3.OperationalError("database is locked")) is None


def test_postgresql_disk_full_is_507_and_its_other_shortages_are_not_disk() -> None:
    disk = psycopg.errors.DiskFull("could not extend file: No space left on device")
    assert disk.sqlstate == "53100"
    found = shortage(OperationalError("COPY job_logs", {}, disk))
    assert found is not None and found.disk and found.why.startswith("PostgreSQL 53100:")
    busy = shortage(psycopg.errors.TooManyConnections("sorry, too many clients already"))
    assert busy is not None and not busy.disk
    assert shortage(psycopg.errors.UniqueViolation("duplicate key")) is None


def test_a_file_write_out_of_space_or_quota_is_a_disk_shortage() -> None:
    assert shortage(OSError(errno.ENOSPC, "No space left on device")) == Shortage(
        True, "No space left on device"
    )
    assert shortage(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    assert shortage(OSError(errno.EACCES, "Permission denied")) is None


def test_the_watch_is_full_until_a_write_commits_with_no_failure_in_it() -> None:
    watch = SpaceWatch()
    assert watch.why is None
    began = watch.mark()
    watch.full("SQLite: database or disk is full")
    assert watch.why == "SQLite: database or disk is full"
    watch.wrote(began)  # a batch whose part failed committed: it wrote nothing
    assert watch.why is not None
    began = watch.mark()
    watch.wrote(began)
    assert watch.why is None
