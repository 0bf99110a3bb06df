"""Every API operation, described once as a :class:`Call`."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import quote

from gpufleet.client._api import Call, Reply, model, nothing
from gpufleet.wire import (
    ApplyResult,
    ArtifactAttach,
    ArtifactOut,
    AuditOut,
    BlobOut,
    Candidate,
    CheckpointIn,
    CheckpointOut,
    ClaimRequest,
    EnvLockOut,
    EnvLockPut,
    EventsOut,
    FinishRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    HostOut,
    JobDetail,
    JobOut,
    JobSpecModel,
    Lease,
    LeaveRequest,
    LogAppend,
    LogsOut,
    ManifestApply,
    ReleaseRequest,
    ReportBatch,
    ReportResults,
    SelectRequest,
    StartRequest,
    StatusOut,
    StopRequest,
    SubmitResult,
    TokenCreate,
    TokenCreated,
    TokenOut,
    UsageOut,
    WebhookCreate,
    WebhookCreated,
    WebhookOut,
    WhoAmI,
    WhyOut,
    WorkerOut,
    WorkerRegister,
)


def _q(ref: str) -> str:
    return quote(ref, safe="")


def health() -> Call[dict[str, Any]]:
    return Call("GET", "/v1/health", model(dict[str, Any]))


def submit(spec: JobSpecModel, queue: bool = False) -> Call[SubmitResult]:
    params: dict[str, Any] = {"queue": "true"} if queue else {}
    return Call("POST", "/v1/jobs", model(SubmitResult), body=spec, params=params)


def whoami() -> Call[WhoAmI]:
    return Call("GET", "/v1/whoami", model(WhoAmI))


def jobs(status: str | None, limit: int, name: str | None = None) -> Call[list[JobOut]]:
    params: dict[str, Any] = {"limit": limit}
    if status:
        params["status"] = status
    if name:
        params["name"] = name
    return Call("GET", "/v1/jobs", model(list[JobOut]), params=params)


def job(ref: str) -> Call[JobDetail]:
    return Call("GET", f"/v1/jobs/{_q(ref)}", model(JobDetail))


def cancel(ref: str) -> Call[JobOut]:
    return Call("POST", f"/v1/jobs/{_q(ref)}/cancel", model(JobOut))


def stop(ref: str, grace: float) -> Call[JobOut]:
    return Call("POST", f"/v1/jobs/{_q(ref)}/stop", model(JobOut), body=StopRequest(grace=grace))


def pause(ref: str) -> Call[JobOut]:
    return Call("POST", f"/v1/jobs/{_q(ref)}/pause", model(JobOut))


def resume(ref: str) -> Call[JobOut]:
    return Call("POST", f"/v1/jobs/{_q(ref)}/resume", model(JobOut))


def requeue(ref: str) -> Call[JobOut]:
    return Call("POST", f"/v1/jobs/{_q(ref)}/requeue", model(JobOut))


def why(ref: str) -> Call[WhyOut]:
    return Call("GET", f"/v1/jobs/{_q(ref)}/why", model(WhyOut))


def logs(ref: str, after: int, limit: int) -> Call[LogsOut]:
    params = {"after": after, "limit": limit}
    return Call("GET", f"/v1/jobs/{_q(ref)}/logs", model(LogsOut), params=params)


def events(ref: str, after: int, limit: int) -> Call[EventsOut]:
    params = {"after": after, "limit": limit, "format": "json"}
    return Call("GET", f"/v1/jobs/{_q(ref)}/events", model(EventsOut), params=params)


def apply(plan: ManifestApply) -> Call[ApplyResult]:
    return Call("POST", "/v1/manifests", model(ApplyResult), body=plan)


def workers(pool: str | None = None) -> Call[list[WorkerOut]]:
    params: dict[str, Any] = {"pool": pool} if pool else {}
    return Call("GET", "/v1/workers", model(list[WorkerOut]), params=params)


def usage(window_hours: float, pool: str | None = None) -> Call[UsageOut]:
    params: dict[str, Any] = {"window_hours": window_hours}
    if pool:
        params["pool"] = pool
    return Call("GET", "/v1/usage", model(UsageOut), params=params)


def hosts() -> Call[list[HostOut]]:
    return Call("GET", "/v1/hosts", model(list[HostOut]))


def select(spec: JobSpecModel) -> Call[list[Candidate]]:
    return Call("POST", "/v1/workers/select", model(list[Candidate]), body=SelectRequest(spec=spec))


def drain(ref: str, deadline: float | None = None) -> Call[WorkerOut]:
    params = {} if deadline is None else {"deadline": deadline}
    return Call("POST", f"/v1/workers/{_q(ref)}/drain", model(WorkerOut), params=params)


def remove_worker(ref: str) -> Call[WorkerOut]:
    return Call("DELETE", f"/v1/workers/{_q(ref)}", model(WorkerOut))


def leave(worker_id: str, body: LeaveRequest) -> Call[None]:
    return Call("POST", f"/v1/workers/{_q(worker_id)}/leave", nothing, body=body)


def status() -> Call[StatusOut]:
    return Call("GET", "/v1/status", model(StatusOut))


def create_token(body: TokenCreate) -> Call[TokenCreated]:
    return Call("POST", "/v1/tokens", model(TokenCreated), body=body)


def tokens() -> Call[list[TokenOut]]:
    return Call("GET", "/v1/tokens", model(list[TokenOut]))


def revoke_token(token_id: str) -> Call[TokenOut]:
    return Call("DELETE", f"/v1/tokens/{_q(token_id)}", model(TokenOut))


def rotate_token(token_id: str) -> Call[TokenCreated]:
    return Call("POST", f"/v1/tokens/{_q(token_id)}/rotate", model(TokenCreated))


def create_webhook(body: WebhookCreate) -> Call[WebhookCreated]:
    return Call("POST", "/v1/webhooks", model(WebhookCreated), body=body)


def webhooks() -> Call[list[WebhookOut]]:
    return Call("GET", "/v1/webhooks", model(list[WebhookOut]))


def remove_webhook(hook_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/webhooks/{_q(hook_id)}", nothing)


def audit(since: datetime | None, limit: int, after: int = 0) -> Call[list[AuditOut]]:
    params: dict[str, Any] = {"limit": limit, "after": after}
    if since is not None:
        params["since"] = since.isoformat()
    return Call("GET", "/v1/audit", model(list[AuditOut]), params=params)


def register(body: WorkerRegister) -> Call[WorkerOut]:
    return Call("POST", "/v1/workers", model(WorkerOut), body=body)


def claim(worker_id: str, body: ClaimRequest) -> Call[Lease | None]:
    # The server holds the poll up to body.wait seconds; give the answer time to arrive.
    return Call(
        "POST",
        f"/v1/workers/{_q(worker_id)}/claim",
        model(Lease),
        body=body,
        timeout=body.wait + 15.0,
    )


def heartbeat(worker_id: str, body: HeartbeatRequest) -> Call[HeartbeatResponse]:
    return Call(
        "POST", f"/v1/workers/{_q(worker_id)}/heartbeat", model(HeartbeatResponse), body=body
    )


def env_lock(key: str, pool: str | None = None) -> Call[EnvLockOut]:
    params: dict[str, Any] = {"pool": pool} if pool else {}
    return Call("GET", f"/v1/environments/locks/{_q(key)}", model(EnvLockOut), params=params)


def put_env_lock(key: str, body: EnvLockPut) -> Call[EnvLockOut]:
    return Call("PUT", f"/v1/environments/locks/{_q(key)}", model(EnvLockOut), body=body)


def start(job_id: str, body: StartRequest) -> Call[None]:
    return Call("POST", f"/v1/jobs/{_q(job_id)}/start", nothing, body=body)


def _stop_grace(resp: Reply) -> float | None:
    """The ``Gpufleet-Stop`` answer to a log batch: the job was asked to stop."""
    raw = resp.headers.get("gpufleet-stop")
    try:
        return None if raw is None else float(raw)
    except ValueError:
        return None


def output(job_id: str, body: LogAppend) -> Call[float | None]:
    """Append output lines; the stop grace (seconds) when the job was asked to stop."""
    return Call("POST", f"/v1/jobs/{_q(job_id)}/output", _stop_grace, body=body)


def finish(job_id: str, body: FinishRequest) -> Call[JobOut]:
    return Call("POST", f"/v1/jobs/{_q(job_id)}/finish", model(JobOut), body=body)


def reports(body: ReportBatch) -> Call[ReportResults]:
    """Start and finish reports in one call; each has its own result."""
    return Call("POST", "/v1/reports", model(ReportResults), body=body)


def release(job_id: str, body: ReleaseRequest) -> Call[JobOut]:
    return Call("POST", f"/v1/jobs/{_q(job_id)}/release", model(JobOut), body=body)


def blobs(limit: int = 1000) -> Call[list[BlobOut]]:
    return Call("GET", "/v1/blobs", model(list[BlobOut]), params={"limit": limit})


def artifact(ref: str) -> Call[ArtifactOut]:
    return Call("GET", f"/v1/jobs/{_q(ref)}/artifact", model(ArtifactOut))


def checkpoints(ref: str) -> Call[list[CheckpointOut]]:
    return Call("GET", f"/v1/jobs/{_q(ref)}/checkpoints", model(list[CheckpointOut]))


def record_checkpoint(job_id: str, body: CheckpointIn) -> Call[CheckpointOut]:
    return Call("POST", f"/v1/jobs/{_q(job_id)}/checkpoints", model(CheckpointOut), body=body)


def attach_artifact(job_id: str, body: ArtifactAttach) -> Call[None]:
    return Call("POST", f"/v1/jobs/{_q(job_id)}/artifact", nothing, body=body)
