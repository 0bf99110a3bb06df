"""The Python SDK: :class:`Client` (sync, for scripts and the CLI) and
:class:`AsyncClient` (for the worker), over the same calls in :mod:`_ops`."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from gpufleet.client import _events as events
from gpufleet.client import _ops as ops
from gpufleet.client._api import Call, CallFailed, Reply, headers, raise_for, unreachable
from gpufleet.client._direct import Direct, proxied
from gpufleet.client._events import Event
from gpufleet.client._servers import Servers
from gpufleet.client._tls import CaPath
from gpufleet.client._tls import context as tls_context
from gpufleet.errors import ServerUnavailable
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
    StartRequest,
    StatusOut,
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

if TYPE_CHECKING:  # imported when a client first needs them: a CLI call does not
    import httpx

    from gpufleet.client._transfer import Progress, Sent, Transfers

T = TypeVar("T")


def _quiet(_: int) -> None:
    return None


DEFAULT_TIMEOUT = 30.0


def _sent(exc: httpx.TransportError) -> bool:
    """Whether the request may have left (httpx's connect errors say it did not)."""
    import httpx

    return not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def _verify(tls: ssl.SSLContext | None) -> ssl.SSLContext:
    # A plain-http server never uses it: a bare context costs nothing, httpx's default
    # would load the CA bundle.
    return tls or ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class Client:
    """A blocking client for the gpufleet API.

    An ``https://`` server's certificate is verified against the default trust store, or
    only against the CA certificates in the PEM file ``ca`` when given. ``server`` may
    name several servers of one database, ``URL1,URL2``: a call goes to the next when one
    cannot be reached (see :mod:`gpufleet.client._servers`).
    Errors raise :class:`gpufleet.errors.GpufleetError` subclasses."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        ca: CaPath | None = None,
    ) -> None:
        self.servers = Servers(server)
        self._token, self._timeout, self._ca = token, timeout, ca
        self._to: dict[str, tuple[httpx.Client, Transfers]] = {}
        self._direct: dict[str, Direct | None] = {}
        self._tls: dict[str, ssl.SSLContext | None] = {}
        self._making = threading.RLock()  # threads making their first calls at once
        self._closed = False

    @property
    def server(self) -> str:
        """The server in use."""
        return self.servers.current

    def _tls_for(self, url: str) -> ssl.SSLContext | None:
        # One TLS context for every HTTP path to a server (httpx, and http.client).
        with self._making:
            if url not in self._tls:
                self._tls[url] = tls_context(url, self._ca)
            return self._tls[url]

    def _direct_to(self, url: str) -> Direct | None:
        """Calls and downloads over http.client, unless a proxy stands in the way."""
        with self._making:
            if self._closed:
                raise RuntimeError("this gpufleet Client is closed")
            if url not in self._direct:
                self._direct[url] = (
                    None
                    if proxied(url)
                    else Direct(url, headers(self._token), self._timeout, self._tls_for(url))
                )
            return self._direct[url]

    def _at(self, url: str) -> tuple[httpx.Client, Transfers]:
        direct = self._direct_to(url)
        with self._making:
            if url not in self._to:
                import httpx

                from gpufleet.client._transfer import Transfers

                http = httpx.Client(
                    base_url=url,
                    headers=headers(self._token),
                    timeout=self._timeout,
                    verify=_verify(self._tls_for(url)),
                )
                self._to[url] = (http, Transfers(http, url, direct))
            return self._to[url]

    def _transfer(self, run: Callable[[Transfers], T]) -> T:
        """A blob transfer on the server in use; when it cannot be reached, the next
        call goes to the next server (a transfer resumes where it was, on any server)."""
        url = self.server
        try:
            return run(self._at(url)[1])
        except ServerUnavailable:
            self.servers.failed(url)
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._making:
            self._closed = True
            to, directs = list(self._to.values()), list(self._direct.values())
        for http, _ in to:
            http.close()
        for direct in directs:
            if direct is not None:
                direct.close()

    def _send(self, url: str, call: Call[Any]) -> Reply:
        direct = self._direct_to(url)
        if direct is not None:
            return direct.send(call)
        import httpx

        http = self._at(url)[0]
        try:
            return http.send(call.request(http))
        except httpx.TransportError as exc:
            raise CallFailed(exc, sent=_sent(exc)) from exc

    def call(self, call: Call[T]) -> T:
        for tried in self.servers.tries():
            url = self.server
            try:
                resp = self._send(url, call)
                break
            except CallFailed as failed:
                if not self.servers.pass_on(url, failed.sent, tried):
                    raise unreachable(url, failed.cause) from failed.cause
        raise_for(resp)
        return call.parse(resp)

    def health(self) -> dict[str, Any]:
        return self.call(ops.health())

    def submit(self, spec: JobSpecModel, queue: bool = False) -> SubmitResult:
        """Queue a job. A job aimed at a worker that cannot take it now is refused (409)
        unless ``queue``."""
        return self.call(ops.submit(spec, queue))

    def whoami(self) -> WhoAmI:
        return self.call(ops.whoami())

    def jobs(
        self, status: str | None = None, limit: int = 1000, name: str | None = None
    ) -> list[JobOut]:
        """The newest ``limit`` jobs, oldest first; with ``name``, those whose name holds
        it (any case)."""
        return self.call(ops.jobs(status, limit, name))

    def job(self, ref: str) -> JobDetail:
        return self.call(ops.job(ref))

    def cancel(self, ref: str) -> JobOut:
        return self.call(ops.cancel(ref))

    def requeue(self, ref: str) -> JobOut:
        return self.call(ops.requeue(ref))

    def pause(self, ref: str) -> JobOut:
        """Hold a job until resumed (a running one once its worker has vacated it)."""
        return self.call(ops.pause(ref))

    def resume(self, ref: str) -> JobOut:
        """Queue a paused job again, to go on from its checkpoint."""
        return self.call(ops.resume(ref))

    def stop(self, ref: str, grace: float = 60.0) -> JobOut:
        """Ask a running job to finish early and keep its outputs: SIGINT, then after
        ``grace`` seconds SIGTERM and SIGKILL."""
        return self.call(ops.stop(ref, grace))

    def why(self, ref: str) -> WhyOut:
        return self.call(ops.why(ref))

    def logs(self, ref: str, after: int = 0, limit: int = 10_000) -> LogsOut:
        return self.call(ops.logs(ref, after, limit))

    def events(self, ref: str, after: int = 0, limit: int = 1000) -> EventsOut:
        """One page of a job's event log (status changes, progress records, output
        lines) after ``after``; ``next`` is where the next page begins."""
        return self.call(ops.events(ref, after, limit))

    def follow(self, ref: str, after: int = 0) -> Iterator[Event]:
        """A job's events after ``after`` as they come (Server-Sent Events), resumed
        after a break with nothing missed or repeated, until the job has ended (the last
        event is ``end``). Pass a job id, not a name."""

        def at() -> tuple[str, httpx.Client]:
            return self.server, self._at(self.server)[0]

        return events.follow(at, self.servers.failed, ops._q(ref), after)

    def apply(self, plan: ManifestApply) -> ApplyResult:
        return self.call(ops.apply(plan))

    def workers(self, pool: str | None = None) -> list[WorkerOut]:
        return self.call(ops.workers(pool))

    def usage(self, window_hours: float = 168.0, pool: str | None = None) -> UsageOut:
        """GPU-hours per user and pool over the window, with shares and standing."""
        return self.call(ops.usage(window_hours, pool))

    def hosts(self) -> list[HostOut]:
        """The manifests' ``[hosts.NAME]`` declarations, with where each came from."""
        return self.call(ops.hosts())

    def select(self, spec: JobSpecModel) -> list[Candidate]:
        """The workers that could take ``spec`` now (most free GPU memory first), then
        the others with their reason."""
        return self.call(ops.select(spec))

    def drain(self, ref: str, deadline: float | None = None) -> WorkerOut:
        """Drain a worker; with ``deadline`` (seconds), its running jobs are vacated then
        (grace signal, last checkpoint, back to the queue)."""
        return self.call(ops.drain(ref, deadline))

    def remove_worker(self, ref: str) -> WorkerOut:
        """Forget an offline worker (409 for one that is not offline)."""
        return self.call(ops.remove_worker(ref))

    def status(self) -> StatusOut:
        return self.call(ops.status())

    def create_token(self, body: TokenCreate) -> TokenCreated:
        return self.call(ops.create_token(body))

    def tokens(self) -> list[TokenOut]:
        return self.call(ops.tokens())

    def revoke_token(self, token_id: str) -> TokenOut:
        return self.call(ops.revoke_token(token_id))

    def rotate_token(self, token_id: str) -> TokenCreated:
        return self.call(ops.rotate_token(token_id))

    def create_webhook(self, body: WebhookCreate) -> WebhookCreated:
        """Set a webhook; the answer holds the secret only when the server made it."""
        return self.call(ops.create_webhook(body))

    def webhooks(self) -> list[WebhookOut]:
        return self.call(ops.webhooks())

    def remove_webhook(self, hook_id: str) -> None:
        self.call(ops.remove_webhook(hook_id))

    def audit(
        self, since: datetime | None = None, limit: int = 1000, after: int = 0
    ) -> list[AuditOut]:
        """Audit records since ``since``, oldest first, ``limit`` at a time; page on with
        ``after`` = the last record's ``seq``."""
        return self.call(ops.audit(since, limit, after))

    # ---- blobs and artifacts -----------------------------------------------------------

    def has_blob(self, sha256: str) -> int | None:
        """The blob's size if the server has it, else None."""
        return self._transfer(lambda t: t.has(sha256))

    def put_blob(
        self, path: Path, sha256: str | None = None, progress: Progress | None = None
    ) -> Sent:
        """Upload a file as a blob unless the server has it (then no body is sent).
        Large files go through a resumable session."""
        return self._transfer(lambda t: t.put(path, sha256, progress or _quiet))

    def get_blob(self, sha256: str, dest: Path, progress: Progress | None = None) -> int:
        """Download a blob to ``dest``, verified; resumes a ``dest.partial``."""
        return self._transfer(lambda t: t.get(sha256, dest, progress or _quiet))

    def blobs(self, limit: int = 1000) -> list[BlobOut]:
        return self.call(ops.blobs(limit))

    def artifact(self, ref: str) -> ArtifactOut:
        return self.call(ops.artifact(ref))

    def attach_artifact(self, job_id: str, body: ArtifactAttach) -> None:
        self.call(ops.attach_artifact(job_id, body))

    def checkpoints(self, ref: str) -> list[CheckpointOut]:
        """The job's checkpoint snapshots kept on the server, newest first."""
        return self.call(ops.checkpoints(ref))

    # The worker protocol, for tests and tools that act as a worker.
    def register(self, body: WorkerRegister) -> WorkerOut:
        return self.call(ops.register(body))

    def claim(self, worker_id: str, body: ClaimRequest) -> Lease | None:
        return self.call(ops.claim(worker_id, body))

    def heartbeat(self, worker_id: str, body: HeartbeatRequest) -> HeartbeatResponse:
        return self.call(ops.heartbeat(worker_id, body))

    def start(self, job_id: str, body: StartRequest) -> None:
        self.call(ops.start(job_id, body))

    def output(self, job_id: str, body: LogAppend) -> float | None:
        return self.call(ops.output(job_id, body))

    def finish(self, job_id: str, body: FinishRequest) -> JobOut:
        return self.call(ops.finish(job_id, body))

    def release(self, job_id: str, body: ReleaseRequest) -> JobOut:
        return self.call(ops.release(job_id, body))


