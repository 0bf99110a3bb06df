"""A job's Python environment: what it asks for, and the keys that name its builds.

A job names its environment in uv's own words (``--with-requirements FILE``, ``--with
REQ``, ``--python VERSION``). The files travel content-addressed, like packages: the spec
keeps each one's SHA-256, and the worker fetches them from the server's blobs.

Two keys name an environment:

- the *spec key* (:meth:`EnvSpec.key`): the hash of what the job asked for, the same on
  every machine. The server keeps the fleet-wide lock of an unlocked spec under it (with
  the Python version and the torch build, :func:`lock_key`), and placement asks workers
  whether they have it built;
- the *build key* (:func:`build_key`): the spec key with what the worker adds, the exact
  Python, the platform and every build option that changes the result (the torch build,
  the index uv is pointed at). A worker's cache holds one environment per build key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class EnvKind(StrEnum):
    """What an environment is built from."""

    REQUIREMENTS = "requirements"  # a requirements.txt and/or --with strings
    PROJECT = "project"  # a pyproject.toml, with its uv.lock when it has one


@dataclass(frozen=True)
class EnvFile:
    """One file of an environment's spec, kept as a blob on the server."""

    name: str  # as the job named it: "requirements.txt", "pyproject.toml", "uv.lock"
    sha256: str
    size: int


#: A Python version a job may ask for: 3, 3.12 or 3.12.4 (uv also takes ranges; we keep
#: to versions a worker can say it has).
PYTHON_PATTERN = r"^3(\.\d{1,2}(\.\d{1,3})?)?$"
#: The most ``--with`` requirements one job names, and the longest one.
MOST_WITH = 100
WITH_CHARS = 500


@dataclass(frozen=True)
class EnvSpec:
    """What a job asked for. ``requirements`` is a requirements.txt (its ``-r`` includes
    inlined by the client); ``project`` a pyproject.toml with ``lock``, its uv.lock, when
    one was beside it; ``with_`` extra requirement strings; ``python`` the version wanted
    (None: the worker's own). ``upgrade`` asks for a fresh resolution instead of the
    fleet's recorded lock (uv's ``--upgrade``); it is not part of the key."""

    requirements: EnvFile | None = None
    project: EnvFile | None = None
    lock: EnvFile | None = None
    with_: tuple[str, ...] = ()
    python: str | None = None
    upgrade: bool = False

    @property
    def kind(self) -> EnvKind:
        return EnvKind.PROJECT if self.project is not None else EnvKind.REQUIREMENTS

    @property
    def locked(self) -> bool:
        """Whether the spec brings its own lock (a uv.lock): it is installed as it is,
        and the fleet records none."""
        return self.lock is not None

    @property
    def files(self) -> tuple[EnvFile, ...]:
        return tuple(f for f in (self.requirements, self.project, self.lock) if f is not None)

    def key(self) -> str:
        """The hash of the spec, normalized: the same request gives the same key wherever
        it is computed. ``--with`` strings count as a set (order and spacing aside).
        Computed once per spec: a claim ranks every waiting worker by it."""
        return _spec_key(self)

    def describe(self) -> str:
        """One line for ``show`` and the logs: what the environment is built from."""
        parts = []
        if self.project is not None:
            lock = f" + {self.lock.name}" if self.lock else " (no lock)"
            parts.append(f"{self.project.name}{lock}")
        if self.requirements is not None:
            parts.append(self.requirements.name)
        parts += [f"--with {r}" for r in self.with_]
        if self.python:
            parts.append(f"--python {self.python}")
        if self.upgrade:
            parts.append("--upgrade")
        return ", ".join(parts) or "(empty)"


@functools.lru_cache(maxsize=4096)
def _spec_key(spec: EnvSpec) -> str:
    body = {
        "kind": spec.kind.value,
        "requirements": spec.requirements.sha256 if spec.requirements else None,
        "project": spec.project.sha256 if spec.project else None,
        "lock": spec.lock.sha256 if spec.lock else None,
        "with": sorted({normalize_requirement(r) for r in spec.with_}),
        "python": spec.python,
    }
    return _hash(body)


