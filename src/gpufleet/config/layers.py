"""Which value wins: a setting is resolved from layers, highest first::

    CLI flag > environment (GPUFLEET_*) > ./gpufleet.toml > <user config dir>/gpufleet.toml
             > default

A config file gives one layer for its top level and one for its
``[environments.NAME]`` table when ``GPUFLEET_ENV=NAME``; each ``GPUFLEET_*`` variable is
a layer of its own, so a value reports its own variable as its source.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from gpufleet.config.files import config_files, read_toml
from gpufleet.config.settings import ENV_ENVIRONMENT, ENVIRONMENTS_KEY, SETTINGS, unknown
from gpufleet.config.values import display, parse
from gpufleet.errors import ConfigError


class _Raw(NamedTuple):
    label: str  # how the user wrote it: GPUFLEET_PORT, port, --port
    value: Any


class _Layer(NamedTuple):
    source: str  # "default" | "file /p" | "file /p [environments.N]" | "env X" | "cli"
    raw: dict[str, _Raw]
    base: Path  # relative paths are resolved against this directory


def _table_layer(source: str, where: str, table: Mapping[str, Any], base: Path) -> _Layer:
    raw: dict[str, _Raw] = {}
    for key, value in table.items():
        if key not in SETTINGS:
            raise unknown(where, key)
        raw[key] = _Raw(key, value)
    return _Layer(source, raw, base)


def _environments(path: Path, data: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    envs = data.get(ENVIRONMENTS_KEY, {})
    if not isinstance(envs, dict):
        raise ConfigError(f"{path}: [{ENVIRONMENTS_KEY}] must be a table of tables")
    for name, table in envs.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{ENVIRONMENTS_KEY}.{name}] must be a table")
    return envs


def _file_layers(path: Path, environment: str) -> tuple[list[_Layer], bool]:
    """The file's top level and, if it defines it, its ``[environments.<environment>]``."""
    data = read_toml(path)
    envs = _environments(path, data)
    top = {k: v for k, v in data.items() if k != ENVIRONMENTS_KEY}
    layers = [_table_layer(f"file {path}", str(path), top, path.parent)]
    for name, table in envs.items():  # validate every environment's keys, use one
        where = f"{path} [{ENVIRONMENTS_KEY}.{name}]"
        layer = _table_layer(f"file {where}", where, table, path.parent)
        if name == environment:
            layers.append(layer)
    return layers, environment in envs


def _files_layers(files: list[Path], environment: str) -> list[_Layer]:
    layers: list[_Layer] = []
    defined = False
    for path in files:
        file_layers, has_env = _file_layers(path, environment)
        layers.extend(file_layers)
        defined = defined or has_env
    if environment and not defined:
        read = ", ".join(str(p) for p in files) or "none found"
        raise ConfigError(
            f'{ENV_ENVIRONMENT}="{environment}": no config file defines '
            f"[{ENVIRONMENTS_KEY}.{environment}] (files read: {read})"
        )
    return layers


def _env_layers(env: Mapping[str, str], names: Iterable[str], cwd: Path) -> list[_Layer]:
    """One layer per variable, so each value reports its own variable as source."""
    layers = []
    for name in names:
        var = SETTINGS[name].env
        value = env.get(var, "")
        if value != "":  # an empty variable counts as unset
            layers.append(_Layer(f"env {var}", {name: _Raw(var, value)}, cwd))
    return layers


def _cli_layer(cli: Mapping[str, Any], cwd: Path) -> _Layer:
    raw: dict[str, _Raw] = {}
    for name, value in cli.items():
        if name not in SETTINGS:
            raise unknown("command line", name)
        if value is not None:
            raw[name] = _Raw("--" + name.replace("_", "-"), value)
    return _Layer("cli", raw, cwd)


@dataclass(frozen=True)
class Resolved:
    """The resolved values of some settings, and where each one came from."""

    values: dict[str, Any]
    sources: dict[str, str]

    def __getitem__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"setting {name!r} was not resolved") from None

    def rows(self) -> list[tuple[str, str, str]]:
        """``(name, shown value, source)`` per setting, secrets masked, for ``config show``."""
        return [
            (name, display(SETTINGS[name], v), self.sources[name])
            for name, v in self.values.items()
        ]


def _selected(only: Iterable[str] | None) -> list[str]:
    if only is None:
        return list(SETTINGS)
    wanted = set(only)
    for name in wanted:
        if name not in SETTINGS:
            raise unknown("resolve(only=...)", name)
    return [name for name in SETTINGS if name in wanted]


def _winner(name: str, layers: list[_Layer]) -> tuple[Any, str]:
    """``name``'s value and its source: the highest layer that gives it, else the default.
    Every layer's value is parsed, so a bad one is an error even where another wins."""
    setting = SETTINGS[name]
    value, source = setting.default_value(), "default"
    for layer in layers:  # lowest precedence first: the last one given wins
        if name in layer.raw:
            raw = layer.raw[name]
            value = parse(setting, raw.label, raw.value, layer.source, layer.base)
            source = layer.source
    return value, source


def resolve(
    cli: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    only: Iterable[str] | None = None,
) -> Resolved:
    """Resolve settings: cli (``None`` = not given) > env > cwd file > user file > default.

    Every value given in any layer is parsed and checked, even if a higher layer wins.
    Relative paths resolve against the config file's directory, or ``cwd`` for env and cli.
    """
    env = os.environ if env is None else env
    cwd = (cwd or Path.cwd()).absolute()
    names = _selected(only)
    environment = env.get(ENV_ENVIRONMENT, "")
    layers = _files_layers(config_files(cwd, env=env), environment)
    layers += _env_layers(env, names, cwd)
    layers.append(_cli_layer(cli or {}, cwd))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in names:
        values[name], sources[name] = _winner(name, layers)
    return Resolved(values, sources)
