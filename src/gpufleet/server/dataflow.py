"""How data moves between jobs: inputs checked at submit, dependencies (``job:NAME``
inputs) that hold a job back until they succeed, and artifacts attached to attempts.

A job that needs another job's artifact stays pending with a count of unmet dependencies
(the claim query skips it until the count is 0). When a dependency fails or is cancelled,
every job waiting on it fails too, with the reason, and so on down the chain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from gpufleet.domain.environments import (
    EnvFile,
    EnvSpec,
    pyproject_problem,
    requirements_text_problem,
    uv_lock_problem,
)
from gpufleet.domain.models import InputKind, JobInput, JobSpec, JobStatus
from gpufleet.errors import Conflict, GpufleetError, NotFound, UnsafeArchive, ValidationFailed
from gpufleet.server.blobs import BlobService
from gpufleet.store import DataStore, JobRow, JobStore
from gpufleet.store.rows_read import ArtifactRow
from gpufleet.wire import MOST_ENV_FILE, StagedInput

FAILED_DEP = (JobStatus.FAILED, JobStatus.CANCELLED)


def env_files(spec: JobSpec) -> tuple[EnvFile, ...]:
    """The files of ``spec``'s environment (none without one)."""
    return spec.environment.files if isinstance(spec.environment, EnvSpec) else ()


#: The most environment-file verdicts a server keeps (then it forgets them all).
MOST_VERDICTS = 4096