def normalize_requirement(text: str) -> str:
    """A requirement string, its spaces gone and its name lowercased, so ``Numpy >= 2``
    and ``numpy>=2`` are one requirement."""
    text = re.sub(r"\s+", "", text)
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(.*)$", text)
    if not m:
        return text
    name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
    return name + m.group(2)


#: A requirement without a direct reference: a name, extras, version specifiers, markers.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_EXTRAS = r"(?:\s*\[\s*(?:[A-Za-z0-9._-]+(?:\s*,\s*[A-Za-z0-9._-]+)*)?\s*,?\s*\])?"
_ONE = r"(?:~=|===|==|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_SPECIFIERS = rf"(?:\s*\(?\s*{_ONE}(?:\s*,\s*{_ONE})*\s*\)?)?"
_REQUIREMENT = re.compile(rf"^{_NAME}{_EXTRAS}{_SPECIFIERS}\s*(?:;(?P<markers>.*))?$")
#: Words that make a requirement reach past the worker's index (a URL, a path, a VCS).
_REACHING = ("://", "file:", "git+", "hg+", "svn+", "bzr+", "${")
#: Endings that make uv read a requirement's name as a local archive.
_ARCHIVES = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz")


def requirement_problem(text: str) -> str | None:
    """What is wrong with one requirement (a ``--with`` string, a line of a requirements
    file, a pyproject's dependency), or None. It must be a name, extras, version
    specifiers and markers only: never an option (``--index-url``), a direct reference
    (``name @ url``), a URL, a VCS or a local path. Any of those would have uv fetch or
    read something the worker's index does not serve (the server checks; uv may run as
    root, and an air-gapped fleet must contact nothing else)."""
    stripped = text.strip()
    if not stripped:
        return "an empty requirement"
    if len(stripped) > WITH_CHARS:
        return f"a requirement of {len(stripped)} characters (at most {WITH_CHARS})"
    if stripped.startswith("-"):
        return f"{stripped[:80]!r} is an option, not a requirement"
    if "\n" in stripped or "\r" in stripped or "\0" in stripped:
        return "a requirement is one line"
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*", stripped):
        return f"{stripped[:80]!r} does not start with a package name (a path cannot travel)"
    for word in _REACHING:
        if word in stripped:
            return (
                f"{stripped[:80]!r} names a URL, a VCS or a variable ({word!r}): a requirement "
                "is a name and versions, fetched from the worker's index"
            )
    name = re.split(r"[\s\[(;<>=!~]", stripped, maxsplit=1)[0].lower()
    if name.endswith(_ARCHIVES):
        return f"{stripped[:80]!r} names an archive, which uv reads as a local path"
    m = _REQUIREMENT.match(stripped)
    if m is None or "@" in stripped.split(";", 1)[0]:
        return (
            f"{stripped[:80]!r} is not a plain requirement (a name, extras, versions, "
            "markers): a direct reference (name @ url) or a path cannot travel"
        )
    return None


def requirements_text_problem(text: str) -> str | None:
    """What is wrong with a requirements file's text, or None. Each logical line (``\\``
    continuations joined) is a comment, blank, or one requirement optionally followed by
    ``--hash=ALGO:DIGEST`` options; any other option line (``-r``, ``-c``, ``-e``,
    ``--index-url``, ``--find-links`` ...) is refused, naming its line, since it would
    have uv read a file of the worker's or reach past its index."""
    for number, line in logical_lines(text):
        body = line if not line.lstrip().startswith("#") else ""
        body = re.split(r"\s+#", body, maxsplit=1)[0].strip()
        if not body:
            continue
        words = body.split()
        hashes = 0
        while words and re.fullmatch(r"--hash=(sha256|sha384|sha512):[0-9a-fA-F]+", words[-1]):
            words.pop()
            hashes += 1
        requirement = " ".join(words)
        if not requirement and hashes:
            return f"line {number}: --hash options follow no requirement"
        if requirement.startswith("-"):
            option = re.split(r"[\s=]", requirement, maxsplit=1)[0]
            return (
                f"line {number}: {option[:40]!r}: options are not sent (the worker's "
                "configuration chooses the index; includes are inlined by the client)"
            )
        problem = requirement_problem(requirement)
        if problem:
            return f"line {number}: {problem}"
    return None


