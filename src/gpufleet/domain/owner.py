"""The workstation's owner comes first: a worker's owner policy (a small TOML file), its
time windows, and what a worker under one says about itself.

Pure: parsing and the windows take text and datetimes; the worker
(:mod:`gpufleet.worker.owner`) reads NVML, the clock and the idle sources and applies
what is decided here.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from gpufleet.errors import ConfigError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
FULL_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MINUTES_A_DAY = 24 * 60
KEYS = (
    "foreign_gpu_mib",
    "on_return",
    "delay",
    "suspend_limit",
    "idle_minutes",
    "hours",
    "on_battery",
    "input_dir",
)


@dataclass(frozen=True)
class Window:
    """When new jobs may start: on ``days`` (0 is Monday), from ``start`` to ``end``
    (minutes after midnight, local time). A window whose end is before its start runs
    past midnight into the next day: it belongs to the day it starts on."""

    text: str
    days: frozenset[int]
    start: int = 0
    end: int = MINUTES_A_DAY

    def covers(self, when: datetime) -> bool:
        minute = when.hour * 60 + when.minute
        day = when.weekday()
        if self.start < self.end:
            return day in self.days and self.start <= minute < self.end
        yesterday = (day - 1) % 7
        return (day in self.days and minute >= self.start) or (
            yesterday in self.days and minute < self.end
        )


@dataclass(frozen=True)
class OwnerPolicy:
    """A worker's owner policy; ``source`` is the file it came from."""

    source: str = "owner policy"
    foreign_gpu_mib: int = 0  # more than this by processes not ours: the owner's GPU
    on_return: Literal["vacate", "suspend"] = "vacate"
    delay: float = 30.0  # seconds a foreign process persists before a job makes way
    suspend_limit: float = 600.0  # seconds suspended, at most, before it is vacated
    idle_minutes: float | None = None  # None: no idle rule
    hours: tuple[Window, ...] = ()  # empty: always
    on_battery: bool = False  # whether new jobs start on battery
    input_dir: Path | None = None  # only these input devices tell idleness

    def in_hours(self, when: datetime) -> bool:
        """Whether new jobs may start at ``when`` (local time) by the time windows."""
        return not self.hours or any(w.covers(when) for w in self.hours)

    def hours_text(self) -> str:
        return ", ".join(w.text for w in self.hours)

    def owners(self, foreign_mib: int, processes: int) -> bool:
        """Whether a GPU with ``processes`` foreign processes using ``foreign_mib`` MiB
        in all is the owner's."""
        if self.foreign_gpu_mib == 0:
            return processes > 0
        return foreign_mib > self.foreign_gpu_mib


def load_policy(path: Path) -> OwnerPolicy:
    """The owner policy in the TOML file ``path``; a ConfigError names the file and key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"owner policy {path}: cannot read it ({exc.strerror or exc})") from exc
    return parse_policy(text, str(path))


def parse_policy(text: str, source: str) -> OwnerPolicy:
    """An owner policy from TOML ``text``; ``source`` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"owner policy {source}: not valid TOML ({exc})") from exc
    for key in data:
        if key not in KEYS:
            raise _bad(source, key, f"unknown key; the keys are {', '.join(KEYS)}")
    on_return = data.get("on_return", "vacate")
    if on_return not in ("vacate", "suspend"):
        raise _bad(source, "on_return", f'{on_return!r}: expected "vacate" or "suspend"')
    idle = data.get("idle_minutes")
    input_dir = data.get("input_dir")
    if input_dir is not None and not isinstance(input_dir, str):
        raise _bad(source, "input_dir", "expected a folder's path (text)")
    return OwnerPolicy(
        source=source,
        foreign_gpu_mib=int(_number(data, "foreign_gpu_mib", 0, source, whole=True)),
        on_return=on_return,
        delay=_number(data, "delay", 30.0, source),
        suspend_limit=_number(data, "suspend_limit", 600.0, source),
        idle_minutes=None if idle is None else _number(data, "idle_minutes", 0, source),
        hours=_windows(data.get("hours", []), source),
        on_battery=_flag(data, "on_battery", source),
        input_dir=None if input_dir is None else Path(input_dir).expanduser(),
    )


def _bad(source: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"owner policy {source}: {key}: {problem}")


def _number(
    data: dict[str, Any], key: str, default: float, source: str, whole: bool = False
) -> float:
    value = data.get(key, default)
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _bad(source, key, f"{value!r}: expected a {'whole ' if whole else ''}number")
    if value < 0 or value > 10**9:
        raise _bad(source, key, f"{value!r}: expected 0 or more")
    return float(value)


