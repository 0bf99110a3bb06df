"""Running the jobs a worker accepted: stage each one's inputs, start its process,
stream its output, stop or kill it when asked, collect its outputs and report how it
ended.

The agent (:mod:`gpufleet.worker.agent`) claims jobs and hands each lease to a
:class:`JobRunner`, which it builds with what running them needs: its clients, its
settings, the stager and slots, and the agent's retry and background calls. A job's own
state is a :class:`~gpufleet.worker.running.Running`; ending its process is the
:class:`~gpufleet.worker.stopping.Stopper`'s; sending its output and outputs is
:class:`~gpufleet.worker.uploads.Uploads`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

from gpufleet.client import AsyncClient, Client
from gpufleet.domain import oom, progress
from gpufleet.domain.caps import timed_out_text
from gpufleet.domain.environments import EnvSpec
from gpufleet.domain.models import Adapter as AdapterKind
from gpufleet.domain.models import Capability, HyperStyle
from gpufleet.errors import Conflict, GpufleetError, ServerUnavailable
from gpufleet.wire import FinishRequest, Lease, LeaseOrder, ReleaseRequest, StartRequest
from gpufleet.worker import sleap
from gpufleet.worker.adapters import Adapter, AdapterError, Emit
from gpufleet.worker.backlog import Backlog
from gpufleet.worker.calls import Retrying, Spawn
from gpufleet.worker.capability import job_path
from gpufleet.worker.downloads import Download
from gpufleet.worker.envphase import EnvFailed, EnvPhase
from gpufleet.worker.isolation import (
    SlotUsers,
    check_run_as,
    give_tree,
    is_secret_env,
    job_user_env,
    make_private_file,
    set_up_run_as,
    slot_users,
)
from gpufleet.worker.keeping import Keeping
from gpufleet.worker.log import say
from gpufleet.worker.options import WorkerOptions
from gpufleet.worker.progress import ProgressFile
from gpufleet.worker.reports import Reports
from gpufleet.worker.runner import JobProcess, build_argv, describe_exit, job_env, oom_kills
from gpufleet.worker.running import Outcome, Running, StopReason
from gpufleet.worker.slots import Slots
from gpufleet.worker.staging import InputError, Stager
from gpufleet.worker.stopping import Stopper
from gpufleet.worker.uploads import Uploads
from gpufleet.worker.workdirs import job_dir_name

PROGRESS_DIR = ".progress"
SPILL = ".unsent-output"  # under the work dir: output held while the server is away
#: Where a job with an environment installs packages at run time: in its own folder.
# Jobs stopped to free their slot, handed back rather than reported as ended.
VACATED = (StopReason.DRAIN, StopReason.PAUSE, StopReason.OWNER, StopReason.PREEMPT)
JOB_SITE = "GPUFLEET_JOB_SITE"
JOB_SITE_DIR = ".site-packages"


def adapter_for(
    kind: str | None,
    argv: list[str],
    workdir: Path,
    emit: Emit,
    kept: Path | None = None,
    resumed: bool = False,
) -> Adapter:
    """The adapter a job's spec names (a plain one for None). ``kept``: the job's
    checkpoint folder; ``resumed``: a snapshot was restored into it."""
    if kind is None:
        return Adapter()
    if kind == AdapterKind.SLEAP_TRAIN:
        run = None if kept is None else sleap.run_folder(argv, workdir, kept)
        epochs = sleap.epochs_of(argv, workdir)
        return sleap.TrainAdapter(emit, epochs, run=run, resumed=resumed)
    if kind == AdapterKind.SLEAP_TRACK:
        return sleap.TrackAdapter(emit)
    raise AdapterError(f"this worker does not know the job adapter {kind!r}; upgrade it")


def _failure_class(run: Running, code: int | None, killed: bool, timed_out: bool) -> str | None:
    """The class of a failed run the worker can name: its timeout, out of GPU memory (the
    framework said so in its last lines), out of host memory (the kernel's OOM killer
    ended it); None for a success or another failure."""
    if timed_out:
        return "timeout"
    if code == 0 or code is None or run.stop_reason is not None:
        return None
    if oom.host_oom(code, killed):
        return oom.HOST_OOM
    if (line := oom.gpu_oom(run.tail)) is not None:
        run.note(f"out of GPU memory: {line}")
        return oom.GPU_OOM
    if oom.gpu_full(run.gpu_peak_mib, run.gpu_total_mib):
        run.note(
            f"out of GPU memory: its processes held {run.gpu_peak_mib} of its GPUs' "
            f"{run.gpu_total_mib} MiB at a heartbeat (NVML) before it failed"
        )
        return oom.GPU_OOM
    return None


def run_as_users(opts: WorkerOptions, capability: Capability) -> SlotUsers | None:
    """``--run-as``: its users, checked (root, enough of them, able to reach the work
    dir), with the worker's own files closed to them from now on."""
    if not opts.run_as:
        return None
    users = slot_users(opts.run_as)
    check_run_as(users, 1 if opts.ephemeral else opts.cpu_slots + len(capability.gpus))
    for warning in set_up_run_as(users, opts.work_dir, PROGRESS_DIR, opts.cache_dir):
        say(f"warning: {warning}")
    say(f"jobs run as {', '.join(u.name for u in users)}, one user per running job")
    return SlotUsers(users)


