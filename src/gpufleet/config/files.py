"""Where gpufleet's own files are, and how they are read and written: the config files
(``gpufleet.toml`` in the user config dir and in the current directory) and the atomic,
private write that ``credentials.json`` and the service files use."""

from __future__ import annotations

import os
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import platformdirs

from gpufleet.config.settings import APP, ENV_CONFIG_DIR, FILE_NAME
from gpufleet.errors import ConfigError


def _config_dir(env: Mapping[str, str]) -> Path:
    override = env.get(ENV_CONFIG_DIR, "")
    return Path(override).expanduser() if override else Path(platformdirs.user_config_dir(APP))


def config_dir() -> Path:
    """``$GPUFLEET_CONFIG_DIR`` if set, else the platform's user config dir for gpufleet."""
    return _config_dir(os.environ)


def config_files(cwd: Path | None = None, *, env: Mapping[str, str] | None = None) -> list[Path]:
    """The config files that exist, lowest precedence first (user dir, then ``cwd``)."""
    env = os.environ if env is None else env
    candidates = [_config_dir(env) / FILE_NAME, (cwd or Path.cwd()) / FILE_NAME]
    found: list[Path] = []
    for path in candidates:
        path = path.absolute()
        if path.is_file() and not any(path.samefile(seen) for seen in found):
            found.append(path)
    return found


def read_toml(path: Path) -> dict[str, Any]:
    """A config file's tables; a ConfigError naming the file if it cannot be read or parsed."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc


def write_file(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` atomically: a temp file in the same dir (0600 from its
    creation, so a secret is never readable by others), given ``mode``, then renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if hasattr(os, "fchmod"):  # Windows has ACLs instead
                os.fchmod(fh.fileno(), mode)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
