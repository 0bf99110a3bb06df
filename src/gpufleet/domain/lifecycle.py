"""The job state machine: one table of allowed transitions, and every status change
computed from it here.

The table is drawn in ``docs/core.md`` (its test reads the drawing). Every attempt that
ends has a cause: the job's own (its exit, its timeout, out of GPU or host memory, its
environment), counted against ``max_attempts``, or its machine's (worker lost, drained),
counted apart in ``losses`` against a larger limit (``most_losses``). Each function
below turns one event into a :class:`Change`: the status it moves to (from the table),
the statuses and lease it may move from, and the fields it sets. A store applies a
change as one conditional update and decides nothing itself.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from gpufleet.domain.models import JobStatus
from gpufleet.domain.retries import backoff_seconds, not_retried
from gpufleet.domain.transitions import Table

P, C, R = JobStatus.PENDING, JobStatus.CLAIMED, JobStatus.RUNNING
S, F, X = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED
H = JobStatus.PAUSED  # held

#: Where every job starts.
INITIAL = P


class Event(StrEnum):
    CLAIM = "claim"
    START = "start"
    SUCCEED = "succeed"
    RETRY = "retry"  # failed, attempts left: back to pending after a backoff
    FAIL = "fail"  # failed, no attempts left
    LOSE = "lose"  # lease expired: its machine's fault, not counted against max_attempts
    LOSE_FINAL = "lose_final"  # lost, and asked to stop or lost its machine too often
    RELEASE = "release"  # a draining worker hands the job back; attempt not counted
    CANCEL = "cancel"
    REQUEUE = "requeue"
    DEPENDENCY_FAILED = "dependency_failed"  # a job whose result it needs failed or was cancelled
    PAUSE = "pause"  # `gpufleet pause`: held (a running one once its worker has vacated it)
    RESUME = "resume"  # `gpufleet resume`: queued again, to go on from its checkpoint
    PREEMPT = "preempt"  # vacated for a waiting job of a higher priority; not counted


TRANSITIONS: dict[tuple[JobStatus, Event], JobStatus] = {
    (P, Event.CLAIM): C,
    (C, Event.START): R,
    (R, Event.SUCCEED): S,
    (C, Event.SUCCEED): S,
    (R, Event.RETRY): P,
    (C, Event.RETRY): P,
    (R, Event.FAIL): F,
    (C, Event.FAIL): F,
    (C, Event.LOSE): P,
    (R, Event.LOSE): P,
    (C, Event.LOSE_FINAL): F,
    (R, Event.LOSE_FINAL): F,
    (C, Event.RELEASE): P,
    (R, Event.RELEASE): P,
    (C, Event.PREEMPT): P,
    (R, Event.PREEMPT): P,
    (P, Event.CANCEL): X,
    (C, Event.CANCEL): X,
    (R, Event.CANCEL): X,
    (H, Event.CANCEL): X,
    (P, Event.PAUSE): H,
    (C, Event.PAUSE): H,
    (R, Event.PAUSE): H,
    (H, Event.RESUME): P,
    (F, Event.REQUEUE): P,
    (X, Event.REQUEUE): P,
    (P, Event.DEPENDENCY_FAILED): F,
}

#: Events that count one attempt against ``max_attempts``: the job's own ends. A lost
#: lease or a hand back is its machine's, counted in ``losses`` instead.
COUNTED = frozenset({Event.RETRY, Event.FAIL, Event.SUCCEED})
#: Attempts a job may lose to its machines (a worker lost or drained) before it fails,
#: unless the server's settings say otherwise.
MOST_LOSSES = 10


#: The lookups on :data:`TRANSITIONS`, worked out once.
TABLE: Table[JobStatus, Event, JobStatus] = Table("job", TRANSITIONS)
transition = TABLE.transition
sources = TABLE.sources
target = TABLE.target


def failure_event(attempts_used: int, max_attempts: int, *, lost: bool = False) -> Event:
    """What a failed attempt does, given the attempts used *including* this one."""
    if attempts_used >= max_attempts:
        return Event.LOSE_FINAL if lost else Event.FAIL
    return Event.LOSE if lost else Event.RETRY


#: Why a failure its worker calls final is not retried, by class: an environment no worker
#: can build; an attempt stopped at its pool's ``max_run`` (all a job of the pool may run).
NOT_BUILDABLE = "not retried: the environment cannot be built on any worker"
FINAL = {"environment": NOT_BUILDABLE, "timeout": "not retried: the pool's max_run is its most"}
#: What a failed attempt's ``state`` record keeps of its stderr: the last lines, each cut.
SAID_LINES = 5
SAID_CHARS = 300


class Ended(Protocol):
    """What a failed job's dependents name of it."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def status(self) -> JobStatus: ...
    @property
    def error(self) -> str | None: ...


