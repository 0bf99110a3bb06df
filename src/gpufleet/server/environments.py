"""Job environments on the server: each pool's locks of unlocked environment specs.

An unlocked spec (a requirements.txt with ranges, unpinned ``--with`` strings, a
pyproject.toml without its uv.lock) is resolved once for each pool. The first worker of
the pool to build it uploads what uv resolved (pinned requirements, or a uv.lock) as a
blob and records it here under the spec's ``lock_key`` (spec, Python major.minor, torch
build) and the job's pool; every later build of the spec, on any worker of the pool,
reads the lock and installs exactly those versions. Locks are per pool, as the workers
and their trust are: one pool's worker never writes what another pool's install. The
first lock recorded wins; only a job whose spec asks for a fresh resolution
(``upgrade``) replaces it, and the audit log says so.
"""

from __future__ import annotations

from collections.abc import Callable

from gpufleet.domain.environments import EnvSpec, lock_key
from gpufleet.domain.models import Role
from gpufleet.errors import NotFound, ValidationFailed
from gpufleet.server.access import Caller
from gpufleet.server.blobs import BlobService
from gpufleet.server.fleet import OnEvent
from gpufleet.server.holders import Holders
from gpufleet.store import EnvironmentStore, EnvLockRow, JobRow
from gpufleet.wire import EnvLockPut


class EnvLocks:
    """Reads and records fleet-wide environment locks; one per server process."""

    def __init__(
        self,
        store: EnvironmentStore,
        blobs: BlobService,
        holders: Holders,
        clock: Callable[[], float],
        on_event: OnEvent,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.holders = holders
        self.clock = clock
        self.on_event = on_event

    def get(self, key: str, pool: str | None, caller: Caller) -> EnvLockRow:
        """The lock ``pool`` recorded under ``key``, or 404. ``pool`` None: the caller's
        only pool (``default`` for an admin); a caller confined to pools reads only
        theirs (403). A worker reading it may download its blob from now on."""
        pool = pool or caller.default_pool()
        caller.may_use(pool)
        row = self.store.get_env_lock(pool, key)
        if row is None:
            raise NotFound(
                f"pool {pool!r} has no lock recorded for environment {key}: the first build "
                "of its spec in the pool resolves it and records one",
                detail={"lock": key, "pool": pool},
            )
        self._share(row, caller)
        return row

    def put(self, key: str, body: EnvLockPut, caller: Caller) -> tuple[EnvLockRow, bool]:
        """Record the lock a worker's build resolved, if it holds the job's lease (and
        secret) and the job's environment is the spec the lock is for. The first lock
        recorded stands: a later put without ``replace`` gets the recorded one back (and
        its worker installs that one instead of its own); with ``replace`` (a job whose
        spec asks for ``upgrade``) it replaces it. Returns the lock now recorded and
        whether this call created it."""
        job = self.holders.check(body.job_id, body.attempt, caller.id, caller.pools, body.secret)
        self._check(key, body, job)
        if self.blobs.has(body.sha256) is None or not self.blobs.readable(
            body.sha256, caller.pools
        ):
            raise NotFound(
                f"no blob {body.sha256}: upload the lock's text first (field 'sha256')",
                detail={"blob": body.sha256, "field": "sha256"},
            )
        holder = self.holders.fleet.claimer(job.worker_id) if job.worker_id else None
        row = EnvLockRow(
            pool=job.spec.pool,
            key=key,
            sha256=body.sha256,
            spec_key=body.spec_key,
            python=body.python,
            torch_backend=body.torch_backend,
            job_id=job.id,
            worker_name=holder.name if holder else "?",
            created_at=self.clock(),
        )
        got, created = self.store.put_env_lock(row, body.replace)
        if body.replace and not created:
            detail = f"job {job.id} on {row.worker_name} resolved it afresh: blob {body.sha256}"
            detail += f" (pool {row.pool})"
            self.on_event("environment.lock_replaced", key, detail, caller.token)
        self._share(got, caller)
        return got, created

    def _share(self, row: EnvLockRow, caller: Caller) -> None:
        """Let the lock's pool read its blob (operators and admins read every blob); only
        that pool, which the caller is of (checked before)."""
        if caller.role != Role.WORKER:
            return
        if not self.blobs.readable(row.sha256, [row.pool]):  # a write only the first time
            self.blobs.grant([(row.sha256, row.pool)])

    @staticmethod
    def _check(key: str, body: EnvLockPut, job: JobRow) -> None:
        """422, naming the field, unless the lock is for the job's own unlocked spec."""
        env = job.spec.environment
        if not isinstance(env, EnvSpec):
            raise ValidationFailed(
                f"job {job.id} names no environment: it has no lock to record",
                detail={"field": "job_id", "job": job.id},
            )
        if env.locked:
            raise ValidationFailed(
                f"job {job.id}'s environment brings its own uv.lock: the fleet records no "
                "lock for it",
                detail={"field": "job_id", "job": job.id},
            )
        if env.key() != body.spec_key:
            raise ValidationFailed(
                f"spec_key {body.spec_key} is not the key of job {job.id}'s environment",
                detail={"field": "spec_key", "job": job.id},
            )
        if lock_key(body.spec_key, body.python, body.torch_backend) != key:
            raise ValidationFailed(
                f"lock key {key} is not the key of this spec_key, python and torch_backend",
                detail={"field": "key"},
            )
        if body.replace and not env.upgrade:
            raise ValidationFailed(
                f"replace: job {job.id}'s environment does not ask for a fresh resolution "
                "(upgrade); the recorded lock stands",
                detail={"field": "replace", "job": job.id},
            )
