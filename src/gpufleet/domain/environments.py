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

import hashlib
import json
import re
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
        it is computed. ``--with`` strings count as a set (order and spacing aside)."""
        body = {
            "kind": self.kind.value,
            "requirements": self.requirements.sha256 if self.requirements else None,
            "project": self.project.sha256 if self.project else None,
            "lock": self.lock.sha256 if self.lock else None,
            "with": sorted({normalize_requirement(r) for r in self.with_}),
            "python": self.python,
        }
        return _hash(body)

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


def normalize_requirement(text: str) -> str:
    """A requirement string, its spaces gone and its name lowercased, so ``Numpy >= 2``
    and ``numpy>=2`` are one requirement."""
    text = re.sub(r"\s+", "", text)
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(.*)$", text)
    if not m:
        return text
    name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
    return name + m.group(2)


def requirement_problem(text: str) -> str | None:
    """What is wrong with a ``--with`` string, or None. It must be one requirement (a
    name, extras, a version specifier, markers): never an option (``--index-url``), a
    local path or a file include, which would reach past the spec."""
    stripped = text.strip()
    if not stripped:
        return "an empty requirement"
    if len(stripped) > WITH_CHARS:
        return f"a requirement of {len(stripped)} characters (at most {WITH_CHARS})"
    if stripped.startswith("-"):
        return f"{stripped!r} is an option, not a requirement"
    if "\n" in stripped or "\r" in stripped or "\0" in stripped:
        return "a requirement is one line"
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*", stripped):
        return f"{stripped!r} does not start with a package name"
    return None


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
