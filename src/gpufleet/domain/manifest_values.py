"""Checks of a manifest's values: where each sits, the error that names it, and each
value converted for the domain. Used by :mod:`gpufleet.domain.manifest`."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from gpufleet.domain.checkpoints import MOST_GRACE, grace_signal
from gpufleet.domain.environments import MOST_WITH, PYTHON_PATTERN, requirement_problem
from gpufleet.domain.limits import (
    MAX_ATTEMPTS,
    MAX_GIB,
    MAX_GPUS,
    MAX_NAME,
    MAX_PRIORITY,
    MAX_TIMEOUT,
)
from gpufleet.domain.models import (
    HyperStyle,
    InputKind,
    JobInput,
)
from gpufleet.domain.retries import exit_codes_problem
from gpufleet.errors import ManifestError

# ---- where a value sits, and the error that names it -----------------------------------


@dataclass(frozen=True)
class _Where:
    file: str
    scope: str = ""
    job: str | None = None
    host: str | None = None

    def fail(self, field: str | None, problem: str) -> NoReturn:
        parts = [self.file, self.scope, "" if field is None else f'field "{field}"', problem]
        detail: dict[str, Any] = {"file": self.file, "job": self.job, "field": field}
        if self.host is not None:
            detail["host"] = self.host
        raise ManifestError(": ".join(p for p in parts if p), detail=detail)


def _kind(value: object) -> str:
    kinds: tuple[tuple[type, str], ...] = (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a float"),
        (str, "a string"),
        (list, "an array"),
        (dict, "a table"),
    )
    return next((name for cls, name in kinds if isinstance(value, cls)), "a date/time")


def _show(value: object) -> str:
    """A short TOML-like rendering of a scalar, for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value[:60]}..."' if len(value) > 60 else f'"{value}"'
    if isinstance(value, int | float):
        text = str(value)
        return text[:40] + "..." if len(text) > 40 else text
    return ""


def _wrong_type(value: object, where: _Where, field: str | None, expected: str) -> NoReturn:
    shown = _show(value)
    where.fail(field, f"expected {expected}, got {_kind(value)}{' ' + shown if shown else ''}")


def _unknown(where: _Where, key: str, candidates: Iterable[str], what: str, hint: str) -> NoReturn:
    close = difflib.get_close_matches(key, list(candidates), n=1)
    suggestion = f'did you mean "{close[0]}"?' if close else hint
    where.fail(key, f"unknown {what} ({suggestion})")


# ---- value checks: each returns the value converted for the domain ---------------------

_Check = Callable[[Any, _Where, str], Any]


def _str(value: Any, where: _Where, field: str) -> str:
    if not isinstance(value, str):
        _wrong_type(value, where, field, "a string")
    return value


def _name(value: Any, where: _Where, field: str) -> str:
    text = _str(value, where, field)
    if not text.strip():
        where.fail(field, "must not be empty")
    if len(text) > MAX_NAME:
        where.fail(field, f"must be at most {MAX_NAME} characters, got {len(text)}")
    return text


def _label(value: Any, where: _Where, field: str) -> str:
    """A short text the server stores as is (model, mode): at most MAX_NAME, no NUL."""
    text = _str(value, where, field)
    if len(text) > MAX_NAME:
        where.fail(field, f"must be at most {MAX_NAME} characters, got {len(text)}")
    if "\x00" in text:
        where.fail(field, "must not contain a NUL character")
    return text


def _bool(value: Any, where: _Where, field: str) -> bool:
    if not isinstance(value, bool):
        _wrong_type(value, where, field, "a boolean (true or false)")
    return value


def _in_range(
    value: float, where: _Where, field: str, low: float, high: float, *, open_low: bool = False
) -> None:
    if open_low and value <= low:
        where.fail(field, f"must be > {low}, got {_show(value)}")
    if value < low:
        where.fail(field, f"must be >= {low}, got {_show(value)}")
    if value > high:
        where.fail(field, f"must be <= {high}, got {_show(value)}")


