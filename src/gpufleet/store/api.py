"""The store, named by what the queue does with it.

Three implementations keep this contract: :class:`gpufleet.store.memory.MemoryStore`
(policy tests), and :class:`gpufleet.store.SqlStore` over SQLite or PostgreSQL. One
contract suite (``tests/contract``) runs over all three. A store persists the changes it
is given and decides none: every status change is a
:class:`~gpufleet.domain.lifecycle.Change` computed in :mod:`gpufleet.domain.lifecycle`,
applied only if the job is still where the change expects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from gpufleet.domain.caps import Recheck
from gpufleet.domain.lifecycle import Change
from gpufleet.domain.models import JobSpec
from gpufleet.domain.quota import OutputQuota
from gpufleet.domain.worker_lifecycle import WorkerChange
from gpufleet.store.rows_read import (
    ArtifactRow,
    AttemptRow,
    AuditRow,
    BlobRow,
    CheckpointRow,
    DeliveryRow,
    EnvLockRow,
    HostRow,
    JobRow,
    LogRow,
    TokenRow,
    WebhookRow,
    WorkerRow,
)
from gpufleet.store.space import SpaceWatch


@dataclass(frozen=True)
class Hosts:
    """A manifest's ``hosts`` entries (host name -> policy JSON). They replace what that
    manifest said before, about every host or, with ``within``, only about those hosts
    (an operator's own workers); and any other manifest's entry for a host they name."""

    manifest: str
    policies: Mapping[str, str]
    within: Collection[str] | None = None

    def replaces(self, host: HostRow) -> bool:
        if host.name in self.policies:
            return True
        return host.manifest == self.manifest and (self.within is None or host.name in self.within)

    def after(self, current: Iterable[HostRow]) -> dict[str, str]:
        """Host name -> policy once these entries are written over ``current``."""
        kept = {h.name: h.policy for h in current if not self.replaces(h)}
        return {**kept, **self.policies}


@dataclass(frozen=True)
class Batch:
    """What one submit or one manifest apply writes, all in one transaction: the new jobs
    (id, spec, unrunnable verdict) with the jobs each waits for, the blobs their pools may
    read from now on, a manifest's hosts, and (``update``) a new spec for each listed job
    that exists already and is still pending. A job whose id exists is never inserted
    twice."""

    jobs: Sequence[tuple[str, JobSpec, str | None]]
    deps: Mapping[str, Sequence[str]] = field(default_factory=dict)
    submitted_by: str | None = None
    by: str | None = None  # the submitting token's name, for the jobs' event logs
    grants: Collection[tuple[str, str]] = ()
    hosts: Hosts | None = None
    update: bool = False


@dataclass(frozen=True)
class Submitted:
    """What a :class:`Batch` did: the jobs it created and the pending ones it changed."""

    created: list[str]
    updated: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Appended:
    """What an append of output did: whether the lease held the job, the stop grace when
    the job has been asked to stop, and the marker of an output cut it began (the
    attempt passed its quota), if any."""

    held: bool
    stop: float | None = None
    cut: str | None = None


@dataclass(frozen=True)
class UsageSlice:
    """Unit-seconds a user's ended attempts held in a pool in one time slice."""

    owner: str
    pool: str
    kind: str  # "gpu" or "cpu" (gpufleet.domain.fairshare)
    start: float
    width: float
    seconds: float


@dataclass(frozen=True)
class RunningUse:
    """A job claimed or running now: whose, where, what it holds, since when."""

    job_id: str
    owner: str
    pool: str
    gpus: tuple[int, ...]
    started_at: float | None
    claimed_at: float | None
    status: str


#: (owner, pool, GPUs of each job, jobs): the jobs claimed or running now, grouped.
HeldRow = tuple[str, str, int, int]


@dataclass(frozen=True)
class ClaimView:
    """What a claim ranks on: the slots the worker's jobs hold (the GPUs of each; () a CPU
    slot), its claim count, the pending jobs aimed at it that it may claim now, and the
    first page of its pool's queue."""

    held: list[tuple[int, ...]]
    claims: int
    aimed: list[JobRow]
    queue: list[JobRow]


@dataclass(frozen=True)
class Applied:
    """A change that took: the job as it is now, the dependents failed with it (ids), and
    how many waiting jobs it made claimable."""

    job: JobRow
    failed: list[str] = field(default_factory=list)
    released: int = 0


@dataclass(frozen=True)
class QueueGauges:
    """The queue as /metrics shows it: jobs by (status, pool), each pool's oldest pending
    job (its created_at), and the bytes of blobs kept as artifacts and of the others."""

    jobs: dict[tuple[str, str], int]
    oldest_pending: dict[str, float]
    artifact_bytes: int
    package_bytes: int


class StaleClaim(Exception):
    """Another claim for the worker came between its snapshot and its claim: rank again."""


class ClaimSession(Protocol):
    """One claim: a snapshot to rank on, and the write that takes a job."""

    page_size: int  # queued jobs to read at a time
    choices: int  # claims to offer at once

    def view(self, worker_id: str, name: str, pool: str, now: float, page: int) -> ClaimView: ...
    def page(self, pool: str, now: float, after: JobRow | None, limit: int) -> list[JobRow]: ...
    def claim(
        self, worker_id: str, seen: int, changes: Sequence[Change], caps: Recheck | None = None
    ) -> str | None:
        """Apply the first of ``changes`` whose job is still pending (its id, or None). With
        ``caps``, first lock the capped holders (serializing the claims that count against
        them) and drop the changes a cap holds back on what is held then."""
        ...

    def held(self, owners: Sequence[str], pools: Sequence[str]) -> list[HeldRow]:
        """What the jobs claimed or running now of ``owners`` or in ``pools`` hold."""
        ...

    def made_way(self, worker_id: str, now: float) -> list[JobRow]:
        """The pending jobs a preemption is freeing a slot of this worker for."""
        ...

    def owners(self, pool: str) -> list[str]:
        """The owners with jobs pending in ``pool`` (some may wait on dependencies)."""
        ...

    def owner_page(
        self, pool: str, owner: str, now: float, after: JobRow | None, limit: int
    ) -> list[JobRow]:
        """The next ``limit`` claimable jobs of ``owner`` in ``pool`` after ``after``."""
        ...


class UsageStore(Protocol):
    """Usage for fair share: ended attempts' slices, and what runs now."""

    usage_width: float

    def usage_slices(self, since: float, pool: str | None = None) -> list[UsageSlice]: ...
    def running_use(self, pool: str | None = None) -> list[RunningUse]: ...
    def prune_usage(self, before: float) -> int: ...


@dataclass(frozen=True)
class Preempt:
    """A running job (``victim`` on lease ``lease``) asked to make way for the waiting job
    ``by``: what each one's event log says of it (``why``: the victim's, ``said``: the
    waiting job's)."""

    victim: str
    lease: int
    by: str
    why: str
    said: str
    # The victim's worker, whose freed slot its claims offer ``by`` first until ``until``.
    worker: str | None = None
    until: float | None = None


class PreemptionStore(Protocol):
    """Preemption: the waiting jobs that may preempt, a victim marked (once), and which
    of a worker's leases are to be vacated for it."""

    def preemptors(self, pool: str, min_priority: int, since: float, limit: int) -> list[JobRow]:
        """The pending jobs of ``pool`` (dependencies met) of priority ``min_priority``
        or more, claimable since ``since`` or earlier, in claim order."""
        ...

    def request_preempt(self, ask: Preempt, now: float) -> bool:
        """Mark ``ask.victim`` as asked to make way (only if it still runs on that lease,
        is asked nothing else, and ``ask.by`` still waits with no other job making way
        for it), and say so in both jobs' event logs; whether it took."""
        ...

    def preempting(self, leases: Iterable[tuple[str, int]]) -> set[str]:
        """Of these leases, the jobs asked to make way for a waiting job."""
        ...

    def preempted_for(self, job_id: str, limit: int) -> list[JobRow]:
        """The jobs whose latest preemption freed a slot for ``job_id``, latest first."""
        ...


class JobStore(Protocol):
    """Jobs and leases: submit and apply, start, extend, finish, release, lose, cancel,
    requeue, stop, and what is read of jobs and attempts (a claim is :class:`ClaimStore`'s)."""

    def submit(self, batch: Batch, now: float) -> Submitted: ...
    def start(self, change: Change) -> Applied | None: ...
    def finish(self, change: Change) -> Applied | None: ...
    def release(self, change: Change) -> Applied | None: ...
    def lose(self, change: Change) -> Applied | None: ...
    def cancel(self, change: Change) -> Applied | None: ...
    def requeue(self, change: Change) -> Applied | None: ...
    def pause(self, change: Change) -> Applied | None: ...
    def resume(self, change: Change) -> Applied | None: ...
    def request_pause(self, job_id: str, now: float, by: str | None = None) -> bool: ...
    def pausing(self, leases: Iterable[tuple[str, int]]) -> set[str]: ...
    def extend_leases(
        self,
        leases: Iterable[tuple[str, int]],
        expires: float,
        worker_id: str,
        gpu_mib: Mapping[tuple[str, int], int] | None = None,
    ) -> set[tuple[str, int]]: ...
    def request_stop(
        self, job_id: str, now: float, grace: float, by: str | None = None
    ) -> bool: ...
    def stops(self, leases: Iterable[tuple[str, int]]) -> dict[str, float]: ...
    def refresh_waiting(self, job_ids: Sequence[str] | None = None) -> int: ...
    def fold_job_counts(self) -> int: ...
    def get_job(self, job_id: str) -> JobRow | None: ...
    def find_jobs_by_name(
        self, name: str, limit: int = 2, pools: Sequence[str] | None = None
    ) -> list[JobRow]: ...
    def list_jobs(
        self,
        statuses: Iterable[str] = (),
        limit: int = 1000,
        pools: Sequence[str] | None = None,
        name: str | None = None,
        before: tuple[float, str] | None = None,
    ) -> list[JobRow]: ...
    def job_counts(
        self, pools: Sequence[str] | None = None, name: str | None = None
    ) -> dict[str, int]: ...
    def queue_gauges(self) -> QueueGauges: ...
    def queue_ahead(self, job: JobRow, limit: int) -> list[JobRow]: ...
    def manifest_jobs(
        self, manifest: str, pools: Sequence[str] | None = None
    ) -> list[tuple[str, str]]: ...
    def pools_of(self, job_ids: Sequence[str]) -> dict[str, str]: ...
    def holding(self, worker: WorkerRow) -> list[JobRow]: ...
    def aimed_jobs(self) -> list[JobRow]: ...
    def active_jobs(self, worker_id: str | None = None) -> list[JobRow]: ...
    def lost_leases(self, now: float) -> list[JobRow]: ...
    def attempts(self, job_id: str) -> list[AttemptRow]: ...
    def late_result(self, job_id: str, attempt: int, text: str) -> None: ...
    def dependencies(self, job_id: str) -> list[JobRow]: ...


class EventStore(Protocol):
    """A job's event log (its output, progress and status changes), the fleet-wide stream
    of status changes, and the pruning of old records."""

    def append_logs(
        self,
        job_id: str,
        lease: int,
        lines: Sequence[tuple[str, str]],
        now: float,
        first: int | None = None,
        quota: OutputQuota | None = None,
    ) -> Appended: ...
    def logs(
        self,
        job_id: str,
        after: int,
        limit: int,
        streams: Collection[str] | None = None,
        before: int | None = None,
        budget: int | None = None,
    ) -> list[LogRow]: ...
    def state_events(
        self,
        after: int,
        limit: int,
        pools: Sequence[str] | None = None,
        budget: int | None = None,
    ) -> list[tuple[LogRow, str]]: ...
    def last_seq(self, job_id: str | None = None) -> int: ...
    def prune(self, logs_before: float | None, audit_before: float | None, batch: int) -> int: ...


class FleetStore(Protocol):
    """Workers and host policies."""

    def upsert_worker(self, worker_id: str, values: dict[str, Any]) -> tuple[str, bool]: ...
    def get_worker(self, worker_id: str) -> WorkerRow | None: ...
    def list_workers(self, pools: Sequence[str] | None = None) -> list[WorkerRow]: ...
    def change_worker(self, change: WorkerChange) -> bool: ...
    def drain_worker(self, worker_id: str, by: float | None = None) -> bool: ...
    def set_worker_environments(self, worker_id: str, environments: str) -> bool: ...
    def set_worker_capability(self, worker_id: str, capability: str) -> bool: ...
    def set_worker_owner_state(self, worker_id: str, state: str | None) -> bool: ...
    def record_beats(self, beats: Sequence[tuple[str, float, str | None]]) -> None: ...
    def bind_worker(self, worker_id: str, token_id: str) -> bool: ...
    def mark_offline(self, before: float) -> list[str]: ...
    def delete_worker(self, worker_id: str) -> bool: ...
    def delete_gone_ephemeral(self, before: float) -> list[str]: ...
    def hosts(self) -> list[HostRow]: ...


class AccessStore(Protocol):
    """Who may call: tokens (stored hashed), dashboard sessions, the server's own keys, and
    the audit log of what each caller did."""

    def server_key(self, name: str, fresh: str) -> str: ...
    def insert_token(self, values: dict[str, Any]) -> None: ...
    def token_by_hash(self, digest: str) -> TokenRow | None: ...
    def list_tokens(self) -> list[TokenRow]: ...
    def revoke_token(self, token_id: str, now: float) -> bool: ...
    def get_token(self, token_id: str) -> TokenRow | None: ...
    def rotate_token(self, token_id: str, digest: str, hint: str) -> bool: ...
    def count_tokens(self, role: str) -> int: ...
    def insert_session(self, values: dict[str, Any], now: float) -> None: ...
    def session_token(self, digest: str, now: float) -> TokenRow | None: ...
    def delete_session(self, digest: str) -> bool: ...
    def insert_audit(self, rows: list[dict[str, Any]]) -> None: ...
    def audit(self, since: float, limit: int, after: int = 0) -> list[AuditRow]: ...
    def publish_tokens_changed(self) -> None:
        """Tell other server replicas that a token was rotated or revoked."""
        ...


class DataStore(Protocol):
    """Blobs (their records; the bytes are files), resumable uploads and artifacts."""

    def record_blob(self, sha256: str, size: int, now: float) -> None: ...
    def get_blob(self, sha256: str) -> BlobRow | None: ...
    def list_blobs(self, limit: int, pools: Sequence[str] | None = None) -> list[BlobRow]: ...
    def grant_blobs(self, grants: Iterable[tuple[str, str]]) -> None: ...
    def blob_readable(self, sha256: str, pools: Sequence[str]) -> bool: ...
    def set_blob_archive(self, sha256: str, summary: dict[str, Any]) -> None: ...
    def create_upload(
        self, upload_id: str, sha256: str | None, size: int, now: float, owner: str | None = None
    ) -> None: ...
    def upload_owner(self, upload_id: str) -> str | None: ...
    def get_upload(self, upload_id: str) -> tuple[str | None, int, float] | None: ...
    def delete_upload(self, upload_id: str) -> None: ...
    def old_uploads(self, created_before: float) -> list[str]: ...
    def upload_ids(self, created_after: float) -> set[str]: ...
    def attach_artifact(self, job_id: str, lease: int, values: dict[str, Any]) -> bool: ...
    def artifact(self, job_id: str, attempt: int | None = None) -> ArtifactRow | None: ...


class CheckpointStore(Protocol):
    """The snapshots of jobs' checkpoint folders (gpufleet.domain.checkpoints)."""

    def add_checkpoint(
        self, job_id: str, lease: int, values: dict[str, Any], keep: int
    ) -> int | None: ...
    def checkpoints(self, job_id: str, limit: int = 100) -> list[CheckpointRow]: ...
    def checkpoint_totals(self) -> tuple[int, int]: ...
    def prune_checkpoints(self, before: float, batch: int) -> int: ...


class EnvironmentStore(Protocol):
    """Job environments: the fleet-wide locks of unlocked specs, and which workers have
    a spec built."""

    def get_env_lock(self, pool: str, key: str) -> EnvLockRow | None: ...
    def put_env_lock(self, row: EnvLockRow, replace: bool) -> tuple[EnvLockRow, bool]: ...
    def workers_with_env(self, spec_key: str, pools: Sequence[str] | None = None) -> list[str]: ...


class WebhookStore(Protocol):
    """Webhooks, their deliveries (due, made, given up) and how far the scan of status
    changes has read (:mod:`gpufleet.server.hooks`)."""

    def add_webhook(self, values: Mapping[str, object]) -> None: ...
    def webhooks(self) -> list[WebhookRow]: ...
    def remove_webhook(self, webhook_id: str) -> bool: ...
    def webhook_cursor(self) -> int | None: ...
    def move_webhook_cursor(self, old: int | None, new: int) -> bool:
        """Set the cursor to ``new`` if it is still ``old``; whether it was."""
        ...

    def add_deliveries(self, rows: Sequence[Mapping[str, object]]) -> int:
        """Insert deliveries, skipping those whose ``key`` is there; how many went in."""
        ...

    def take_deliveries(self, now: float, limit: int, hold: float) -> list[DeliveryRow]:
        """Pending deliveries due by ``now`` (oldest first, ``limit`` at most), each taken
        by moving its ``next_at`` ``hold`` seconds on and counting a try (a conditional
        update: two servers never take one)."""
        ...

    def end_delivery(
        self, delivery_id: int, state: str, next_at: float, error: str | None
    ) -> None: ...
    def pending_deliveries(self) -> int: ...
    def prune_deliveries(self, before: float) -> int: ...


@dataclass(frozen=True)
class Offers:
    """What a backend can do beyond the contract, so that nothing outside it asks which
    backend it is. ``claimers``: how many claim sessions are worth running at once (SQLite
    writes one at a time); ``listens``: it hears other servers' changes
    (:meth:`Store.listen`: PostgreSQL's LISTEN/NOTIFY)."""

    claimers: int = 1
    listens: bool = False


class ClaimStore(Protocol):
    """Claims: each runs in a transaction of its own (:class:`ClaimSession`), so none can be
    asked of a :class:`Transaction`'s store."""

    def claiming(self) -> AbstractContextManager[ClaimSession]: ...
    def publish_claimable(self) -> None:
        """Tell other server replicas that a job may have become claimable."""
        ...

    def publish_superseded(self, worker_id: str, replica: str) -> None:
        """Tell other replicas that ``worker_id`` sent a poll replacing its open one."""
        ...


class InTransaction(
    JobStore,
    PreemptionStore,
    EventStore,
    FleetStore,
    AccessStore,
    DataStore,
    CheckpointStore,
    EnvironmentStore,
    Protocol,
):
    """The store as a :class:`Transaction` gives it: every call made through it is part of
    that transaction, and reads what the calls before it wrote. It has no claims and no
    transaction of its own (its type has neither)."""

    def hold_worker(self, worker: WorkerRow) -> list[JobRow]:
        """Hold ``worker`` until the transaction ends (two transactions about one worker
        run one after the other) and rank any claim it has open again (its claim count
        moves); the jobs it runs or has claimed, and the pending ones aimed at it, the
        pending ones in claim order."""
        ...


class Transaction(Protocol):
    """One unit of work, passed where a transaction is meant: its :attr:`store` makes
    every call part of it; it commits as its ``with`` block ends and is rolled back if the
    block raises. Work to do only once it has committed (telling followers and waiting
    polls) is given to :meth:`after_commit`."""

    @property
    def store(self) -> InTransaction: ...
    def savepoint(self) -> AbstractContextManager[object]:
        """A part of the transaction that is all or nothing: if its block raises, what it
        wrote is undone and the rest of the transaction stands."""
        ...

    def after_commit(self, call: Callable[[], None]) -> None:
        """Run ``call`` once the transaction has committed (never, if it does not); a
        call that fails is logged and the others still run."""
        ...


class Store(
    JobStore,
    ClaimStore,
    UsageStore,
    PreemptionStore,
    EventStore,
    FleetStore,
    AccessStore,
    DataStore,
    CheckpointStore,
    EnvironmentStore,
    WebhookStore,
    Protocol,
):
    """Everything the server keeps, and the plumbing around it."""

    def transaction(self, job_ids: Sequence[str] = ()) -> AbstractContextManager[Transaction]:
        """Begin a :class:`Transaction`. ``job_ids``: the jobs its calls will change,
        held first, in one order, as the backend must (so two cannot deadlock)."""
        ...

    dialect: ClassVar[str]  # its name, for the server's log ("sqlite", "postgresql", "memory")
    space: SpaceWatch  # whether its writes fail for lack of disk now

    @property
    def offers(self) -> Offers: ...
    def listen(
        self,
        on_notify: Callable[[], None],
        stop: threading.Event,
        on_tokens: Callable[[], None] | None = None,
        on_superseded: Callable[[str, str], None] | None = None,
    ) -> None: ...

    def migrate(self) -> None: ...
    def close(self) -> None: ...
    def ping(self) -> str: ...