def _flag(data: dict[str, Any], key: str, source: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise _bad(source, key, f"{value!r}: expected true or false")
    return value


def _windows(value: object, source: str) -> tuple[Window, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(source, "hours", 'expected a list of windows, e.g. ["mon-fri 19:00-08:00"]')
    found = []
    for text in value:
        try:
            found.append(parse_window(text))
        except ValueError as exc:
            raise _bad(source, "hours", f"{text!r}: {exc}") from exc
    return tuple(found)


def parse_window(text: str) -> Window:
    """``"mon-fri 19:00-08:00"``, ``"sat-sun"``, ``"19:00-08:00"`` (every day),
    ``"mon,wed 09:00-12:00"``; ValueError says what is wrong."""
    parts = text.lower().split()
    if not parts or len(parts) > 2:
        raise ValueError('expected "DAYS HH:MM-HH:MM", "DAYS" or "HH:MM-HH:MM"')
    days: frozenset[int] = frozenset(range(7))
    if not parts[0][:1].isdigit():
        days = _days(parts.pop(0))
    if not parts:
        return Window(text, days)
    start, _, end = parts[0].partition("-")
    first, last = _minute(start), _minute(end)
    if first in (last, MINUTES_A_DAY):
        raise ValueError("a window's start and end must differ (and start before 24:00)")
    return Window(text, days, first, last)


def _days(text: str) -> frozenset[int]:
    if text in ("daily", "all"):
        return frozenset(range(7))
    days: set[int] = set()
    for item in text.split(","):
        first, _, last = item.partition("-")
        a, b = _day(first), _day(last or first)
        days.update((a + i) % 7 for i in range((b - a) % 7 + 1))  # "fri-mon" wraps
    return frozenset(days)


def _day(text: str) -> int:
    if text not in DAYS and text not in FULL_DAYS:
        raise ValueError(f"{text!r} is not a day (mon, tue, ... sun)")
    return DAYS.index(text[:3])


def _minute(text: str) -> int:
    hour, sep, minute = text.partition(":")
    if not sep or not hour.isdigit() or not minute.isdigit() or len(minute) != 2:
        raise ValueError(f"{text!r} is not a time (HH:MM)")
    value = int(hour) * 60 + int(minute)
    if int(minute) > 59 or value > MINUTES_A_DAY:
        raise ValueError(f"{text!r} is not a time of day")
    return value


# ---- what a worker under an owner policy says ------------------------------------------


@dataclass(frozen=True)
class ForeignProcess:
    """A process on a GPU that no job of this worker started."""

    gpu: int
    pid: int
    name: str | None
    mib: int


@dataclass(frozen=True)
class OwnerState:
    """Why a worker under an owner policy takes no new jobs (``reasons``: the idle
    rule, the hours, the battery, a yield), and the GPUs that are the owner's now, by
    the foreign processes on them."""

    reasons: tuple[str, ...] = ()
    foreign: tuple[ForeignProcess, ...] = ()
    owned: tuple[int, ...] = ()  # GPUs the owner's processes hold: nothing starts there

    @property
    def taking(self) -> bool:
        return not self.reasons


def gib_text(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib} MiB"


def gpu_lines(state: OwnerState) -> list[str]:
    """A line per owner's GPU: "GPU 0: owner's process 4242 (blender) uses 3.1 GiB;
    not taking jobs"."""
    lines = []
    for gpu in state.owned:
        procs = [p for p in state.foreign if p.gpu == gpu]
        said = "; ".join(
            f"owner's process {p.pid}{f' ({p.name})' if p.name else ''} uses {gib_text(p.mib)}"
            for p in procs[:3]
        )
        more = f" (and {len(procs) - 3} more)" if len(procs) > 3 else ""
        lines.append(f"GPU {gpu}: {said or 'owner processes'}{more}; not taking jobs")
    return lines


def state_lines(state: OwnerState) -> list[str]:
    """Everything a worker under an owner policy says about itself, a line each."""
    return [*gpu_lines(state), *state.reasons]


def idle_reason(idle_seconds: float | None, minutes: float) -> str | None:
    """Why the idle rule says no (None: the user has been idle long enough)."""
    if idle_seconds is None:
        return f"owner away rule: cannot tell whether the user is idle (idle after {minutes:g} min)"
    if idle_seconds >= minutes * 60:
        return None
    ago = idle_seconds / 60
    when = "now" if idle_seconds < 60 else f"{ago:.0f} min ago"
    return f"owner away rule: user active {when} (idle after {minutes:g} min)"


def owner_reasons(state: OwnerState, gpu_job: bool, wanted: int, free: set[int]) -> list[str]:
    """Why a worker in ``state`` does not take a job now by its owner's rules (``why``):
    every reason it takes no jobs, or, for a ``gpu_job`` wanting ``wanted`` GPUs, the
    owner's GPUs among its ``free`` ones when too few others are left."""
    if state.reasons:
        return list(state.reasons)
    owned = free & set(state.owned)
    if not gpu_job or not owned or len(free - owned) >= wanted:
        return []
    return gpu_lines(OwnerState((), state.foreign, tuple(sorted(owned))))
