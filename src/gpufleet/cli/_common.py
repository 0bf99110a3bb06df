"""What every command shares: settings-backed options, the client, printing."""

from __future__ import annotations

import inspect
import io
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import MISSING, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TextIO, cast, get_type_hints

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from gpufleet import config
from gpufleet.client import Client
from gpufleet.errors import ConfigError
from gpufleet.terminal import visible
from gpufleet.tokens import redact


class _Redacting(io.TextIOBase):  # a TextIO for Rich: it only writes, flushes and asks
    """A text stream that cuts anything token-shaped to its hint on its way out: what
    the CLI shows never includes a token (``tokens create`` prints its new secret with
    ``print``, past this)."""

    def __init__(self, stream: Callable[[], TextIO]) -> None:
        self._find = stream  # looked up at each write: tests swap sys.stdout/stderr

    def _stream(self) -> TextIO:
        # While Rich shows a live display it puts a proxy of its console in sys.stdout and
        # sys.stderr; the stream is the one behind it, as Rich's own console finds it.
        stream = self._find()
        return cast(TextIO, getattr(stream, "rich_proxied_file", stream))

    def write(self, text: str) -> int:
        self._stream().write(redact(text))
        return len(text)

    def flush(self) -> None:
        self._stream().flush()

    def isatty(self) -> bool:
        return self._stream().isatty()

    def fileno(self) -> int:
        return self._stream().fileno()


# Off a terminal (pipes, CI logs) tables get room instead of the 80-column default.
out = Console(
    file=cast(TextIO, _Redacting(lambda: sys.stdout)),
    highlight=False,
    width=None if sys.stdout.isatty() else 200,
)
err = Console(file=cast(TextIO, _Redacting(lambda: sys.stderr)), highlight=False, soft_wrap=True)


def setting_help(name: str, extra: str = "") -> str:
    s = config.SETTINGS[name]
    default = s.default_value() if not callable(s.default) else None
    shown = f" (default: {default})" if default not in (None, "") else ""
    return f"{s.help[0].upper()}{s.help[1:]}{extra}{shown} (env: {s.env})."


def setting_option(name: str, *flags: str, extra: str = "") -> Any:
    """A CLI option backed by a setting: None unless given, help shows its env variable."""
    flag = flags or ("--" + name.replace("_", "-"),)
    return typer.Option(*flag, help=setting_help(name, extra), show_default=False)


def fields_signature(cls: Any) -> inspect.Signature:
    """A command's signature made from a dataclass's fields (their ``Annotated`` options
    and defaults), so a command whose options become one object declares them once."""
    hints = get_type_hints(cls, include_extras=True)
    empty = inspect.Parameter.empty
    return inspect.Signature(
        [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=empty if f.default is MISSING else f.default,
                annotation=hints[f.name],
            )
            # what must be given (a command's argument) first, then the options in order
            for f in sorted(fields(cls), key=lambda f: f.default is not MISSING)
            if f.init  # a field the command sets itself is not an option
        ]
    )


CaOpt = Annotated[Path | None, setting_option("ca")]
ServerOpt = Annotated[str | None, setting_option("server")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
SessionOpt = Annotated[
    str | None,
    typer.Option(
        "--session",
        help="Talk to the server of this session string (what a worker printed; @FILE "
        "reads it from a file) with the token it carries (the worker's --share-token), "
        "else your own token for that server. Commands then see what that token sees: "
        "`jobs` lists every job of its pools (a submitter token's), or of every pool (an "
        "admin's), not only the jobs sent to that worker. Default: GPUFLEET_SESSION, "
        "when set.",
    ),
]


DAY, HOUR = 86400.0, 3600.0


def retention_seconds(retention: float, unit: float) -> float | None:
    """A retention setting (in days or hours, ``unit`` seconds each) in seconds; None
    (keep forever) for 0."""
    return retention * unit if retention > 0 else None


def resolve(**cli: Any) -> config.Resolved:
    return config.resolve(cli, only=list(cli) + (["token"] if "server" in cli else []))


def client(server: str | None, ca: Path | None = None, token: str | None = None) -> Client:
    """A client for the ``server`` setting, verifying an https:// server against the ``ca``
    setting (flag, GPUFLEET_CA or a config file) when set. ``token`` (a session's) wins
    over the configured one."""
    settings = resolve(server=server, ca=ca)
    url = settings["server"]
    return Client(url, token or config.token_for(url, settings), ca=settings["ca"])


def print_json(data: Any) -> None:
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    elif isinstance(data, list):
        data = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in data]
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def parse_pairs(items: Iterable[str], what: str) -> dict[str, str]:
    """``k=v`` items (or one comma-separated string) into a dict, with a clear error."""
    pairs: dict[str, str] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not key:
                raise ConfigError(f"{what}: {part!r} must look like key=value")
            pairs[key.strip()] = value.strip()
    return pairs


def when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone().strftime("%H:%M:%S")


def day(value: datetime | None) -> str:
    """A date and time to the minute, local time; "-" for none."""
    if value is None:
        return "-"
    return value.astimezone().strftime("%Y-%m-%d %H:%M")


def age(value: datetime | None) -> str:
    """How long ago: "4s", "3m", "2h", "5d"; "-" for never."""
    if value is None:
        return "-"
    seconds = max(0.0, (datetime.now(UTC) - value).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:.0f}s"


def duration(start: datetime | None, end: datetime | None) -> str:
    if start is None:
        return "-"
    seconds = ((end or datetime.now(UTC)) - start).total_seconds()
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


STATUS_STYLE = {
    "pending": "yellow",
    "claimed": "cyan",
    "running": "blue",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
    "paused": "bright_black",
    "available": "green",
    "reserved": "cyan",
    "busy": "blue",
    "connecting": "yellow",
    "draining": "yellow",
    "offline": "red",
}


def shown(text: object) -> str:
    """What someone else wrote (a name, a label, an error, an id), as Rich markup that
    prints it as it is: control characters as visible escapes, brackets as brackets."""
    return escape(visible(str(text)))


def styled(status: str) -> str:
    style = STATUS_STYLE.get(status)
    return f"[{style}]{status}[/{style}]" if style else shown(status)
