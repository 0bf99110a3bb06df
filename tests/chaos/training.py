"""The chaos run with checkpoints (issue 34): training jobs that resume, under worker and
server SIGKILLs.

The load is the example training (examples/checkpoints/train.py): ``epochs`` epochs of
``epoch_seconds`` each, a checkpoint (state.json) after every epoch, kept by its worker
on the server as a snapshot at once, and restored into the next attempt's folder, which
goes on from the epoch after it. The faults come from the seeded schedule of
:mod:`tests.chaos.harness`: workers SIGKILLed (a worker running a training is chosen when
there is one) and started again, servers SIGKILLed and started again.

At the end, from the server's records only (each job's history, its progress events per
attempt, its snapshots, the state.json of its newest one and the final.json of its
artifact):

- unfinished: a job not ``succeeded``, or whose final state or final.json does not list
  every epoch exactly once;
- trained over twice: an epoch that more than two attempts trained;
- the work lost to each kill, per attempt it ended: from the attempt's last snapshot
  before the kill (or its start, when it took none) to the kill, plus the requeue delay
  (the kill to the server recording the attempt lost). Its bound is one checkpoint
  interval (an epoch) plus the lease, plus ``slack`` (the sync's and the requeue's own
  latency), plus the time no server ran within it (a snapshot cannot be kept then).
  Asserted by epochs: the epochs trained again (the killed attempt's last epoch on
  record less the epoch the next attempt resumed after) times the interval, plus the
  requeue delay. Reported by time as well (which counts an attempt's start-up, before
  its first checkpoint, as lost).

A server keeps a job's newest few snapshots only, and a worker that loses its lease
drops the progress lines it could not send: so a watcher asks the servers for the
snapshots of the running jobs twice a second during the run, and the snapshots it saw
are the record of when each was taken and how far it went.
"""

from __future__ import annotations

import io
import json
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.client import Client
from gpufleet.errors import GpufleetError
from gpufleet.wire import AttemptOut, CheckpointOut, JobDetail, JobSpecModel
from tests.chaos.harness import PYTHON, Chaos, Event, Plan, Report, Watcher

TRAIN = Path(__file__).parents[2] / "examples" / "checkpoints" / "train.py"


@dataclass
class TrainingPlan(Plan):
    """The chaos suite with checkpoints: ``jobs`` trainings, worker and server SIGKILLs."""

    jobs: int = 20
    workers: int = 4
    slots: int = 2
    worker_kills: int = 10
    pauses: int = 0
    server_kills: int = 5
    cancel_requeues: int = 0
    epochs: int = 8
    epoch_seconds: float = 0.75
    max_attempts: int = 20
    gap: tuple[float, float] = (1.5, 3.0)
    slack: float = 2.0
    warmup: float = 8.0  # before the first fault
    deadline: float = 300.0


@dataclass
class Loss:
    """The work one kill cost one attempt."""

    kill: str  # "worker SIGKILL", or "server SIGKILL" (the attempt lost no worker)
    job: str
    attempt: int
    since_snapshot: float  # the attempt's last snapshot (or start) to the kill
    requeue: float  # the kill to the attempt recorded lost
    epochs_again: int
    bound: float  # interval + lease + slack + the time no server ran meanwhile
    server_down: float  # that last part

    interval: float = 0.0  # the checkpoint interval (an epoch)

    @property
    def total(self) -> float:
        """By time: the last snapshot (or the attempt's start, process start-up included)
        to the kill, plus the requeue delay."""
        return self.since_snapshot + self.requeue

    @property
    def work(self) -> float:
        """By epochs: the epochs trained again times the interval, plus the requeue delay
        (the figure asserted)."""
        return self.epochs_again * self.interval + self.requeue


