"""The owner policy (gpufleet.domain.owner): its file, its time windows (across midnight
and the week's end), and what a worker under one says; fixed datetimes, no real clock."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from gpufleet.domain.owner import (
    ForeignProcess,
    OwnerState,
    idle_reason,
    load_policy,
    owner_reasons,
    parse_policy,
    parse_window,
    state_lines,
)
from gpufleet.errors import ConfigError

# 2026-11-23 is a Monday.
MON, FRI, SAT, SUN = 23, 27, 28, 29


def at(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute)


FULL = """
foreign_gpu_mib = 500
on_return = "suspend"
delay = 30
suspend_limit = 600
idle_minutes = 10
hours = ["mon-fri 19:00-08:00", "sat-sun"]
on_battery = false
input_dir = "/tmp/inputs"
"""


def test_a_full_policy_is_read_with_every_key() -> None:
    p = parse_policy(FULL, "owner.toml")
    assert (p.foreign_gpu_mib, p.on_return, p.delay, p.suspend_limit) == (500, "suspend", 30, 600)
    assert p.idle_minutes == 10 and p.on_battery is False
    assert p.input_dir == Path("/tmp/inputs")
    assert p.hours_text() == "mon-fri 19:00-08:00, sat-sun"


def test_an_empty_policy_has_the_defaults() -> None:
    p = parse_policy("", "owner.toml")
    assert (p.foreign_gpu_mib, p.on_return, p.delay, p.suspend_limit) == (0, "vacate", 30, 600)
    assert p.idle_minutes is None and p.hours == () and p.input_dir is None
    assert p.in_hours(at(MON, 12))  # no hours: always


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('on_return = "kill"', ["owner.toml", "on_return", "'kill'"]),
        ("delay = -1", ["owner.toml", "delay", "0 or more"]),
        ('delay = "soon"', ["owner.toml", "delay", "number"]),
        ("foreign_gpu_mib = 1.5", ["owner.toml", "foreign_gpu_mib", "whole number"]),
        ("on_battery = 1", ["owner.toml", "on_battery", "true or false"]),
        ('hours = ["mon-fri 19:00"]', ["owner.toml", "hours", "19:00"]),
        ('hours = ["someday"]', ["owner.toml", "hours", "not a day"]),
        ('hours = ["mon 25:00-26:00"]', ["owner.toml", "hours", "not a time of day"]),
        ('hours = ["mon 08:00-08:00"]', ["owner.toml", "hours", "must differ"]),
        ('hours = "mon-fri"', ["owner.toml", "hours", "list"]),
        ("idle = 10", ["owner.toml", "idle", "unknown key", "idle_minutes"]),
        ("delay = ", ["owner.toml", "TOML"]),
    ],
)
def test_a_bad_policy_names_the_file_and_the_key(text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_policy(text, "owner.toml")
    for word in words:
        assert word in caught.value.message


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        load_policy(tmp_path / "nope.toml")


def test_a_night_window_runs_past_midnight_into_the_next_day() -> None:
    nights = parse_window("mon-fri 19:00-08:00")
    assert not nights.covers(at(MON, 18, 59))
    assert nights.covers(at(MON, 19, 0))
    assert nights.covers(at(MON + 1, 3))  # Monday's night, on Tuesday morning
    assert not nights.covers(at(MON + 1, 8, 0))  # its end is not in it
    assert not nights.covers(at(MON, 3))  # Sunday's night is not a mon-fri window
    assert nights.covers(at(SAT, 7, 59))  # Friday's night ends on Saturday morning
    assert not nights.covers(at(SAT, 19))


def test_weekend_days_and_a_range_across_the_weeks_end() -> None:
    weekend = parse_window("sat-sun")
    assert weekend.covers(at(SAT, 0)) and weekend.covers(at(SUN, 23, 59))
    assert not weekend.covers(at(MON, 0)) and not weekend.covers(at(FRI, 23, 59))
    wraps = parse_window("fri-mon 22:00-06:00")  # fri, sat, sun, mon
    assert wraps.covers(at(SUN, 23)) and wraps.covers(at(MON, 5))  # Sunday's night
    assert wraps.covers(at(MON + 1, 5))  # Monday's night, into Tuesday
    assert not wraps.covers(at(MON + 2, 5))  # Tuesday's night is not in it
    assert not wraps.covers(at(MON + 2, 23))


def test_windows_every_day_lists_and_full_names() -> None:
    lunch = parse_window("12:00-13:30")
    assert all(lunch.covers(at(d, 12, 45)) for d in range(MON, SUN + 1))
    assert not lunch.covers(at(MON, 13, 30))
    some = parse_window("monday,wed 09:00-24:00")
    assert some.covers(at(MON, 23, 59)) and some.covers(at(MON + 2, 9))
    assert not some.covers(at(MON + 1, 10))


def test_hours_of_a_policy_are_any_of_its_windows() -> None:
    p = parse_policy('hours = ["mon-fri 19:00-08:00", "sat-sun"]', "owner.toml")
    assert p.in_hours(at(SAT, 12)) and p.in_hours(at(SUN, 23)) and p.in_hours(at(MON + 1, 2))
    assert not p.in_hours(at(MON, 12)) and not p.in_hours(at(FRI, 18))
    # a window belongs to the day it starts on: Sunday's own night needs a window of its
    # own ("sat-sun" ends at Sunday's midnight)
    assert not p.in_hours(at(MON, 2))
    sunday = parse_policy('hours = ["mon-fri 19:00-08:00", "sat-sun", "sun 19:00-08:00"]', "p")
    assert sunday.in_hours(at(MON, 2)) and not sunday.in_hours(at(MON, 8))


def test_a_gpu_is_the_owners_by_any_foreign_process_or_over_the_amount() -> None:
    strict = parse_policy("", "p")
    assert strict.owners(0, 1) and not strict.owners(0, 0)
    lenient = parse_policy("foreign_gpu_mib = 500", "p")
    assert not lenient.owners(400, 2) and lenient.owners(501, 1)


def test_what_the_owner_sees() -> None:
    state = OwnerState(
        reasons=("outside hours mon-fri 19:00-08:00", "on battery"),
        foreign=(ForeignProcess(0, 4242, "blender", 3174), ForeignProcess(1, 7, None, 100)),
        owned=(0,),
    )
    assert state_lines(state) == [
        "GPU 0: owner's process 4242 (blender) uses 3.1 GiB; not taking jobs",
        "outside hours mon-fri 19:00-08:00",
        "on battery",
    ]
    assert not state.taking and OwnerState().taking


def test_the_idle_rule_says_how_long_ago_the_user_was_active() -> None:
    assert idle_reason(120, 10) == "owner away rule: user active 2 min ago (idle after 10 min)"
    assert idle_reason(5, 10) == "owner away rule: user active now (idle after 10 min)"
    assert idle_reason(600, 10) is None
    assert "cannot tell" in str(idle_reason(None, 10))


def test_why_names_the_owners_gpu_only_when_the_job_needs_it() -> None:
    state = OwnerState((), (ForeignProcess(0, 4242, "blender", 3174),), (0,))
    assert owner_reasons(state, True, 1, {0}) == [
        "GPU 0: owner's process 4242 (blender) uses 3.1 GiB; not taking jobs"
    ]
    assert owner_reasons(state, True, 1, {0, 1}) == []  # GPU 1 is free for it
    assert owner_reasons(state, False, 1, {0}) == []  # a CPU job
    closed = OwnerState(("on battery",))
    assert owner_reasons(closed, False, 1, set()) == ["on battery"]
