"""The store's kept records, on the memory store, SQLite and PostgreSQL: tokens and
dashboard sessions (kept as hashes), the server's keys, and retention of old output and
audit records.
"""

from __future__ import annotations

import hashlib

import pytest

from gpufleet.domain.models import JobStatus, Role
from gpufleet.errors import Forbidden, NotFound, Unauthorized
from gpufleet.server.auth import Auth
from gpufleet.server.blobs import BlobService
from gpufleet.server.services import Services
from gpufleet.server.settings import QueueSettings
from gpufleet.store import Store
from tests.queue_steps import LEASE, OUT, FakeClock, claim, job, register, spec

# ---- tokens and sessions -------------------------------------------------------------


def test_tokens_are_stored_as_hashes_and_revocable(store: Store, clock: FakeClock) -> None:
    auth = Auth(store, clock=lambda: clock.now)
    row, secret = auth.create("ci-runner", Role.SUBMITTER, ["vision", "nlp"])
    assert secret.startswith("gf_")
    assert row.hash == hashlib.sha256(secret.encode()).hexdigest()

    stored = store.token_by_hash(row.hash)
    assert stored == row
    assert stored.role == "submitter"
    assert stored.pools == ("vision", "nlp")
    assert stored.hint == secret[:7]
    assert stored.revoked_at is None
    for tok in store.list_tokens():
        assert secret not in repr(tok)
    assert store.token_by_hash(secret) is None

    other, other_secret = auth.create("worker-1", Role.WORKER)
    assert auth.check(f"Bearer {secret}").id == row.id
    with pytest.raises(Unauthorized):
        auth.check(f"Bearer {secret}x")
    with pytest.raises(Unauthorized):
        auth.check(None)

    clock.advance(7)
    auth.revoke(row.id)
    revoked = store.token_by_hash(row.hash)
    assert revoked is not None
    assert revoked.revoked_at == clock.now
    with pytest.raises(Unauthorized, match="revoked"):
        auth.check(f"Bearer {secret}")
    assert auth.check(f"Bearer {other_secret}").id == other.id
    with pytest.raises(NotFound):
        auth.revoke(row.id)
    assert store.count_tokens("submitter") == 0
    assert store.count_tokens("worker") == 1


def test_ensure_admin_creates_one_admin_once(store: Store) -> None:
    auth = Auth(store)
    secret = auth.ensure_admin()
    assert secret is not None
    assert secret.startswith("gf_")
    assert auth.check(f"Bearer {secret}").role == "admin"
    assert auth.ensure_admin() is None


def test_dashboard_sessions_live_until_they_end_sign_out_or_their_token_changes(
    store: Store, clock: FakeClock
) -> None:
    auth = Auth(store, clock=lambda: clock.now)
    row, secret = auth.create("alice", Role.OPERATOR)
    _, session, ends = auth.sign_in(secret)
    assert ends == clock.now + 12 * 3600
    assert session.startswith("gs_") and session != secret
    assert store.session_token(session, clock.now) is None  # kept as a hash only
    assert auth.session(session).id == row.id
    auth.sign_out(session)
    with pytest.raises(Unauthorized, match="sign in again"):
        auth.session(session)

    _, session, _ = auth.sign_in(secret)
    clock.advance(12 * 3600 + 1)
    auth.forget()
    with pytest.raises(Unauthorized):
        auth.session(session)  # ended by time
    _, later, _ = auth.sign_in(secret)  # signing in drops ended sessions as it goes
    auth.rotate(row.id)
    with pytest.raises(Unauthorized):
        auth.session(later)  # the token changed: its sessions end
    worker_secret = auth.create("w", Role.WORKER)[1]
    with pytest.raises(Forbidden):
        auth.sign_in(worker_secret)


# ---- server keys ---------------------------------------------------------------------


def test_a_server_key_is_made_once_and_read_alike_after(store: Store) -> None:
    """The first server to ask makes the fleet's key; every later ask (any server sharing
    the database) reads that one, whatever it offers."""
    assert store.server_key("event-ids", "first") == "first"
    assert store.server_key("event-ids", "second") == "first"
    assert store.server_key("other", "third") == "third"


# ---- retention -----------------------------------------------------------------------


def test_retention_deletes_finished_jobs_output_and_old_audit_records_only(
    store: Store, clock: FakeClock, blobs: BlobService
) -> None:
    """Output of a job that ended past the retention goes (the job and its history stay);
    a running job's output, a recent job's and recent audit records stay, and a job's
    line numbers go on."""
    day = 86400.0
    settings = QueueSettings(lease_timeout=LEASE, log_retention=7 * day, audit_retention=30 * day)
    q = Services(store, settings, blobs, clock=lambda: clock.now)
    w = register(q, "w", cpu_slots=3)
    ids = [q.submission.submit(spec(n, max_attempts=1)).id for n in ("old", "recent", "running")]
    for _ in ids:
        lease = claim(q, w)
        q.leases.append_logs(
            lease.job_id, lease.attempt, [("stdout", f"{lease.job_id} {n}") for n in range(7)]
        )
    store.insert_audit([{"at": clock.now, "address": "-", "event": "x", "target": "old"}])
    q.leases.finish(ids[0], 1, exit_code=0, error=None)
    clock.advance(10 * day)
    q.leases.finish(ids[1], 1, exit_code=1, error=None)
    store.insert_audit([{"at": clock.now, "address": "-", "event": "x", "target": "new"}])
    last = max(r.seq for r in store.logs(ids[2], 0, 100))

    # the old job's lines and its 3 status changes; the audit record is 10 days old
    assert q.retention.run() == 7 + 3
    assert [len(store.logs(i, 0, 100, streams=OUT)) for i in ids] == [0, 7, 7]
    assert job(store, ids[0]).status is JobStatus.SUCCEEDED
    assert [a.outcome for a in store.attempts(ids[0])] == ["succeeded"]
    clock.advance(25 * day)
    assert q.retention.run() == 7 + 3 + 1  # now the recent job's records and the first audit
    assert [a.target for a in store.audit(0, 10)] == ["new"]
    q.leases.append_logs(ids[2], 1, [("stdout", "later")])
    assert (
        store.logs(ids[2], last, 100, streams=OUT)[0].line == "later"
    )  # a follower's cursor holds
    assert q.retention.run() == 0
