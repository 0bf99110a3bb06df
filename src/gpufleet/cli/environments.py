"""A job's environment as the client sends it: its files read, checked and uploaded
content-addressed (as packages are), and the hint when a package brings a spec that the
job does not use.

A requirements.txt travels as one file: its ``-r`` includes are read here and inlined,
comments and blank lines dropped, lines sorted, so two files that ask for the same things
are one spec (and one environment on every worker). What cannot travel is refused here,
naming the file and line: an editable or local path, and an index option (the worker's
configuration chooses the index, so an air-gapped lab contacts nothing else).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from gpufleet.client import Client
from gpufleet.domain.environments import (
    EnvRequest,
    logical_lines,
    pyproject_problem,
    requirements_text_problem,
    uv_lock_problem,
)
from gpufleet.errors import ConfigError
from gpufleet.wire import EnvFileModel, EnvironmentModel

#: Files that say a folder is a Python project with its own environment.
SPEC_FILES = ("uv.lock", "pyproject.toml", "requirements.txt")
#: Options of a requirements file that reach past the spec: refused.
_REFUSED = {
    "-e": "an editable install of a local folder cannot travel; send it as a --package",
    "--editable": "an editable install of a local folder cannot travel; send it as a --package",
    "-i": "the worker's configuration chooses the index (docs/environments.md)",
    "--index-url": "the worker's configuration chooses the index (docs/environments.md)",
    "--extra-index-url": "the worker's configuration chooses the index (docs/environments.md)",
    "-f": "the worker's configuration chooses where wheels come from (docs/environments.md)",
    "--find-links": "the worker's configuration chooses where wheels come from",
    "--no-index": "the worker's configuration chooses the index (docs/environments.md)",
    "-c": "constraints files are not sent; write the pins into the requirements file",
    "--constraint": "constraints files are not sent; write the pins into the requirements file",
}
#: The deepest chain of ``-r`` includes followed.
MOST_INCLUDES = 20


def environment_model(c: Client, req: EnvRequest, base: Path | None = None) -> EnvironmentModel:
    """``req`` with its file read, checked and uploaded (once: the server keeps blobs by
    their hash); ``base`` is the folder a relative path is read from (the manifest's)."""
    fields: dict[str, EnvFileModel | None] = {}
    if req.with_requirements is not None:
        path = Path(req.with_requirements).expanduser()
        if base is not None and not path.is_absolute():
            path = base / path
        fields = _spec_files(c, path)
    try:
        return EnvironmentModel(
            **fields, with_=list(req.with_), python=req.python, upgrade=req.upgrade
        )
    except ValueError as exc:  # pydantic's, naming the field
        raise ConfigError(f"environment: {exc}") from None


def _spec_files(c: Client, path: Path) -> dict[str, EnvFileModel | None]:
    """A pyproject.toml (with its uv.lock, when one is beside it) or a requirements file."""
    if path.is_dir():
        raise ConfigError(
            f"--with-requirements {path}: a folder; name its requirements.txt or pyproject.toml"
        )
    if not path.is_file():
        raise ConfigError(f"--with-requirements {path}: no such file")
    if path.name == "pyproject.toml" or path.suffix == ".toml":
        project = _upload(c, "pyproject.toml", _checked(path, _read(path), pyproject_problem))
        lock = path.parent / "uv.lock"
        locked = None
        if lock.is_file():
            locked = _upload(c, "uv.lock", _checked(lock, _read(lock), uv_lock_problem))
        return {"project": project, "lock": locked}
    text = _checked(path, requirements_text(path), requirements_text_problem)
    return {"requirements": _upload(c, path.name, text)}


def _checked(path: Path, text: str, check: Callable[[str], str | None]) -> str:
    """``text`` unless the server would refuse it (domain.environments' checks): then a
    ConfigError naming the file, before anything is uploaded."""
    problem = check(text)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return text


def requirements_text(path: Path) -> str:
    """A requirements file as it travels: its ``-r`` includes inlined, comments and blank
    lines gone, each requirement once, sorted. Refuses (ConfigError, naming the file and
    line) what cannot travel."""
    lines = sorted(set(_requirement_lines(path, [])))
    return "".join(line + "\n" for line in lines)


def _requirement_lines(path: Path, chain: list[Path]) -> list[str]:
    real = path.resolve()
    if real in chain:
        raise ConfigError(f"{path}: includes itself (-r)")
    if len(chain) >= MOST_INCLUDES:
        raise ConfigError(f"{path}: more than {MOST_INCLUDES} nested -r includes")
    found: list[str] = []
    for number, raw in logical_lines(_read(path)):
        comment = raw.lstrip().startswith("#")
        line = "" if comment else re.split(r"\s#", raw, maxsplit=1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        word, *more = re.split(r"\s+", line, maxsplit=1)
        rest = more[0] if more else ""
        option = word.split("=", 1)[0]
        if option in ("-r", "--requirement"):
            target = (rest or word.partition("=")[2]).strip()
            if not target:
                raise ConfigError(f"{where}: -r names no file")
            found += _requirement_lines(path.parent / target, [*chain, real])
        elif option in _REFUSED:
            raise ConfigError(f"{where}: {option}: {_REFUSED[option]}")
        elif line.startswith((".", "/", "file:")) or option.startswith("-e"):
            raise ConfigError(
                f"{where}: {line[:80]!r} is a local path, which cannot travel; send it as a "
                "--package or build a wheel"
            )
        else:
            problem = requirements_text_problem(line)
            if problem:
                raise ConfigError(f"{where}: {problem.removeprefix('line 1: ')}")
            found.append(line)
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None


def _upload(c: Client, name: str, text: str) -> EnvFileModel:
    data = text.encode()
    with tempfile.TemporaryDirectory(prefix="gpufleet-env-") as tmp:
        file = Path(tmp) / name
        file.write_bytes(data)
        sent = c.put_blob(file)
    return EnvFileModel(name=name, sha256=sent.sha256, size=len(data))


def spec_hint(packages: list[str]) -> str | None:
    """One line when a package folder's root holds a spec the job does not use (its
    environment named none): nothing changes silently. None otherwise."""
    for item in packages:
        path = Path(item.split("=", 1)[-1] if "=" in item else item).expanduser()
        if not path.is_dir():
            continue
        for name in SPEC_FILES:
            if (path / name).is_file():
                use = path / ("pyproject.toml" if name == "uv.lock" else name)
                return (
                    f"{path} holds {name}; the job runs in the worker's own Python unless you "
                    f"add --with-requirements {use}"
                )
    return None
