"""Job environments on the server: the fleet-wide locks of unlocked environment specs.

An unlocked spec (a requirements.txt with ranges, unpinned ``--with`` strings, a
pyproject.toml without its uv.lock) is resolved once for the whole fleet. The first
worker to build it uploads what uv resolved (pinned requirements, or a uv.lock) as a
blob and records it here under the spec's ``lock_key`` (spec, Python major.minor, torch
build); every later build of the spec, on any worker, reads the lock and installs exactly
those versions. The first lock recorded wins; only a job whose spec asks for a fresh
resolution (``upgrade``) replaces it, and the audit log says so.
"""

from __future__ import annotations

from collections.abc import Callable

from gpufleet.domain.environments import EnvSpec, lock_key
from gpufleet.domain.models import Role
from gpufleet.errors import NotFound, ValidationFailed
from gpufleet.server.access import Caller
from gpufleet.server.blobs import BlobService
from gpufleet.server.fleet import OnEvent
from gpufleet.server.leases import Leases
from gpufleet.store import EnvLockRow, JobRow, Store
from gpufleet.wire import EnvLockPut


class EnvLocks:
    """Reads and records fleet-wide environment locks; one per server process."""

    def __init__(
        self,
        store: Store,
        blobs: BlobService,
        leases: Leases,
        clock: Callable[[], float],
        on_event: OnEvent,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.leases = leases
        self.clock = clock
        self.on_event = on_event

    def get(self, key: str, caller: Caller) -> EnvLockRow:
        """The lock recorded under ``key``, or 404. A worker reading it may download its
        blob from now on (its pool is granted it): the lock is the fleet's, whichever
        pool's worker recorded it."""
        row = self.store.get_env_lock(key)
        if row is None:
            raise NotFound(
                f"no lock is recorded for environment {key}: the first build of its spec "
                "resolves it and records one",
                detail={"lock": key},
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
        job = self.leases.check_holder(
            body.job_id, body.attempt, caller.id, caller.pools, body.secret
        )
        self._check(key, body, job)
        if self.blobs.has(body.sha256) is None or not self.blobs.readable(
            body.sha256, caller.pools
        ):
            raise NotFound(
                f"no blob {body.sha256}: upload the lock's text first (field 'sha256')",
                detail={"blob": body.sha256, "field": "sha256"},
            )
        holder = self.leases.fleet.claimer(job.worker_id) if job.worker_id else None
        row = EnvLockRow(
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
            self.on_event("environment.lock_replaced", key, detail, caller.token)
        self._share(got, caller)
        return got, created

    def _share(self, row: EnvLockRow, caller: Caller) -> None:
        """Let a worker's pool read the lock's blob (operators and admins read every blob)."""
        if caller.role != Role.WORKER or not caller.pools:
            return
        if not self.blobs.readable(row.sha256, caller.pools):  # a write only the first time
            self.blobs.grant((row.sha256, pool) for pool in caller.pools)

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
