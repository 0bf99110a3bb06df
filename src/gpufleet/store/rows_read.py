"""Rows the store returns: plain dataclasses, parsed from the tables (the JSON they hold
by the tolerant models of :mod:`gpufleet.store.json_columns`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any, Self

from gpufleet.domain.checkpoints import SnapFile, Snapshot
from gpufleet.domain.models import Capability, GpuInfo, JobSpec, JobStatus, WorkerStatus
from gpufleet.store import json_columns


def _lines(text: str | None) -> tuple[str, ...]:
    return tuple(json.loads(text)) if text else ()


class _Columns:
    """A row whose columns map one to one onto the dataclass's fields."""

    @classmethod
    def from_row(cls, r: Any) -> Self:
        return cls.from_mapping(dict(r._mapping))

    @classmethod
    def from_mapping(cls, m: dict[str, Any]) -> Self:
        return cls(**m)


@dataclass(frozen=True)
class JobRow:
    id: str
    name: str
    status: JobStatus
    spec_json: str
    priority: int
    pool: str
    manifest: str | None
    model: str | None
    attempts: int
    max_attempts: int
    lease: int
    worker_id: str | None
    gpus: tuple[int, ...]
    lease_expires_at: float | None
    created_at: float
    claimed_at: float | None
    started_at: float | None
    finished_at: float | None
    not_before: float | None
    exit_code: int | None
    error: str | None
    unrunnable: str | None
    waiting: int = 0
    submitted_by: str | None = None
    target: str | None = None
    stderr_tail: tuple[str, ...] = ()
    stop_requested_at: float | None = None
    stop_grace: float | None = None
    stopped_early: bool = False
    progress: str | None = None  # the latest progress record, JSON
    metrics: str | None = None  # the last value of each metric, a JSON object
    gpu_mib: int | None = None  # GPU memory its processes used, at the last heartbeat
    failure: str | None = None  # the latest attempt's failure class ("environment")
    losses: int = 0  # attempts its machines lost (not counted against max_attempts)
    pause_requested_at: float | None = None  # `gpufleet pause`, while it is carried out
    raised: str | None = None  # why a requirement was raised after an out-of-memory, JSON
    owner: str = ""  # the submitting token's name: the user charged for what it runs
    preempt_requested_at: float | None = None  # asked to make way, while carried out
    preempted_at: float | None = None  # when it was last preempted (its protection)
    preempted_by: str | None = None  # the job it last made way for
    made_way_on: str | None = None  # the worker whose slot is being freed for it
    made_way_until: float | None = None  # ...until when (its claims offer it first)

    @cached_property
    def spec(self) -> JobSpec:
        """Parsed on first use: a claim looks at many rows and reads few specs."""
        return json_columns.spec(self.spec_json)

    @classmethod
    def from_row(cls, r: Any) -> JobRow:
        return cls.from_mapping(dict(r._mapping))

    @classmethod
    def from_mapping(cls, m: dict[str, Any]) -> JobRow:
        m["spec_json"] = m.pop("spec")
        m["status"] = JobStatus(m["status"])
        m["gpus"] = tuple(json.loads(m["gpus"]))
        m["stderr_tail"] = _lines(m.get("stderr_tail"))
        m["stopped_early"] = bool(m.get("stopped_early"))
        missing, extra = _JOB_REQUIRED.difference(m), m.keys() - _JOB_NAMES
        if missing or extra:
            wrong = [*(f"without {k}" for k in sorted(missing)), *(f"with {k}" for k in extra)]
            raise TypeError(f"a job row {', '.join(wrong)}")
        # Filled in directly: a frozen dataclass's __init__ sets each of the 32 fields
        # through object.__setattr__ (9 us a row), and claims and listings read many rows.
        row = object.__new__(cls)
        row.__dict__.update(_JOB_DEFAULTS, **m)
        return row


_JOB_FIELDS = fields(JobRow)
_JOB_DEFAULTS = {f.name: f.default for f in _JOB_FIELDS if f.default is not MISSING}
_JOB_REQUIRED = frozenset(f.name for f in _JOB_FIELDS if f.default is MISSING)
_JOB_NAMES = frozenset(f.name for f in _JOB_FIELDS)


