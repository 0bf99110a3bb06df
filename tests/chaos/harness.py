"""A chaos run: real servers and workers, real jobs, and faults from a seeded schedule.

The load is jobs that sleep a random short time, append a line to a side-effects file
when they begin and "NAME ATTEMPT START END" when they end, and write an artifact whose
content follows from the job's name. The faults, drawn from a seeded random schedule and
spread over the run: workers SIGKILLed (and started again), workers paused (SIGSTOP, then
SIGCONT after longer than the lease), servers SIGKILLed (and started again), and
cancel/requeue pairs. Jobs are submitted throughout, so there is work during every fault.

At the end, every job is read back from the server and checked:

- lost: a submitted job that did not end ``succeeded``;
- recorded twice: a job name with two jobs, an attempt number twice in a job's history,
  more than one succeeded attempt, the artifact not the succeeded attempt's, or the
  succeeded attempt's greeting line twice (or never) in the job's log;
- corrupt: an artifact whose content is not what the job wrote;
- a 5xx or a traceback in any server's log, a traceback in any worker's log.

And measured: the jobs that ran twice (two attempts reached their end), the overlap of
two attempts of one job (a process watcher notes when each attempt's process is gone),
split into attempts on a worker that was alive and on one that was paused, and the
requeue delay after a worker's SIGKILL: to the server recording the attempt lost, and to
the next attempt starting.

``tests/chaos`` runs it at CI size; ``bench/chaos.py`` at bench size.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import itertools
import math
import os
import random
import signal
import sys
import tarfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from gpufleet.client import Client
from gpufleet.config import load_token
from gpufleet.errors import Conflict, GpufleetError, ServerUnavailable
from gpufleet.wire import JobDetail, JobSpecModel
from tests.procs import Proc, alive, free_port, listening, wait_for

T = TypeVar("T")
PYTHON = sys.executable

# The job: one process (so it dies with a SIGKILLed worker, which sets PDEATHSIG on it).
JOB = r"""
import hashlib, os, sys, time
name, attempt = os.environ["GPUFLEET_JOB_NAME"], os.environ["GPUFLEET_ATTEMPT"]
effects, seconds = sys.argv[1], float(sys.argv[2])

def append(line):
    fd = os.open(effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)

start = time.time()
append(f"begin {name} {attempt} {start:.3f} {os.getpid()}\n")
print(f"hello {name} attempt {attempt}", flush=True)
time.sleep(seconds)
os.makedirs("outputs", exist_ok=True)
seed = hashlib.sha256(name.encode()).digest()
with open("outputs/result.bin", "wb") as f:
    for i in range(64):
        f.write(hashlib.sha256(seed + i.to_bytes(4, "big")).digest() * 32)
