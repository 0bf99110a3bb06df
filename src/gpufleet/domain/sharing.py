"""Sharing a fleet: the operator's rules, read from the server's sharing file (TOML).

Users (a token's name) and pools have **weights** (their fair share of the GPUs) and
**caps** (the most GPUs and CPU slots they may hold at once; for a pool, the longest a job
may run). ``[fair_share]`` sets the half-life usage decays with, ``[preemption]`` which
jobs may preempt which, and ``[webhooks]`` which destinations webhooks may reach. A lab's
whole file::

    [fair_share]
    half_life = "7d"

    [users.alice]
    weight = 2
    max_gpus = 4

    [pools.default]
    max_run = "2d"
    preemptible = true

    [preemption]
    min_priority = 10
    min_wait = "10m"
    protection = "1h"

Nothing here does I/O: :func:`parse` takes the decoded TOML and the file's name (for its
errors); :mod:`gpufleet.server.sharing` reads the file and reads it again when it changes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufleet.domain.destinations import Allowed
from gpufleet.domain.fairshare import HALF_LIFE
from gpufleet.domain.limits import MAX_TIMEOUT
from gpufleet.errors import ConfigError

#: The weight of a user or pool the file does not name.
WEIGHT = 1.0
#: A waiting job's least wait before it may preempt, and a preempted job's protection.
MIN_WAIT = 300.0
PROTECTION = 3600.0
#: The name a job without a token's owner is charged to (a server without tokens).
NOBODY = ""

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


@dataclass(frozen=True)
class Share:
    """One user's or pool's weight and caps (None: no cap)."""

    weight: float = WEIGHT
    max_gpus: int | None = None
    max_cpu_slots: int | None = None
    # A pool's only: the longest a job of the pool may run (seconds), and whether its
    # running jobs may be preempted even when they do not say so themselves.
    max_run: float | None = None
    preemptible: bool = False
    # A user's only: the highest priority their submitter tokens may ask for (None: any,
    # unless preemption is on; see :func:`priority_refusal`).
    max_priority: int | None = None


@dataclass(frozen=True)
class Preemption:
    """Which waiting jobs may preempt: those of priority ``min_priority`` or more, after
    waiting ``min_wait`` seconds, of a running job of a lower priority that allows it and
    was not preempted in the last ``protection`` seconds."""

    enabled: bool = False
    min_priority: int = 1
    min_wait: float = MIN_WAIT
    protection: float = PROTECTION


@dataclass(frozen=True)
class Sharing:
    """The operator's sharing rules; the default (no file) is no fair share, no caps, no
    preemption."""

    fair_share: bool = False
    half_life: float = HALF_LIFE
    # Per-user labels on /metrics (off by default: a series per user is the operator's call).
    user_metrics: bool = False
    users: Mapping[str, Share] = field(default_factory=dict)
    pools: Mapping[str, Share] = field(default_factory=dict)
    preemption: Preemption = field(default_factory=Preemption)
    # Webhook destinations allowed (host names, addresses or networks), beyond the defaults.
    webhook_allow: tuple[str, ...] = ()

    def user(self, name: str) -> Share:
        return self.users.get(name, _DEFAULT)

    def pool(self, name: str) -> Share:
        return self.pools.get(name, _DEFAULT)


_DEFAULT = Share()


def duration(value: object, where: str) -> float:
    """Seconds from a number or a string such as "90", "30s", "10m", "2h", "7d", "1w"."""
    if isinstance(value, bool):
        raise ConfigError(f'{where}: expected seconds or a duration such as "10m", got {value!r}')
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value.lower())):
        seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    else:
        raise ConfigError(
            f'{where}: expected seconds or a duration such as "10m", "2h", "7d"; got {value!r}'
        )
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{where}: must be a finite duration of 0 or more, got {value!r}")
    return seconds


def _table(raw: object, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table, got {type(raw).__name__}")
    return raw


def _unknown(raw: Mapping[str, Any], known: set[str], where: str) -> None:
    extra = sorted(set(raw) - known)
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r} (known: {', '.join(sorted(known))})")


def _count(raw: Mapping[str, Any], key: str, where: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}.{key}: expected a whole number of 0 or more, got {value!r}")
    return value


def _share(raw: object, where: str, pool: bool) -> Share:
    table = _table(raw, where)
    known = {"weight", "max_gpus", "max_cpu_slots"} | (
        {"max_run", "preemptible"} if pool else {"max_priority"}
    )
    _unknown(table, known, where)
    weight = table.get("weight", WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise ConfigError(f"{where}.weight: expected a number above 0, got {weight!r}")
    if not math.isfinite(weight):
        raise ConfigError(f"{where}.weight: expected a finite number, got {weight!r}")
    preemptible = table.get("preemptible", False)
    if not isinstance(preemptible, bool):
        raise ConfigError(f"{where}.preemptible: expected true or false, got {preemptible!r}")
    return Share(
        weight=float(weight),
        max_gpus=_count(table, "max_gpus", where),
        max_cpu_slots=_count(table, "max_cpu_slots", where),
        max_run=_max_run(table.get("max_run"), f"{where}.max_run"),
        preemptible=preemptible,
        max_priority=_priority(table.get("max_priority"), f"{where}.max_priority"),
    )


def _priority(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 1_000_000:
        raise ConfigError(f"{where}: expected a whole number from -1000000 to 1000000")
    return value


def priority_refusal(rules: Sharing, user: str, priority: int) -> str | None:
    """Why a submitter token of ``user`` may not ask for ``priority`` (None: it may). Its
    ``max_priority`` bounds it; without one, while preemption is on, a submitter stays
    below ``min_priority`` (priority is what preempts another user's job: the operator
    grants it). Operators and admins are not bounded."""
    limit = rules.user(user).max_priority
    key = f"users.{user}.max_priority"
    if limit is None and rules.preemption.enabled:
        limit, key = rules.preemption.min_priority - 1, "preemption.min_priority, less one"
    if limit is None or priority <= limit:
        return None
    return (
        f"priority {priority} is above the most {user or 'this token'} may ask for: {limit} "
        f"({key}, in the server's sharing rules)"
    )


def _max_run(raw: object, where: str) -> float | None:
    """A pool's longest run: every attempt's timeout, so at least a second (0 would stop
    each job of the pool as it starts) and no longer than a job's own timeout may be."""
    if raw is None:
        return None
    seconds = duration(raw, where)
    if not 1 <= seconds <= MAX_TIMEOUT:
        raise ConfigError(
            f"{where}: must be between 1 second and {MAX_TIMEOUT} seconds, got {raw!r}"
        )
    return seconds