@dataclass(frozen=True)
class AttemptRow:
    job_id: str
    attempt: int
    worker_id: str | None
    worker_name: str | None
    gpus: tuple[int, ...]
    claimed_at: float
    started_at: float | None
    finished_at: float | None
    exit_code: int | None
    outcome: str | None
    error: str | None
    stderr_tail: tuple[str, ...] = ()
    late_result: str | None = None
    log_lines: int = 0
    output_bytes: int = 0
    output_dropped: int = 0  # bytes of its output cut by the quota (gpufleet.domain.quota)
    output_cut: bool = False
    failure: str | None = None  # the class of its failure ("environment"), if named
    environment: str | None = None  # the environment it ran in, JSON (its start report)
    cause: str | None = None  # why it ended: the job's own or its machine's (lifecycle)
    restored: str | None = None  # the snapshot restored before it started, JSON

    @classmethod
    def from_row(cls, r: Any) -> AttemptRow:
        return cls.from_mapping(dict(r._mapping))

    @classmethod
    def from_mapping(cls, m: dict[str, Any]) -> AttemptRow:
        m["gpus"] = tuple(json.loads(m["gpus"]))
        m["stderr_tail"] = _lines(m.get("stderr_tail"))
        m["output_cut"] = bool(m.get("output_cut"))
        return cls(**m)


@dataclass(frozen=True)
class WorkerRow:
    id: str
    name: str
    pool: str
    labels: dict[str, str]
    capability: Capability
    cpu_slots: int
    ephemeral: bool
    status: WorkerStatus
    drain: bool
    gpu_stats: tuple[GpuInfo, ...]
    registered_at: float
    last_heartbeat: float | None
    token_id: str | None = None
    offline_since: float | None = None
    fixed_labels: dict[str, str] = field(default_factory=dict)
    environments: tuple[BuiltEnv, ...] = ()  # in its cache, as its heartbeats last said
    drain_by: float | None = None  # an operator's drain deadline (server time), if any
    owner_state: str | None = None  # its owner policy as its heartbeat said it (JSON)

    @classmethod
    def from_row(cls, r: Any) -> WorkerRow:
        return cls.from_mapping(r._mapping)

    @classmethod
    def from_mapping(cls, m: Any) -> WorkerRow:
        return cls(
            id=m["id"],
            name=m["name"],
            pool=m["pool"],
            labels=json.loads(m["labels"]),
            capability=json_columns.capability(m["capability"]),
            cpu_slots=m["cpu_slots"],
            ephemeral=bool(m["ephemeral"]),
            status=WorkerStatus(m["status"]),
            drain=bool(m["drain"]),
            gpu_stats=json_columns.gpus(m["gpu_stats"]),
            registered_at=m["registered_at"],
            last_heartbeat=m["last_heartbeat"],
            token_id=m["token_id"],
            offline_since=m["offline_since"],
            fixed_labels=json.loads(m["fixed_labels"] or "{}"),
            environments=built_envs(m.get("environments")),
            drain_by=m.get("drain_by"),
            owner_state=m.get("owner_state"),
        )


@dataclass(frozen=True)
class BuiltEnv:
    """An environment in a worker's cache: its build key, the spec it was built from,
    the Python, its size on disk, when a job last used it (epoch seconds), what it is
    built from, in a line, and its torch build."""

    key: str
    spec_key: str
    python: str
    size_bytes: int = 0
    last_used: float = 0.0
    describe: str = ""
    torch_backend: str | None = None