append(f"{name} {attempt} {start:.3f} {time.time():.3f}\n")
"""


def expected_artifact(name: str) -> bytes:
    """What the job named ``name`` writes to outputs/result.bin (64 KiB)."""
    seed = hashlib.sha256(name.encode()).digest()
    return b"".join(hashlib.sha256(seed + i.to_bytes(4, "big")).digest() * 32 for i in range(64))


@dataclass
class Plan:
    """The size of a run and its faults."""

    jobs: int = 60
    workers: int = 4
    slots: int = 2
    worker_kills: int = 6
    pauses: int = 3
    server_kills: int = 2
    cancel_requeues: int = 4
    servers: int = 1
    db: str | None = None  # None: SQLite in the data dir; or a postgresql:// URL
    seed: int = 1
    lease: float = 3.0
    heartbeat: float = 0.5
    job_seconds: tuple[float, float] = (0.3, 4.0)
    long_jobs: float = 0.15  # this share of the jobs outlasts the lease by 1 to 5 s
    gap: tuple[float, float] = (0.3, 1.5)  # between two faults
    worker_down: tuple[float, float] = (0.2, 2.0)  # a killed worker starts again after
    server_down: tuple[float, float] = (0.2, 3.0)  # a killed server starts again after
    pause_past_lease: tuple[float, float] = (0.5, 2.0)  # a pause lasts the lease plus
    deadline: float = 600.0  # the whole run, at most


@dataclass
class Report:
    jobs: int = 0
    lost: list[str] = field(default_factory=list)
    twice: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)  # 5xx and tracebacks
    worker_errors: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    ran_twice: int = 0
    attempts: int = 0
    overlap_live: float = 0.0
    overlap_frozen: float = 0.0
    overlap_cancelled: float = 0.0
    requeued: list[float] = field(default_factory=list)  # kill -> attempt recorded lost
    restarted: list[float] = field(default_factory=list)  # kill -> next attempt started
    # the same, for the kills after which no server ran for a while (all were SIGKILLed):
    # how many, and how long after the later of the lease's end and a server's return
    across_restart: int = 0
    overdue: list[float] = field(default_factory=list)
    requeued_server_up: list[float] = field(default_factory=list)  # the others
    seconds: float = 0.0

    def ok(self) -> bool:
        return not (
            self.lost or self.twice or self.corrupt or self.server_errors or self.worker_errors
        )

    def lines(self, plan: Plan) -> list[str]:
        def p(values: list[float], q: float) -> str:
            if not values:
                return "-"
            ordered = sorted(values)
            return f"{ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]:.2f}s"

        backend = "PostgreSQL" if plan.db else "SQLite"
        faults = ", ".join(f"{n} {k}" for k, n in sorted(self.faults.items()))
        return [
            f"{plan.servers} server(s) on {backend}, {plan.workers} workers x {plan.slots} slots,"
            f" lease {plan.lease}s, heartbeat {plan.heartbeat}s, seed {plan.seed}",
            f"jobs {self.jobs}, attempts {self.attempts}, in {self.seconds:.0f}s; faults: {faults}",
            f"lost {len(self.lost)}, recorded twice {len(self.twice)},"
            f" corrupt {len(self.corrupt)}, server 5xx/tracebacks {len(self.server_errors)},"
            f" worker tracebacks {len(self.worker_errors)}",
            f"ran twice (two attempts reached their end): {self.ran_twice}",
            f"max overlap of two attempts: live workers {self.overlap_live:.2f}s,"
            f" paused (frozen) workers {self.overlap_frozen:.2f}s,"
            f" cancel/requeue {self.overlap_cancelled:.2f}s",
            f"after a worker's SIGKILL ({len(self.requeued)} attempts): recorded lost p50"
            f" {p(self.requeued, 50)} max {p(self.requeued, 100)}; next attempt started p50"
            f" {p(self.restarted, 50)} max {p(self.restarted, 100)}",
            f"  with a server up throughout ({len(self.requeued_server_up)}): recorded lost"
            f" p50 {p(self.requeued_server_up, 50)} max {p(self.requeued_server_up, 100)}",
            f"  while no server ran ({self.across_restart}): recorded lost after the lease's"
            f" end or a server's return (the later) p50 {p(self.overdue, 50)}"
            f" max {p(self.overdue, 100)}",
        ]


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class Watcher(threading.Thread):
    """Notes when each attempt's process is gone: reads the "begin" lines of the
    side-effects file and polls those pids."""

    def __init__(self, effects: Path) -> None:
        super().__init__(daemon=True)
        self.effects = effects
        self.gone: dict[tuple[str, int], float] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        offset, watching = 0, dict[int, tuple[str, int]]()  # pid -> (name, attempt)
        while not self.stopping.is_set():
            if self.effects.exists():
                with self.effects.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                end = chunk.rfind(b"\n") + 1
                offset += end
                for line in chunk[:end].decode().splitlines():
                    if line.startswith("begin "):
                        _, name, attempt, _, pid = line.split()
                        watching[int(pid)] = (name, int(attempt))
            now = time.time()
            for gone in [p for p in watching if not alive(p)]:
                self.gone[watching.pop(gone)] = now
            time.sleep(0.05)


@dataclass
class Event:
    at: float
    kind: str
    target: int = 0

    def __lt__(self, other: Event) -> bool:
        return self.at < other.at


class Chaos:
    def __init__(self, plan: Plan, root: Path) -> None:
        self.plan = plan
        self.root = root
        self.rng = random.Random(plan.seed)  # the faults'
        self.calls_rng = random.Random(plan.seed + 1)  # the client thread's
        self.effects = root / "effects"
        self.script = root / "job.py"
        # the first server saves the admin token here; the workers and this process read it
        os.environ["GPUFLEET_CONFIG_DIR"] = str(root / "config")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.ports = [free_port() for _ in range(plan.servers)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.servers: list[Proc | None] = [None] * plan.servers
        self.workers: list[Proc | None] = [None] * plan.workers
        self.paused: set[int] = set()
        self.retired: list[Proc] = []
        self.kills: list[tuple[str, float]] = []  # worker name, when
        self.no_server: list[tuple[float, float]] = []  # while no server ran (from, to)
        self.pauses: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.cancelled: set[tuple[str, int]] = set()  # (name, attempt) cancelled by us
        self.names: list[str] = []
        self.ids: dict[str, str] = {}
        self.report = Report()

    # ---- processes ------------------------------------------------------------------

    def start_server(self, i: int) -> None:
        argv = [
            PYTHON, "-m", "gpufleet", "server",
            "--port", str(self.ports[i]),
            "--data-dir", str(self.root / "data"),
            "--lease-timeout", str(self.plan.lease),
            "--retry-backoff", "0.2",
        ]  # fmt: skip
        if self.plan.db:
            argv += ["--db", self.plan.db]
        proc = Proc(argv, self.env, self._log(f"server-{i}"))
        wait_for(lambda: listening(proc), 60, f"server {i} to listen")
        wait_for(lambda: _answers(self.urls[i]), 60, f"server {i} to answer")  # serving now
        self.servers[i] = proc
        if self.no_server and self.no_server[-1][1] == math.inf:
            self.no_server[-1] = (self.no_server[-1][0], time.time())

    def start_worker(self, i: int) -> None:
        urls = self.urls[i % len(self.urls) :] + self.urls[: i % len(self.urls)]
        argv = [
            PYTHON, "-m", "gpufleet", "worker",
            "--name", f"w{i}",
            "--server", ",".join(urls),
            "--slots", str(self.plan.slots),
            "--heartbeat", str(self.plan.heartbeat),
            "--work-dir", str(self.root / "work" / f"w{i}"),
        ]  # fmt: skip
        self.workers[i] = Proc(argv, self.env, self._log(f"worker-w{i}"))

    def _log(self, stem: str) -> Path:
        n, log = 1, self.root / f"{stem}.log"
        while log.exists():
            n += 1
            log = self.root / f"{stem}.{n}.log"
        return log

    def every_proc(self) -> Iterator[Proc]:
        yield from self.retired
        yield from (p for p in (*self.servers, *self.workers) if p is not None)

    def stop(self) -> None:
        for proc in [*self.workers, *self.servers]:
            if proc is not None and proc.popen.poll() is None:
                proc.stop()
        for proc in self.every_proc():
            if not proc.file.closed:
                proc.file.close()

    # ---- the client's side ----------------------------------------------------------

    def client(self) -> Client:
        return Client(",".join(self.urls), load_token(",".join(self.urls)))

    def retrying(self, c: Client, what: str, call: Callable[[], T], timeout: float = 60) -> T:
        """``call`` until a server answers it (servers are killed during the run)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return call()
            except ServerUnavailable:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no server answered {what} for {timeout}s") from None
                time.sleep(0.2)

    def job_spec(self, name: str) -> JobSpecModel:
        """The job named ``name``: a sleep of a random length, then its artifact."""
        rng, plan = self.calls_rng, self.plan
        long = rng.random() < plan.long_jobs
        seconds = round(rng.uniform(plan.lease + 1, plan.lease + 5), 2) if long else None
        seconds = seconds or round(rng.uniform(*plan.job_seconds), 2)
        return JobSpecModel(
            name=name,
            command=[PYTHON, str(self.script), str(self.effects), str(seconds)],
            max_attempts=100,
        )

    def submit(self, c: Client, name: str) -> None:
        spec = self.job_spec(name)
        sent = False

        def once() -> str:
            nonlocal sent
            if sent:  # a submit cut off in flight may have been made: look before again
                try:
                    return c.job(name).id
                except GpufleetError as exc:
                    if isinstance(exc, ServerUnavailable):
                        raise
            sent = True
            return c.submit(spec).job.id

        self.ids[name] = self.retrying(c, f"submit {name}", once)
        self.names.append(name)

    def cancel_requeue(self, c: Client) -> None:
        running = [j for j in self.retrying(c, "jobs", lambda: c.jobs("running"))]
        if not running:
            return
        job = self.calls_rng.choice(running)

        def cancel() -> int | None:
            try:
                return c.cancel(job.id).attempt
            except Conflict:  # it ended meanwhile, or a retried cancel had been done
                now = c.job(job.id)
                return now.attempt if now.status == "cancelled" else None

        attempt = self.retrying(c, "cancel", cancel)
        if attempt is None:
            return  # the next cancel/requeue event picks another
        self.cancelled.add((job.name, attempt))

        def requeue() -> None:
            try:
                c.requeue(job.id)
            except Conflict:  # a retried requeue that had been done: fine; else not
                if c.job(job.id).status == "cancelled":
                    raise

        self.retrying(c, "requeue", requeue)
        self.report.faults["cancel/requeue"] += 1

    # ---- the schedule ---------------------------------------------------------------

    def schedule(self) -> list[Event]:
        plan, rng = self.plan, self.rng
        kinds = (
            ["kill worker"] * plan.worker_kills
            + ["pause worker"] * plan.pauses
            + ["kill server"] * plan.server_kills
            + ["cancel/requeue"] * plan.cancel_requeues
        )
        rng.shuffle(kinds)
        events, at = [], 2.0
        for kind in kinds:
            at += rng.uniform(*plan.gap)
            events.append(Event(at, kind))
        return events

    def run(self) -> Report:
        plan = self.plan
        self.script.write_text(JOB)
        started = time.monotonic()
        for i in range(plan.servers):
            self.start_server(i)
        for i in range(plan.workers):
            self.start_worker(i)
        watcher = Watcher(self.effects)
        watcher.start()
        events = self.schedule()
        span = events[-1].at if events else 5.0
        ops = [e for e in events if e.kind == "cancel/requeue"]
        ops += [Event(span * n / plan.jobs, "submit", n) for n in range(plan.jobs)]
        faults = [e for e in events if e.kind != "cancel/requeue"]
        errors: list[BaseException] = []

        def client_side() -> None:  # submits and cancel/requeue pairs, on their own
            try:
                with self.client() as c:
                    self.drive(c, ops, started)
            except BaseException as exc:
                errors.append(exc)

        calls = threading.Thread(target=client_side, daemon=True)
        try:
            calls.start()
            self.drive(None, faults, started)
            calls.join(plan.deadline)
            if errors:
                raise errors[0]
            with self.client() as c:
                self.wait_all(c, started)
            time.sleep(plan.heartbeat * 2)  # the last attempts' processes are reaped
            self.report.seconds = time.monotonic() - started
            self.check(watcher)
        finally:
            watcher.stopping.set()
            self.stop()
        return self.report

    def drive(self, c: Client | None, queue: list[Event], started: float) -> None:
        """Deal the events of ``queue`` at their times: the client's (with ``c``) or the
        processes' (without). A fault may bring another event (a restart, a resume), or
        come back half a second later when nothing may take it now."""
        heapq.heapify(queue)
        while queue:
            event = heapq.heappop(queue)
            delay = started + event.at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if event.kind == "submit":
                assert c is not None
                self.submit(c, f"j{event.target:05d}")
            elif event.kind == "cancel/requeue":
                assert c is not None
                self.cancel_requeue(c)
            elif (after := self.deal(event)) is not None:
                heapq.heappush(queue, after)

    def deal(self, event: Event) -> Event | None:
        plan, rng, i = self.plan, self.rng, event.target
        if event.kind == "start worker":
            self.start_worker(i)
        elif event.kind == "resume worker":
            self._worker(i).signal(signal.SIGCONT)
            self.paused.discard(i)
        elif event.kind == "start server":
            self.start_server(i)
        elif event.kind in ("kill worker", "pause worker"):
            up = [n for n, w in enumerate(self.workers) if w and n not in self.paused]
            if not up:
                return Event(event.at + 0.5, event.kind)
            i = self.kill_target(up) if event.kind == "kill worker" else rng.choice(up)
            if event.kind == "kill worker":
                self._worker(i).kill()
                self.kills.append((f"w{i}", time.time()))
                self.retired.append(self._worker(i))
                self.workers[i] = None
                self.report.faults["worker SIGKILL"] += 1
                return Event(event.at + rng.uniform(*plan.worker_down), "start worker", i)
            self._worker(i).signal(signal.SIGSTOP)
            self.paused.add(i)
            length = plan.lease + rng.uniform(*plan.pause_past_lease)
            self.pauses[f"w{i}"].append((time.time(), time.time() + length))
            self.report.faults["worker SIGSTOP past the lease"] += 1
            return Event(event.at + length, "resume worker", i)
        elif event.kind == "kill server":
            if not all(self.servers):  # one down at a time
                return Event(event.at + 0.5, event.kind)
            i = rng.randrange(plan.servers)
            proc = self.servers[i]
            assert proc is not None
            proc.kill()
            self.retired.append(proc)
            self.servers[i] = None
            if not any(self.servers):
                self.no_server.append((time.time(), math.inf))
            self.report.faults["server SIGKILL"] += 1
            return Event(event.at + rng.uniform(*plan.server_down), "start server", i)
        return None

    def kill_target(self, up: list[int]) -> int:
        """The worker a SIGKILL hits, of those up (not paused)."""
        return self.rng.choice(up)

    def _worker(self, i: int) -> Proc:
        proc = self.workers[i]
        assert proc is not None, f"worker {i} is not running"
        return proc

    def wait_all(self, c: Client, started: float) -> None:
        left = set(self.ids.values())
        deadline = started + self.plan.deadline
        while left and time.monotonic() < deadline:
            page = self.retrying(c, "jobs", lambda: c.jobs(limit=100_000))
            left -= {j.id for j in page if j.status in ("succeeded", "failed", "cancelled")}
            time.sleep(0.5)

    # ---- the checks -----------------------------------------------------------------

    def check(self, watcher: Watcher) -> None:
        r = self.report
        r.jobs = len(self.names)
        details: dict[str, JobDetail] = {}
        with self.client() as c:
            by_name = Counter(j.name for j in c.jobs(limit=100_000))
            for name in self.names:
                d = details[name] = c.job(self.ids[name])
                r.attempts += len(d.history)
                if by_name[name] != 1:
                    r.twice.append(f"{name}: {by_name[name]} jobs")
                if d.status != "succeeded":
                    r.lost.append(f"{name}: {d.status} {d.error or ''}")
                    continue
                r.twice.extend(f"{name}: {why}" for why in self.recorded_twice(c, d))
                if problem := self.corrupt(c, d):
                    r.corrupt.append(f"{name}: {problem}")
        self.measure(details, watcher)
        self.scan_logs()

    def scan_logs(self) -> None:
        """Note each 5xx answered and traceback in a server's log, and each traceback in
        a worker's."""
        r = self.report
        for proc in self.every_proc():
            text = proc.text()
            server = proc.log.name.startswith("server")
            for line in text.splitlines():
                if "Traceback" in line or (
                    server and ("answered 5" in line or "internal error" in line)
                ):
                    (r.server_errors if server else r.worker_errors).append(
                        f"{proc.log.name}: {line}"
                    )

    def recorded_twice(self, c: Client, d: JobDetail) -> list[str]:
        problems = []
        numbers = [a.attempt for a in d.history]
        if len(set(numbers)) != len(numbers):
            problems.append(f"attempt numbers {numbers}")
        won = [a.attempt for a in d.history if a.outcome == "succeeded"]
        if len(won) != 1:
            problems.append(f"succeeded attempts {won}")
            return problems
        art = c.artifact(d.id)
        if art.attempt != won[0]:
            problems.append(f"artifact of attempt {art.attempt}, succeeded {won[0]}")
        greeting = f"hello {d.name} attempt {won[0]}"
        said = [e.line for e in c.logs(d.id).lines].count(greeting)
        if said != 1:
            problems.append(f"{said} x {greeting!r} in its log")
        return problems

    def corrupt(self, c: Client, d: JobDetail) -> str | None:
        art = c.artifact(d.id)
        blob = self.root / "artifact.tar.zst"
        c.get_blob(art.sha256, blob)
        data = blob.read_bytes()
        if hashlib.sha256(data).hexdigest() != art.sha256:
            return "the blob's digest is not its name"
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            member = tar.extractfile("outputs/result.bin")
            content = member.read() if member else b""
        if content != expected_artifact(d.name):
            return f"outputs/result.bin differs ({len(content)} bytes)"
        return None

    def measure(self, details: dict[str, JobDetail], watcher: Watcher) -> None:
        r = self.report
        begun: dict[tuple[str, int], float] = {}
        ended: dict[tuple[str, int], float] = {}
        for line in self.effects.read_text().splitlines():
            parts = line.split()
            if parts[0] == "begin":
                begun[(parts[1], int(parts[2]))] = float(parts[3])
            else:
                ended[(parts[0], int(parts[1]))] = float(parts[3])
        done = Counter(name for name, _ in ended)
        r.ran_twice = sum(1 for n in done.values() if n > 1)
        for name, d in details.items():
            worker_of = {a.attempt: a.worker for a in d.history}
            runs = sorted((t, a) for (n, a), t in begun.items() if n == name)
            for (_, first), (start_next, _) in itertools.pairwise(runs):
                gone = watcher.gone.get((name, first), ended.get((name, first), start_next))
                overlap = max(0.0, gone - start_next)
                if (name, first) in self.cancelled:
                    r.overlap_cancelled = max(r.overlap_cancelled, overlap)
                elif self.was_paused(worker_of.get(first), begun[(name, first)], gone):
                    r.overlap_frozen = max(r.overlap_frozen, overlap)
                else:
                    r.overlap_live = max(r.overlap_live, overlap)
            for a, b in itertools.pairwise(d.history):
                if a.outcome != "lost" or a.finished_at is None:
                    continue
                claimed = a.claimed_at.timestamp()
                finished = a.finished_at.timestamp()
                killed = [t for w, t in self.kills if w == a.worker and claimed < t < finished]
                if not killed:
                    continue
                r.requeued.append(finished - killed[0])
                if b.started_at is not None:
                    r.restarted.append(b.started_at.timestamp() - killed[0])
                due = killed[0] + self.plan.lease
                back = [t1 for t0, t1 in self.no_server if t0 < due + 2 and killed[0] < t1]
                if back:
                    r.across_restart += 1
                    r.overdue.append(finished - max(due, *back))
                else:
                    r.requeued_server_up.append(finished - killed[0])

    def was_paused(self, worker: str | None, start: float, end: float) -> bool:
        return any(p0 < end and start < p1 for p0, p1 in self.pauses.get(worker or "", []))


def summary(report: Report, plan: Plan) -> str:
    return "\n".join(report.lines(plan))