class JobRunner:
    """Runs each job the agent accepted, from its slot's taking to its slot's return.
    ``data`` is the blocking client (run in threads) for outputs' bytes; ``spawn`` runs
    the runner's background work; ``retrying`` retries a call while the server is away."""

    def __init__(
        self,
        opts: WorkerOptions,
        client: AsyncClient,
        data: Client,
        *,
        stager: Stager,
        slots: Slots,
        reports: Reports,
        envs: EnvPhase,
        users: SlotUsers | None,
        spawn: Spawn,
        retrying: Retrying,
    ) -> None:
        self.opts = opts
        self.client = client
        self.stager = stager
        self.slots = slots
        self.reports = reports  # start and finish reports, batched while one is on its way
        self.envs = envs  # jobs' Python environments
        self.users = users  # --run-as: the users jobs run as
        self.spawn = spawn
        self.retrying = retrying
        self.stopper = Stopper(spawn)
        self.uploads = Uploads(client, data, retrying, self.stopper, opts.work_dir)
        self.keeping = Keeping(client, data, retrying)  # jobs' checkpoint folders
        # Keyed by lease: a job cancelled and requeued may come back to this worker while
        # its old attempt is still being killed.
        self.running: dict[tuple[str, int], Running] = {}
        # Output an earlier worker process could not send: its attempts have ended.
        shutil.rmtree(opts.work_dir / SPILL, ignore_errors=True)

    # ---- what the agent asks -----------------------------------------------------------

    def start(self, lease: Lease) -> None:
        """Take the lease's slot (and a slot user) and run its job in the background."""
        self.slots.take(lease.gpus)
        spill = self.opts.work_dir / SPILL / job_dir_name(lease.job_id, lease.attempt)
        backlog = Backlog(spill, disk=self.opts.log_backlog)
        user = self.users.take() if self.users is not None else None
        run = self.running[(lease.job_id, lease.attempt)] = Running(lease, backlog, user=user)
        self.spawn(self.run_job(run))

    def kill_all(self, reason: StopReason) -> None:
        """Kill every job running here."""
        for run in list(self.running.values()):
            self.stopper.kill(run, reason)

    def vacate_all(self, checkpointing: bool = False) -> None:
        """Hand every job running here (with ``checkpointing``, each that keeps a
        checkpoint folder) back to the queue: its grace signal, its grace period, its last
        checkpoint synced."""
        for run in list(self.running.values()):
            if not checkpointing or run.lease.spec.checkpoint_dir is not None:
                self.stopper.vacate(run, StopReason.DRAIN)

    def obey(self, order: LeaseOrder, sent: float) -> None:
        """What a heartbeat sent at ``sent`` (monotonic) was told of one lease."""
        run = self.running.get((order.job_id, order.attempt))
        if run is None:
            return
        if order.order != "cancel":  # the server renewed this lease
            run.renewed = max(run.renewed, sent)
        if order.order == "cancel" and not run.killed:
            say(f"job {order.job_id}: the server says kill it (cancelled or lease lost)")
            self.stopper.kill(run, StopReason.CANCEL)
        elif order.order == "stop":
            self.stopper.stop_early(run, order.grace if order.grace is not None else 60.0)
        elif order.order == "pause" and not run.killing:
            say(f"job {order.job_id}: paused by its owner; vacating it")
            self.stopper.vacate(run, StopReason.PAUSE)
        elif order.order == "preempt" and not run.killing:
            say(f"job {order.job_id}: preempted by a job of a higher priority; vacating it")
            self.stopper.vacate(run, StopReason.PREEMPT)

    def fence(self, lease: float) -> None:
        """Stop each job whose lease (``lease`` seconds) this worker has not seen renewed
        for nearly that long: SIGTERM ``margin`` before it ends, SIGKILL at its end."""
        margin = min(3.0, lease / 4)
        now = time.monotonic()
        for run in list(self.running.values()):
            silent = now - run.renewed
            if run.abandoned or silent < lease - margin:
                continue
            say(
                f"job {run.lease.job_id} attempt {run.lease.attempt}: no heartbeat "
                f"answered for {silent:.1f}s (the lease is {lease:g}s); stopping it, "
                "since the server requeues it"
            )
            self.stopper.kill(run, StopReason.LOST, grace=max(0.0, lease - silent))

    # ---- one job -----------------------------------------------------------------------

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
        """Run the job and report how it ended; whatever happens, free its slot after."""
        lease = run.lease
        try:
            await self.report(run, await self.execute(run))
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
            await self._free(run)

    async def _free(self, run: Running) -> None:
        """The job has ended: its slot, slot user, adapter and environment are let go."""
        lease = run.lease
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
        spec = run.lease.spec
        argv = build_argv(spec.command, spec.hyper, spec.shell, HyperStyle(spec.hyper_style))
        env = self._process_env(run, workdir)
        try:
            await self.stager.stage(run.lease.inputs, workdir, run.note, Download(run.downloading))
        except InputError as exc:
            say(f"job {run.lease.job_id}: {exc.message}")
            return exc.message
        refused = await self.keeping.prepare(run, workdir)
        if refused is not None:
            say(f"job {run.lease.job_id}: {refused}")
            return refused
        env.update(self.keeping.env(run, workdir))
        if run.user is not None:  # staged by the worker: the job's to read and change
            await asyncio.to_thread(give_tree, workdir, run.user)
        if run.stop_reason is not None:  # cancelled while its inputs were fetched
            return f"stopped ({run.stop_reason.value}) before starting"
        if spec.environment is not None:
            failed = await self._environment(run, spec.environment.to_domain(), env, workdir)
            if failed is not None:
                return failed
        return await self._start(run, argv, workdir, env)

    def _process_env(self, run: Running, workdir: Path) -> dict[str, str]:
        """The job process's environment variables; its progress file made (empty)."""
        lease, spec = run.lease, run.lease.spec
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
        return job_env(base, spec.env, lease.gpus, extra)

    async def _start(
        self, run: Running, argv: list[str], workdir: Path, env: dict[str, str]
    ) -> str | None:
        """Open the job's adapter and start its process; why it could not, or None."""
        lease, spec = run.lease, run.lease.spec
        try:
            kept = None if spec.checkpoint_dir is None else workdir / spec.checkpoint_dir
            resumed = run.restored is not None
            run.adapter = adapter_for(spec.adapter, argv, workdir, run.record, kept, resumed)
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
        if run.stop_reason is StopReason.STOP:  # asked to stop while it was being started
            self.stopper.interrupt(run)
        where = f"GPUs {lease.gpus}" if lease.gpus else "a CPU slot"
        if run.user is not None:
            where += f" as {run.user.name}"
        say(
            f"job {lease.job_id} ({spec.name}) attempt {lease.attempt} started on {where}, "
            f"pid {run.proc.pid}"
        )
        await self._report_start(run, started)
        return None

    async def _report_start(self, run: Running, started: datetime) -> None:
        """Tell the server the job started; a lease the server no longer holds kills it."""
        lease = run.lease
        try:
            await self.reports.start(
                lease.job_id,
                StartRequest(
                    attempt=lease.attempt,
                    secret=lease.secret,
                    pid=run.proc.pid if run.proc else None,
                    started_at=started,
                    environment=run.env.used if run.env else None,
                    restored=run.restored,
                ),
            )
        except Conflict:
            self.stopper.kill(run, StopReason.LOST)

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
            return f"stopped ({run.stop_reason.value}) while its environment was built"
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
            return f"stopped ({run.stop_reason.value}) before starting"
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

    async def execute(self, run: Running) -> Outcome:
        """Run the job to its end, and say how it ended."""
        spec = run.lease.spec
        workdir = self.make_workdir(run)
        # sent from the start: the download of its inputs is seen as it goes
        flusher = asyncio.create_task(self.uploads.flush_loop(run))
        syncer = None
        try:
            refused = await self._launch(run, workdir)
            if refused is not None:
                return Outcome(None, refused)
            syncer = self.keeping.start(run)
            code, oom = await self._wait(run)
        finally:
            await self.keeping.stop(run, syncer)
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
        await self.keeping.last(run)
        run.read_progress(final=True)
        if (bad := run.progress.summary()) is not None:
            run.note(bad)
        timed_out = run.stop_reason is StopReason.TIMEOUT
        error = timed_out_text(spec.timeout or 0.0, run.lease.max_run_of) if timed_out else None
        error = error or describe_exit(code, oom=oom)
        run.failure = run.failure or _failure_class(run, code, oom, timed_out)
        # stopped at its pool's max_run: the longest a job of that pool may run, in all
        run.final = run.final or (timed_out and run.lease.max_run_of is not None)
        if run.keeps_outputs:  # a stopped job keeps its outputs
            failed = await self.uploads.collect(run, workdir)
            if failed:
                error = f"{error}; {failed}" if error else failed
        return Outcome(code, error)

    async def _wait(self, run: Running) -> tuple[int, bool]:
        """Wait for the job's process to end (killed at its timeout), and read what it
        left: its exit code, and whether the kernel's OOM killer ran meanwhile."""
        lease, spec = run.lease, run.lease.spec
        assert run.proc is not None
        kills = oom_kills()
        code = await run.proc.wait(spec.timeout)
        if code is None:
            ended = timed_out_text(spec.timeout or 0.0, lease.max_run_of)
            say(f"job {lease.job_id}: {ended}; killing its process group")
            run.stop_reason = run.stop_reason or StopReason.TIMEOUT
            code = await run.proc.stop()
        await run.proc.reap(self.workdir(lease))
        await run.adapter.close()
        ours = run.stop_reason is not None  # we signalled it: not the kernel
        return code, not ours and oom_kills() > kills

    async def report(self, run: Running, outcome: Outcome) -> None:
        """Report how the job ended: its result, or, drained, the lease handed back."""
        lease = run.lease
        if run.abandoned:
            assert run.stop_reason is not None
            say(f"job {lease.job_id}: stopped ({run.stop_reason.value}); not reporting a result")
            return
        try:
            try:
                await self.uploads.flush(run)
            except ServerUnavailable:  # the result matters more than the last lines
                say(f"job {lease.job_id}: dropped {run.backlog.clear()} unsent log lines")
            if run.stop_reason in VACATED:
                await self._hand_back(lease, run.stop_reason)
                return
            body = FinishRequest(
                attempt=lease.attempt,
                secret=lease.secret,
                exit_code=outcome.exit_code,
                error=outcome.error,
                stderr_tail=list(run.tail) if outcome.failed else [],
                failure=run.failure,
                final=run.final,
            )
            out = await self.reports.finish(lease.job_id, body)
            say(
                f"job {lease.job_id} ({lease.spec.name}) finished: "
                f"{outcome.error or 'exit code 0'} -> {out.status}"
            )
        except Conflict as exc:
            say(f"job {lease.job_id}: result refused ({exc.message})")

    async def _hand_back(self, lease: Lease, why: StopReason) -> None:
        """A vacated job goes back to the queue (drained, preempted, or for the
        workstation's owner) or is held (paused), its attempt not counted."""
        said = {
            StopReason.DRAIN: "drained",
            StopReason.PAUSE: "vacated it for a pause",
            StopReason.OWNER: "vacated for the workstation's owner",
            StopReason.PREEMPT: "vacated it for a job of a higher priority",
        }[why]
        body = ReleaseRequest(
            attempt=lease.attempt,
            secret=lease.secret,
            reason=f"worker {self.opts.name} {said}",
            cause="owner" if why is StopReason.OWNER else None,
        )
        try:
            await self.retrying("release", lambda: self.client.release(lease.job_id, body))
        except GpufleetError as exc:
            if exc.status != 422 or body.cause is None:
                raise
            # a server from before owner policies: handed back as drained
            plain = body.model_copy(update={"cause": None})
            await self.retrying("release", lambda: self.client.release(lease.job_id, plain))
        say(f"job {lease.job_id}: handed back to the queue (attempt not counted)")
