"""The job state machine: the one table that decides every status change."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.domain import lifecycle, retries
from gpufleet.domain.lifecycle import (
    COUNTED,
    TRANSITIONS,
    Event,
    backoff_seconds,
    failure_event,
    sources,
    target,
    transition,
)
from gpufleet.domain.models import ACTIVE, TERMINAL, JobStatus
from gpufleet.errors import InvalidTransition

P, C, R = JobStatus.PENDING, JobStatus.CLAIMED, JobStatus.RUNNING
S, F, X = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED

ROOT = Path(__file__).resolve().parents[2]
EDGE = re.compile(r"^([a-z]+(?:\s*\|\s*[a-z]+)*)\s+--([a-z_]+)-->\s+([a-z]+)")


def drawn_table() -> dict[tuple[JobStatus, Event], JobStatus]:
    """The edges drawn in docs/core.md ("A job's states"), read independently of the code."""
    text = (ROOT / "docs" / "core.md").read_text()
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    table = {}
    for line in block.splitlines():
        found = EDGE.match(line)
        assert found, f"docs/core.md: not an edge: {line!r}"
        froms, event, to = found.groups()
        for src in froms.split("|"):
            table[(JobStatus(src.strip()), Event(event))] = JobStatus(to)
    return table


ALLOWED = drawn_table()
ALL_PAIRS = [(s, e) for s in JobStatus for e in Event]


@pytest.mark.parametrize(("status", "event"), sorted(ALLOWED), ids=str)
def test_allowed_transition(status: JobStatus, event: Event) -> None:
    assert transition(status, event) is ALLOWED[(status, event)]


def test_the_table_allows_nothing_more() -> None:
    assert TRANSITIONS == ALLOWED


def test_the_drawing_has_every_event_and_status() -> None:
    assert {e for _, e in ALLOWED} == set(Event)
    assert {s for s, _ in ALLOWED} | set(ALLOWED.values()) == set(JobStatus)


@pytest.mark.parametrize("event", list(Event), ids=str)
def test_each_event_leads_to_one_status(event: Event) -> None:
    assert {dst for (_, ev), dst in ALLOWED.items() if ev is event} == {target(event)}


@pytest.mark.parametrize(
    ("status", "event"),
    [pair for pair in ALL_PAIRS if pair not in ALLOWED],
    ids=str,
)
def test_forbidden_transition_names_status_and_event(status: JobStatus, event: Event) -> None:
    with pytest.raises(InvalidTransition) as info:
        transition(status, event)
    assert status.value in str(info.value)
    assert event.value in str(info.value)
    assert info.value.detail == {"status": status.value, "event": event.value}


def test_succeeded_job_cannot_be_claimed_or_cancelled() -> None:
    with pytest.raises(InvalidTransition, match="a succeeded job cannot claim"):
        transition(S, Event.CLAIM)
    with pytest.raises(InvalidTransition, match="a succeeded job cannot cancel"):
        transition(S, Event.CANCEL)


def test_running_job_cannot_be_requeued_or_claimed_again() -> None:
    with pytest.raises(InvalidTransition, match="running"):
        transition(R, Event.REQUEUE)
    with pytest.raises(InvalidTransition, match="claim"):
        transition(R, Event.CLAIM)


def test_cancel_sources_are_exactly_the_non_terminal_statuses() -> None:
    assert sources(Event.CANCEL) == frozenset({P, C, R, JobStatus.PAUSED})
    assert sources(Event.CANCEL) == frozenset(JobStatus) - TERMINAL


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (Event.CLAIM, {P}),
        (Event.START, {C}),
        (Event.SUCCEED, {C, R}),
        (Event.RETRY, ACTIVE),
        (Event.FAIL, ACTIVE),
        (Event.LOSE, ACTIVE),
        (Event.LOSE_FINAL, ACTIVE),
        (Event.RELEASE, ACTIVE),
        (Event.REQUEUE, {F, X}),
        (Event.DEPENDENCY_FAILED, {P}),
    ],
)
def test_sources(event: Event, expected: set[JobStatus]) -> None:
    assert sources(event) == frozenset(expected)


def test_only_the_jobs_own_ends_count_an_attempt() -> None:
    assert {Event.RETRY, Event.FAIL, Event.SUCCEED} == COUNTED
    assert Event.RELEASE not in COUNTED  # its worker drained: the machine's
    assert Event.LOSE not in COUNTED and Event.LOSE_FINAL not in COUNTED  # its worker lost
    assert Event.CANCEL not in COUNTED
    assert Event.REQUEUE not in COUNTED
    assert Event.DEPENDENCY_FAILED not in COUNTED  # the job never ran


@pytest.mark.parametrize(
    ("used", "max_attempts", "lost", "expected"),
    [
        (1, 3, False, Event.RETRY),
        (2, 3, False, Event.RETRY),
        (3, 3, False, Event.FAIL),
        (4, 3, False, Event.FAIL),  # over the limit (e.g. max lowered) still fails
        (1, 1, False, Event.FAIL),
        (1, 3, True, Event.LOSE),
        (2, 3, True, Event.LOSE),
        (3, 3, True, Event.LOSE_FINAL),
        (1, 1, True, Event.LOSE_FINAL),
    ],
)
def test_failure_event(used: int, max_attempts: int, lost: bool, expected: Event) -> None:
    assert failure_event(used, max_attempts, lost=lost) is expected


def test_failure_event_lands_where_the_design_says() -> None:
    assert transition(R, failure_event(1, 3)) is P
    assert transition(R, failure_event(3, 3)) is F
    assert transition(C, failure_event(2, 3, lost=True)) is P
    assert transition(C, failure_event(3, 3, lost=True)) is F


@pytest.mark.parametrize(
    ("used", "expected"),
    [(1, 10.0), (2, 20.0), (3, 40.0), (4, 80.0), (6, 320.0), (7, 600.0), (30, 600.0)],
)
def test_backoff_doubles_up_to_the_default_cap(used: int, expected: float) -> None:
    assert backoff_seconds(used, 10.0) == expected


def test_backoff_custom_cap_and_edges() -> None:
    assert backoff_seconds(1, 2.0, cap=5.0) == 2.0
    assert backoff_seconds(2, 2.0, cap=5.0) == 4.0
    assert backoff_seconds(3, 2.0, cap=5.0) == 5.0
    assert backoff_seconds(0, 10.0) == 0.0
    assert backoff_seconds(3, 0.0) == 0.0
    # the most attempts a job can have (max_attempts <= 100) still gives the cap
    assert backoff_seconds(100, 1.0, cap=60.0) == 60.0


@given(used=st.integers(1, 40), base=st.floats(0.01, 100.0), cap=st.floats(0.01, 10_000.0))
def test_backoff_is_monotonic_and_capped(used: int, base: float, cap: float) -> None:
    this, after = backoff_seconds(used, base, cap), backoff_seconds(used + 1, base, cap)
    assert 0 < this <= cap
    assert this <= after


@settings(max_examples=300)
@given(events=st.lists(st.sampled_from(list(Event)), max_size=40))
def test_random_event_sequences_stay_in_the_state_machine(events: list[Event]) -> None:
    status = P
    for event in events:
        try:
            nxt = transition(status, event)
        except InvalidTransition:
            assert (status, event) not in ALLOWED
            continue
        assert nxt in set(JobStatus)
        if status.terminal:
            # a finished job only ever comes back through an operator's requeue
            assert event is Event.REQUEUE
            assert nxt is P
        if event is Event.CLAIM:
            assert status is P
        status = nxt


# ---- the changes computed from the table ---------------------------------------------------


@dataclass(frozen=True)
class Job:
    id: str = "j1"
    name: str = "train"
    status: JobStatus = P
    lease: int = 0
    attempts: int = 0
    max_attempts: int = 3
    error: str | None = None
    stop_requested_at: float | None = None
    losses: int = 0
    pause_requested_at: float | None = None
    preempt_requested_at: float | None = None


def test_a_claim_moves_to_the_next_lease_and_opens_its_attempt() -> None:
    change = lifecycle.claim(Job(lease=4), "w-1", "box", (1,), now=10.0, expires=40.0)
    assert (change.sources, change.status, change.lease) == ({P}, C, 4)
    assert change.fields["lease"] == 5 and change.attempt == 5
    assert change.fields["gpus"] == (1,) and change.fields["lease_expires_at"] == 40.0
    assert change.opens == {
        "worker_id": "w-1",
        "gpus": (1,),
        "worker_name": "box",
        "claimed_at": 10.0,
    }


@pytest.mark.parametrize(
    ("job", "exit_code", "event", "not_before"),
    [
        (Job(status=R, lease=1), 0, Event.SUCCEED, None),
        (Job(status=R, lease=1), 1, Event.RETRY, 110.0),
        (Job(status=R, lease=2, attempts=1), 1, Event.RETRY, 120.0),
        (Job(status=R, lease=3, attempts=2), 1, Event.FAIL, None),
        (Job(status=R, lease=1, stop_requested_at=5.0), 0, Event.SUCCEED, None),
        (Job(status=R, lease=1, stop_requested_at=5.0), 1, Event.FAIL, None),
    ],
)
def test_a_finish_is_decided_from_the_exit_and_the_attempts_left(
    job: Job, exit_code: int, event: Event, not_before: float | None
) -> None:
    change = lifecycle.finish(job, exit_code, None, ["boom"], now=100.0, backoff_base=10.0)
    assert change.event is event
    assert change.status is transition(job.status, event)
    assert change.lease == job.lease
    assert change.fields["not_before"] == not_before
    assert change.fields["attempts"] == job.attempts + 1
    assert change.fields["stopped_early"] is (
        event is Event.SUCCEED and job.stop_requested_at is not None
    )
    failed = event is not Event.SUCCEED
    assert change.fields["error"] == (
        "exit code 1" if exit_code == 1 else "exit code 2" if failed else None
    )
    assert change.fields["stderr_tail"] == (("boom",) if failed else None)
    assert change.record is not None
    assert change.record["outcome"] == (
        "stopped" if job.stop_requested_at else "succeeded" if not failed else "failed"
    )
    if change.status is P:
        assert change.fields["worker_id"] is None and change.fields["gpus"] == ()
    else:
        assert change.fields["finished_at"] == 100.0


def test_a_lost_lease_counts_a_loss_not_an_attempt_and_applies_only_while_expired() -> None:
    change = lifecycle.lose(Job(status=R, lease=2, attempts=2), now=50.0, who="box")
    assert (change.event, change.status, change.lost_before) == (Event.LOSE, P, 50.0)
    assert change.fields["attempts"] == 2 and change.fields["losses"] == 1
    assert change.record is not None and change.record["cause"] == "lost"
    assert change.fields["error"] == "lease lost: worker box stopped heartbeating"
    last = lifecycle.lose(Job(status=R, lease=3, losses=9), now=50.0, who="box", most_losses=10)
    assert last.event is Event.LOSE_FINAL and last.status is F
    assert "lost its machine 10 times (the most is 10)" in str(last.fields["error"])
    stopped = lifecycle.lose(Job(status=R, lease=1, stop_requested_at=1.0), now=50.0, who="box")
    assert stopped.status is F


def test_a_release_does_not_count_unless_the_job_was_asked_to_stop() -> None:
    change = lifecycle.release(Job(status=R, lease=2, attempts=1, error="old"), 9.0, "drained")
    assert (change.event, change.status) == (Event.RELEASE, P)
    assert change.fields["attempts"] == 1 and change.fields["error"] == "old"
    assert change.fields["losses"] == 1
    assert change.record is not None and change.record["cause"] == "drained"
    worn = lifecycle.release(Job(status=R, lease=2, losses=2), 9.0, "drained", most_losses=3)
    assert (worn.event, worn.status) == (Event.LOSE_FINAL, F)
    stopped = lifecycle.release(Job(status=R, lease=2, stop_requested_at=1.0), 9.0, "drained")
    assert (stopped.event, stopped.status) == (Event.FAIL, F)
    assert stopped.fields["error"] == "asked to stop; drained before it ended"


def test_a_job_vacated_for_the_workstations_owner_is_neither_a_failure_nor_a_loss() -> None:
    job = Job(status=R, lease=2, attempts=1, losses=2)
    change = lifecycle.release(job, 9.0, "owner", most_losses=3, owner=True)
    assert (change.event, change.status) == (Event.RELEASE, P), "back in the queue"
    assert change.fields["attempts"] == 1 and change.fields["losses"] == 2
    assert change.record is not None and change.record["cause"] == "owner"
    paused = lifecycle.release(Job(status=R, lease=2, pause_requested_at=4.0), 9.0, "x", owner=True)
    assert paused.status is JobStatus.PAUSED, "a pause asked for still holds it"


def test_cancel_requeue_and_a_failed_dependency() -> None:
    cancel = lifecycle.cancel(Job(status=R, lease=2), 7.0)
    assert (cancel.sources, cancel.status, cancel.lease) == ({P, C, R, JobStatus.PAUSED}, X, 2)
    assert cancel.record == {"finished_at": 7.0, "outcome": "cancelled", "error": "cancelled"}
    requeue = lifecycle.requeue(Job(status=F, lease=3, attempts=3))
    assert (requeue.sources, requeue.status, requeue.lease) == ({F, X}, P, 3)
    assert requeue.fields["attempts"] == 0 and "lease" not in requeue.fields
    dep = Job(id="d1", name="prep", status=F, error="exit code 1")
    failed = lifecycle.dependency_failed(Job(), dep, 8.0)
    assert (failed.sources, failed.status) == ({P}, F)
    assert failed.fields == {
        "finished_at": 8.0,
        "error": "dependency prep (d1) failed: exit code 1",
    }


def test_a_failure_fails_everything_below_it_nearest_first_each_naming_its_dependency() -> None:
    """A diamond: b and c wait on a, d on both. d is failed once, by b (reached first),
    and its error carries b's, which carries a's."""
    a = Job(id="a", name="prep", status=F, error="exit code 3")
    b, c, d = Job(id="b", name="train"), Job(id="c", name="eval"), Job(id="d", name="report")
    changes = lifecycle.dependents_failed(a, {"a": [b, c], "b": [d], "c": [d]}, now=5.0)
    assert [ch.job_id for ch in changes] == ["b", "c", "d"]
    assert {ch.status for ch in changes} == {F}
    errors = {ch.job_id: ch.fields["error"] for ch in changes}
    assert errors["b"] == "dependency prep (a) failed: exit code 3"
    assert errors["d"] == f"dependency train (b) failed: {errors['b']}"


def test_a_chain_of_any_length_is_walked_without_recursion() -> None:
    chain = [Job(id=f"j{n}", name=f"s{n}") for n in range(5000)]
    below = {"root": [chain[0]]} | {f"j{n}": [chain[n + 1]] for n in range(4999)}
    root = Job(id="root", name="root", status=X, error="cancelled")
    changes = lifecycle.dependents_failed(root, below, now=1.0)
    assert len(changes) == 5000 and changes[-1].job_id == "j4999"


# ---- which failures are retried, and what a failed attempt's record says -----------------


@pytest.mark.parametrize(
    ("code", "retry_on", "no_retry_on", "retried"),
    [
        (1, (), (), True),
        (-9, (), (), True),  # killed by a signal (the OOM killer): worth another try
        (None, (), (), True),  # did not start, or timed out
        (2, (), (), False),  # a usage error: the same command fails the same way
        (126, (), (), False),
        (127, (), (), False),
        (2, (2,), (), True),
        (4, (), (4, 5), False),
        (4, (4,), (4,), False),  # no_retry_on wins
    ],
)
def test_which_exit_codes_are_retried(
    code: int | None, retry_on: tuple[int, ...], no_retry_on: tuple[int, ...], retried: bool
) -> None:
    assert (retries.not_retried(code, retry_on, no_retry_on) is None) is retried


def test_an_exit_code_not_retried_fails_the_job_at_once_saying_why() -> None:
    job = Job(status=R, lease=1)
    change = lifecycle.finish(job, 4, None, ["boom"], 100.0, 10.0, no_retry_on=(4,))
    assert change.event is Event.FAIL and change.fields["attempts"] == 1
    assert change.fields["error"] == "exit code 4, never retried (the job's no_retry_on names it)"
    record = lifecycle.state_event(change)
    assert record["not_retried"] == "never retried (the job's no_retry_on names it)"
    assert (record["exit_code"], record["attempts"], record["max_attempts"]) == (4, 1, 3)
    last = lifecycle.finish(Job(status=R, attempts=2), 4, None, [], 100.0, 10.0, no_retry_on=(4,))
    assert last.fields["error"] == "exit code 4" and "not_retried" not in last.said


def test_a_retried_attempts_record_says_its_exit_code_stderr_and_retry_time() -> None:
    lines = [f"line {i}" for i in range(8)] + ["x" * 1000]
    change = lifecycle.finish(Job(status=R, lease=1), 4, None, lines, 100.0, 10.0)
    record = lifecycle.state_event(change)
    assert (record["event"], record["exit_code"], record["retry_at"]) == ("retry", 4, 110.0)
    tail = record["stderr_tail"]
    assert isinstance(tail, list) and len(tail) == lifecycle.SAID_LINES
    assert tail[:-1] == ["line 4", "line 5", "line 6", "line 7"]
    assert len(tail[-1]) == lifecycle.SAID_CHARS and tail[-1].endswith("\u2026")
    assert "exit_code" not in lifecycle.state_event(
        lifecycle.finish(Job(status=R, lease=1), 0, None, [], 100.0, 10.0)
    )


def test_a_lost_lease_says_attempts_and_losses_and_no_exit_code() -> None:
    record = lifecycle.state_event(lifecycle.lose(Job(status=R, lease=1), 100.0, "box"))
    assert (record["event"], record["attempts"], record["max_attempts"]) == ("lose", 0, 3)
    assert record["losses"] == 1
    assert "exit_code" not in record and "retry_at" not in record


@pytest.mark.parametrize(
    ("retry_on", "no_retry_on", "said"),
    [
        ((0,), (), "retry_on: 0 is not a failing exit code"),
        ((), (-65,), "no_retry_on: -65 is not"),
        ((3, 4), (4,), "exit code 4 is in both"),
        (tuple(range(1, 70)), (), "at most 64"),
    ],
)
def test_wrong_exit_code_lists_are_refused(
    retry_on: tuple[int, ...], no_retry_on: tuple[int, ...], said: str
) -> None:
    problem = retries.exit_codes_problem(retry_on, no_retry_on)
    assert problem is not None and said in problem
    assert retries.exit_codes_problem((75, -9), (4, 255)) is None


def test_a_pause_holds_a_pending_job_and_a_vacated_one_without_counting() -> None:
    held = lifecycle.pause(Job(status=P, lease=2), 5.0)
    assert (held.sources, held.status) == ({P, C, R}, JobStatus.PAUSED)
    vacated = lifecycle.release(Job(status=R, lease=2, pause_requested_at=4.0), 9.0, "paused")
    assert (vacated.event, vacated.status) == (Event.PAUSE, JobStatus.PAUSED)
    assert vacated.fields["attempts"] == 0 and vacated.fields["losses"] == 0
    assert vacated.record is not None and vacated.record["cause"] == "paused"
    lost = lifecycle.lose(Job(status=R, lease=2, pause_requested_at=4.0), 9.0, "box")
    assert lost.status is JobStatus.PAUSED, "its worker died while vacating it: held still"
    again = lifecycle.resume(Job(status=JobStatus.PAUSED, lease=2))
    assert (again.sources, again.status) == ({JobStatus.PAUSED}, P)
    assert again.fields["pause_requested_at"] is None


def test_a_preempted_job_goes_back_to_the_queue_counted_in_neither_budget() -> None:
    job = Job(status=R, lease=3, attempts=1, losses=2, preempt_requested_at=4.0)
    back = lifecycle.release(job, 9.0, "its worker handed it back")
    assert (back.event, back.status) == (Event.PREEMPT, P)
    assert back.fields["attempts"] == 1 and back.fields["losses"] == 2
    assert back.fields["preempt_requested_at"] is None, "the next attempt is not preempted"
    assert back.record is not None and back.record["cause"] == "preempted"
    assert back.record["outcome"] == "preempted"
    # A stop asked of it meanwhile wins: the job ends, as a stop asks.
    stopped = lifecycle.release(replace(job, stop_requested_at=5.0), 9.0, "handed back")
    assert stopped.status is JobStatus.FAILED
    # Lost while it was vacating: a loss like any other, and the mark goes with it.
    lost = lifecycle.lose(job, 9.0, "box")
    assert (lost.event, lost.fields["losses"]) == (Event.LOSE, 3)
    assert lost.fields["preempt_requested_at"] is None
