"""Running one job on a worker: stage its inputs, start its process, stream its output,
stop or kill it when asked, collect its outputs and report how it ended.

A mixin of :class:`gpufleet.worker.agent.Agent`, which holds the client, the stager, the
slots and the jobs it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from gpufleet.client import AsyncClient, Client
from gpufleet.domain import progress
from gpufleet.domain.environments import EnvSpec
from gpufleet.domain.models import DEFAULT_OUTPUTS, HyperStyle
from gpufleet.domain.models import Adapter as AdapterKind
from gpufleet.errors import Conflict, GpufleetError, ServerUnavailable
from gpufleet.terminal import visible
from gpufleet.tokens import redact
from gpufleet.wire import (
    BAR_END,
    STDERR_TAIL_CHARS,
    STDERR_TAIL_LINES,
    ArtifactAttach,
    FinishRequest,
    Lease,
    LogAppend,
    LogLine,
    ReleaseRequest,
    StartRequest,
)
from gpufleet.worker import sleap
from gpufleet.worker.adapters import Adapter, AdapterError, Emit
from gpufleet.worker.backlog import Backlog
from gpufleet.worker.capability import job_path
from gpufleet.worker.downloads import Download
from gpufleet.worker.envphase import ENV_MARK, EnvFailed, EnvPhase, Prepared
from gpufleet.worker.isolation import (
    SlotUser,
    SlotUsers,
    give_tree,
    is_secret_env,
    job_user_env,
    make_private_file,
)
from gpufleet.worker.options import WorkerOptions
from gpufleet.worker.progress import Progress, ProgressFile
from gpufleet.worker.reports import Reports
from gpufleet.worker.runner import JobProcess, build_argv, describe_exit, job_env, oom_kills
from gpufleet.worker.slots import Slots
from gpufleet.worker.staging import InputError, Stager, human, pack_outputs
from gpufleet.worker.workdirs import job_dir_name

T = TypeVar("T")
FLUSH_SECONDS = 1.0
MAX_BATCH = 5000
# Characters of output in one log request: JSON-escaped, well under the server's body limit.
MAX_BATCH_CHARS = 2_000_000
PROGRESS_DIR = ".progress"
#: Where a job with an environment installs packages at run time: in its own folder.
JOB_SITE = "GPUFLEET_JOB_SITE"
JOB_SITE_DIR = ".site-packages"


class Stopped(GpufleetError):
    """The worker was told to stop while it waited for the server, with nothing to hand
    back or report: it stops instead of retrying."""


def say(msg: str) -> None:
    """A line of the worker's log (never a token: anything token-shaped is cut). It
    names jobs that others submitted: their control characters are shown as escapes."""
    print(f"{time.strftime('%H:%M:%S')} {visible(redact(msg))}", flush=True)


def adapter_for(kind: str | None, argv: list[str], workdir: Path, emit: Emit) -> Adapter:
    """The adapter a job's spec names (a plain one for None)."""
    if kind is None:
        return Adapter()
    if kind == AdapterKind.SLEAP_TRAIN:
        return sleap.TrainAdapter(emit, sleap.epochs_of(argv, workdir))
    if kind == AdapterKind.SLEAP_TRACK:
        return sleap.TrackAdapter(emit)
    raise AdapterError(f"this worker does not know the job adapter {kind!r}; upgrade it")


