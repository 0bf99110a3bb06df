"""Progress records: what a job reports about itself, with no import needed.

A job appends JSON lines to the file named by ``GPUFLEET_PROGRESS_FILE``, or prints one
line ``::gpufleet:: {json}`` on stdout or stderr. Each line is one object, for example
``{"epoch": 3, "epochs": 50, "loss": 0.12}``. The known keys say how far it is:
``epoch``/``epochs``, ``step``/``steps``, ``progress`` (0 to 1), ``eta_s`` and
``message``, and of a transfer ``bytes``/``bytes_total`` and ``bytes_per_s`` (the worker
reports its download of a job's inputs so). Any other key with a number is a metric to
plot. A line that is not such an object is refused with a reason; the worker counts
those and never stops the job for one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

#: A stdout or stderr line that starts with this is a progress record, not output.
MARK = "::gpufleet::"
#: The environment variable naming the job's progress file.
ENV = "GPUFLEET_PROGRESS_FILE"
COUNTS = ("epoch", "epochs", "step", "steps", "bytes", "bytes_total", "bytes_per_s")
#: A record with ``"checkpoint": true`` asks the worker to sync the job's checkpoint
#: folder now (``gpufleet.checkpoint()`` writes one).
CHECKPOINT = "checkpoint"
KNOWN = frozenset({*COUNTS, "progress", "eta_s", "message", CHECKPOINT})
MAX_LINE = 16_384  # characters of one record
MAX_MESSAGE = 500
MAX_METRICS = 64  # metric keys in one record
MAX_KEY = 64


class BadProgress(ValueError):
    """A progress line that is not a record; the message says why."""


def is_number(value: Any) -> bool:
    """An int or float (not a bool) that a float can hold: an integer too large for one
    (JSON allows 10**400) is not a number here."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def parse(text: str) -> dict[str, Any]:
    """One record from one JSON line (the mark already cut), in its stored form: known
    keys checked, metrics kept as numbers (a NaN or infinite one as null), keys of
    other values dropped. Raises :class:`BadProgress`."""
    text = text.strip()
    if len(text) > MAX_LINE:
        raise BadProgress(f"longer than {MAX_LINE} characters")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadProgress(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise BadProgress(f"not a JSON object but {type(value).__name__}")
    return check(value)


def check(value: Mapping[str, Any]) -> dict[str, Any]:
    """A record's stored form (see :func:`parse`)."""
    out: dict[str, Any] = {}
    for key in COUNTS:
        if key in value and value[key] is not None:
            n = value[key]
            if not is_number(n) or not math.isfinite(n) or n < 0 or n != int(n) or n > 2**53:
                raise BadProgress(f"{key!r} must be a whole number >= 0, not {n!r}")
            out[key] = int(n)
    for key, low, high in (("progress", 0.0, 1.0), ("eta_s", 0.0, 1e9)):
        if key in value and value[key] is not None:
            n = value[key]
            if not is_number(n) or not math.isfinite(n) or not low <= n <= high:
                raise BadProgress(f"{key!r} must be a number from {low:g} to {high:g}, not {n!r}")
            out[key] = float(n)
    if "message" in value and value["message"] is not None:
        if not isinstance(value["message"], str):
            raise BadProgress(f"'message' must be text, not {value['message']!r}")
        out["message"] = value["message"][:MAX_MESSAGE]
    if value.get(CHECKPOINT) is not None:
        if not isinstance(value[CHECKPOINT], bool):
            raise BadProgress(f"'checkpoint' must be true or false, not {value[CHECKPOINT]!r}")
        if value[CHECKPOINT]:
            out[CHECKPOINT] = True
    metrics = 0
    for key, n in value.items():
        if key in KNOWN or not isinstance(key, str) or not is_number(n):
            continue
        if len(key) > MAX_KEY or not key.isprintable():
            raise BadProgress(f"metric name {key[:MAX_KEY]!r}... is not a short printable name")
        metrics += 1
        if metrics > MAX_METRICS:
            raise BadProgress(f"more than {MAX_METRICS} metrics in one record")
        out[key] = float(n) if math.isfinite(n) else None
    if not out:
        raise BadProgress("no known key and no numeric metric")
    return out


def encode(record: Mapping[str, Any]) -> str:
    """A record as one compact JSON line."""
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


def metrics_of(record: Mapping[str, Any]) -> dict[str, float | None]:
    """The record's metrics: its keys that are not known ones."""
    return {k: v for k, v in record.items() if k not in KNOWN}


def fold(
    records: Iterable[Mapping[str, Any]], metrics: Mapping[str, float | None] | None = None
) -> dict[str, float | None]:
    """The last value of each metric, after ``records`` (newest last) over ``metrics``."""
    out = dict(metrics or {})
    for record in records:
        out.update(metrics_of(record))
    return out


def fraction(record: Mapping[str, Any]) -> float | None:
    """How far along a record says the job is, 0 to 1: ``progress``, else epoch of
    epochs, else step of steps, else bytes of bytes_total; None when it does not say."""
    if record.get("progress") is not None:
        return float(record["progress"])
    for done, total in (("epoch", "epochs"), ("step", "steps"), ("bytes", "bytes_total")):
        if record.get(done) is not None and record.get(total):
            return min(1.0, float(record[done]) / float(record[total]))
    return None
