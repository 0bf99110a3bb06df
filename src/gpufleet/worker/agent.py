"""The worker agent: register, long-poll for jobs that fit, run them, heartbeat, drain.

Everything runs on one asyncio loop; children's output is read by the loop, never by a
blocking call. The worker only dials out to the server: it needs no inbound port.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from gpufleet import archive
from gpufleet.client import AsyncClient, Client
from gpufleet.domain.models import Capability, GpuInfo
from gpufleet.errors import (
    Forbidden,
    GpufleetError,
    NotFound,
    ServerUnavailable,
    Unauthorized,
)
from gpufleet.terminal import visible
from gpufleet.wire import (
    MOST_BUILT,
    CapabilityModel,
    ClaimRequest,
    EnvBuiltModel,
    GpuModel,
    HeartbeatRequest,
    Lease,
    LeaseRef,
    LeaveRequest,
    ReleaseRequest,
    WorkerRegister,
)
from gpufleet.worker.announce import announce
from gpufleet.worker.cache import BlobCache, remove_leftovers
from gpufleet.worker.capability import live_gpus, live_state
from gpufleet.worker.envphase import EnvPhase, env_cache
from gpufleet.worker.isolation import drop_secret_env, make_undumpable
from gpufleet.worker.jobs import JobRunner, run_as_users
from gpufleet.worker.log import say
from gpufleet.worker.nvml import GpuReading, group_gpu_mib
from gpufleet.worker.options import WorkerOptions
from gpufleet.worker.owner import OwnerWatch
from gpufleet.worker.owner_yield import YIELD_SIGNAL, remove_pid, write_pid
from gpufleet.worker.reports import Reports
from gpufleet.worker.runner import kill_leftovers
from gpufleet.worker.running import StopReason
from gpufleet.worker.slots import Slots
from gpufleet.worker.spawn import stop_guard
from gpufleet.worker.staging import Stager
from gpufleet.worker.workdirs import job_dir_name, prune_work_dirs

T = TypeVar("T")
RETRY_CAP = 2.0  # seconds between tries at most while the server is away
PRUNE_EVERY = 600.0  # seconds between removals of old work dirs
FENCE_CHECK = 0.25  # seconds between self-fencing checks


class Stopped(GpufleetError):
    """The worker was told to stop while it waited for the server, with nothing to hand
    back or report: it stops instead of retrying."""


@dataclass
class Poll:
    """One of this worker's claim polls: when it was sent, and whether a newer one of
    ours replaced it (its empty answer is then expected)."""

    sent: float
    replaced: bool = False


class Agent:
    """A worker: its registration, claims, heartbeats and drain. It runs the jobs it
    claims with its :class:`~gpufleet.worker.jobs.JobRunner`, ``jobs``."""

    def __init__(self, opts: WorkerOptions, capability: Capability) -> None:
        self.opts = opts
        self.capability = replace(
            capability, mounts=opts.mounts, python_downloads=opts.env_python_downloads
        )
        self.found_pythons: list[str] | None = None  # found since the last heartbeat
        self.users = run_as_users(opts, capability)
        self.client = AsyncClient(opts.server, opts.token, ca=opts.ca)
        # Bulk transfers run the blocking client in threads: one code path for the SDK,
        # the CLI and the worker.
        self.data = Client(opts.server, opts.token, timeout=120.0, ca=opts.ca)
        cache = BlobCache(
            opts.cache_dir or opts.work_dir / "cache", opts.cache_size, self.data.get_blob
        )
        digests = archive.Remembered(opts.work_dir / "mount-digests.json")
        self.stager = Stager(cache, opts.mounts, archive.Limits(), digests)
        self.envs = EnvPhase(
            env_cache(opts), self.client, self.data, cache, self.capability, self.retrying
        )
        if self.users is not None and (why := self.envs.closed_to(self.users.users)):
            say(f"warning: {why}")
        opts.work_dir.mkdir(parents=True, exist_ok=True)
        remove_leftovers(opts.work_dir, ".artifact.")
        self.slots = Slots(opts.cpu_slots, capability.gpus)
        self.lease_timeout: float | None = None
        self.worker_id = ""
        self.announced = False
        self.locked_out = False
        self.draining = False
        self.drain_why = ""
        self.stopping = asyncio.Event()  # set when the drain begins: wakes retry waits
        self.drain_deadline: float | None = None
        self.early_polls = 0  # polls in a row that someone else ended early
        self.several = not opts.ephemeral  # ask for a job per free slot in one poll
        self.tasks: set[asyncio.Task[None]] = set()
        self.reports = Reports(self.client, self.retrying)
        self.jobs = JobRunner(
            opts,
            self.client,
            self.data,
            stager=self.stager,
            slots=self.slots,
            reports=self.reports,
            envs=self.envs,
            users=self.users,
            spawn=self.spawn,
            retrying=self.retrying,
        )
        self.owner = OwnerWatch(opts.owner_policy, opts.work_dir, self.jobs, self.slots)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ---- lifecycle ---------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal)
        loop.add_signal_handler(YIELD_SIGNAL, self.owner.on_signal)  # gpufleet worker --yield
        write_pid(self.opts.work_dir)
        left = kill_leftovers(self.opts.work_dir)
        if left:
            say(f"killed {left} process(es) a previous worker left running in {self.opts.work_dir}")
        try:
            self.spawn(self.find_pythons())  # seconds where pyenv shims abound: not in the way
            try:
                await self.register()
            except Stopped:
                say(f"worker {self.opts.name} stopped before the server answered")
                return 0
            tasks = [
                asyncio.create_task(self.heartbeat_loop()),
                asyncio.create_task(self.claim_loop()),
                asyncio.create_task(self.fence_loop()),
                asyncio.create_task(self.prune_loop()),
            ]
            await self.wait_drained()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.locked_out:
                say(f"worker {self.opts.name} stopped: its token was refused")
                return 1
            await self.goodbye()
            say(f"worker {self.opts.name} drained; exiting")
            return 0
        finally:
            remove_pid(self.opts.work_dir)
            await self.client.aclose()
            self.data.close()

    async def goodbye(self) -> None:
        """Tell the server this worker stops, so it shows offline at once (not draining
        until its lease runs out). Bounded: a server that does not answer is not waited
        for."""
        try:
            await asyncio.wait_for(
                self.client.leave(self.worker_id, LeaveRequest(reason=self.drain_why)), 5.0
            )
        except (GpufleetError, TimeoutError) as exc:
            say(f"could not tell the server this worker stops ({exc}); it shows offline later")

    def on_signal(self) -> None:
        if self.draining:
            say("second signal: handing running jobs back now")
            self.drain_deadline = time.monotonic()
        else:
            self.begin_drain(self.opts.drain_grace, "signal")
            # a job that keeps checkpoints loses nothing by moving: it goes now, while
            # the machine (a spot instance being reclaimed) still has time to save it
            self.jobs.vacate_all(checkpointing=True)

    def begin_drain(self, grace: float | None, why: str) -> None:
        if not self.draining:
            jobs = len(self.jobs.running)
            say(f"draining ({why}): no new jobs; {jobs} running job(s) may finish")
            self.drain_why = why
        self.draining = True
        self.stopping.set()
        if grace is not None:
            deadline = time.monotonic() + grace
            self.drain_deadline = min(deadline, self.drain_deadline or deadline)
        self.slots.changed.set()

    def lock_out(self, exc: GpufleetError) -> None:
        """The server no longer accepts this worker's token (revoked, expired, or the name
        taken by another token): its jobs are requeued there, so stop them here, now."""
        if not self.locked_out:
            say(f"the server refused this worker's token ({exc.message}); stopping its jobs")
        self.locked_out = True
        self.begin_drain(0.0, "token refused")

    def shutdown_overdue(self) -> bool:
        """Draining past its deadline (plus 10 s to report): stop waiting for the server."""
        deadline = self.drain_deadline
        return self.draining and deadline is not None and time.monotonic() > deadline + 10

    async def wait_drained(self) -> None:
        while not (self.draining and not self.jobs.running):
            if self.draining and self.drain_deadline and time.monotonic() >= self.drain_deadline:
                if self.locked_out:  # its writes are refused: nothing to keep, kill now
                    self.jobs.kill_all(StopReason.DRAIN)
                else:  # grace signal, last checkpoint, back to the queue
                    self.jobs.vacate_all()
            await asyncio.sleep(0.1)

    # ---- talking to the server ---------------------------------------------------------

    async def retrying(
        self, what: str, call: Callable[[], Awaitable[T]], give_up: float | None = None
    ) -> T:
        """Retry while the server is away (backoff with jitter, capped at RETRY_CAP: a
        server back from a restart is found within two seconds, well inside a lease)."""
        delay, started, warned = 0.2, time.monotonic(), False
        while True:
            try:
                result = await call()
                if warned:
                    say(f"server is back ({what})")
                return result
            except ServerUnavailable as exc:
                if give_up is not None and time.monotonic() - started > give_up:
                    raise
                if self.shutdown_overdue():
                    say(f"giving up {what}: the server is away and this worker is shutting down")
                    raise
                if self.draining and not self.jobs.running:
                    raise Stopped(f"stopping: nothing runs, so {what} is not retried") from exc
                if not warned:
                    say(f"server unreachable during {what}: {exc.message}; retrying")
                    warned = True
            # A drain (a signal) wakes the wait: a worker with nothing running stops at once.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay * (0.5 + random.random()))
            delay = min(delay * 2, RETRY_CAP)

    async def register(self) -> None:
        self.envs.changed = True  # a server that forgot us learns what we have built
        body = WorkerRegister(
            name=self.opts.name,
            labels=self.opts.labels,
            capability=CapabilityModel.from_domain(self.capability),
            cpu_slots=self.opts.cpu_slots,
            pool=self.opts.pool,
            ephemeral=self.opts.ephemeral,
            running=[
                LeaseRef(job_id=r.lease.job_id, attempt=r.lease.attempt)
                for r in self.jobs.running.values()
            ],
        )
        out = await self.retrying("register", lambda: self.client.register(body))
        self.worker_id = out.id
        self.lease_timeout = out.lease_timeout
        self.envs.pool = out.pool  # the fleet's locks of environments are its pool's
        sim = " [simulated]" if self.capability.gpus_simulated else ""
        gpus = ", ".join(
            f"{g.index}:{g.name} {g.total_gib:.0f}GiB{sim}" for g in self.capability.gpus
        )
        say(
            f"worker {out.name} ({out.id}) registered with {self.opts.server} in pool "
            f"{out.pool}; slots: {self.opts.cpu_slots} CPU, "
            f"{len(self.capability.gpus)} GPU ({gpus or 'no GPU'})"
            + "".join(f"; {t} {v}" for t, v in self.capability.tools.items())
        )
        if not self.announced:
            self.announced = True
            await announce(self.opts, self.retrying, out.id, out.pool)

    async def send_heartbeat(self) -> None:
        gpus, readings = await self.live_state()
        await self.owner.look(readings)
        body = HeartbeatRequest(
            leases=[
                LeaseRef(
                    job_id=r.lease.job_id,
                    attempt=r.lease.attempt,
                    gpu_mib=r.gpu_reading(group_gpu_mib(readings, r.proc.pid), gpus)
                    if r.proc is not None and r.lease.gpus and readings
                    else None,
                )
                for r in self.jobs.running.values()
            ],
            gpus=[GpuModel.from_domain(g) for g in gpus],
            draining=self.draining,
            environments=self.built_environments(),
            pythons=self.found_pythons,
            owner=self.owner.report(),
        )
        sent = time.monotonic()
        try:
            resp = await self.client.heartbeat(self.worker_id, body)
            if body.pythons is not None and self.found_pythons is body.pythons:
                self.found_pythons = None  # the server has them
            if body.environments is not None:
                self.envs.changed = False  # (a change since is sent with the next)
        except NotFound:
            say("the server does not know this worker any more; registering again")
            await self.register()
            return
        for order in resp.orders:
            self.jobs.obey(order, sent)
        if resp.drain:
            self.begin_drain(resp.drain_in, "operator")

    async def find_pythons(self) -> None:
        """The Python versions jobs' environments may ask for (uv finds them), for the
        next heartbeat and every registration after it."""
        try:
            pythons = await self.envs.cache.pythons()
        except Exception as exc:  # jobs that name a Python are then not judged at submit
            say(f"could not list this machine's Pythons: {exc!r}")
            return
        pythons = pythons[:50]  # the newest: what a heartbeat carries at most
        self.capability = replace(self.capability, pythons=tuple(pythons))
        self.found_pythons = pythons

    def built_environments(self) -> list[EnvBuiltModel] | None:
        """The environments this worker has built, when that changed since the last
        heartbeat said it (None: unchanged)."""
        if not self.envs.changed:
            return None
        try:
            listed = self.envs.listing()
        except OSError as exc:
            say(f"could not list the built environments: {exc}")
            return None
        found = []
        for info in listed[:MOST_BUILT]:
            try:
                found.append(EnvBuiltModel(**info))
            except ValueError:  # an entry the server would refuse: its heartbeat goes on
                continue
        return found

    async def heartbeat_loop(self) -> None:
        warned = False
        while True:
            # Never slower than a third of the server's lease, whatever --heartbeat says.
            interval = self.opts.heartbeat
            if self.lease_timeout is not None:
                interval = min(interval, self.lease_timeout / 3)
            await asyncio.sleep(interval)
            try:
                await self.send_heartbeat()
                if warned:
                    say("server is back (heartbeat)")
                warned = False
            except ServerUnavailable as exc:
                if not warned:
                    say(f"heartbeat failed: {exc.message}; jobs keep running")
                warned = True
            except (Unauthorized, Forbidden) as exc:
                self.lock_out(exc)
            except GpufleetError as exc:
                say(f"heartbeat refused: {exc.message}")
                if exc.status == 422 and "owner" in exc.message:  # a server before policies
                    self.owner.unheard = True

    async def fence_loop(self) -> None:
        """Self-fencing: a job whose lease this worker has not seen renewed for a lease
        timeout is stopped here, server or no server. By then the server has requeued it
        (or will within its sweep), so another attempt may start elsewhere: the two
        never overlap while this worker runs. SIGTERM goes ``margin`` before the lease
        ends and SIGKILL at its end. A worker that is frozen (SIGSTOP, a paused VM)
        cannot do this: its jobs run on until it thaws, and then stop at once."""
        while True:
            await asyncio.sleep(FENCE_CHECK)
            if self.lease_timeout is not None:
                self.jobs.fence(self.lease_timeout)

    async def prune_loop(self) -> None:
        """Remove finished jobs' work dirs past --work-dir-retention, now and every ten
        minutes."""
        keep = self.opts.work_dir_retention
        while keep is not None:
            busy = {job_dir_name(job, attempt) for job, attempt in self.jobs.running}
            try:
                gone = await asyncio.to_thread(prune_work_dirs, self.opts.work_dir, keep, busy)
            except OSError as exc:
                say(f"could not prune old work dirs: {exc}")
                gone = 0
            if gone:
                say(f"removed {gone} work dir(s) of jobs ended over {keep / 3600:g}h ago")
            await asyncio.sleep(PRUNE_EVERY)

    # ---- claiming ----------------------------------------------------------------------

    async def live_gpus(self) -> tuple[GpuInfo, ...]:
        """This worker's GPUs with their free memory now. NVML is read in a thread: a
        driver call that hangs must not stop heartbeats."""
        if self.capability.gpus_simulated or not self.capability.gpus:
            return self.capability.gpus
        return await asyncio.to_thread(live_gpus, self.capability)

    async def live_state(self) -> tuple[tuple[GpuInfo, ...], dict[int, GpuReading]]:
        """:meth:`live_gpus`, with NVML's readings (the processes on each GPU)."""
        if self.capability.gpus_simulated or not self.capability.gpus:
            return self.capability.gpus, {}
        return await asyncio.to_thread(live_state, self.capability)

    async def claim_body(self, supersede: bool = False) -> ClaimRequest:
        live = await self.live_gpus()
        gpus = self.slots.free_gpus(live)
        return ClaimRequest(
            cpu_slots=self.slots.cpu_free,
            gpus=gpus,
            wait=self.opts.claim_wait,
            supersede=supersede,
            # as many jobs as could start now: every free CPU slot and GPU could take one
            # (an ephemeral worker runs one job in all; a server before `most` takes one)
            most=min(64, max(1, self.slots.cpu_free + len(gpus))) if self.several else 1,
        )

    async def claim_loop(self) -> None:
        """Keep a long poll open while a slot is free. When a slot frees during a poll,
        send a new poll at once with the fresh slots: the server ends the old one (it
        answers empty), so a freed GPU is taken within the dispatch latency. At most two
        polls are open (the old one answering, and the new one)."""
        polls: dict[asyncio.Task[Lease | None], Poll] = {}
        stale = True  # the open poll's slots are out of date (or there is none)
        try:
            while not self.draining:
                if self.slots.changed.is_set():
                    self.slots.changed.clear()
                    stale = True
                if (stale or not polls) and self.slots.any_free() and len(polls) < 2:
                    for old in polls.values():
                        old.replaced = True
                    body = await self.claim_body(supersede=bool(polls))
                    polls[asyncio.create_task(self.poll(body))] = Poll(time.monotonic())
                    stale = False
                elif stale and self.slots.owner_took_all():  # no poll of theirs stays open
                    for task in polls:
                        task.cancel()
                    polls.clear()
                if not polls:  # nothing free: wait for a slot
                    await self.slots.changed.wait()
                    continue
                waiter = asyncio.ensure_future(self.slots.changed.wait())
                waits: set[asyncio.Future[Any]] = {*polls, *([waiter] if len(polls) < 2 else [])}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                for task in [t for t in done if t in polls]:
                    if not await self.answered(task, polls.pop(task)):
                        return
        finally:
            for task in polls:
                task.cancel()

    async def poll(self, body: ClaimRequest) -> Lease | None:
        return await self.retrying("claim", lambda: self.client.claim(self.worker_id, body))

    async def answered(self, task: asyncio.Task[Lease | None], poll: Poll) -> bool:
        """Act on a finished poll; False when this worker must stop claiming."""
        try:
            lease = task.result()
        except NotFound:
            await self.register()
            return True
        except (Unauthorized, Forbidden) as exc:
            self.lock_out(exc)
            return False
        except Stopped:
            return False
        except GpufleetError as exc:
            if exc.status == 422 and self.several and "most" in exc.message:
                say("the server takes one job a poll (it predates `most`); asking for one")
                self.several = False
                return True
            say(f"claim refused: {exc.message}")
            await asyncio.sleep(2.0)
            return True
        if lease is not None:
            self.early_polls = 0
            for one in (lease, *lease.more):
                await self.accept(one)
        elif not poll.replaced and self.ended_early(poll):
            await self.after_early_end()
        else:
            self.early_polls = 0
        return True

    def ended_early(self, poll: Poll) -> bool:
        """An empty answer well before the poll's wait that this worker did not cause."""
        wait = self.opts.claim_wait
        return wait >= 2 and time.monotonic() - poll.sent < wait / 2

    async def after_early_end(self) -> None:
        """Someone else ended this worker's poll (a server stopping, or another process
        polling as this worker): wait a moment before the next, longer each time, so two
        processes sharing one worker never spin on each other."""
        self.early_polls += 1
        if self.early_polls == 3:
            say(
                f"polls of worker {self.opts.name} keep ending early: another process may be "
                "polling as this worker (the same --name with the same token); give each "
                "worker process its own --name"
            )
        delay = min(5.0, 0.25 * 2 ** (self.early_polls - 1))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), delay)

    async def accept(self, lease: Lease) -> None:
        if self.draining:
            await self.hand_back(lease, "worker is draining")
            return
        if self.slots.owners(lease.gpus):  # the owner's since the poll was sent
            await self.hand_back(lease, "the workstation's owner has it now", owner=True)
            return
        if not self.slots.fits(lease.gpus):  # the server takes held slots out; never here
            say(f"job {lease.job_id}: its slot is taken here; handing it back")
            await self.hand_back(lease, "slot already taken on the worker")
            return
        self.lease_timeout = lease.lease_timeout
        self.jobs.start(lease)
        if self.opts.ephemeral:
            self.begin_drain(None, "ephemeral worker took its one job")

    async def hand_back(self, lease: Lease, reason: str, owner: bool = False) -> None:
        cause = "owner" if owner else None
        body = ReleaseRequest(
            attempt=lease.attempt, secret=lease.secret, reason=reason, cause=cause
        )
        with contextlib.suppress(GpufleetError):
            await self.client.release(lease.job_id, body)


def run_worker(opts: WorkerOptions, capability: Capability) -> int:
    """Run a worker until it is drained; the process exit code. Its token lives in
    ``opts`` alone from here: gone from its environment, and its memory closed to the
    processes of its user (see :mod:`gpufleet.worker.isolation`)."""
    drop_secret_env()
    make_undumpable()
    opts.work_dir.mkdir(parents=True, exist_ok=True)
    try:
        # asyncio's own loop: where there are no pidfds, jobs start through its
        # subprocesses (gpufleet.worker.spawn), which uvloop's would fork the whole worker
        return asyncio.run(Agent(opts, capability).run())
    except GpufleetError as exc:
        print(f"error: {visible(exc.message)}", file=sys.stderr)
        return 1
    finally:
        stop_guard()  # what still runs dies with the worker