@dataclass
class TrainingReport:
    base: Report
    jobs: int = 0
    attempts: int = 0
    resumed: int = 0  # attempts that restored a snapshot
    unfinished: list[str] = field(default_factory=list)
    overtrained: list[str] = field(default_factory=list)
    losses: list[Loss] = field(default_factory=list)
    times_trained: Counter[int] = field(default_factory=Counter)  # times -> epochs

    @property
    def over_bound(self) -> list[Loss]:
        return [loss for loss in self.losses if loss.work > loss.bound]

    def ok(self) -> bool:
        b = self.base
        return not (
            self.unfinished
            or self.overtrained
            or self.over_bound
            or b.server_errors
            or b.worker_errors
        )

    def lines(self, plan: TrainingPlan) -> list[str]:
        b, interval = self.base, plan.epoch_seconds
        backend = "PostgreSQL" if plan.db else "SQLite"
        faults = ", ".join(f"{n} {k}" for k, n in sorted(b.faults.items()))
        trained = ", ".join(f"{n} epochs x{t}" for t, n in sorted(self.times_trained.items()))
        out = [
            f"{plan.servers} server(s) on {backend}, {plan.workers} workers x {plan.slots}"
            f" slots, lease {plan.lease}s, {plan.epochs} epochs of {interval}s a job"
            f" (a checkpoint each), seed {plan.seed}",
            f"jobs {self.jobs}, attempts {self.attempts} ({self.resumed} resumed from a"
            f" snapshot), in {b.seconds:.0f}s; faults: {faults}",
            f"unfinished {len(self.unfinished)}, an epoch trained over twice"
            f" {len(self.overtrained)}; epochs trained: {trained}",
            f"server 5xx/tracebacks {len(b.server_errors)},"
            f" worker tracebacks {len(b.worker_errors)}",
            f"work lost per kill and attempt ({len(self.losses)}), against checkpoint"
            f" interval + lease = {interval + plan.lease:.2f}s (asserted with"
            f" {plan.slack}s slack, plus any time no server ran):",
        ]
        for loss in sorted(self.losses, key=lambda x: -x.total):
            down = f" + {loss.server_down:.2f}s no server" if loss.server_down else ""
            out.append(
                f"  {loss.kill} {loss.job}#{loss.attempt}: {loss.work:.2f}s ="
                f" {loss.epochs_again} epoch(s) again + {loss.requeue:.2f}s requeue; by time"
                f" {loss.total:.2f}s ({loss.since_snapshot:.2f}s since its snapshot or start);"
                f" bound {loss.bound:.2f}s{down}{'  OVER' if loss.work > loss.bound else ''}"
            )
        return out


@dataclass(frozen=True)
class Seen:
    """A snapshot as the watcher saw it on a server."""

    job: str
    attempt: int
    at: float  # created
    epoch: int


class Snapshots(threading.Thread):
    """Asks the servers for the snapshots of the running jobs, twice a second."""

    def __init__(self, client: Callable[[], Client]) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.seen: dict[int, Seen] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        with self.client() as c:
            while not self.stopping.wait(0.5):
                try:
                    for job in c.jobs("running"):
                        self.note(job.name, c.checkpoints(job.id))
                except GpufleetError:
                    continue  # no server answered: the next round asks again

    def note(self, name: str, snaps: list[CheckpointOut]) -> None:
        for s in snaps:
            epoch = s.progress.get("epoch", 0)
            self.seen[s.id] = Seen(name, s.attempt, s.created_at.timestamp(), epoch)