@dataclass
class Running:
    lease: Lease
    backlog: Backlog  # output not yet sent: bounded in memory, then on disk
    proc: JobProcess | None = None
    # set when we end it: "cancel", "lost", "drain", "timeout"; "stop": asked to finish early
    stop_reason: str | None = None
    killing: bool = False
    stop_grace: float = 60.0  # a stop: seconds after SIGINT before SIGTERM
    # The job's last stderr lines: what a failed job says about why (shown by `show`).
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    # When the server last renewed the lease, on this worker's monotonic clock: the claim's
    # answer, then the send time of each heartbeat answered with the lease held (the
    # server's renewal came after it, so the lease lives at least a lease from here).
    renewed: float = field(default_factory=time.monotonic)
    progress_file: ProgressFile | None = None  # GPUFLEET_PROGRESS_FILE, once it is named
    user: SlotUser | None = None  # the slot user it runs as (--run-as)
    adapter: Adapter = field(default_factory=Adapter)  # the job type's own channel and stop
    env: Prepared | None = None  # the Python environment it runs in, held while it runs
    building: asyncio.Task[Prepared] | None = None  # getting it: cancelled by a kill
    # why it failed, when the worker knows a class ("environment"), and whether that
    # failure would happen the same way on every worker (then it is not retried)
    failure: str | None = None
    final: bool = False

    def __post_init__(self) -> None:
        self.progress = Progress(
            lambda record: self.backlog.add("progress", record),
            lambda message: self.backlog.add("stderr", f"[gpufleet] {message}"),
        )

    def read_progress(self, final: bool = False) -> None:
        """Take what the job appended to its progress file since the last read."""
        if self.progress_file is not None:
            for line in self.progress_file.read(final):
                self.progress.line(line, "GPUFLEET_PROGRESS_FILE")

    def record(self, record: dict[str, Any]) -> None:
        """A progress record from the job's adapter."""
        self.backlog.add("progress", progress.encode(record))

    def _adapted(self, stream: str, line: str) -> bool:
        """Whether the adapter took the line as progress. The line's reader must never
        stop (the job would block on a full pipe), whatever the line holds."""
        try:
            return self.adapter.line(stream, line)
        except Exception as exc:  # an adapter's bug: the line stays output
            say(f"job {self.lease.job_id}: adapter could not read a line: {exc!r}")
            return False

    def on_line(self, stream: str, line: str) -> None:
        if self._adapted(stream, line):
            return
        if line.startswith(progress.MARK):
            self.read_progress()  # what the file has came first: records stay in order
        if self.progress.marked(line):
            return
        self.backlog.add(stream, line)
        if stream == "stderr":
            self.tail.append(line[:STDERR_TAIL_CHARS])

    def on_bar(self, stream: str, state: str) -> None:
        """The latest state of a line the job redraws in place (a progress bar), not yet
        finished: stored with a carriage return at its end (a finished line never has
        one), in place of the state before it when that one is not sent yet. A state the
        job's adapter takes as progress is a record, as a finished line would be; an
        unfinished progress mark waits for its end."""
        if self._adapted(stream, state) or state.startswith(progress.MARK):
            return
        self.backlog.update(stream, state + BAR_END)

    def env_line(self, line: str) -> None:
        """A line of the environment's build (uv's, or the worker's about it), marked."""
        self.backlog.add("stderr", ENV_MARK + line)
        self.tail.append((ENV_MARK + line)[:STDERR_TAIL_CHARS])

    def downloading(self, record: dict[str, Any], line: str | None, finished: bool) -> None:
        """How far the download of the job's inputs is: a progress record, and a line of
        the worker's own in its output (a bar's state until ``finished``)."""
        self.record(record)
        if line is not None:
            said = f"[gpufleet] {line}"
            if finished:
                self.backlog.add("stderr", said)
            else:
                self.on_bar("stderr", said)