class JobState(Ended, Protocol):
    """What a change needs to know of a job (a stored job row has it)."""

    @property
    def lease(self) -> int: ...
    @property
    def attempts(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def stop_requested_at(self) -> float | None: ...
    @property
    def losses(self) -> int: ...
    @property
    def pause_requested_at(self) -> float | None: ...
    @property
    def preempt_requested_at(self) -> float | None: ...


@dataclass(frozen=True)
class Change:
    """One status change of one job, decided here. A store applies it only if the job is
    still in one of ``sources`` with lease ``lease`` (and, for a lost lease, still
    lapsed before ``lost_before``): it sets ``status`` and ``fields``, opens the
    claim's attempt record (``opens``) or sets ``record`` on the attempt still open.
    Nothing else changes a job's status, and only if each ``guard`` field still holds its
    value."""

    job_id: str
    event: Event
    lease: int
    fields: Mapping[str, object] = field(default_factory=dict)
    opens: Mapping[str, object] | None = None
    record: Mapping[str, object] | None = None
    lost_before: float | None = None
    # Stored fields that must still hold what the change was decided on (a claim: the
    # spec it was ranked by; a manifest may have changed a pending job since).
    guard: Mapping[str, object] = field(default_factory=dict)
    # Who asked for it (a token's or worker's name), for the job's event log.
    by: str | None = None
    # What else the job's event log says of it: how a failed attempt ended (its exit code,
    # stderr's last lines, when it is tried again), for those following the job.
    said: Mapping[str, object] = field(default_factory=dict)

    @property
    def sources(self) -> frozenset[JobStatus]:
        return sources(self.event)

    @property
    def status(self) -> JobStatus:
        return target(self.event)

    @property
    def attempt(self) -> int:
        """The attempt record the change opens or updates."""
        return self.lease + 1 if self.event == Event.CLAIM else self.lease


def state_record(
    status: str, event: str, attempt: int, by: str | None = None, why: str | None = None
) -> dict[str, object]:
    """A ``state`` record of a job's event log: the status it is in after ``event``, the
    attempt, who asked (a token's or worker's name) and why, when known."""
    out: dict[str, object] = {"status": status, "event": event, "attempt": attempt}
    if by:
        out["by"] = by
    if why:
        out["why"] = why
    return out


def state_event(change: Change) -> dict[str, object]:
    """The record a change leaves in its job's event log (a claim's ``by``: its worker;
    ``why``: the error it sets, if any)."""
    by = change.by
    if by is None and change.opens is not None:
        by = str(change.opens.get("worker_name") or "") or None
    why = change.fields.get("error") or (change.record or {}).get("error")
    out = state_record(
        change.status.value, change.event.value, change.attempt, by, str(why) if why else None
    )
    return {**out, **change.said}


def failed_attempt(
    job: JobState, event: Event, exit_code: int | None, stderr_tail: Sequence[str], **more: object
) -> dict[str, object]:
    """What a failed attempt's ``state`` record says besides its status: the attempts used
    of how many, its exit code, the last ``SAID_LINES`` lines of its stderr (each cut at
    ``SAID_CHARS``) and anything in ``more`` (``retry_at``, ``not_retried``) that is set."""
    lines = [
        line if len(line) <= SAID_CHARS else line[: SAID_CHARS - 1] + "\u2026"
        for line in list(stderr_tail)[-SAID_LINES:]
    ]
    said: dict[str, object] = {
        "attempts": job.attempts + (1 if event in COUNTED else 0),
        "max_attempts": job.max_attempts,
    }
    if exit_code is not None:
        said["exit_code"] = exit_code
    if lines:
        said["stderr_tail"] = lines
    return {**said, **{k: v for k, v in more.items() if v is not None}}


#: What a job loses when it goes back to the queue: no worker holds it.
_UNHELD: dict[str, object] = {
    "worker_id": None,
    "gpus": (),
    "started_at": None,
    "lease_expires_at": None,
    "preempt_requested_at": None,
}


def claim(
    job: JobState,
    worker_id: str,
    worker_name: str,
    gpus: Sequence[int],
    now: float,
    expires: float,
    spec: str | None = None,
) -> Change:
    """A worker claims a pending job: a new lease (the attempt number) on ``gpus``. With
    ``spec`` (the stored spec the claim was ranked on), it takes only if the job still
    has that spec: an apply changing it meanwhile voids the claim."""
    held = {"worker_id": worker_id, "gpus": tuple(gpus)}
    fields = {
        **held,
        "lease": job.lease + 1,
        "claimed_at": now,
        "started_at": None,
        "finished_at": None,
        "exit_code": None,
        "lease_expires_at": expires,
    }
    opens = {**held, "worker_name": worker_name, "claimed_at": now}
    guard = {} if spec is None else {"spec": spec}
    return Change(job.id, Event.CLAIM, job.lease, fields, opens=opens, guard=guard)


def start(
    job_id: str,
    lease: int,
    started: float,
    expires: float,
    environment: str | None = None,
    restored: Mapping[str, object] | None = None,
) -> Change:
    """The worker started the claimed job's process at ``started``; ``environment``: the
    Python environment it runs in, as the worker reported it (JSON), kept on the attempt;
    ``restored``: the checkpoint snapshot restored before it started (snapshot, files,
    bytes, seconds), kept on the attempt and said in the job's event log."""
    fields = {"started_at": started, "lease_expires_at": expires}
    record: dict[str, object] = {"started_at": started}
    if environment is not None:
        record["environment"] = environment
    said: dict[str, object] = {}
    if restored is not None:
        record["restored"] = json.dumps(dict(restored), separators=(",", ":"))
        said["restored"] = dict(restored)
    return Change(job_id, Event.START, lease, fields, record=record, said=said)


def _ended(
    job: JobState,
    event: Event,
    now: float,
    *,
    attempts: int,
    outcome: str,
    error: str | None,
    exit_code: int | None = None,
    stderr_tail: Sequence[str] = (),
    failure: str | None = None,
    cause: str | None = None,
    **extra: object,
) -> Change:
    """An attempt ends with ``event``: the job's fields and the attempt's record (the
    job's ``failure`` is its latest attempt's class, as its ``error`` is; ``cause``, kept
    on the attempt, says whose fault its end was)."""
    tail = tuple(stderr_tail) or None
    said = {"exit_code": exit_code, "error": error, "stderr_tail": tail, "failure": failure}
    fields: dict[str, object] = {
        **said,
        "attempts": attempts,
        "lease_expires_at": None,
        "not_before": None,
        "stopped_early": False,
        **extra,
    }
    if target(event).terminal:
        fields["finished_at"] = now
    else:
        fields.update(_UNHELD)
    record = {**said, "finished_at": now, "outcome": outcome, "cause": cause}
    return Change(job.id, event, job.lease, fields, record=record)


def finish(
    job: JobState,
    exit_code: int | None,
    error: str | None,
    stderr_tail: Sequence[str],
    now: float,
    backoff_base: float,
    *,
    retry_on: Collection[int] = (),
    no_retry_on: Collection[int] = (),
    failure: str | None = None,
    final: bool = False,
    no_bigger: str | None = None,
    raised: Mapping[str, object] | None = None,
) -> Change:
    """The worker reports how the attempt ended: success, a retry after a backoff while
    attempts are left, or failure. A job asked to stop that did not exit 0 failed and is
    not tried again; one that exited 0 succeeded early. An exit code that is not retried
    (:func:`not_retried`, from the job's ``retry_on`` and ``no_retry_on``) fails it at
    once, saying why. ``failure`` names the failure's class ("environment": the job's
    environment could not be built), kept on the attempt and the job; ``final`` says it
    would fail the same way on every worker (a requirement that does not exist), so the
    job fails at once (:data:`NOT_BUILDABLE`); a failure that is not final (the network,
    a full disk) is retried as any other. An attempt out of memory ("gpu_oom",
    "host_oom") is retried with the job's fields ``raised`` sets (its spec, asking for
    more memory), or, with ``no_bigger`` (why no worker has more), fails at once."""
    event, outcome, error, refused = _outcome(
        job, exit_code, error, failure, final or no_bigger, retry_on, no_retry_on
    )
    change = _finished(
        job, event, now, backoff_base, outcome, error, exit_code, stderr_tail, refused, failure
    )
    if event == Event.RETRY and raised:
        change = replace(change, fields={**change.fields, **raised})
    return change


def _finished(
    job: JobState,
    event: Event,
    now: float,
    backoff_base: float,
    outcome: str,
    error: str | None,
    exit_code: int | None,
    stderr_tail: Sequence[str],
    refused: str | None,
    failure: str | None,
) -> Change:
    """The change :func:`finish` makes once it knows how the attempt ended (``event``):
    the job's fields, the attempt's record, and what a failure says."""
    used = job.attempts + 1
    stopped = job.stop_requested_at is not None
    if event == Event.SUCCEED:
        stderr_tail = ()
    not_before = now + backoff_seconds(used, backoff_base) if event == Event.RETRY else None
    change = _ended(
        job,
        event,
        now,
        attempts=used,
        outcome="stopped" if stopped else outcome,
        error=error,
        exit_code=exit_code,
        stderr_tail=stderr_tail,
        not_before=not_before,
        stopped_early=stopped and event == Event.SUCCEED,
        failure=None if event == Event.SUCCEED else failure,
        cause=None if event == Event.SUCCEED else (failure or "exit"),
    )
    if event == Event.SUCCEED:
        return change
    said = failed_attempt(
        job,
        event,
        exit_code,
        stderr_tail,
        retry_at=not_before,
        not_retried=refused,
        failure=failure,
    )
    return replace(change, said=said)


def _outcome(
    job: JobState,
    exit_code: int | None,
    error: str | None,
    failure: str | None,
    final: bool | str | None,
    retry_on: Collection[int],
    no_retry_on: Collection[int],
) -> tuple[Event, str, str | None, str | None]:
    """How an attempt ended (:func:`finish`): event, outcome, error, why not retried."""
    if exit_code == 0 and error is None and failure is None:
        return Event.SUCCEED, "succeeded", error, None
    used = job.attempts + 1
    stopped = job.stop_requested_at is not None
    refused = None
    if not stopped and used < job.max_attempts:  # with none left, it fails anyway
        refused = not_retried(exit_code, retry_on, no_retry_on)
        if final is True and failure in FINAL:
            refused = FINAL[failure]
        elif isinstance(final, str):  # why no worker could do better
            refused = final
    event = Event.FAIL if stopped or refused else failure_event(used, job.max_attempts)
    error = error or _no_word(exit_code, failure)
    if refused:
        error = f"{error.rstrip('.')}, {refused}"
    return event, "failed", error, refused


def _no_word(exit_code: int | None, failure: str | None) -> str:
    """A failed attempt's error when its worker sent none."""
    if failure == "environment":
        return "the environment could not be built"
    if failure == "gpu_oom":
        return f"out of GPU memory (exit code {exit_code})"
    if failure == "host_oom":
        return "out of host memory: the kernel's OOM killer ended it"
    return f"exit code {exit_code}"


def lose(
    job: JobState,
    now: float,
    who: str | None,
    restarted: bool = False,
    most_losses: int = MOST_LOSSES,
) -> Change:
    """The job's lease expired (its worker went silent): its machine's fault, so not
    counted against ``max_attempts`` but in ``losses``, and the job back in the queue
    until it has lost ``most_losses`` (never, when it was asked to stop). Applied only if
    the lease is still expired at ``now``: a heartbeat may just have landed. With
    ``restarted``, its worker started again and no longer runs it (it died, and the job
    with it): the lease is lost now, as it would be at its expiry, without waiting."""
    losses = job.losses + 1
    if restarted:
        error = f"lost: worker {who} started again without it"
    else:
        error = f"lease lost: worker {who} stopped heartbeating"
    event = Event.LOSE
    if job.stop_requested_at is not None:
        event = Event.LOSE_FINAL
    elif job.pause_requested_at is not None:  # it was being paused: held, as asked
        event = Event.PAUSE
    elif losses >= most_losses:
        event = Event.LOSE_FINAL
        error = f"{error}; it has lost its machine {losses} times (the most is {most_losses})"
    change = _ended(
        job,
        event,
        now,
        attempts=job.attempts,
        outcome="lost",
        error=error,
        cause="lost",
        losses=losses,
    )
    change = replace(change, said={**failed_attempt(job, event, None, ()), "losses": losses})
    return change if restarted else replace(change, lost_before=now)


def release(
    job: JobState, now: float, why: str, most_losses: int = MOST_LOSSES, owner: bool = False
) -> Change:
    """The worker hands the job back (drained, left, its token revoked): back in the
    queue, the attempt counted in ``losses``, not against ``max_attempts``; a job that has
    lost ``most_losses`` so fails, one vacated for a pause is held; one preempted or
    vacated for the workstation's ``owner`` counts as neither. A job asked to stop ends
    instead, failed: running it again from the start is not what a stop asked for."""
    losses, error = job.losses + (0 if owner else 1), job.error
    event, outcome, cause = Event.RELEASE, "released", "owner" if owner else "drained"
    if job.pause_requested_at is not None:  # vacated for `gpufleet pause`: held
        event, outcome, cause, losses = Event.PAUSE, "paused", "paused", job.losses
    elif job.stop_requested_at is not None:
        error = f"asked to stop; {why} before it ended"
        return _ended(job, Event.FAIL, now, attempts=job.attempts + 1, outcome="stopped",
                      error=error, cause=cause)  # fmt: skip
    elif job.preempt_requested_at is not None:  # made way for a job of a higher priority
        event, outcome, cause, losses = Event.PREEMPT, "preempted", "preempted", job.losses
    elif losses >= most_losses:
        event = Event.LOSE_FINAL
        error = f"{why}; it has lost its machine {losses} times (the most is {most_losses})"
    change = _ended(job, event, now, attempts=job.attempts, outcome=outcome, error=error,
                    cause=cause, losses=losses)  # fmt: skip
    if change.status.terminal:
        return change
    # the job keeps its latest counted attempt's class, as it keeps its error
    return replace(change, fields={k: v for k, v in change.fields.items() if k != "failure"})


def cancel(job: JobState, now: float) -> Change:
    """An owner or operator cancels a job that has not ended."""
    fields = {
        "finished_at": now,
        "lease_expires_at": None,
        "error": "cancelled",
        "stderr_tail": None,
        "failure": None,
    }
    record = {"finished_at": now, "outcome": "cancelled", "error": "cancelled"}
    return Change(job.id, Event.CANCEL, job.lease, fields, record=record)


def pause(job: JobState, now: float) -> Change:
    """`gpufleet pause` of a pending job: held at once (a claimed or running one is held
    once its worker has vacated it: :func:`release`)."""
    return Change(job.id, Event.PAUSE, job.lease, {"pause_requested_at": now, "not_before": None})


def resume(job: JobState) -> Change:
    """`gpufleet resume`: a paused job is queued again (its next attempt restores its
    latest checkpoint, wherever it runs)."""
    return Change(job.id, Event.RESUME, job.lease, {"pause_requested_at": None})


def requeue(job: JobState) -> Change:
    """An operator queues a failed or cancelled job again, with fresh budgets of attempts
    and losses (its attempt number, the lease, goes on counting up; the history keeps
    every one)."""
    fields = {
        **_UNHELD,
        "attempts": 0,
        "losses": 0,
        "not_before": None,
        "finished_at": None,
        "exit_code": None,
        "error": None,
        "stderr_tail": None,
        "failure": None,
        "stop_requested_at": None,
        "stop_grace": None,
        "stopped_early": False,
    }
    return Change(job.id, Event.REQUEUE, job.lease, fields)


@dataclass(frozen=True)
class _EndedAs:
    id: str
    name: str
    status: JobStatus
    error: str | None


def dependents_failed(
    failed: Ended, below: Mapping[str, Sequence[JobState]], now: float
) -> list[Change]:
    """The changes failing every pending job below ``failed`` (``below``: a job's id to
    the pending jobs waiting on it), nearest first, each naming the first dependency that
    failed it reached, with its final status. Breadth first, no recursion: any length."""
    changes: list[Change] = []
    ended: deque[Ended] = deque([failed])
    seen = {failed.id}
    while ended:
        dep = ended.popleft()
        for waiting in below.get(dep.id, ()):
            if waiting.id in seen:
                continue
            seen.add(waiting.id)
            change = dependency_failed(waiting, dep, now)
            changes.append(change)
            error = change.fields["error"]
            ended.append(_EndedAs(waiting.id, waiting.name, change.status, str(error)))
    return changes


def dependency_failed(job: JobState, dep: Ended, now: float) -> Change:
    """A pending job whose dependency ``dep`` ended without success fails too, naming the
    dependency's final status (and its error)."""
    reason = f"dependency {dep.name} ({dep.id}) {dep.status.value}"
    if dep.error:
        reason += f": {dep.error}"
    fields = {"finished_at": now, "error": reason[:2000]}
    return Change(job.id, Event.DEPENDENCY_FAILED, job.lease, fields)
