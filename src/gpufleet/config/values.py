"""What a setting's value may be: each kind's parser (from TOML, a ``GPUFLEET_*``
variable or a flag), the bounds check, and how a value is shown.

A value that does not fit raises :class:`Invalid`, whose message ends "must be ...";
:func:`parse` turns it into a :class:`~gpufleet.errors.ConfigError` naming the setting,
how the user wrote it and where.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpufleet.config.settings import Setting
from gpufleet.errors import ConfigError


class Invalid(ValueError):
    """A value that does not fit its kind; the message ends 'must be ...'."""


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse_str(value: Any, base: Path) -> str:
    if not isinstance(value, str):
        raise Invalid("must be a string")
    return value


def _parse_int(value: Any, base: Path) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise Invalid("must be an integer")


def _parse_float(value: Any, base: Path) -> float:
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise Invalid("must be a number")
    return number


def _parse_bool(value: Any, base: Path) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
    raise Invalid("must be a boolean (1/0, true/false, yes/no, on/off)")


def _parse_path(value: Any, base: Path) -> Path:
    if not isinstance(value, str | os.PathLike) or str(value) == "":
        raise Invalid("must be a path")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def normalize_url(value: str) -> str:
    """Strip surrounding whitespace and trailing slashes (the key of a server URL)."""
    return value.strip().rstrip("/")


def server_urls(value: str) -> list[str]:
    """The URLs of ``URL1,URL2`` (servers sharing one database), each normalized; empty
    parts and repeats dropped."""
    return list(dict.fromkeys(u for u in map(normalize_url, value.split(",")) if u))


def parse_url(value: Any, base: Path) -> str:
    """A URL, or several comma-separated (servers sharing one database)."""
    if isinstance(value, str):
        urls = [normalize_url(u) for u in value.split(",")]
        if all(u.lower().startswith(("http://", "https://")) and urlsplit(u).netloc for u in urls):
            return ",".join(urls)
    raise Invalid("must be a URL starting with http:// or https:// (or several, URL1,URL2)")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any) -> int:
    """Bytes from ``1024``, ``512M``, ``20G``, ``1.5TiB`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("ib").removesuffix("b")
        unit = text[-1:] if text[-1:] in _UNITS else ""
        number = text[: len(text) - len(unit)].strip()
        try:
            size = float(number) * _UNITS[unit]
        except ValueError:
            size = math.nan
        if math.isfinite(size) and size >= 0:
            return int(size)
    raise Invalid("must be a size such as 1024, 512M, 20G or 1T")


def _parse_size(value: Any, base: Path) -> int:
    return parse_size(value)


_PARSERS: dict[str, Callable[[Any, Path], Any]] = {
    "str": _parse_str,
    "int": _parse_int,
    "float": _parse_float,
    "bool": _parse_bool,
    "path": _parse_path,
    "url": parse_url,
    "size": _parse_size,
}


def _check_bounds(setting: Setting, value: float) -> None:
    if setting.minimum is not None and value < setting.minimum:
        raise Invalid(f"must be at least {setting.minimum:g}")
    if setting.maximum is not None and value > setting.maximum:
        raise Invalid(f"must be at most {setting.maximum:g}")


def _quoted(setting: Setting, value: Any) -> str:
    """The value as an error message quotes it, a secret masked."""
    if setting.secret:
        return '"****"'
    return json.dumps(value) if isinstance(value, str) else repr(value)


def parse(setting: Setting, label: str, value: Any, source: str, base: Path) -> Any:
    """``value`` as ``setting``'s kind, within its bounds; else a ConfigError naming
    ``label`` (how the user wrote it: GPUFLEET_PORT, port, --port) and ``source``.
    Relative paths resolve against ``base``."""
    try:
        parsed = _PARSERS[setting.kind](value, base)
        if setting.kind in ("int", "float", "size"):
            _check_bounds(setting, parsed)
    except Invalid as exc:
        shown = _quoted(setting, value)
        raise ConfigError(
            f"{label}={shown} ({source}): {setting.name} {exc}",
            detail={"setting": setting.name, "source": source},
        ) from None
    return parsed


def display(setting: Setting, value: Any) -> str:
    """A resolved value as ``config show`` prints it, a secret masked."""
    if value is None:
        return "(unset)"
    if setting.secret:
        return "****"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)
