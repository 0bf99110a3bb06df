"""Store rows to wire models; time as ISO 8601 UTC."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime

from gpufleet.domain.checkpoints import Snapshot
from gpufleet.domain.environments import EnvSpec
from gpufleet.domain.models import GpuInfo, JobSpec, JobStatus, WorkerStatus
from gpufleet.scheduling.matching import WorkerView, effective_gpus, warm
from gpufleet.server.fleet import HostDeclaration, WorkerState
from gpufleet.store import AttemptRow, AuditRow, JobRow, LogRow, TokenRow
from gpufleet.store.rows_read import ArtifactRow, BlobRow, EnvLockRow
from gpufleet.wire import (
    ArtifactFile,
    ArtifactOut,
    AttemptOut,
    AuditOut,
    BlobOut,
    CapabilityModel,
    CheckpointFile,
    CheckpointOut,
    DependencyOut,
    EnvBuiltModel,
    EnvLockOut,
    EnvUsed,
    GpuModel,
    HostModel,
    HostOut,
    JobDetail,
    JobOut,
    JobSpecModel,
    LogEntry,
    OwnerStateModel,
    Restored,
    TokenOut,
    WorkerOut,
)


def ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def job_out(job: JobRow, names: dict[str, str]) -> JobOut:
    return JobOut(
        id=job.id,
        name=job.name,
        status=job.status.value,
        pool=job.pool,
        attempt=job.lease,
        attempts=job.attempts,
        max_attempts=job.max_attempts,
        priority=job.priority,
        worker=names.get(job.worker_id or ""),
        worker_id=job.worker_id,
        gpus=list(job.gpus),
        created_at=ts(job.created_at),
        started_at=ts(job.started_at),
        finished_at=ts(job.finished_at),
        exit_code=job.exit_code,
        error=job.error,
        model=job.model,
        manifest=job.manifest,
        not_before=ts(job.not_before) if job.status == JobStatus.PENDING else None,
        waiting=job.waiting if job.status == JobStatus.PENDING else 0,
        submitted_by=job.submitted_by,
        stderr_tail=list(job.stderr_tail),
        stop_requested_at=ts(job.stop_requested_at),
        stopped_early=job.stopped_early,
        progress=json.loads(job.progress) if job.progress else None,
        metrics=json.loads(job.metrics) if job.metrics else {},
        gpu_mib=job.gpu_mib if job.status.active else None,
        failure=job.failure,
        losses=job.losses,
        pause_requested_at=ts(job.pause_requested_at),
        raised=json.loads(job.raised)["why"] if job.raised else None,
    )


def attempt_out(a: AttemptRow) -> AttemptOut:
    return AttemptOut(
        attempt=a.attempt,
        worker=a.worker_name,
        worker_id=a.worker_id,
        gpus=list(a.gpus),
        claimed_at=ts(a.claimed_at),
        started_at=ts(a.started_at),
        finished_at=ts(a.finished_at),
        exit_code=a.exit_code,
        outcome=a.outcome,
        error=a.error,
        stderr_tail=list(a.stderr_tail),
        late_result=a.late_result,
        output_dropped=a.output_dropped,
        failure=a.failure,
        cause=a.cause,
        restored=Restored.model_validate_json(a.restored) if a.restored else None,
        environment=_environment(a.environment),
    )


def _environment(text: str | None) -> EnvUsed | None:
    """An attempt's environment as its worker reported it (checked when it came in)."""
    if not text:
        return None
    try:
        return EnvUsed.model_validate_json(text)
    except ValueError:  # written by another version: shown as not known
        return None


def job_detail(
    job: JobRow,
    names: dict[str, str],
    history: list[AttemptRow],
    artifact: ArtifactRow | None = None,
    deps: list[JobRow] | None = None,
    host: HostDeclaration | None = None,
    submitter: str | None = None,
    snapshots: list[Snapshot] | None = None,
) -> JobDetail:
    base = job_out(job, names).model_dump()
    return JobDetail(
        **base,
        spec=JobSpecModel.shown(job.spec),
        history=[attempt_out(a) for a in history],
        unrunnable=job.unrunnable,
        artifact=artifact_out(artifact) if artifact else None,
        depends_on=[
            DependencyOut(job_id=d.id, name=d.name, status=d.status.value) for d in deps or []
        ],
        host=host_out(host) if host else None,
        submitted_by_name=submitter,
        checkpoints=[checkpoint_out(s) for s in snapshots or []],
    )


def host_out(d: HostDeclaration) -> HostOut:
    return HostOut(
        name=d.name,
        manifest=d.manifest,
        file=d.file,
        applied_at=ts(d.applied_at),
        applied_by=d.applied_by,
        narrows=list(d.policy.narrowing()),
        policy=HostModel.from_domain(d.policy),
    )