def _int_in(low: int, high: int) -> _Check:
    def check(value: Any, where: _Where, field: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            _wrong_type(value, where, field, "an integer")
        _in_range(value, where, field, low, high)
        return value

    return check


def _number_in(low: int, high: int, *, open_low: bool = False) -> _Check:
    def check(value: Any, where: _Where, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _wrong_type(value, where, field, "a number")
        if isinstance(value, float) and not math.isfinite(value):
            where.fail(field, f"must be a finite number, got {value}")
        _in_range(value, where, field, low, high, open_low=open_low)
        return float(value)

    return check


def _str_list(value: Any, where: _Where, field: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        _wrong_type(value, where, field, "an array of strings")
    return tuple(_str(item, where, f"{field}[{i}]") for i, item in enumerate(value))


def _str_table(value: Any, where: _Where, field: str) -> dict[str, str]:
    if not isinstance(value, dict):
        _wrong_type(value, where, field, "a table of strings")
    return {key: _str(item, where, f"{field}.{key}") for key, item in value.items()}


def _env(value: Any, where: _Where, field: str) -> dict[str, str]:
    table = _str_table(value, where, field)
    for key in table:
        if not key or "=" in key or "\0" in key:
            where.fail(f"{field}.{key}", "an environment variable name must be non-empty, no '='")
    return table


def _plain_data(value: Any, where: _Where, field: str) -> None:
    """Hyper values must survive JSON: TOML dates and times are refused."""
    if isinstance(value, dict):
        for key, item in value.items():
            _plain_data(item, where, f"{field}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _plain_data(item, where, f"{field}[{i}]")
    elif not isinstance(value, str | int | float):
        where.fail(field, "dates and times are not supported here; write them as strings")


def _hyper(value: Any, where: _Where, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _wrong_type(value, where, field, "a table")
    _plain_data(value, where, field)
    return dict(value)


def _command(value: Any, where: _Where, field: str) -> str | tuple[str, ...]:
    if isinstance(value, list):
        argv = _str_list(value, where, field)
        if not argv:
            where.fail(field, "must not be empty")
        return argv
    if not isinstance(value, str):
        _wrong_type(value, where, field, "a string or an array of strings")
    if not value.strip():
        where.fail(field, "must not be empty")
    return value


def _variable(value: Any, where: _Where, field: str) -> Any:
    """A template variable: a string, number or boolean, or an array of them."""
    expected = "a string, number or boolean (or an array of them) for a template variable"
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, str | int | float):
            _wrong_type(item, where, field, expected)
    return list(value) if isinstance(value, list) else value


def split_dest(text: str) -> tuple[str | None, str]:
    """``DEST=THING`` into (DEST, THING); a plain ``THING`` gives (None, THING)."""
    dest, sep, rest = text.partition("=")
    if sep and dest.strip() and rest.strip():
        return dest.strip(), rest.strip()
    return None, text.strip()


def default_job_dest(ref: str) -> str:
    """Where a dependency's artifact lands unless told: ``inputs/NAME``."""
    return "inputs/" + ref.replace("/", "_")


def _rel_path(value: str, where: _Where, field: str) -> str:
    parts = value.replace("\\", "/").split("/")
    if not value or value.startswith(("/", "\\")) or ".." in parts or value[1:2] == ":":
        where.fail(field, f"{value!r} must be a path inside the job directory (relative, no ..)")
    return value


def _packages(value: Any, where: _Where, field: str) -> tuple[JobInput, ...]:
    found = []
    for item in _str_list(value, where, field):
        dest, path = split_dest(item)
        if not path:
            where.fail(field, f"{item!r}: expected PATH or DEST=PATH")
        found.append(
            JobInput(
                InputKind.LOCAL, path, _rel_path(dest, where, field) if dest else ".", label=path
            )
        )
    return tuple(found)


def _inputs(value: Any, where: _Where, field: str) -> tuple[JobInput, ...]:
    found = []
    for item in _str_list(value, where, field):
        dest, ref = split_dest(item)
        if not ref.startswith("job:") or len(ref) == 4:
            where.fail(
                field, f"{item!r}: expected job:NAME or DEST=job:NAME (use packages for files)"
            )
        name = ref[4:]
        target = _rel_path(dest, where, field) if dest else default_job_dest(name)
        found.append(JobInput(InputKind.JOB, name, target, label=ref))
    return tuple(found)


def _outputs(value: Any, where: _Where, field: str) -> tuple[str, ...]:
    return tuple(_rel_path(v, where, field) for v in _str_list(value, where, field))


def _exit_codes(value: Any, where: _Where, field: str) -> tuple[int, ...]:
    """Exit codes a job is (not) retried after: an array of integers, each failing."""
    if not isinstance(value, list):
        _wrong_type(value, where, field, "an array of exit codes")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            _wrong_type(item, where, f"{field}[{i}]", "an integer exit code")
    problem = exit_codes_problem(value, ()) if field == "retry_on" else None
    problem = problem or exit_codes_problem((), value)
    if problem:
        where.fail(field, problem)
    return tuple(value)


def _checkpoint_dir(value: Any, where: _Where, field: str) -> str:
    """A folder inside the job directory, kept on the server as checkpoints."""
    return _rel_path(_str(value, where, field), where, field)


def _grace_signal(value: Any, where: _Where, field: str) -> str:
    """The signal gpufleet sends before it ends the job to free its slot, by name."""
    try:
        return grace_signal(_str(value, where, field)).name
    except ValueError as exc:
        where.fail(field, str(exc))


def _hyper_style(value: Any, where: _Where, field: str) -> HyperStyle:
    text = _str(value, where, field)
    styles = [s.value for s in HyperStyle]
    if text not in styles:
        where.fail(
            field,
            f'expected one of {", ".join(repr(s) for s in styles)}, got "{text[:40]}" '
            '("dash": batch_size is --batch-size and true a bare flag; "verbatim": as written)',
        )
    return HyperStyle(text)


def _with_requirements(value: Any, where: _Where, field: str) -> str:
    """A requirements.txt or pyproject.toml, relative to the manifest's folder."""
    text = _str(value, where, field)
    if not text.strip() or "\0" in text:
        where.fail(field, "expected the path of a requirements.txt or pyproject.toml")
    return text


def _with(value: Any, where: _Where, field: str) -> tuple[str, ...]:
    """Requirement strings, each one requirement (uv's --with)."""
    items = _str_list(value, where, field)
    for i, item in enumerate(items):
        problem = requirement_problem(item)
        if problem:
            where.fail(f"{field}[{i}]", problem)
    if len(items) > MOST_WITH:
        where.fail(field, f"{len(items)} requirements; at most {MOST_WITH}")
    return tuple(item.strip() for item in items)


def _python(value: Any, where: _Where, field: str) -> str:
    text = _str(value, where, field)
    if not re.match(PYTHON_PATTERN, text):
        where.fail(field, f'"{text[:40]}" is not a Python version (3.12 or 3.12.4)')
    return text


#: The environment a job runs in (docs/environments.md), in uv's words.
_ENV_FIELDS: dict[str, _Check] = {
    "with_requirements": _with_requirements,
    "with": _with,
    "python": _python,
    "upgrade": _bool,
}

_REQUIREMENT_FIELDS: dict[str, _Check] = {
    "require_cuda": _bool,
    "prefer_cuda": _bool,
    "gpu_count": _int_in(0, MAX_GPUS),
    "min_vram_gib": _number_in(0, MAX_GIB),
    "min_ram_gib": _number_in(0, MAX_GIB),
    "gpu_name": _str,
    "labels": _str_table,
    "allowed_hosts": _str_list,
    "worker": _str,
    "cpu_only": _bool,
}
_SPEC_FIELDS: dict[str, _Check] = {
    "model": _label,
    "mode": _label,
    "command": _command,
    "priority": _int_in(-MAX_PRIORITY, MAX_PRIORITY),
    "hyper": _hyper,
    "env": _env,
    "max_attempts": _int_in(1, MAX_ATTEMPTS),
    "timeout": _number_in(0, MAX_TIMEOUT, open_low=True),
    "pool": _name,
    "shell": _bool,
    "packages": _packages,
    "inputs": _inputs,
    "outputs": _outputs,
    "hyper_style": _hyper_style,
    "retry_on": _exit_codes,
    "no_retry_on": _exit_codes,
    "checkpoint_dir": _checkpoint_dir,
    "grace_signal": _grace_signal,
    "grace_period": _number_in(0, MOST_GRACE),
    "preemptible": _bool,
}
_JOB_FIELDS: dict[str, _Check] = {
    "name": _name,
    **_SPEC_FIELDS,
    **_REQUIREMENT_FIELDS,
    **_ENV_FIELDS,
}
_ALIASES = {"gpus": "gpu_count"}
_HOST_FIELDS: dict[str, _Check] = {
    "description": _str,
    "priority": _int_in(-MAX_PRIORITY, MAX_PRIORITY),
    "allow_jobs": _str_list,
    "deny_jobs": _str_list,
    "cuda": _bool,
    "gpus": _int_in(0, MAX_GPUS),
    "vram_gib": _number_in(0, MAX_GIB),
    "ram_gib": _number_in(0, MAX_GIB),
}
_DECLARED_FIELDS = ("cuda", "gpus", "vram_gib", "ram_gib")
