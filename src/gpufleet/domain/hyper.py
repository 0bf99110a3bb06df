"""A job's ``hyper.*`` keys against the options its script takes.

A manifest's ``hyper.batch_size = 64`` reaches the script as ``--batch-size 64``
(:func:`gpufleet.domain.models.hyper_flags`). A key the script does not take fails the
job only once it runs, on a worker, after its queue wait. The script's ``--help`` lists
the options it takes (argparse, click and typer print every long option there); this
module reads that text and names each key whose flag is not among them, with the closest
option. Pure: running the script is the CLI's (:mod:`gpufleet.cli.hypercheck`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.domain.models import HyperStyle, hyper_flags

# A long option where a help text names one: after a space, a comma, a slash, a bracket
# or a box-drawing bar (typer's rich panels), never inside a word.
_LONG = re.compile(r"(?<![\w-])--[A-Za-z0-9][A-Za-z0-9_.-]*")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass(frozen=True)
class UnknownKey:
    """A ``hyper`` key whose flag the script does not take, and its closest option
    (shown after the script's name: "train.py takes no --batchsize ...")."""

    key: str
    flag: str
    closest: str | None

    def __str__(self) -> str:
        hint = f" (did you mean {self.closest}?)" if self.closest else ""
        return f"takes no {self.flag}{hint}"


def options_in_help(text: str) -> set[str]:
    """Every long option (``--batch-size``) a ``--help`` text names."""
    plain = _ANSI.sub("", text)
    return {m.rstrip(".-") for m in _LONG.findall(plain) if len(m.rstrip(".-")) > 2}


def flag_of(key: str, value: Any, style: HyperStyle) -> str | None:
    """The flag ``key`` becomes on the command line; None when it adds none (a false
    boolean in the dash style)."""
    flags = hyper_flags({key: value}, style)
    return flags[0] if flags else None


def unknown_keys(
    hyper: Mapping[str, Any], style: HyperStyle, options: Collection[str], *, prefixes: bool = False
) -> list[UnknownKey]:
    """The keys of ``hyper`` whose flags are not in ``options``, each with the closest
    option (difflib), in the order written. With ``prefixes`` (argparse's allow_abbrev,
    its default) a flag that begins exactly one option is taken for it: ``--batch`` is
    ``--batch-size``."""
    found = []
    for key, value in hyper.items():
        flag = flag_of(key, value, style)
        if flag is None or flag in options:
            continue
        if prefixes and sum(o.startswith(flag) for o in options) == 1:
            continue
        close = difflib.get_close_matches(flag, sorted(options), n=1, cutoff=0.6)
        found.append(UnknownKey(key, flag, close[0] if close else None))
    return found
