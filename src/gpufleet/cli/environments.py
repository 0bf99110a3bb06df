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

import tempfile
from pathlib import Path

from gpufleet.client import Client
from gpufleet.domain.environments import EnvRequest
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
        project = _upload(c, path.name, _read(path))
        lock = path.parent / "uv.lock"
        locked = _upload(c, "uv.lock", _read(lock)) if lock.is_file() else None
        return {"project": project, "lock": locked}
    return {"requirements": _upload(c, path.name, requirements_text(path))}


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
    for number, raw in _logical_lines(_read(path)):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        where = f"{path}:{number}"
        word, _, rest = line.partition(" ")
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
            found.append(line)
    return found


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """The file's lines with each ``\\`` continuation joined to its line (a hash-pinned
    requirement and its ``--hash`` options are one line), numbered by where each starts."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        stripped = raw.rstrip()
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(raw.strip())
        out.append((start, " ".join(p for p in pending if p)))
        pending = []
    if pending:
        out.append((start, " ".join(p for p in pending if p)))
    return out


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