def logical_lines(text: str) -> list[tuple[int, str]]:
    """A requirements file's lines with each ``\\`` continuation joined to its line (a
    hash-pinned requirement and its ``--hash`` options are one line), numbered by where
    each starts."""
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


#: The keys of a pyproject's ``[tool.uv]`` that cannot reach past the worker's index
#: (what to install and for which platforms); any other (``index``, ``sources``,
#: ``find-links``, ``cache-dir``, ``python-install-mirror`` ...) is refused.
UV_TOOL_KEYS = frozenset(
    {
        "dev-dependencies",
        "override-dependencies",
        "constraint-dependencies",
        "build-constraint-dependencies",
        "environments",
        "required-environments",
        "conflicts",
        "default-groups",
        "package",
        "managed",
    }
)


def pyproject_problem(text: str) -> str | None:
    """What is wrong with a pyproject.toml's text, or None: every dependency (``[project]
    dependencies`` and ``optional-dependencies``, ``[dependency-groups]``, uv's
    dependency lists) must pass :func:`requirement_problem`, and ``[tool.uv]`` may hold
    only :data:`UV_TOOL_KEYS` (no indexes, sources, find-links or cache folder: the
    worker's configuration chooses where packages come from)."""
    doc = _toml(text)
    if isinstance(doc, str):
        return doc
    project = doc.get("project", {})
    if not isinstance(project, dict):
        return "[project] is not a table"
    lists: list[tuple[str, Any]] = [("project.dependencies", project.get("dependencies", []))]
    for extra, deps in _table(project.get("optional-dependencies")).items():
        lists.append((f"project.optional-dependencies.{extra}", deps))
    for group, deps in _table(doc.get("dependency-groups")).items():
        lists.append((f"dependency-groups.{group}", deps))
    uv = _table(_table(doc.get("tool")).get("uv"))
    for key in sorted(uv):
        if key not in UV_TOOL_KEYS:
            return (
                f"tool.uv.{key}: not allowed (the worker's configuration chooses where "
                f"packages come from; allowed: {', '.join(sorted(UV_TOOL_KEYS))})"
            )
    for key in ("dev-dependencies", "override-dependencies", "constraint-dependencies"):
        lists.append((f"tool.uv.{key}", uv.get(key, [])))
    for where, deps in lists:
        problem = _dependencies_problem(where, deps)
        if problem:
            return problem
    return None


def _dependencies_problem(where: str, deps: Any) -> str | None:
    if not isinstance(deps, list):
        return f"{where}: not a list"
    for i, dep in enumerate(deps):
        if (
            isinstance(dep, dict)
            and where.startswith("dependency-groups.")
            and set(dep) == {"include-group"}
        ):
            continue  # a group including another (PEP 735)
        if not isinstance(dep, str):
            return f"{where}[{i}]: not a requirement string"
        problem = requirement_problem(dep)
        if problem:
            return f"{where}[{i}]: {problem}"
    return None


