"""Column values both stores write: a new job's row, and its first event."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpufleet.domain import lifecycle, progress
from gpufleet.domain.lifecycle import Change
from gpufleet.domain.models import JobSpec
from gpufleet.domain.quota import MARKER, Account, Admitted, OutputQuota, admit
from gpufleet.store.json_columns import spec_json


def job_values(
    job_id: str,
    spec: JobSpec,
    now: float,
    unrunnable: str | None,
    submitted_by: str | None,
    owner: str | None = None,
) -> dict[str, Any]:
    """The row of a job just submitted: where the lifecycle starts every job. ``owner``:
    the submitting token's name (its user), charged for what the job runs."""
    return {
        "submitted_by": submitted_by,
        "owner": owner or "",
        "target": spec.requirements.worker,
        "id": job_id,
        "name": spec.name,
        "status": lifecycle.INITIAL.value,
        "spec": spec_json(spec),
        "priority": spec.priority,
        "pool": spec.pool,
        "manifest": spec.manifest,
        "model": spec.model,
        "attempts": 0,
        "max_attempts": spec.max_attempts,
        "lease": 0,
        "gpus": "[]",
        "created_at": now,
        "unrunnable": unrunnable,
    }


def state_row(job_id: str, attempt: int, record: dict[str, object], now: float) -> dict[str, Any]:
    """A ``state`` record (:func:`gpufleet.domain.lifecycle.state_record`) of ``attempt``
    as a row of the job's event log."""
    line = json.dumps(record, separators=(",", ":"))
    return {"job_id": job_id, "attempt": attempt, "stream": "state", "line": line, "ts": now}


def submit_events(job_ids: Sequence[str], by: str | None, now: float) -> list[dict[str, Any]]:
    """The first record of each new job's event log: it is pending, submitted by ``by``."""
    record = lifecycle.state_record("pending", "submit", 0, by)
    return [state_row(i, 0, record, now) for i in job_ids]


def progress_columns(
    lines: Sequence[tuple[str, str]], metrics: str | None
) -> dict[str, str] | None:
    """The job's ``progress`` and ``metrics`` columns after these lines are appended (the
    metrics it had are ``metrics``); None when none of them is a progress record."""
    records = [json.loads(line) for stream, line in lines if stream == "progress"]
    if not records:
        return None
    folded = progress.fold(records, json.loads(metrics) if metrics else None)
    return {"progress": progress.encode(records[-1]), "metrics": progress.encode(folded)}


def state_rows(changes: Sequence[Change]) -> list[dict[str, Any]]:
    """The event log rows of applied changes: one ``state`` record each."""
    now = time.time()
    return [state_row(c.job_id, c.attempt, lifecycle.state_event(c), now) for c in changes]


def stop_event(
    job_id: str, status: str, attempt: int, by: str | None, grace: float, now: float
) -> dict[str, Any]:
    """The record ``gpufleet stop`` leaves in the job's log: asked, by whom; no change."""
    why = f"asked to stop early (SIGTERM after {grace:g} s if it still runs)"
    record = lifecycle.state_record(status, "stop", attempt, by, why)
    return state_row(job_id, attempt, record, now)


def pause_event(job_id: str, attempt: int, by: str | None, now: float) -> dict[str, Any]:
    """The record ``gpufleet pause`` of a running job leaves in its log: asked, by whom;
    the job is held once its worker has vacated it."""
    why = "asked to pause: its grace signal, its checkpoint kept, then held"
    record = lifecycle.state_record("running", "pausing", attempt, by, why)
    return state_row(job_id, attempt, record, now)


def preempt_events(
    victim: str, lease: int, by: str, by_lease: int, why: str, said: str, now: float
) -> list[dict[str, Any]]:
    """The records a preemption leaves: in the victim's log (still running, being
    vacated, ``why``) and in the waiting job's (``said``: which job makes way for it)."""
    mine = lifecycle.state_record("running", "preempting", lease, None, why)
    theirs = lifecycle.state_record("pending", "preempting", by_lease, None, said)
    return [state_row(victim, lease, mine, now), state_row(by, by_lease, theirs, now)]


def metered(
    lines: Sequence[tuple[str, str]],
    attempt: Mapping[str, Any],
    quota: OutputQuota | None,
    now: float,
) -> Admitted:
    """Of an attempt's new lines, those to store under its output quota (None: all), and
    its account after them; ``attempt``: its row (claim time and account)."""
    account = Account(
        int(attempt["output_bytes"] or 0),
        int(attempt["output_dropped"] or 0),
        bool(attempt["output_cut"]),
    )
    if quota is None:
        return Admitted(list(lines), account, None)
    return admit(lines, account, quota, now - float(attempt["claimed_at"]))


def account_columns(account: Account) -> dict[str, Any]:
    """An attempt's output account as its row's columns."""
    return {
        "output_bytes": account.counted,
        "output_dropped": account.dropped,
        "output_cut": account.cut,
    }


def cut_event(job_id: str, status: str, attempt: int, marker: str, now: float) -> dict[str, Any]:
    """The record an output cut leaves in the job's event log: the marker's words; the
    job's status does not change (it runs on)."""
    why = marker.removeprefix(MARKER)
    return state_row(
        job_id, attempt, lifecycle.state_record(status, "output_cut", attempt, None, why), now
    )
