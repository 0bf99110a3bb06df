"""Table definitions (SQLAlchemy Core). Migrations in ``migrations/versions`` create them.

Timestamps are seconds since the epoch (floats) taken from the server's clock only.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData()
# Ever-growing row numbers (log lines, audit records): 64-bit. SQLite's INTEGER PRIMARY KEY
# is 64-bit already, and only that exact type is its auto-increment rowid.
SEQ = BigInteger().with_variant(Integer, "sqlite")

jobs = Table(
    "jobs",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("status", String(16), nullable=False),
    Column("spec", Text, nullable=False),
    Column("priority", Integer, nullable=False, default=0),
    Column("pool", String(200), nullable=False),
    Column("manifest", String(200)),
    Column("model", String(200)),
    Column("attempts", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False),
    Column("lease", Integer, nullable=False, default=0),
    Column("worker_id", String(64)),
    Column("gpus", Text, nullable=False, default="[]"),
    Column("lease_expires_at", Float),
    Column("created_at", Float, nullable=False),
    Column("claimed_at", Float),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("not_before", Float),
    Column("exit_code", Integer),
    Column("error", Text),
    Column("unrunnable", Text),
    # Dependencies (job:NAME inputs) not yet succeeded; only a job at 0 is claimable.
    Column("waiting", Integer, nullable=False, default=0),
    # The token that submitted it: a submitter steers only its own jobs.
    Column("submitted_by", String(64)),
    # The worker (id or name) the job is aimed at, if any: it holds that worker's slot.
    Column("target", String(200)),
    # The last lines the latest attempt wrote to stderr (JSON list), to say why it failed.
    Column("stderr_tail", Text),
    # `gpufleet stop`: when it was asked, and how long the job may take before SIGTERM.
    Column("stop_requested_at", Float),
    Column("stop_grace", Float),
    # It ended after a stop with exit code 0: succeeded, early.
    Column("stopped_early", Boolean, nullable=False, default=False),
    # What the job last reported of itself (a progress record, JSON), and the last value
    # of each metric it has reported (JSON object): read without walking its event log.
    Column("progress", Text),
    Column("metrics", Text),
    # GPU memory the job's processes used at its worker's last heartbeat (MiB), if known.
    Column("gpu_mib", Integer),
    # The class of the latest attempt's failure, when the worker named one ("environment":
    # its environment could not be built); None otherwise. Cleared as ``error`` is.
    Column("failure", String(32)),
    # Attempts that ended because of the machine (worker lost, drained, paused): counted
    # apart from ``attempts`` (the job's own failures), against a larger limit (0017).
    Column("losses", Integer, nullable=False, default=0, server_default="0"),
    # `gpufleet pause`: when it was asked (the running job is checkpointed, then held).
    Column("pause_requested_at", Float),
    # Why a requirement was raised after an attempt ran out of memory (JSON), for `why`.
    Column("raised", Text),
    # The name of the token that submitted it (its user), charged for what it runs and
    # ranked by that user's fair share (0018); "" without a token.
    Column("owner", String(200), nullable=False, default="", server_default=""),
    # Preemption (0019): when it was asked to make way for a waiting job (cleared once its
    # worker handed it back), when it was last preempted (its protection runs from then)
    # and by which job.
    Column("preempt_requested_at", Float),
    Column("preempted_at", Float),
    Column("preempted_by", String(64)),
    # A waiting job a running one was preempted for: the worker whose slot is being freed
    # for it, until when; that worker's claims offer it first (0019).
    Column("made_way_on", String(64)),
    Column("made_way_until", Float),
)
# Claims read jobs in (priority DESC, created_at, id) order: the index matches it exactly.
Index(
    "ix_jobs_queue",
    jobs.c.status,
    jobs.c.pool,
    jobs.c.priority.desc(),
    jobs.c.created_at,
    jobs.c.id,
)
Index("ix_jobs_worker", jobs.c.worker_id, jobs.c.status)
# Fair share reads each user's first claimable jobs: the pending jobs by pool and owner in
# claim order. Partial: a job leaves it when claimed, so finished jobs cost nothing.
Index(
    "ix_jobs_owner_queue",
    jobs.c.pool,
    jobs.c.owner,
    jobs.c.priority.desc(),
    jobs.c.created_at,
    jobs.c.id,
    sqlite_where=jobs.c.status == "pending",
    postgresql_where=jobs.c.status == "pending",
)
# The jobs list pages by creation, newest first: read from this index, not by sorting every
# job. Neither column ever changes, so status changes (claims) do not pay for it.
Index("ix_jobs_created", jobs.c.created_at, jobs.c.id)
# Partial: only jobs aimed at a worker are in it, so the claims of every other job (a
# status change each) do not pay for keeping it.
Index(
    "ix_jobs_target",
    jobs.c.target,
    jobs.c.status,
    sqlite_where=jobs.c.target.is_not(None),
    postgresql_where=jobs.c.target.is_not(None),
)
# The pending jobs a worker's slot is being freed for (0019). Partial: a job leaves it
# when it is claimed.
Index(
    "ix_jobs_made_way",
    jobs.c.made_way_on,
    sqlite_where=(jobs.c.status == "pending") & jobs.c.made_way_on.is_not(None),
    postgresql_where=(jobs.c.status == "pending") & jobs.c.made_way_on.is_not(None),
)
# A job's detail names the jobs it preempted (0019). Partial: few jobs were ever preempted.
Index(
    "ix_jobs_preempted_by",
    jobs.c.preempted_by,
    sqlite_where=jobs.c.preempted_by.is_not(None),
    postgresql_where=jobs.c.preempted_by.is_not(None),
)

attempts = Table(
    "attempts",
    metadata,
    Column("job_id", String(64), ForeignKey("jobs.id"), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("worker_id", String(64)),
    Column("worker_name", String(200)),
    Column("gpus", Text, nullable=False, default="[]"),
    Column("claimed_at", Float, nullable=False),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("exit_code", Integer),
    Column("outcome", String(32)),
    Column("error", Text),
    Column("stderr_tail", Text),
    # A result its worker sent after the attempt had ended (lease lost, cancelled): refused
    # with 409, and kept here so the history shows it (what, and when).
    Column("late_result", Text),
    # How many output lines the attempt's worker has sent: a batch sent again (its answer
    # lost) names its first line, and the lines already here are not stored twice.
    Column("log_lines", BigInteger, nullable=False, default=0, server_default="0"),
    # The attempt's output quota (gpufleet.domain.quota): bytes of output stored and
    # dropped, and whether its output is being cut now.
    Column("output_bytes", BigInteger, nullable=False, default=0, server_default="0"),
    Column("output_dropped", BigInteger, nullable=False, default=0, server_default="0"),
    Column("output_cut", Boolean, nullable=False, default=False),
    # The class of its failure ("environment"), when its worker named one.
    Column("failure", String(32)),
    # The Python environment it ran in, as its worker reported it at the start (JSON: build
    # key, spec key, Python, built or found, seconds, package versions, torch build).
    Column("environment", Text),
    # Why it ended, by whose fault: the job's ("exit", "timeout", "gpu_oom", "host_oom",
    # "environment") or the machine's ("lost", "drained", "paused") (0017), or the
    # workstation owner's ("owner": vacated for them, counted as neither) (0020).
    Column("cause", String(32)),
    # The snapshot restored before it started (JSON: id, files, bytes, seconds), if any.
    Column("restored", Text),
)

workers = Table(
    "workers",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("pool", String(200), nullable=False),
    Column("labels", Text, nullable=False, default="{}"),
    Column("capability", Text, nullable=False),
    Column("cpu_slots", Integer, nullable=False),
    Column("ephemeral", Boolean, nullable=False, default=False),
    Column("status", String(16), nullable=False),
    Column("drain", Boolean, nullable=False, default=False),
    # When an operator's drain ends (server time): running jobs are then vacated (grace
    # signal, last checkpoint, back to the queue); None: they may finish (0017).
    Column("drain_by", Float),
    Column("gpu_stats", Text, nullable=False, default="[]"),
    Column("registered_at", Float, nullable=False),
    Column("last_heartbeat", Float),
    # The token that enrolled the worker: only that token may act as this worker.
    Column("token_id", String(64)),
    # When it went offline (no heartbeat, or it left); None while online.
    Column("offline_since", Float),
    # Labels its token fixes (JSON object); the worker cannot change them.
    Column("fixed_labels", Text, nullable=False, default="{}"),
    # Claims made for the worker: a claim ranked on a snapshot commits only if it is
    # still the count it read (nobody claimed a slot of this worker meanwhile).
    Column("claims", BigInteger, nullable=False, default=0, server_default="0"),
    # The environments in its cache, as its last heartbeat that sent them listed them
    # (JSON list: key, spec_key, python, size_bytes, last_used, describe).
    Column("environments", Text, nullable=False, default="[]", server_default="[]"),
    # Its owner policy as its last heartbeat said it (JSON: reasons it takes no jobs, the
    # foreign processes on its GPUs, the owner's GPUs); None: it runs under none (0020).
    Column("owner_state", Text),
)

hosts = Table(
    "hosts",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("manifest", String(200), nullable=False),
    Column("policy", Text, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# One event log per job: output lines (stream stdout or stderr), ``progress`` records and
# ``state`` records (JSON), numbered by one sequence; a job's records in commit order.
job_logs = Table(
    "job_logs",
    metadata,
    Column("seq", SEQ, primary_key=True, autoincrement=True),
    Column("job_id", String(64), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("stream", String(8), nullable=False),
    Column("line", Text, nullable=False),
    Column("ts", Float, nullable=False),
)
Index("ix_job_logs_job", job_logs.c.job_id, job_logs.c.seq)
# The fleet-wide event stream reads status changes only: a partial index of those.
Index(
    "ix_job_logs_state",
    job_logs.c.seq,
    sqlite_where=job_logs.c.stream == "state",
    postgresql_where=job_logs.c.stream == "state",
)

tokens = Table(
    "tokens",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("role", String(16), nullable=False),
    Column("pool", String(200)),
    Column("hash", String(64), nullable=False, unique=True),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float),
    Column("expires_at", Float),
    # The secret's first characters, so a leaked token can be told apart; never more.
    Column("hint", String(16), nullable=False, default=""),
    # Labels a worker enrolled with this token carries, whatever it says (JSON object).
    Column("labels", Text, nullable=False, default="{}"),
)

# Dashboard sign-ins: the browser holds the session secret in an HttpOnly cookie; the
# server keeps its SHA-256. A session lives until ``expires_at``, its sign-out, or its
# token's revocation or rotation (``token_hash`` is the token's hash at sign-in).
# Jobs by pool and status, kept by triggers on ``jobs`` (migration 0011), so that counting
# them costs the same with a hundred jobs or a million. On SQLite the trigger adds to
# ``job_counts`` directly (one writer: nothing to contend for). On PostgreSQL it appends
# +1/-1 rows to ``job_count_deltas`` (appends never wait on each other, where one counter
# row per status would serialize every claim), which the server folds into
# ``job_counts`` every few seconds; a count reads both.
job_counts = Table(
    "job_counts",
    metadata,
    Column("pool", String(200), primary_key=True),
    Column("status", String(16), primary_key=True),
    Column("n", BigInteger, nullable=False),
)

job_count_deltas = Table(
    "job_count_deltas",
    metadata,
    Column("seq", SEQ, primary_key=True, autoincrement=True),
    Column("pool", String(200), nullable=False),
    Column("status", String(16), nullable=False),
    Column("n", Integer, nullable=False),
)

sessions = Table(
    "sessions",
    metadata,
    Column("hash", String(64), primary_key=True),
    Column("token_id", String(64), nullable=False),
    Column("token_hash", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
)

# The fleet's own secrets, by name, made by the first server that needs one: every server
# sharing the database uses the same (the key of pool-scoped callers' event ids).
server_keys = Table(
    "server_keys",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("secret", String(128), nullable=False),
)

# Every state-changing call: who (token), from where, what (method, path, target), how it
# ended (status). Denied calls are recorded too. Lifecycle events the server decides itself
# (a worker registered, went offline, was removed; a lease lost) have an ``event`` instead
# of a method, path and status.
audit = Table(
    "audit",
    metadata,
    Column("seq", SEQ, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("token_id", String(64)),
    Column("token_name", String(200)),
    Column("role", String(16)),
    Column("address", String(64), nullable=False),
    Column("method", String(8)),
    Column("path", String(2000)),
    Column("status", Integer),
    Column("target", String(200)),
    Column("event", String(32)),
    Column("detail", Text),
)
Index("ix_audit_at", audit.c.at)

# Which pools may read a blob: those of the tokens that uploaded it (or proved they hold it
# by sending its bytes), and of the jobs that use it as a package or left it as artifact.
# Admin and operator tokens read every blob.
blob_pools = Table(
    "blob_pools",
    metadata,
    Column("sha256", String(64), primary_key=True),
    Column("pool", String(200), primary_key=True),
)

# The fleet-wide lock of an unlocked environment spec, by ``lock_key`` (spec, Python
# major.minor, torch build): the versions the first build resolved (a blob: uv's pinned
# requirements or a uv.lock), which every later build of the spec installs. A job asking
# for a fresh resolution (``upgrade``) replaces it (``replaced_at``).
environment_locks = Table(
    "environment_locks",
    metadata,
    Column("pool", String(200), primary_key=True),
    Column("key", String(64), primary_key=True),
    Column("sha256", String(64), nullable=False),
    Column("spec_key", String(64), nullable=False),
    Column("python", String(32), nullable=False),
    Column("torch_backend", String(64)),
    Column("job_id", String(64), nullable=False),
    Column("worker_name", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("replaced_at", Float),
)

# Usage for fair share: unit-seconds (GPU-seconds, or CPU-slot-seconds of ``kind`` "cpu")
# each user's ended attempts held in a pool, by time slice (``start``, ``width`` seconds;
# gpufleet.domain.fairshare). Rows only grow; a slice older than a few half-lives is
# dropped by the retention sweep.
usage = Table(
    "usage",
    metadata,
    Column("owner", String(200), primary_key=True),
    Column("pool", String(200), primary_key=True),
    Column("kind", String(8), primary_key=True),
    Column("start", Float, primary_key=True),
    Column("width", Float, nullable=False),
    Column("seconds", Float, nullable=False),
)
Index("ix_usage_start", usage.c.start)

# ---- the data plane ---------------------------------------------------------------------

# A row exists only once the blob's file is complete, verified, fsynced and renamed.
blobs = Table(
    "blobs",
    metadata,
    Column("sha256", String(64), primary_key=True),
    Column("size", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    # What a scan of the blob as an archive found: {"files", "bytes"} or {"error"}.
    Column("archive", Text),
)

uploads = Table(
    "uploads",
    metadata,
    Column("id", String(64), primary_key=True),
    # NULL: the blob is named by the hash of what arrives (migration 0012)
    Column("sha256", String(64)),
    Column("size", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    # the token that opened the session: only it may append, finish or abort it (0013)
    Column("token_id", String(64)),
)

artifacts = Table(
    "artifacts",
    metadata,
    Column("job_id", String(64), ForeignKey("jobs.id"), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("sha256", String(64), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("files", Text, nullable=False),
    Column("file_count", Integer, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
)

# A job's checkpoint folder at one moment (gpufleet.domain.checkpoints): a row exists
# only once every file it lists is a blob on the server (0017).
checkpoints = Table(
    "checkpoints",
    metadata,
    Column("id", SEQ, primary_key=True, autoincrement=True),
    Column("job_id", String(64), ForeignKey("jobs.id"), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    # JSON: [[path, sha256, size], ...]
    Column("files", Text, nullable=False),
    Column("file_count", Integer, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    # JSON: the job's last epoch and step (and their totals) when it was taken
    Column("progress", Text, nullable=False, default="{}"),
)
Index("ix_checkpoints_job", checkpoints.c.job_id, checkpoints.c.id)

job_deps = Table(
    "job_deps",
    metadata,
    Column("job_id", String(64), ForeignKey("jobs.id"), primary_key=True),
    Column("dep_id", String(64), primary_key=True),
)
Index("ix_job_deps_dep", job_deps.c.dep_id)

# Webhooks (gpufleet.domain.webhooks): word when a job ends, to a URL signed with a
# secret. ``scope``: whose jobs, ``user`` (a token's name, ``target``), ``pool`` or ``job``
# (a job id). The secret is kept as given: the server signs with it. Neither the URL nor
# the secret is ever shown again (lists show the URL's host).
webhooks = Table(
    "webhooks",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("scope", String(8), nullable=False),
    Column("target", String(200), nullable=False),
    Column("url", Text, nullable=False),
    Column("secret", String(200), nullable=False),
    Column("events", Text, nullable=False),  # JSON list of event names
    Column("running_past", Float),
    Column("created_by", String(64)),  # the token that made it
    Column("created_at", Float, nullable=False),
)
Index("ix_webhooks_scope", webhooks.c.scope, webhooks.c.target)

# Deliveries to make, being made and made: written when an event is seen, so one that is
# due survives a restart. ``key`` is the webhook, job, event and record: an event seen
# twice (two servers, a scan again after a crash) is delivered once.
webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    Column("id", SEQ, primary_key=True, autoincrement=True),
    Column("key", String(300), nullable=False, unique=True),
    Column("webhook_id", String(64), nullable=False),
    Column("job_id", String(64), nullable=False),
    Column("event", String(16), nullable=False),
    Column("body", Text, nullable=False),
    Column("state", String(8), nullable=False),  # pending | sent | failed
    Column("tries", Integer, nullable=False, default=0),
    Column("next_at", Float, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("error", String(300)),
)
Index("ix_webhook_deliveries_due", webhook_deliveries.c.state, webhook_deliveries.c.next_at)

# How far the webhook scan has read the fleet's status changes (``job_logs.seq``).
webhook_cursor = Table(
    "webhook_cursor",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("seq", BigInteger, nullable=False),
)
