"""The worker's transition table, checked against its drawing in docs/core.md (read
independently of the code), and the changes each event makes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpufleet.domain import worker_lifecycle as wl
from gpufleet.domain.models import WorkerStatus
from gpufleet.domain.worker_lifecycle import TRANSITIONS, WorkerEvent, transition
from gpufleet.errors import InvalidTransition

ROOT = Path(__file__).resolve().parents[2]
STATE = r"(?:\[\*\]|[a-z]+)"
EDGE = re.compile(rf"^({STATE}(?:\s*\|\s*{STATE})*)\s+--([a-z_]+)-->\s+({STATE})")
NEW = "[*]"


def drawn() -> tuple[dict[tuple[WorkerStatus, WorkerEvent], WorkerStatus | None], set[str]]:
    """The edges drawn under "A worker's states", and the events drawn from ``[*]``."""
    text = (ROOT / "docs" / "core.md").read_text()
    section = text.split("## A worker's states", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    table: dict[tuple[WorkerStatus, WorkerEvent], WorkerStatus | None] = {}
    from_new = set()
    for line in block.splitlines():
        found = EDGE.match(line)
        assert found, f"docs/core.md: not an edge: {line!r}"
        froms, event, to = found.groups()
        dst = None if to == NEW else WorkerStatus(to)
        for src in (f.strip() for f in froms.split("|")):
            if src == NEW:
                assert dst is wl.INITIAL, "a new worker starts where the code says"
                from_new.add(event)
            else:
                table[(WorkerStatus(src), WorkerEvent(event))] = dst
    return table, from_new


ALLOWED, FROM_NEW = drawn()
ALL_PAIRS = [(s, e) for s in sorted(wl.STORED) for e in WorkerEvent]


def test_the_table_is_the_drawing() -> None:
    assert TRANSITIONS == ALLOWED
    assert sorted(FROM_NEW) == [WorkerEvent.REGISTER.value]


def test_the_drawing_has_every_event_and_stored_status() -> None:
    assert {e for _, e in ALLOWED} == set(WorkerEvent)
    assert {s for s, _ in ALLOWED} == set(wl.STORED)
    # reserved and busy are worked out from a worker's jobs: never a stored status
    assert WorkerStatus.RESERVED not in wl.STORED and WorkerStatus.BUSY not in wl.STORED


@pytest.mark.parametrize("event", list(WorkerEvent), ids=str)
def test_each_event_leads_to_one_status(event: WorkerEvent) -> None:
    assert {dst for (_, ev), dst in ALLOWED.items() if ev is event} == {wl.target(event)}


@pytest.mark.parametrize(("status", "event"), [p for p in ALL_PAIRS if p not in ALLOWED], ids=str)
def test_a_forbidden_transition_names_status_and_event(
    status: WorkerStatus, event: WorkerEvent
) -> None:
    with pytest.raises(InvalidTransition) as info:
        transition(status, event)
    assert info.value.detail == {"status": status.value, "event": event.value}
    assert status.value in str(info.value) and event.value in str(info.value)


def test_a_poll_revives_a_connecting_or_offline_worker_only() -> None:
    for status in (WorkerStatus.CONNECTING, WorkerStatus.OFFLINE):
        change = wl.poll("w", status, 5.0)
        assert change is not None
        assert change.values() == {
            "status": "available",
            "last_heartbeat": 5.0,
            "offline_since": None,
        }
    assert wl.poll("w", WorkerStatus.AVAILABLE, 5.0) is None
    assert wl.poll("w", WorkerStatus.DRAINING, 5.0) is None  # a poll does not undrain


def test_a_heartbeat_changes_a_status_only_when_it_differs() -> None:
    assert wl.heartbeat("w", "available", False, False, 1.0, None) is None
    assert wl.heartbeat("w", "draining", True, False, 1.0, None) is None
    asked = wl.heartbeat("w", "available", True, False, 1.0, '[{"index": 0}]')
    assert asked is not None and asked.values() == {
        "status": "draining",
        "last_heartbeat": 1.0,
        "offline_since": None,
        "gpu_stats": '[{"index": 0}]',
    }
    back = wl.heartbeat("w", "offline", False, False, 1.0, None)
    assert back is not None and back.status is WorkerStatus.AVAILABLE
    assert "gpu_stats" not in back.values()  # None: the last readings stay
    on_its_own = wl.heartbeat("w", "connecting", False, True, 1.0, None)
    assert on_its_own is not None and on_its_own.status is WorkerStatus.DRAINING


def test_a_revoked_token_leaves_its_worker_offline_and_asked_to_drain() -> None:
    change = wl.revoke("w", 9.0)
    assert change.values() == {"status": "offline", "offline_since": 9.0, "drain": True}
    assert WorkerStatus.OFFLINE in change.sources
    assert WorkerStatus.OFFLINE not in wl.leave("w", 9.0).sources  # leaving twice: once
