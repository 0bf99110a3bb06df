"""Prometheus metrics at ``/metrics``: base units, counters ending in ``_total``, and no
label per job, user or token (a label's values stay few: statuses, pools, workers, GPUs).

Two kinds:

* **Gauges read from the database at each scrape** (the same on every server sharing it;
  with several servers, take ``max`` of them, not ``sum``): jobs by status and pool, the
  oldest pending job's age per pool, workers by status and pool, each worker's GPUs
  (memory used and total, utilisation), and the bytes kept as artifacts and packages.
* **What this process did** (``sum`` them across servers): jobs submitted, finished by
  outcome, claims, lease expirations, requeues by reason, and histograms of queue wait,
  dispatch latency (claimed to started) and run time; plus the long-polls and event
  streams open on it now.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufleet.domain import fairshare
from gpufleet.domain.models import WorkerStatus

if TYPE_CHECKING:
    from gpufleet.server.events import Hub
    from gpufleet.server.fleet import Fleet, WorkerState
    from gpufleet.server.polls import Polls
    from gpufleet.server.reads import Reads
    from gpufleet.store.api import QueueGauges
    from gpufleet.store.rows_read import JobRow

MIB = 1 << 20
# Seconds: from a moment to a day and more (queue waits and run times are long).
WAITS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400)
RUNS = (1, 10, 60, 300, 900, 1800, 3600, 2 * 3600, 4 * 3600, 8 * 3600, 86400, 3 * 86400)
# Seconds an environment build takes: a cached wheel set in a tenth of a second, a
# resolution and a CUDA torch download in many minutes.
BUILDS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800)


class Metrics:
    """This process's counters and histograms (one registry per app, so tests that build
    many apps do not share them)."""

    def __init__(self, per_user: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # registered in this order, which is the order /metrics lists them in
        self._count_jobs(self.registry)
        self._time_jobs(self.registry)
        self._watch_environments(self.registry)
        self._count_checkpoints(self.registry)
        self._count_use(self.registry)
        self.per_user = per_user

    def _count_jobs(self, r: CollectorRegistry) -> None:
        """The counters of jobs submitted, finished, claimed, lost and requeued."""
        self.submitted = Counter(
            "gpufleet_jobs_submitted", "Jobs submitted through this server", registry=r
        )
        self.finished = Counter(
            "gpufleet_jobs_finished",
            "Jobs that ended through this server, by outcome",
            ["outcome"],
            registry=r,
        )
        self.claims = Counter("gpufleet_claims", "Jobs claimed by workers", registry=r)
        self.leases_lost = Counter(
            "gpufleet_leases_lost", "Leases lost for want of a heartbeat", registry=r
        )
        self.requeues = Counter(
            "gpufleet_requeues",
            "Jobs put back in the queue, by reason (retry, lease_lost, released, preempted, "
            "operator)",
            ["reason"],
            registry=r,
        )

    def _count_use(self, r: CollectorRegistry) -> None:
        """What ended attempts held, by pool (and by user, only if the operator asks)."""
        self.gpu_seconds = Counter(
            "gpufleet_gpu_seconds",
            "GPU-seconds held by attempts that ended through this server, by pool",
            ["pool"],
            registry=r,
        )
        self.cpu_slot_seconds = Counter(
            "gpufleet_cpu_slot_seconds",
            "CPU-slot-seconds held by GPU-less attempts that ended through this server, by pool",
            ["pool"],
            registry=r,
        )
        self.user_gpu_seconds = Counter(
            "gpufleet_user_gpu_seconds",
            "GPU-seconds by pool and user (only with [fair_share] user_metrics = true)",
            ["pool", "user"],
            registry=r,
        )

    def _time_jobs(self, r: CollectorRegistry) -> None:
        """The histograms of queue wait, dispatch latency and run time."""
        self.queue_wait = Histogram(
            "gpufleet_queue_wait_seconds",
            "Seconds from submission to the claim that took the job",
            buckets=WAITS,
            registry=r,
        )
        self.dispatch = Histogram(
            "gpufleet_dispatch_latency_seconds",
            "Seconds from a claim to the job's process having started",
            buckets=WAITS,
            registry=r,
        )
        self.run_time = Histogram(
            "gpufleet_run_duration_seconds",
            "Seconds an attempt ran, from start to its end",
            buckets=RUNS,
            registry=r,
        )

    def _watch_environments(self, r: CollectorRegistry) -> None:
        """How long environment builds take, and how often one is built or reused."""
        self.env_build = Histogram(
            "gpufleet_environment_build_seconds",
            "Seconds a worker took to build a job's environment (builds made for a start)",
            buckets=BUILDS,
            registry=r,
        )
        self.env_builds = Counter(
            "gpufleet_environment_builds",
            "Job starts in an environment, by whether it was built for them or reused "
            "from a worker's cache",
            ["result"],
            registry=r,
        )

    def _count_checkpoints(self, r: CollectorRegistry) -> None:
        """Checkpoint snapshots recorded and restored through this server."""
        self.snapshots = Counter(
            "gpufleet_checkpoints", "Checkpoint snapshots recorded through this server", registry=r
        )
        self.snapshot_bytes = Counter(
            "gpufleet_checkpoint_bytes",
            "Bytes the checkpoint snapshots recorded through this server list",
            registry=r,
        )
        self.restores = Histogram(
            "gpufleet_checkpoint_restore_seconds",
            "Seconds a worker took to restore a job's checkpoint snapshot before its start",
            buckets=WAITS,
            registry=r,
        )

    def checkpointed(self, size: int) -> None:
        self.snapshots.inc()
        self.snapshot_bytes.inc(size)

    def restored(self, seconds: float) -> None:
        """A restore's time (its bytes were counted once, when its snapshot was recorded)."""
        self.restores.observe(seconds)

    def environment(self, built: bool, seconds: float) -> None:
        """A job started in an environment its worker built for it, or reused."""
        self.env_builds.labels("built" if built else "reused").inc()
        if built:
            self.env_build.observe(seconds)

    def claimed(self, created_at: float, now: float) -> None:
        self.claims.inc()
        self.queue_wait.observe(max(0.0, now - created_at))

    def started(self, claimed_at: float | None, now: float) -> None:
        if claimed_at is not None:
            self.dispatch.observe(max(0.0, now - claimed_at))

    def ended(self, status: str, job: JobRow, now: float, reason: str) -> None:
        """An attempt of ``job`` (as it was while it ran) ended: the job finished
        (``status`` terminal) or went back to the queue (pending, for ``reason``). What it
        held is counted in GPU-seconds (or CPU-slot-seconds) by pool, and by user too
        when the operator's rules ask for it (``per_user``)."""
        started_at = job.started_at
        if started_at is not None:
            held = max(0.0, now - started_at)
            self.run_time.observe(held)
            units = held * fairshare.amount(job.gpus)
            if job.gpus:
                self.gpu_seconds.labels(job.pool).inc(units)
                if self.per_user:
                    self.user_gpu_seconds.labels(job.pool, job.owner).inc(units)
            else:
                self.cpu_slot_seconds.labels(job.pool).inc(units)
        if status == "pending":
            self.requeues.labels(reason).inc()
        elif status == "paused":
            self.requeues.labels("paused").inc()
        else:
            self.finished.labels(status).inc()

    def watch(
        self,
        reads: Reads,
        fleet: Fleet,
        polls: Polls,
        hub: Hub,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Add the gauges read at each scrape: the queue through ``reads``, the workers
        through ``fleet``, this server's polls and streams."""
        self.registry.register(_Gauges(reads, fleet, polls, hub, clock))


class _Gauges(Collector):
    def __init__(
        self, reads: Reads, fleet: Fleet, polls: Polls, hub: Hub, clock: Callable[[], float]
    ) -> None:
        self.reads, self.fleet, self.polls, self.hub, self.clock = reads, fleet, polls, hub, clock

    def describe(self) -> list[Metric]:
        return []  # read at scrape time only

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        q = self.reads.gauges()
        yield from _queue_gauges(q, now)
        states = self.fleet.states()
        yield _worker_gauge(states)
        yield from _gpu_gauges(states)
        yield from self._server_gauges(q)

    def _server_gauges(self, q: QueueGauges) -> Iterator[Metric]:
        """This server's polls and event streams, and the bytes of blobs kept."""
        polls = GaugeMetricFamily(
            "gpufleet_claim_polls_waiting", "Worker long-polls waiting on this server"
        )
        polls.add_metric([], len(self.polls))
        yield polls
        streams = GaugeMetricFamily(
            "gpufleet_event_streams", "Event streams open on this server", labels=["kind"]
        )
        streams.add_metric(["job"], self.hub.counters.job_streams)
        streams.add_metric(["fleet"], self.hub.counters.fleet_streams)
        yield streams
        stored = GaugeMetricFamily(
            "gpufleet_stored_bytes", "Bytes of blobs kept, by kind", labels=["kind"]
        )
        stored.add_metric(["artifact"], q.artifact_bytes)
        stored.add_metric(["package"], q.package_bytes)
        yield stored
        kept, listed = self.reads.checkpoint_totals()
        snaps = GaugeMetricFamily(
            "gpufleet_checkpoint_snapshots_kept", "Checkpoint snapshots kept for jobs"
        )
        snaps.add_metric([], kept)
        yield snaps
        snap_bytes = GaugeMetricFamily(
            "gpufleet_checkpoint_snapshot_bytes",
            "Bytes the kept snapshots list (a file in two snapshots counts twice; it is "
            "stored once)",
        )
        snap_bytes.add_metric([], listed)
        yield snap_bytes


def _queue_gauges(q: QueueGauges, now: float) -> Iterator[Metric]:
    """Jobs by status and pool, and the oldest pending job's age per pool."""
    jobs = GaugeMetricFamily(
        "gpufleet_jobs", "Jobs in each status, by pool", labels=["status", "pool"]
    )
    for (status, pool), n in sorted(q.jobs.items()):
        jobs.add_metric([status, pool], n)
    yield jobs
    oldest = GaugeMetricFamily(
        "gpufleet_oldest_pending_job_age_seconds",
        "Age of the oldest pending job, by pool",
        labels=["pool"],
    )
    for pool, created in sorted(q.oldest_pending.items()):
        oldest.add_metric([pool], max(0.0, now - created))
    yield oldest


def _worker_gauge(states: list[WorkerState]) -> Metric:
    """Workers by status and pool."""
    workers = GaugeMetricFamily(
        "gpufleet_workers", "Workers in each status, by pool", labels=["status", "pool"]
    )
    counts: dict[tuple[str, str], int] = {}
    for s in states:
        status_pool = (s.status.value, s.row.pool)
        counts[status_pool] = counts.get(status_pool, 0) + 1
    for (status, pool), n in sorted(counts.items()):
        workers.add_metric([status, pool], n)
    return workers


def _gpu_gauges(states: list[WorkerState]) -> Iterator[Metric]:
    """Each GPU of the workers not offline: memory used and total, utilisation."""
    labels = ["worker", "gpu", "name"]
    used = GaugeMetricFamily("gpufleet_gpu_memory_used_bytes", "GPU memory in use", labels=labels)
    total = GaugeMetricFamily("gpufleet_gpu_memory_total_bytes", "GPU memory", labels=labels)
    util = GaugeMetricFamily(
        "gpufleet_gpu_utilization_ratio", "GPU busy fraction (0-1)", labels=labels
    )
    for s in states:
        if s.status == WorkerStatus.OFFLINE:
            continue
        for g in s.row.gpu_stats:
            key = [s.row.name, str(g.index), g.name]
            used.add_metric(key, (g.total_mib - g.free_mib) * MIB)
            total.add_metric(key, g.total_mib * MIB)
            if g.util_percent is not None:
                util.add_metric(key, g.util_percent / 100)
    yield used
    yield total
    yield util