def artifact_out(a: ArtifactRow) -> ArtifactOut:
    return ArtifactOut(
        job_id=a.job_id,
        attempt=a.attempt,
        sha256=a.sha256,
        size=a.size,
        files=[ArtifactFile(**f) for f in json.loads(a.files)],
        file_count=a.file_count,
        bytes=a.bytes,
        created_at=ts(a.created_at),
    )


def checkpoint_out(s: Snapshot) -> CheckpointOut:
    return CheckpointOut(
        id=s.id,
        job_id=s.job_id,
        attempt=s.attempt,
        created_at=ts(s.created_at),
        files=[CheckpointFile(path=f.path, sha256=f.sha256, size=f.size) for f in s.files],
        file_count=len(s.files),
        bytes=s.bytes,
        progress=dict(s.progress),
    )


def blob_out(b: BlobRow) -> BlobOut:
    return BlobOut(sha256=b.sha256, size=b.size, created_at=ts(b.created_at))


def worker_out(state: WorkerState) -> WorkerOut:
    w = state.row
    live = {g.index: g for g in w.gpu_stats}
    gpus = [GpuModel.model_construct(**live.get(g.index, g).__dict__) for g in w.capability.gpus]
    offered = None
    if state.host is not None and state.host.policy.narrows_gpus():
        offered = [_offered(g, live) for g in effective_gpus(state.view)]
    return WorkerOut(
        id=w.id,
        name=w.name,
        status=state.status.value,
        pool=w.pool,
        labels=w.labels,
        fixed_labels=sorted(w.fixed_labels),
        offline_since=ts(w.offline_since) if state.status == WorkerStatus.OFFLINE else None,
        gpus=gpus,
        gpus_simulated=w.capability.gpus_simulated,
        slots={"cpu": w.cpu_slots, "gpu": len(w.capability.gpus if offered is None else offered)},
        running=[j.id for j in state.running],
        ephemeral=w.ephemeral,
        registered_at=ts(w.registered_at),
        last_heartbeat=ts(w.last_heartbeat),
        capability=CapabilityModel.shown(w.capability),
        host=host_out(state.host) if state.host else None,
        gpus_offered=offered,
        environments=[EnvBuiltModel.model_construct(**asdict(e)) for e in w.environments],
        owner=owner_state(w.owner_state),
    )


def owner_state(text: str | None) -> OwnerStateModel | None:
    """A worker's ``owner_state`` column read back (None: none, or unreadable)."""
    if text is None:
        return None
    try:
        return OwnerStateModel.model_validate_json(text)
    except ValueError:
        return None


def _offered(g: GpuInfo, live: dict[int, GpuInfo]) -> GpuModel:
    """A GPU as its host declaration offers it: its live free memory, within the
    declared cap (``g`` is already capped: :func:`effective_gpus`)."""
    now = live.get(g.index, g)
    free = min(now.free_mib, g.total_mib)
    return GpuModel.model_construct(**{**now.__dict__, "total_mib": g.total_mib, "free_mib": free})


def log_entry(r: LogRow, seq: int) -> LogEntry:
    """An output line, numbered ``seq`` (its record's number as the caller sees it)."""
    return LogEntry(seq=seq, attempt=r.attempt, stream=r.stream, line=r.line, ts=ts(r.ts))


def token_out(t: TokenRow) -> TokenOut:
    return TokenOut(
        id=t.id,
        name=t.name,
        role=t.role,
        pools=list(t.pools),
        hint=t.hint + "…" if t.hint else "",
        labels=t.labels,
        created_at=ts(t.created_at),
        expires_at=ts(t.expires_at),
        revoked_at=ts(t.revoked_at),
    )


def audit_out(a: AuditRow) -> AuditOut:
    return AuditOut(**{**a.__dict__, "at": ts(a.at)})


def env_lock_out(row: EnvLockRow) -> EnvLockOut:
    return EnvLockOut(
        pool=row.pool,
        key=row.key,
        sha256=row.sha256,
        spec_key=row.spec_key,
        python=row.python,
        torch_backend=row.torch_backend,
        job_id=row.job_id,
        worker_name=row.worker_name,
        created_at=ts(row.created_at),
        replaced_at=ts(row.replaced_at),
    )


def environment_built(spec: JobSpec, worker: WorkerView) -> bool | None:
    """Whether ``worker`` has ``spec``'s environment built (None: it names none)."""
    return warm(spec, worker) if isinstance(spec.environment, EnvSpec) else None
