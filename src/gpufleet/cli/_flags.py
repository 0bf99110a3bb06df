"""The options of a command that runs a long-lived part (``gpufleet server``,
``gpufleet worker``), declared once as the fields of a frozen dataclass: what both
commands do with theirs is here, so each declares only its fields."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from gpufleet import config
from gpufleet.cli._common import fields_signature, resolve

Command = TypeVar("Command", bound=Callable[..., None])


@dataclass(frozen=True)
class SettingFlags:
    """A command's options, one field each (``Annotated`` with its typer option). The
    command's signature is made from the fields (:meth:`command`); each field is a
    setting of the same name, None unless given, but those in ``not_settings``."""

    not_settings: ClassVar[frozenset[str]] = frozenset()

    def given(self) -> dict[str, Any]:
        """The settings as given on the command line (None: not given), in the fields'
        order."""
        return {k: v for k, v in vars(self).items() if k not in self.not_settings}

    def resolved(self) -> config.Resolved:
        """The settings: each flag given, else the environment's, a config file's or the
        default."""
        return resolve(**self.given())

    @classmethod
    def command(cls, run: Command) -> Command:
        """``run`` (called with the options as keywords), given the signature typer
        reads the options from."""
        run.__signature__ = fields_signature(cls)  # type: ignore[attr-defined]
        return run
