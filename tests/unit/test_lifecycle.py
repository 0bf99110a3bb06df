"""The job state machine: the one table that decides every status change."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.domain.lifecycle import (
    COUNTED,
    TRANSITIONS,
    Event,
    backoff_seconds,
    failure_event,
    sources,
    transition,
)
from gpufleet.domain.models import ACTIVE, TERMINAL, JobStatus
from gpufleet.errors import InvalidTransition

P, C, R = JobStatus.PENDING, JobStatus.CLAIMED, JobStatus.RUNNING
S, F, X = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED

# Written out by hand from DESIGN.md "Job lifecycle", independently of TRANSITIONS.
ALLOWED = {
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
    (P, Event.CANCEL): X,
    (C, Event.CANCEL): X,
    (R, Event.CANCEL): X,
    (F, Event.REQUEUE): P,
    (X, Event.REQUEUE): P,
    (P, Event.DEPENDENCY_FAILED): F,
}
ALL_PAIRS = [(s, e) for s in JobStatus for e in Event]


@pytest.mark.parametrize(("status", "event"), sorted(ALLOWED), ids=str)
def test_allowed_transition(status: JobStatus, event: Event) -> None:
    assert transition(status, event) is ALLOWED[(status, event)]


def test_the_table_allows_nothing_more() -> None:
    assert TRANSITIONS == ALLOWED


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
    assert sources(Event.CANCEL) == frozenset({P, C, R})
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


def test_release_is_the_only_way_back_that_does_not_count_an_attempt() -> None:
    assert Event.RELEASE not in COUNTED
    assert {Event.RETRY, Event.FAIL, Event.LOSE, Event.LOSE_FINAL, Event.SUCCEED} <= COUNTED
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