class JobSteps(ABC):
    """How the agent runs each job it accepted."""

    opts: WorkerOptions
    client: AsyncClient
    data: Client
    stager: Stager
    slots: Slots
    running: dict[tuple[str, int], Running]
    reports: Reports  # start and finish reports, batched while one is on its way
    users: SlotUsers | None  # --run-as: the users jobs run as
    envs: EnvPhase  # jobs' Python environments

    @abstractmethod
    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background."""

    @abstractmethod
    async def retrying(
        self, what: str, call: Callable[[], Awaitable[T]], give_up: float | None = None
    ) -> T:
        """``call``, retried while the server is away."""

    def progress_path(self, lease: Lease) -> Path:
        """The job's progress file: beside its folder, so its outputs never include it."""
        return (
            self.opts.work_dir / PROGRESS_DIR / f"{job_dir_name(lease.job_id, lease.attempt)}.jsonl"
        )

    def workdir(self, lease: Lease) -> Path:
        return self.opts.work_dir / job_dir_name(lease.job_id, lease.attempt)

    def make_workdir(self, run: Running) -> Path:
        """The job's folder, made: its slot user's alone (mode 0700) under ``--run-as``."""
        path = self.workdir(run.lease)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if run.user is not None:
            os.chown(path, run.user.uid, run.user.gid)
        return path

    async def run_job(self, run: Running) -> None:
        lease = run.lease
        try:
            exit_code, error = await self.execute(run)
            await self.report(run, exit_code, error)
        except ServerUnavailable:
            say(f"job {lease.job_id}: result not recorded; its lease will expire and it re-runs")
        except Exception as exc:  # never lose a slot to a bug: stop the job, report, free it
            say(f"job {lease.job_id}: worker error {type(exc).__name__}: {exc}")
            if run.proc is not None:  # stopped and reaped: the guard forgets its group
                if run.proc.proc.returncode is None:
                    await run.proc.stop(grace=1.0)
                await run.proc.reap(self.workdir(lease))
            with contextlib.suppress(GpufleetError):
                await self.client.finish(
                    lease.job_id,
                    FinishRequest(
                        attempt=lease.attempt, secret=lease.secret, error=f"worker error: {exc}"
                    ),
                )
        finally:
            self.running.pop((lease.job_id, lease.attempt), None)
            self.slots.give(lease.gpus)
            if run.user is not None and self.users is not None:
                self.users.give(run.user)
            try:
                await run.adapter.close()  # sockets let go even when the job went wrong
            except Exception as exc:
                say(f"job {lease.job_id}: adapter did not close cleanly: {exc!r}")
            run.backlog.clear()
            await self._let_env_go(run)
            self.progress_path(lease).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # its age, for --work-dir-retention
                os.utime(self.workdir(lease))

    async def _launch(self, run: Running, workdir: Path) -> str | None:
        """Stage the job's inputs and start its process; why it could not, or None."""
        lease, spec = run.lease, run.lease.spec
        argv = build_argv(spec.command, spec.hyper, spec.shell, HyperStyle(spec.hyper_style))
        progress_path = self.progress_path(lease)
        progress_path.parent.mkdir(parents=True, exist_ok=True)
        progress_path.unlink(missing_ok=True)  # a worker restarted before: begin again
        if run.user is not None:  # the job writes it, and its user may make none there
            make_private_file(progress_path, run.user)
        run.progress_file = ProgressFile(progress_path)
        extra = {
            "GPUFLEET_JOB_ID": lease.job_id,
            "GPUFLEET_ATTEMPT": str(lease.attempt),
            "GPUFLEET_JOB_NAME": spec.name,
            progress.ENV: str(progress_path),
        }
        # The worker's own secrets never reach job code (or its logs).
        # Nor uv's settings (an index's password, its cache): they are the worker's.
        base = {
            k: v for k, v in os.environ.items() if not is_secret_env(k) and not k.startswith("UV_")
        }
        if run.user is not None:  # its user's HOME and names (the job's env may set them)
            base = job_user_env(base, run.user, workdir)
        env = job_env(base, spec.env, lease.gpus, extra)
        try:
            await self.stager.stage(
                lease.inputs, workdir, partial(self.note, run), Download(run.downloading)
            )
            if run.user is not None:  # staged by the worker: the job's to read and change
                await asyncio.to_thread(give_tree, workdir, run.user)
        except InputError as exc:
            say(f"job {lease.job_id}: {exc.message}")
            return exc.message
        if run.stop_reason is not None:  # cancelled while its inputs were fetched
            return f"stopped ({run.stop_reason}) before starting"
        if spec.environment is not None:
            failed = await self._environment(run, spec.environment.to_domain(), env, workdir)
            if failed is not None:
                return failed
        try:
            run.adapter = adapter_for(spec.adapter, argv, workdir, run.record)
            await run.adapter.open()
            argv = run.adapter.argv(argv)
        except AdapterError as exc:
            say(f"job {lease.job_id}: {exc.message}")
            return exc.message
        try:
            run.proc = await JobProcess.start(
                argv, workdir, env, run.on_line, run.user, on_bar=run.on_bar
            )
        except OSError as exc:
            return f"could not start {argv[0]!r}: {exc.strerror or exc}"
        started = datetime.now(UTC)  # the job's start, by this worker's clock
        if run.stop_reason == "stop":  # asked to stop while it was being started
            self._interrupt(run)
        where = f"GPUs {lease.gpus}" if lease.gpus else "a CPU slot"
        if run.user is not None:
            where += f" as {run.user.name}"
        say(
            f"job {lease.job_id} ({spec.name}) attempt {lease.attempt} started on {where}, "
            f"pid {run.proc.pid}"
        )
        try:
            await self.reports.start(
                lease.job_id,
                StartRequest(
                    attempt=lease.attempt,
                    secret=lease.secret,
                    pid=run.proc.pid if run.proc else None,
                    started_at=started,
                    environment=run.env.used if run.env else None,
                ),
            )
        except Conflict:
            await self.stop_job(run, "lost")
        return None

    async def _environment(
        self, run: Running, spec: EnvSpec, env: dict[str, str], workdir: Path
    ) -> str | None:
        """Get the job's Python environment (built or cached) and point ``env`` at it;
        why it could not, or None. The build's time is its own: the job's timeout starts
        with its process. What the job installs at run time goes to its own folder,
        ``GPUFLEET_JOB_SITE`` (first on its ``sys.path`` once it exists), never into the
        environment, which later jobs share."""
        lease = run.lease
        run.building = asyncio.create_task(
            self.envs.prepare(
                lease.job_id,
                lease.attempt,
                lease.secret,
                spec,
                run.env_line,
                run.record,
                writer=run.user is None,
            )
        )
        try:
            run.env = await run.building
        except asyncio.CancelledError:
            if run.stop_reason is None:  # not ours: the worker itself is being cancelled
                raise
            return f"stopped ({run.stop_reason}) while its environment was built"
        except EnvFailed as exc:
            run.failure, run.final = "environment", exc.final  # uv's lines: in the tail
            say(f"job {lease.job_id}: {exc.message}")
            return exc.message
        env.pop("PYTHONHOME", None)
        # not the worker's own Python first on PATH: its pip would install into gpufleet's
        ours = job_path("")
        path = env.get("PATH", os.defpath)
        env.update(run.env.variables(path[len(ours) :] if path.startswith(ours) else path))
        site = workdir / JOB_SITE_DIR  # made now: the environment's .pth adds it at start
        site.mkdir(exist_ok=True)
        if run.user is not None:
            os.chown(site, run.user.uid, run.user.gid)
        env.setdefault(JOB_SITE, str(site))
        if run.stop_reason is not None:  # cancelled while it was built
            return f"stopped ({run.stop_reason}) before starting"
        return None

    async def _let_env_go(self, run: Running) -> None:
        """The job's process ended: its environment is let go (once); one it could have
        changed is checked after (in the background), and removed if it changed."""
        prepared, run.env = run.env, None
        if prepared is None:
            return
        self.envs.done(prepared)
        if run.user is None:
            job_id = run.lease.job_id
            self.spawn(asyncio.to_thread(self.envs.check, prepared, job_id, say))

    async def execute(self, run: Running) -> tuple[int | None, str | None]:
        """Run the job to its end: its exit code (None if it never ran) and why it failed."""
        spec = run.lease.spec
        workdir = self.make_workdir(run)
        # sent from the start: the download of its inputs is seen as it goes
        flusher = asyncio.create_task(self.flush_loop(run))
        try:
            refused = await self._launch(run, workdir)
            if refused is not None:
                return None, refused
            code, oom = await self._wait(run)
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
        run.read_progress(final=True)
        if (bad := run.progress.summary()) is not None:
            self.note(run, bad)
        error = f"timed out after {spec.timeout:g}s" if run.stop_reason == "timeout" else None
        error = error or describe_exit(code, oom=oom)
        if run.stop_reason in (None, "timeout", "stop"):  # a stopped job keeps its outputs
            failed = await self.collect(run, workdir)
            if failed:
                error = f"{error}; {failed}" if error else failed
        return code, error

    async def _wait(self, run: Running) -> tuple[int, bool]:
        """Wait for the job's process to end (killed at its timeout), and read what it
        left: its exit code, and whether the kernel's OOM killer ran meanwhile."""
        lease, spec = run.lease, run.lease.spec
        assert run.proc is not None
        kills = oom_kills()
        code = await run.proc.wait(spec.timeout)
        if code is None:
            say(f"job {lease.job_id}: timed out after {spec.timeout:g}s; killing its process group")
            run.stop_reason = run.stop_reason or "timeout"
            code = await run.proc.stop()
        await run.proc.reap(self.workdir(lease))
        await run.adapter.close()
        ours = run.stop_reason is not None  # we signalled it: not the kernel
        return code, not ours and oom_kills() > kills

    def note(self, run: Running, message: str) -> None:
        """A line from the worker itself in the job's output."""
        run.backlog.add("stderr", f"[gpufleet] {message}")

    async def collect(self, run: Running, workdir: Path) -> str | None:
        """Archive the job's outputs, upload them and attach them to the attempt. Returns
        why that failed, or None (also when no output matched: nothing to keep)."""
        lease = run.lease
        if not lease.spec.outputs:  # the job keeps nothing: no archive, and nothing to say
            return None
        # named with this process's id, so a later worker knows a dead one's leftovers
        out = self.opts.work_dir / f".artifact.{os.getpid()}.{lease.job_id}-{lease.attempt}.tar.zst"
        try:
            packed = await asyncio.to_thread(pack_outputs, workdir, lease.spec.outputs, out)
            for skipped in packed.skipped:
                self.note(run, f"output skipped: {skipped}")
            if not packed.entries:
                if tuple(lease.spec.outputs) != DEFAULT_OUTPUTS:  # asked for, not found: say so
                    self.note(run, f"outputs {', '.join(lease.spec.outputs)} matched no files")
                return None
            sent = await self.retrying(
                "artifact upload", partial(asyncio.to_thread, self.data.put_blob, out), give_up=600
            )
            body = ArtifactAttach(attempt=lease.attempt, secret=lease.secret, sha256=sent.sha256)
            await self.retrying(
                "artifact", partial(self.client.attach_artifact, lease.job_id, body), give_up=600
            )
            self.note(
                run,
                f"artifact: {packed.files} file(s), {human(packed.bytes)} "
                f"({human(sent.size)} packed, {sent.sha256[:12]})",
            )
            return None
        except GpufleetError as exc:
            self.note(run, f"artifact not kept: {exc.message}")
            return f"artifact not kept: {exc.message}"
        except OSError as exc:
            self.note(run, f"artifact not kept: {exc.strerror or exc}")
            return f"artifact not kept: {exc.strerror or exc}"
        finally:
            out.unlink(missing_ok=True)

    async def stop_job(self, run: Running, reason: str, grace: float = 3.0) -> None:
        """SIGTERM the job's process group, SIGKILL it ``grace`` seconds later; once per
        job. A job whose process already ended keeps its result."""
        if run.proc is not None and run.proc.proc.returncode is not None:
            return
        if run.stop_reason in (None, "stop"):  # a kill overrides a stop: nothing is kept
            run.stop_reason = reason
        if run.proc is None and run.building is not None and not run.building.done():
            run.building.cancel()  # uv's process group is killed, its folders cleared
        if run.killing or run.proc is None:
            return
        run.killing = True
        run.proc.signal_group(signal.SIGTERM)
        self.spawn(self._kill_later(run.proc, grace))

    async def _kill_later(self, proc: JobProcess, grace: float = 3.0) -> None:
        if await proc.wait(grace) is None:
            proc.signal_group(signal.SIGKILL)

    def stop_early(self, run: Running, grace: float) -> None:
        """``gpufleet stop``: ask the job to finish and keep what it made. Its adapter's
        own stop (sleap-nn's stop command) or else SIGINT to its process group now; each
        ``grace`` seconds it still runs, the next step: SIGINT (after an adapter's stop),
        SIGTERM, and SIGKILL 3 s later. Its outputs are collected and its result reported
        as usual. Once per job."""
        if run.stop_reason is not None:
            return
        run.stop_reason, run.stop_grace = "stop", grace
        say(f"job {run.lease.job_id}: asked to stop early (then {grace:g}s before each next step)")
        if run.proc is not None:  # else as soon as its process has started
            self._interrupt(run)

    def _interrupt(self, run: Running) -> None:
        assert run.proc is not None
        if run.adapter.stop():
            self.spawn(self._interrupt_later(run.proc, run.stop_grace))
            return
        run.proc.signal_group(signal.SIGINT)
        self.spawn(self._escalate(run.proc, run.stop_grace))

    async def _interrupt_later(self, proc: JobProcess, grace: float) -> None:
        if await proc.wait(grace) is None:
            proc.signal_group(signal.SIGINT)
            await self._escalate(proc, grace)

    async def _escalate(self, proc: JobProcess, grace: float) -> None:
        if await proc.wait(grace) is None:
            proc.signal_group(signal.SIGTERM)
            await self._kill_later(proc)

    async def flush(self, run: Running) -> None:
        """Send the job's unsent output, a batch at a time (each at most MAX_BATCH lines
        and, past the first, MAX_BATCH_CHARS characters); a batch is removed once the
        server has it."""
        while batch := run.backlog.peek(MAX_BATCH, MAX_BATCH_CHARS):
            lines = [LogLine(stream=stream, line=line) for stream, line in batch]
            # first: the lines sent before, so a batch sent again is stored once
            body = LogAppend(
                attempt=run.lease.attempt,
                secret=run.lease.secret,
                lines=lines,
                first=run.backlog.acked,
            )
            stop = await self.retrying(
                "log upload", partial(self.client.output, run.lease.job_id, body), give_up=60
            )
            run.backlog.sent()
            if stop is not None and run.proc is not None and run.proc.proc.returncode is None:
                self.stop_early(run, stop)

    async def flush_loop(self, run: Running) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            try:
                run.read_progress()
                await self.flush(run)
            except Conflict:
                say(f"job {run.lease.job_id}: lease is stale (409); killing it")
                await self.stop_job(run, "lost")
                return
            except GpufleetError as exc:
                say(f"job {run.lease.job_id}: log upload failed: {exc.message}")

    async def report(self, run: Running, exit_code: int | None, error: str | None) -> None:
        lease = run.lease
        if run.stop_reason in ("cancel", "lost"):
            say(f"job {lease.job_id}: stopped ({run.stop_reason}); not reporting a result")
            return
        try:
            try:
                await self.flush(run)
            except ServerUnavailable:  # the result matters more than the last lines
                say(f"job {lease.job_id}: dropped {run.backlog.clear()} unsent log lines")
            if run.stop_reason == "drain":
                await self.retrying(
                    "release",
                    lambda: self.client.release(
                        lease.job_id,
                        ReleaseRequest(
                            attempt=lease.attempt,
                            secret=lease.secret,
                            reason=f"worker {self.opts.name} drained",
                        ),
                    ),
                )
                say(f"job {lease.job_id}: handed back to the queue (attempt not counted)")
                return
            tail = list(run.tail) if (exit_code != 0 or error) else []
            body = FinishRequest(
                attempt=lease.attempt,
                secret=lease.secret,
                exit_code=exit_code,
                error=error,
                stderr_tail=tail,
                failure=run.failure,
                final=run.final,
            )
            out = await self.reports.finish(lease.job_id, body)
            say(
                f"job {lease.job_id} ({lease.spec.name}) finished: "
                f"{error or 'exit code 0'} -> {out.status}"
            )
        except Conflict as exc:
            say(f"job {lease.job_id}: result refused ({exc.message})")