def _shares(raw: object, where: str, pool: bool) -> dict[str, Share]:
    table = _table(raw, where)
    return {name: _share(v, f"{where}.{name}", pool) for name, v in table.items()}


def _preemption(raw: object, where: str) -> Preemption:
    table = _table(raw, where)
    _unknown(table, {"enabled", "min_priority", "min_wait", "protection"}, where)
    enabled = table.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{where}.enabled: expected true or false, got {enabled!r}")
    least = _priority(table.get("min_priority", 1), f"{where}.min_priority")
    return Preemption(
        enabled=enabled,
        min_priority=1 if least is None else least,
        min_wait=duration(table.get("min_wait", MIN_WAIT), f"{where}.min_wait"),
        protection=duration(table.get("protection", PROTECTION), f"{where}.protection"),
    )


def _fair_share(raw: object, where: str) -> tuple[bool, float, bool]:
    table = _table(raw, where)
    _unknown(table, {"enabled", "half_life", "user_metrics"}, where)
    enabled, per_user = table.get("enabled", True), table.get("user_metrics", False)
    for key, value in (("enabled", enabled), ("user_metrics", per_user)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}.{key}: expected true or false, got {value!r}")
    half_life = duration(table.get("half_life", HALF_LIFE), f"{where}.half_life")
    if half_life < 1:
        raise ConfigError(f"{where}.half_life: must be at least 1 second, got {half_life:g}")
    return enabled, half_life, per_user


def _allow(raw: object, where: str) -> tuple[str, ...]:
    table = _table(raw, where)
    _unknown(table, {"allow"}, where)
    allow = table.get("allow", [])
    if not isinstance(allow, list) or not all(isinstance(a, str) and a.strip() for a in allow):
        raise ConfigError(f"{where}.allow: expected a list of host names or networks")
    found = tuple(a.strip() for a in allow)
    try:
        Allowed.of(found)
    except ValueError as exc:
        raise ConfigError(f"{where}.allow: {exc}") from None
    return found


def parse(raw: Mapping[str, Any], source: str) -> Sharing:
    """The rules of a decoded sharing file; a :class:`ConfigError` naming ``source`` and
    the key for anything wrong. Naming ``[fair_share]`` (or a user's weight) turns fair
    share on; ``[preemption]`` turns preemption on unless it says ``enabled = false``."""
    _unknown(raw, {"fair_share", "users", "pools", "preemption", "webhooks"}, source)
    users = _shares(raw.get("users", {}), f"{source}: users", pool=False)
    pools = _shares(raw.get("pools", {}), f"{source}: pools", pool=True)
    on, half_life, per_user = False, HALF_LIFE, False
    if "fair_share" in raw:
        on, half_life, per_user = _fair_share(raw["fair_share"], f"{source}: fair_share")
    elif any(s.weight != WEIGHT for s in users.values()):  # a pool's ranks nothing
        on = True
    preemption = Preemption()
    if "preemption" in raw:
        preemption = _preemption(raw["preemption"], f"{source}: preemption")
    allow = _allow(raw["webhooks"], f"{source}: webhooks") if "webhooks" in raw else ()
    return Sharing(on, half_life, per_user, users, pools, preemption, allow)