def built_envs(text: str | None) -> tuple[BuiltEnv, ...]:
    """A worker's ``environments`` column read back; an entry it cannot read (written by
    another version) is left out rather than failing the worker's row."""
    try:
        found = json.loads(text or "[]")
    except ValueError:
        return ()
    out = []
    for entry in found if isinstance(found, list) else ():
        try:
            out.append(
                BuiltEnv(
                    key=str(entry["key"]),
                    spec_key=str(entry["spec_key"]),
                    python=str(entry["python"]),
                    size_bytes=int(entry.get("size_bytes") or 0),
                    last_used=float(entry.get("last_used") or 0.0),
                    describe=str(entry.get("describe") or ""),
                    torch_backend=str(entry["torch_backend"])
                    if entry.get("torch_backend")
                    else None,
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return tuple(out)


@dataclass(frozen=True)
class EnvLockRow(_Columns):
    """A pool's lock of an unlocked environment spec (``environment_locks``):
    the blob holding the resolved versions, what it locks (spec, Python major.minor,
    torch build), the job and worker whose build recorded it, when, and when it last
    replaced an earlier one. Locks are per pool: one pool's workers never install what
    another pool's recorded."""

    pool: str
    key: str
    sha256: str
    spec_key: str
    python: str
    torch_backend: str | None
    job_id: str
    worker_name: str
    created_at: float
    replaced_at: float | None = None


@dataclass(frozen=True)
class TokenRow(_Columns):
    id: str
    name: str
    role: str
    pool: str | None
    hash: str
    created_at: float
    revoked_at: float | None
    expires_at: float | None = None
    hint: str = ""
    labels_json: str = "{}"

    @classmethod
    def from_mapping(cls, m: dict[str, Any]) -> TokenRow:
        m["labels_json"] = m.pop("labels", None) or "{}"
        return cls(**m)

    @property
    def pools(self) -> tuple[str, ...]:
        """The pools the token is scoped to; empty: every pool (a token of every pool)."""
        return tuple(p for p in (self.pool or "").split(",") if p)

    def live(self, now: float) -> bool:
        """Neither revoked nor expired at ``now``."""
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)

    @property
    def labels(self) -> dict[str, str]:
        """Labels a worker enrolled with this token carries, whatever it declares."""
        found: dict[str, str] = json.loads(self.labels_json)
        return found


@dataclass(frozen=True)
class AuditRow(_Columns):
    seq: int
    at: float
    token_id: str | None
    token_name: str | None
    role: str | None
    address: str
    method: str | None
    path: str | None
    status: int | None
    target: str | None
    event: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class LogRow(_Columns):
    seq: int
    job_id: str
    attempt: int
    stream: str
    line: str
    ts: float


@dataclass(frozen=True)
class HostRow(_Columns):
    name: str
    manifest: str
    policy: str  # a HostPolicy as JSON; read with json_columns.host_policy
    updated_at: float


@dataclass(frozen=True)
class BlobRow(_Columns):
    sha256: str
    size: int
    created_at: float
    archive: str | None


@dataclass(frozen=True)
class ArtifactRow(_Columns):
    job_id: str
    attempt: int
    sha256: str
    size: int
    files: str
    file_count: int
    bytes: int
    created_at: float


@dataclass(frozen=True)
class CheckpointRow(_Columns):
    """A snapshot of a job's checkpoint folder (gpufleet.domain.checkpoints)."""

    id: int
    job_id: str
    attempt: int
    created_at: float
    files: str  # JSON: [[path, sha256, size], ...]
    file_count: int
    bytes: int
    progress: str = "{}"

    def snapshot(self) -> Snapshot:
        files = tuple(SnapFile(str(p), str(h), int(n)) for p, h, n in json.loads(self.files))
        progress = json.loads(self.progress or "{}")
        return Snapshot(self.id, self.job_id, self.attempt, self.created_at, files, progress)


@dataclass(frozen=True)
class FreshLines:
    lines: Sequence[tuple[str, str]]
    end: int  # the attempt's line count after them


def line_bytes(line: str) -> int:
    """The size of a log line in UTF-8 (without encoding it when it is ASCII)."""
    return len(line) if line.isascii() else len(line.encode())


def log_offsets(
    have: int, first: int | None, lines: Sequence[tuple[str, str]]
) -> FreshLines | None:
    """Of a batch of an attempt's output lines starting at line ``first`` (None: after the
    ``have`` lines the store has), the ones the store lacks; None when it has them all (a
    batch sent again after its answer was lost)."""
    start = have if first is None else first
    fresh = lines[max(0, have - start) :]
    return FreshLines(fresh, start + len(lines)) if fresh else None


@dataclass(frozen=True)
class WebhookRow:
    """A webhook (``schema.webhooks``): ``events`` decoded from its JSON text."""

    id: str
    scope: str
    target: str
    url: str
    secret: str
    events: tuple[str, ...]
    running_past: float | None
    created_by: str | None
    created_at: float

    @classmethod
    def from_mapping(cls, m: dict[str, Any]) -> WebhookRow:
        return cls(**{**m, "events": tuple(json.loads(m["events"]))})


@dataclass(frozen=True)
class DeliveryRow(_Columns):
    """A delivery of one event to one webhook (``schema.webhook_deliveries``)."""

    id: int
    key: str
    webhook_id: str
    job_id: str
    event: str
    body: str
    state: str
    tries: int
    next_at: float
    created_at: float
    error: str | None = None