def uv_lock_problem(text: str) -> str | None:
    """What is wrong with a uv.lock's text, or None: every ``[[package]]`` comes from a
    registry (``source = { registry = ... }``), but for the project's own root
    (``editable``/``virtual`` ``"."``). A git, URL, path or directory source would have
    uv fetch or read something the worker's index does not serve."""
    doc = _toml(text)
    if isinstance(doc, str):
        return doc
    packages = doc.get("package", [])
    if not isinstance(packages, list):
        return "package: not an array of tables"
    for i, package in enumerate(packages):
        if not isinstance(package, dict):
            return f"package[{i}]: not a table"
        name = package.get("name", f"package[{i}]")
        source = package.get("source")
        if not isinstance(source, dict) or len(source) != 1:
            return f"package {name!r}: its source is not one registry"
        (kind, value), *_ = source.items()
        if kind == "registry" and isinstance(value, str):
            continue
        if kind in ("editable", "virtual") and value == ".":
            continue
        return (
            f"package {name!r}: source {kind} = {str(value)[:80]!r} (only registry packages "
            "and the project itself: the worker's configuration chooses the index)"
        )
    return None


def _toml(text: str) -> dict[str, Any] | str:
    """The document, or what is wrong with it."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return f"not valid TOML: {exc}"


def _table(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def lock_key(spec_key: str, python: str, torch_backend: str | None) -> str:
    """Where the server keeps an unlocked spec's fleet-wide lock: one per spec, Python
    (major.minor) and torch build, since each resolves differently."""
    minor = ".".join(python.split(".")[:2])
    return _hash({"spec": spec_key, "python": minor, "torch": torch_backend})


def build_key(spec_key: str, python: str, platform: str, options: dict[str, Any]) -> str:
    """A worker's cache key: the spec, the exact Python, the platform and every build
    option that changes the result (the torch build, the index uv reads)."""
    return _hash({"spec": spec_key, "python": python, "platform": platform, "options": options})


def _hash(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


#: CUDA builds of torch uv can select (``--torch-backend``), oldest first.
TORCH_CUDA_BACKENDS: tuple[tuple[tuple[int, int], str], ...] = (
    ((11, 8), "cu118"),
    ((12, 1), "cu121"),
    ((12, 4), "cu124"),
    ((12, 6), "cu126"),
    ((12, 8), "cu128"),
    ((12, 9), "cu129"),
    ((13, 0), "cu130"),
)


def torch_backend_for(cuda_version: str | None, gpus: int) -> str:
    """The torch build for a worker: the newest CUDA build its driver runs (a driver runs
    builds for its CUDA version and older), or ``cpu`` without GPUs or a driver too old
    for any CUDA build."""
    if gpus <= 0 or not cuda_version:
        return "cpu"
    m = re.match(r"^(\d+)\.(\d+)", cuda_version)
    if not m:
        return "cpu"
    have = (int(m.group(1)), int(m.group(2)))
    best = "cpu"
    for version, name in TORCH_CUDA_BACKENDS:
        if version <= have:
            best = name
    return best


#: Packages of the PyTorch ecosystem: an environment naming one of them gets the torch
#: build that matches the worker (``--torch-backend``).
TORCH_PACKAGES = frozenset({"torch", "torchvision", "torchaudio", "torchtext", "triton"})


def names_torch(texts: list[str]) -> bool:
    """Whether any requirement text (a requirements file, a ``--with`` string or a
    pyproject's text) names a PyTorch package."""
    pattern = re.compile(r"""(?:^|[\s"'\[,])([A-Za-z0-9][A-Za-z0-9._-]*)""", re.MULTILINE)
    for text in texts:
        for m in pattern.finditer(text):
            if re.sub(r"[-_.]+", "-", m.group(1)).lower() in TORCH_PACKAGES:
                return True
    return False


@dataclass(frozen=True)
class EnvRequest:
    """An environment as a user wrote it, before its files are uploaded (the client's
    side only, as a local package is): ``with_requirements`` is a local path, relative
    to the manifest's folder (or the working directory on the command line)."""

    with_requirements: str | None = None
    with_: tuple[str, ...] = ()
    python: str | None = None
    upgrade: bool = False

    @property
    def empty(self) -> bool:
        return self.with_requirements is None and not self.with_ and self.python is None