def _env_verdict(data: bytes, check: Callable[[str], str | None]) -> str | None:
    """What is wrong with an environment file's bytes, or None."""
    try:
        return check(data.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8 text"


def _field(index: int) -> str:
    return f"inputs[{index}]"


class FlowStore(JobStore, DataStore, Protocol):
    """What data flow reads and writes: jobs (their dependencies) and blobs and artifacts."""


class DataFlow:
    """Inputs, dependencies and artifacts; one per server, used by the queue."""

    def __init__(
        self,
        store: FlowStore,
        blobs: BlobService,
        clock: Callable[[], float],
        on_change: Callable[[], None],
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.clock = clock
        self.on_change = on_change
        # verdicts of environment files by (role, sha256): a blob's content never
        # changes, and a manifest's jobs often share one environment
        self._env_verdicts: dict[tuple[str, str], str | None] = {}

    # ---- submit time ------------------------------------------------------------------

    def resolve(
        self,
        spec: JobSpec,
        batch: dict[str, str] | None = None,
        readable: Sequence[str] | None = None,
    ) -> JobSpec:
        """``spec`` with every ``job:`` input pointing at a job id, after checking that
        every package blob is on the server and is a safe archive. ``batch`` maps the
        names of jobs submitted together (a manifest) to their ids; they win over older
        jobs. A package blob the pools in ``readable`` may not read (None: any) is answered
        as one not on the server. Raises ValidationFailed naming the input."""
        inputs = []
        for index, inp in enumerate(spec.inputs):
            if inp.kind == InputKind.BLOB:
                self._check_blob(spec.name, index, inp, readable)
                inputs.append(inp)
            elif inp.kind == InputKind.JOB:
                job_id = self._job_id(spec.name, spec.pool, index, inp.ref, batch)
                inputs.append(replace(inp, ref=job_id))
            else:
                inputs.append(inp)
        self._check_environment(spec, readable)
        return replace(spec, inputs=tuple(inputs))

    @staticmethod
    def package_grants(specs: Sequence[JobSpec]) -> set[tuple[str, str]]:
        """(blob, pool): each job's pool may read its package blobs (its workers download
        them), from the moment the job is written."""
        packages = {(i.ref, s.pool) for s in specs for i in s.inputs if i.kind == InputKind.BLOB}
        return packages | {(f.sha256, s.pool) for s in specs for f in env_files(s)}

    def _check_environment(self, spec: JobSpec, readable: Sequence[str] | None) -> None:
        """Each file of the job's environment is a blob on the server, of the size the
        spec says (a plain file: it is read as text, never unpacked)."""
        for f in env_files(spec):
            where = {"job": spec.name, "field": "environment", "blob": f.sha256}
            row = self.store.get_blob(f.sha256)
            size = row.size if row is not None else None
            if size is None or (
                readable is not None and not self.store.blob_readable(f.sha256, readable)
            ):
                raise ValidationFailed(
                    f"job {spec.name!r}: environment: {f.name} (blob {f.sha256[:12]}) is not "
                    "on the server; upload it first (gpufleet blobs put)",
                    detail=where,
                )
            if size != f.size:
                raise ValidationFailed(
                    f"job {spec.name!r}: environment: {f.name} is {size} bytes on the "
                    f"server, not {f.size}",
                    detail=where,
                )
        if isinstance(spec.environment, EnvSpec):
            self._check_env_contents(spec.name, spec.environment)

    def _check_env_contents(self, job: str, env: EnvSpec) -> None:
        """422 unless each file of the environment asks only for what the worker's index
        serves (domain.environments' checks, naming the line or key): the worker's uv
        must read no file of its own and reach no other host. The server checks, not
        only the client: a job may be submitted straight through the API."""
        for role, f, check in (
            ("requirements", env.requirements, requirements_text_problem),
            ("project", env.project, pyproject_problem),
            ("lock", env.lock, uv_lock_problem),
        ):
            if f is None:
                continue
            field = f"environment.{role}"
            where = {"job": job, "field": field, "blob": f.sha256}
            if (role, f.sha256) in self._env_verdicts:
                problem = self._env_verdicts[role, f.sha256]
            else:
                data = self.blobs.content(f.sha256, MOST_ENV_FILE)
                if data is None:
                    raise ValidationFailed(
                        f"job {job!r}: {field}: {f.name} is not on the server or larger than "
                        f"{MOST_ENV_FILE} bytes",
                        detail=where,
                    )
                problem = _env_verdict(data, check)
                if len(self._env_verdicts) >= MOST_VERDICTS:
                    self._env_verdicts.clear()
                self._env_verdicts[role, f.sha256] = problem
            if problem:
                raise ValidationFailed(f"job {job!r}: {field}: {f.name}: {problem}", detail=where)

    def _check_blob(
        self, job: str, index: int, inp: JobInput, readable: Sequence[str] | None
    ) -> None:
        where = {"job": job, "field": _field(index), "blob": inp.ref}
        try:
            if readable is not None and not self.store.blob_readable(inp.ref, readable):
                raise NotFound(f"no blob {inp.ref}")
            self.blobs.scan(inp.ref)
        except NotFound:
            raise ValidationFailed(
                f"job {job!r}: {_field(index)}: package {inp.label or inp.ref} (blob "
                f"{inp.ref[:12]}) is not on the server; upload it first (gpufleet blobs put)",
                detail=where,
            ) from None
        except UnsafeArchive as exc:
            message = f"job {job!r}: {_field(index)}: {exc.message}"
            raise UnsafeArchive(message, detail=where) from None

    def _job_id(
        self, job: str, pool: str, index: int, ref: str, batch: dict[str, str] | None
    ) -> str:
        """The id of the job ``ref`` names, in the same pool: a job of another pool is
        answered as unknown (its artifact is not the pool's to read)."""
        if batch and ref in batch:
            return batch[ref]
        found = self.store.get_job(ref)
        if found is not None and found.pool == pool:
            return found.id
        named = self.store.find_jobs_by_name(ref, limit=5, pools=[pool])
        where = {"job": job, "field": _field(index), "ref": ref}
        if len(named) == 1:
            return named[0].id
        if named:
            ids = ", ".join(j.id for j in named)
            raise ValidationFailed(
                f"job {job!r}: {_field(index)}: several jobs are named {ref!r} ({ids}); use job:ID",
                detail=where,
            )
        raise ValidationFailed(
            f"job {job!r}: {_field(index)}: no job {ref!r} in pool {pool!r}", detail=where
        )

    @staticmethod
    def check_cycles(deps: Mapping[str, Sequence[str]], names: dict[str, str]) -> None:
        """Refuse jobs of one manifest that wait for each other (they would wait forever)."""
        state: dict[str, int] = {}

        def visit(node: str, path: list[str]) -> None:
            if state.get(node) == 2:
                return
            if state.get(node) == 1:
                loop = [*path[path.index(node) :], node]
                shown = " -> ".join(names.get(n, n) for n in loop)
                raise ValidationFailed(
                    f"jobs wait for each other's results: {shown}", detail={"field": "inputs"}
                )
            state[node] = 1
            for dep in deps.get(node, ()):
                visit(dep, [*path, node])
            state[node] = 2

        for node in deps:
            visit(node, [])

    def check_requeue(self, job: JobRow) -> None:
        """A job can come back only when none of its dependencies failed."""
        for dep in self.store.dependencies(job.id):
            if dep.status in FAILED_DEP:
                raise Conflict(
                    f"job {job.id} needs the result of {dep.name} ({dep.id}), which is "
                    f"{dep.status.value}; requeue that job first",
                    detail={"job": job.id, "dependency": dep.id},
                )

    # ---- claim time -------------------------------------------------------------------

    def staged(self, spec: JobSpec) -> list[StagedInput]:
        """What the worker fetches for ``spec``: blobs, dependencies' artifacts, paths."""
        staged = []
        for inp in spec.inputs:
            if inp.kind == InputKind.BLOB:
                staged.append(
                    StagedInput(
                        kind="blob", dest=inp.dest, sha256=inp.ref, size=inp.size, label=inp.label
                    )
                )
            elif inp.kind == InputKind.PATH:
                staged.append(
                    StagedInput(
                        kind="path", dest=inp.dest, sha256=inp.sha256, path=inp.ref, label=inp.label
                    )
                )
            else:
                staged.append(self._dependency(inp))
        return staged

    def _dependency(self, inp: JobInput) -> StagedInput:
        dep = self.store.get_job(inp.ref)
        art = self.store.artifact(inp.ref, dep.lease) if dep else None
        label = f"job:{dep.name if dep else inp.ref}"
        return StagedInput(
            kind="job",
            dest=inp.dest,
            sha256=art.sha256 if art else None,
            size=art.size if art else None,
            label=label,
        )

    # ---- artifacts --------------------------------------------------------------------

    def attach(self, job: JobRow, attempt: int, sha256: str) -> ArtifactRow:
        """Attach blob ``sha256`` as the artifact of the attempt the lease holds."""
        size = self.blobs.require(sha256)
        try:
            summary = self.blobs.scan(sha256)
        except GpufleetError as exc:
            raise UnsafeArchive(
                f"job {job.id}: the artifact is not a safe archive: {exc.message}",
                detail={"job": job.id, "blob": sha256},
            ) from None
        values = {
            "sha256": sha256,
            "size": size,
            "files": json.dumps(summary.get("list", [])),
            "file_count": int(summary["files"]),
            "bytes": int(summary["bytes"]),
            "created_at": self.clock(),
        }
        self.store.grant_blobs([(sha256, job.pool)])  # the job's pool may download it
        if not self.store.attach_artifact(job.id, attempt, values):
            raise Conflict(
                f"stale lease: job {job.id} attempt {attempt} is no longer yours",
                detail={"job": job.id, "attempt": attempt},
            )
        found = self.store.artifact(job.id, attempt)
        assert found is not None
        return found