class AsyncClient:
    """The same API for asyncio code (the worker agent); ``ca`` as for :class:`Client`."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        ca: CaPath | None = None,
    ) -> None:
        self.servers = Servers(server)
        self._token, self._timeout, self._ca = token, timeout, ca
        self._to: dict[str, httpx.AsyncClient] = {}

    @property
    def server(self) -> str:
        """The server in use."""
        return self.servers.current

    def _at(self, url: str) -> httpx.AsyncClient:
        if url not in self._to:
            import httpx

            self._to[url] = httpx.AsyncClient(
                base_url=url,
                headers=headers(self._token),
                timeout=self._timeout,
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
                verify=_verify(tls_context(url, self._ca)),
            )
        return self._to[url]

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for http in self._to.values():
            await http.aclose()

    async def call(self, call: Call[T]) -> T:
        """As :meth:`Client.call`: a server that cannot be reached passes the call on."""
        import httpx

        for tried in self.servers.tries():
            url = self.server
            http = self._at(url)
            try:
                resp = await http.send(call.request(http))
                break
            except httpx.TransportError as exc:
                if not self.servers.pass_on(url, _sent(exc), tried):
                    raise unreachable(url, exc) from exc
        raise_for(resp)
        return call.parse(resp)

    async def register(self, body: WorkerRegister) -> WorkerOut:
        return await self.call(ops.register(body))

    async def claim(self, worker_id: str, body: ClaimRequest) -> Lease | None:
        return await self.call(ops.claim(worker_id, body))

    async def heartbeat(self, worker_id: str, body: HeartbeatRequest) -> HeartbeatResponse:
        return await self.call(ops.heartbeat(worker_id, body))

    async def leave(self, worker_id: str, body: LeaveRequest) -> None:
        await self.call(ops.leave(worker_id, body))

    async def env_lock(self, key: str, pool: str | None = None) -> EnvLockOut:
        """A pool's lock of an unlocked environment spec (NotFound: none yet); ``pool``
        None: the token's only pool."""
        return await self.call(ops.env_lock(key, pool))

    async def put_env_lock(self, key: str, body: EnvLockPut) -> EnvLockOut:
        """Record a build's resolution as the lock of the job's pool; the lock that
        stands."""
        return await self.call(ops.put_env_lock(key, body))

    async def start(self, job_id: str, body: StartRequest) -> None:
        await self.call(ops.start(job_id, body))

    async def output(self, job_id: str, body: LogAppend) -> float | None:
        """Append output lines; the stop grace (seconds) when the job was asked to stop."""
        return await self.call(ops.output(job_id, body))

    async def finish(self, job_id: str, body: FinishRequest) -> JobOut:
        return await self.call(ops.finish(job_id, body))

    async def reports(self, body: ReportBatch) -> ReportResults:
        """Start and finish reports in one call, each with its own result."""
        return await self.call(ops.reports(body))

    async def release(self, job_id: str, body: ReleaseRequest) -> JobOut:
        return await self.call(ops.release(job_id, body))

    async def attach_artifact(self, job_id: str, body: ArtifactAttach) -> None:
        await self.call(ops.attach_artifact(job_id, body))

    async def record_checkpoint(self, job_id: str, body: CheckpointIn) -> CheckpointOut:
        return await self.call(ops.record_checkpoint(job_id, body))

    async def submit(self, spec: JobSpecModel, queue: bool = False) -> SubmitResult:
        return await self.call(ops.submit(spec, queue))

    async def whoami(self) -> WhoAmI:
        return await self.call(ops.whoami())

    async def job(self, ref: str) -> JobDetail:
        return await self.call(ops.job(ref))