class TrainingChaos(Chaos):
    """A chaos run whose jobs are checkpointing trainings."""

    plan: TrainingPlan

    def __init__(self, plan: TrainingPlan, root: Path) -> None:
        super().__init__(plan, root)
        self.training = TrainingReport(self.report)

    def train(self) -> TrainingReport:
        self.snapshots = Snapshots(self.client)
        self.snapshots.start()
        try:
            self.run()
        finally:
            self.snapshots.stopping.set()
        return self.training

    def job_spec(self, name: str) -> JobSpecModel:
        plan = self.plan
        command = [PYTHON, str(TRAIN), "--epochs", str(plan.epochs)]
        command += ["--epoch-seconds", str(plan.epoch_seconds)]
        return JobSpecModel(
            name=name,
            command=command,
            checkpoint_dir="checkpoints",
            max_attempts=plan.max_attempts,
        )

    def schedule(self) -> list[Event]:
        """The faults begin once the first trainings run (workers take seconds to start
        on a loaded machine)."""
        events = super().schedule()
        for e in events:
            e.at += self.plan.warmup
        return events

    def kill_target(self, up: list[int]) -> int:
        """A worker that runs a training: the first the server names within 3 s, or any."""
        deadline = time.monotonic() + 3.0
        busy: list[int] = []
        with self.client() as c:
            while not busy and time.monotonic() < deadline:
                try:
                    running = {j.worker for j in c.jobs("running")}
                except GpufleetError:
                    running = set()
                busy = [i for i in up if f"w{i}" in running]
                if not busy:
                    time.sleep(0.2)
        return self.rng.choice(busy or up)

    # ---- the checks -----------------------------------------------------------------

    def check(self, watcher: Watcher) -> None:
        t = self.training
        t.jobs = len(self.names)
        with self.client() as c:
            for name in self.names:
                self.check_job(c, c.job(self.ids[name]))
        self.scan_logs()

    def check_job(self, c: Client, d: JobDetail) -> None:
        t, epochs = self.training, self.plan.epochs
        t.attempts += len(d.history)
        t.resumed += sum(1 for a in d.history if a.restored is not None)
        if d.status != "succeeded":
            t.unfinished.append(f"{d.name}: {d.status} {d.error or ''}")
            return
        snaps = c.checkpoints(d.id)
        self.snapshots.note(d.name, snaps)
        state = self.final_state(c, snaps)
        final = self.final_json(c, d)
        every = list(range(1, epochs + 1))
        for what, got in (("final snapshot", state), ("final.json", final)):
            listed = sorted(e for e, _ in got.get("trained", []))
            if got.get("epoch") != epochs or listed != every:
                t.unfinished.append(f"{d.name}: its {what} lists epochs {listed}")
        reported = epochs_by_attempt(c, d.id)
        by_epoch: dict[int, set[int]] = {}
        for attempt, done in reported.items():
            for epoch, _ in done:
                by_epoch.setdefault(epoch, set()).add(attempt)
        for epoch, attempt in state.get("trained", []):
            by_epoch.setdefault(epoch, set()).add(attempt)
        mine = [s for s in self.snapshots.seen.values() if s.job == d.name]
        for snap in mine:  # an epoch whose progress line was lost with its attempt
            by_epoch.setdefault(snap.epoch, set()).add(snap.attempt)
        by_epoch.pop(0, None)
        for epoch, attempts in sorted(by_epoch.items()):
            t.times_trained[len(attempts)] += 1
            if len(attempts) > 2:
                t.overtrained.append(f"{d.name}: epoch {epoch} by attempts {sorted(attempts)}")
        self.measure_losses(d, reported)

    def final_state(self, c: Client, snaps: list[CheckpointOut]) -> dict[str, Any]:
        """The state.json of the job's newest snapshot ({} when it has none)."""
        files = [f for f in snaps[0].files if f.path == "state.json"] if snaps else []
        if not files:
            return {}
        dest = self.root / "state.json"
        c.get_blob(files[0].sha256, dest)
        return dict(json.loads(dest.read_text()))

    def final_json(self, c: Client, d: JobDetail) -> dict[str, Any]:
        """outputs/final.json of the job's artifact."""
        import zstandard

        blob = self.root / "artifact.tar.zst"
        c.get_blob(c.artifact(d.id).sha256, blob)
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob.read_bytes())).read()
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            member = tar.extractfile("outputs/final.json")
            return dict(json.loads(member.read())) if member else {}

    def measure_losses(self, d: JobDetail, reported: dict[int, list[tuple[int, float]]]) -> None:
        snaps = {i: s for i, s in self.snapshots.seen.items() if s.job == d.name}
        for a, b in zip(d.history, d.history[1:], strict=False):
            if a.outcome != "lost" or a.finished_at is None:
                continue
            reached = [e for e, _ in reported.get(a.attempt, [])]
            reached += [s.epoch for s in snaps.values() if s.attempt == a.attempt]
            after = 0  # the epoch b resumed after: its snapshot's, or b's first less one
            if b.restored is not None:
                restored = snaps.get(b.restored.snapshot)
                firsts = [e for e, _ in reported.get(b.attempt, [])]
                after = restored.epoch if restored else min(firsts, default=1) - 1
            again = max(0, max(reached, default=0) - after)
            self.training.losses.append(self.loss(d.name, a, snaps, again))

    def loss(self, name: str, a: AttemptOut, snaps: dict[int, Seen], again: int) -> Loss:
        """What the kill that ended attempt ``a`` cost it: from its last snapshot (or its
        start) to the kill, and on to the server recording it lost."""
        plan = self.plan
        claimed, finished = a.claimed_at.timestamp(), a.finished_at.timestamp()  # type: ignore[union-attr]
        killed = [t for w, t in self.kills if w == a.worker and claimed < t < finished]
        down = [t0 for t0, t1 in self.no_server if claimed < t0 < finished]
        if killed:
            kind, at = "worker SIGKILL", killed[0]
        else:  # its worker stopped it, when no server answered its heartbeats
            kind, at = "server SIGKILL", down[0] if down else finished
        began = a.started_at.timestamp() if a.started_at else claimed
        taken = [s.at for s in snaps.values() if s.attempt == a.attempt and s.at <= at]
        since = max([began, *taken])
        gone = sum(max(0.0, min(t1, finished) - max(t0, since)) for t0, t1 in self.no_server)
        bound = plan.epoch_seconds + plan.lease + plan.slack + gone
        loss = Loss(kind, name, a.attempt, at - since, finished - at, again, bound, gone)
        loss.interval = plan.epoch_seconds
        return loss


def epochs_by_attempt(c: Client, job_id: str) -> dict[int, list[tuple[int, float]]]:
    """The epochs each attempt of the job reported, with when, from its progress events."""
    found: dict[int, list[tuple[int, float]]] = {}
    after = 0
    for _ in range(1000):
        page = c.events(job_id, after=after, limit=10_000)
        for e in page.events:
            record, data = e.data.get("record"), e.data
            if e.type == "progress" and isinstance(record, dict) and "epoch" in record:
                at = float(str(data["ts"]))
                found.setdefault(int(str(data["attempt"])), []).append((int(record["epoch"]), at))
        after = page.next
        if not page.more:
            break
    return found


def summary(report: TrainingReport, plan: TrainingPlan) -> str:
    return "\n".join(report.lines(plan))
