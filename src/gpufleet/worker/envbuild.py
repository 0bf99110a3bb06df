"""Building one job environment with uv: the commands, their output streamed line by line
as uv prints it, and uv's failures turned into :class:`EnvError`.

The cache (:mod:`gpufleet.worker.environments`) decides *whether* and *where* to build;
this module only runs uv. Every uv process runs in its own process group, which is
killed when the build's deadline passes or the build is cancelled.

Two kinds of build, after :class:`~gpufleet.domain.environments.EnvKind`:

- requirements: the pinned list is the fleet's lock, or is resolved here with ``uv pip
  compile --universal`` (the new lock); then ``uv venv`` and ``uv pip sync`` of exactly it;
- project: a pyproject.toml in a work folder with its uv.lock (the job's own, the
  fleet's, or made here with ``uv lock``: the new lock); then ``uv venv`` and ``uv sync
  --frozen --no-install-project`` into it.

Neither compiles bytecode: that took 70 % of a build (10 s of 15 s for numpy, scipy,
scikit-learn, pandas and matplotlib on two cores), and the job need not wait for it. The
cache compiles it after the job has started (:func:`compile_bytecode`); jobs run with
``PYTHONDONTWRITEBYTECODE`` so that none writes a ``.pyc`` into the sealed environment
(root ignores its read-only modes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.domain.environments import EnvKind, EnvSpec
from gpufleet.errors import GpufleetError
from gpufleet.worker.isolation import is_secret_env

#: Lines of uv's output an EnvError keeps.
TAIL_LINES = 20
#: The longest line passed on; a longer one is cut (uv prints no such line, a bug might).
MAX_LINE = 8192
#: Seconds a quick uv query (find a Python, freeze) may take.
QUERY_SECONDS = 120.0
#: Variables the worker's own environment keeps from uv: they would point uv at another
#: environment than the one it builds.
NOT_FOR_UV = frozenset({"VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME"})
#: Words of uv's that mean a build fails the same way on every worker: the requirements
#: have no solution, or the spec's files cannot be read.
FINAL_SIGNS = (
    "No solution found",
    "unsatisfiable",
    "was not found in the package registry",
    "was not found in the provided package locations",
    "Failed to parse",
    "No `project` table found",
)
#: ... and words that mean the failure is this worker's or the network's, whatever else
#: uv said.
TRANSIENT_SIGNS = (
    "Failed to fetch",
    "Failed to download",
    "error sending request",
    "dns error",
    "Connection",
    "timed out",
    "network connectivity is disabled",
    "No space left",
    "Too many open files",
)
#: A Python's exact version, its implementation and platform, printed as JSON.
_PROBE = (
    "import json, platform, sys, sysconfig; print(json.dumps({"
    "'version': platform.python_version(), 'implementation': sys.implementation.name, "
    "'platform': sysconfig.get_platform(), 'libc': '-'.join(platform.libc_ver())}))"
)

#: The marks uv draws before a line of an error's tree on a terminal.
_MARKS = "\u00d7\u2570\u2500\u25b6\u2502\u251c "

OnLine = Callable[[str], None]


class EnvError(GpufleetError):
    """A job's environment could not be built. ``message`` is one line, the most telling
    one; ``lines`` uv's last lines; ``final`` whether it fails the same way on every
    worker (no such requirement, no solution, a Python no worker provides: retrying
    elsewhere cannot help); ``where`` the step: python, files, resolve, venv, install,
    freeze, disk, wait, timeout."""

    code = "env_error"

    def __init__(
        self, message: str, *, where: str, final: bool = False, lines: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.where = where
        self.final = final
        self.lines = list(lines)


@dataclass(frozen=True)
class Python:
    """An interpreter a build uses: its path, exact version and platform."""

    path: str
    version: str  # "3.11.7"
    platform: str  # "cpython-linux-x86_64-glibc-2.36": what a venv's wheels depend on

    @property
    def minor(self) -> str:
        return ".".join(self.version.split(".")[:2])


def uv_environment(
    base: Mapping[str, str],
    uv_env: Mapping[str, str],
    python_downloads: bool,
    index_url: str | None = None,
    allow_builds: bool = True,
) -> dict[str, str]:
    """The environment uv runs with: the worker's, less its secrets and what names another
    environment, with the worker's own ``UV_*`` variables as given, and:

    - the worker's index as ``UV_INDEX_URL`` (a variable: it may hold a password, which a
      command line would show every user of the machine);
    - ``UV_NO_BUILD=1`` unless builds are allowed: a source distribution's build runs
      its own code, as the worker (root, under ``--run-as``);
    - ``UV_PYTHON_DOWNLOADS=never`` unless downloads are allowed;
    - ``UV_LINK_MODE=copy`` unless the operator chose: an environment shares no file with
      uv's cache, so sealing it (or a job that gets past the seal) leaves the cache alone;
    - no colours and no progress bars: the lines go to a log.
    """
    env = {
        k: v
        for k, v in base.items()
        if not k.startswith("UV_") and k not in NOT_FOR_UV and not is_secret_env(k)
    }
    env.update(uv_env)
    if index_url:
        env["UV_INDEX_URL"] = index_url
    if not allow_builds:
        env["UV_NO_BUILD"] = "1"
    env.setdefault("UV_LINK_MODE", "copy")
    env["UV_PYTHON_DOWNLOADS"] = "automatic" if python_downloads else "never"
    env.update(NO_COLOR="1", UV_NO_PROGRESS="1")
    return env


def index_args(find_links: Sequence[str], index_url: str | None) -> list[str]:
    """uv's flags for the worker's folders of wheels. Flags, not variables: uv 0.13.8 has
    no variable for ``--no-index`` (a ``UV_NO_INDEX`` is ignored, and PyPI is asked). The
    index itself goes in uv's environment (:func:`uv_environment`)."""
    args: list[str] = []
    for place in find_links:
        args += ["--find-links", place]
    if find_links and not index_url:
        args.append("--no-index")  # the folder is the whole index: nothing else is asked
    return args


class Uv:
    """The uv binary, with the environment and index flags every build passes it."""

    def __init__(self, binary: str, env: Mapping[str, str], index: Sequence[str]) -> None:
        self.binary = binary
        self.env = dict(env)
        self.index = list(index)

    async def run(
        self,
        args: Sequence[str],
        *,
        where: str,
        on_line: OnLine,
        deadline: float,
        cwd: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Run uv, each line it prints (stdout and stderr) passed to ``on_line`` as it
        comes. EnvError when it fails, or when ``deadline`` (monotonic) passes: then its
        process group is killed, as it is when the caller is cancelled."""
        proc = await self._start(args, cwd, env, merged=True)
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        try:
            assert proc.stdout is not None
            left = deadline - time.monotonic()
            await asyncio.wait_for(_pump(proc.stdout, on_line, tail), timeout=max(left, 0.0))
            code = await proc.wait()
        except TimeoutError:
            raise EnvError(
                f"the environment's build took too long and was stopped (during {where})",
                where="timeout",
                lines=tail,
            ) from None
        finally:
            await _stop(proc)
        if code != 0:
            raise failure(where, list(tail))

    async def query(self, args: Sequence[str], cwd: Path) -> tuple[int, str, str]:
        """Run a quick uv command and return its exit code, stdout and stderr."""
        proc = await self._start(args, cwd, None, merged=False)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), QUERY_SECONDS)
        except TimeoutError:
            return 124, "", f"uv {' '.join(args[:3])} took over {QUERY_SECONDS:.0f} s"
        finally:
            await _stop(proc)
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    async def _start(
        self, args: Sequence[str], cwd: Path, env: Mapping[str, str] | None, merged: bool
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            self.binary,
            *args,
            cwd=cwd,
            env={**self.env, **(env or {})},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if merged else asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group, killed as one
        )

    async def find_python(self, request: str, cwd: Path) -> str | None:
        """The path of an interpreter for ``request`` ("3.12", "3.11.7") this machine has,
        or None. Never a virtual environment's (``--system``)."""
        code, out, _ = await self.query(
            ["python", "find", "--system", "--no-project", request], cwd
        )
        return (out.strip() or None) if code == 0 else None

    async def install_python(self, request: str, cwd: Path) -> None:
        """Download a uv-managed Python (only where the worker allows downloads)."""
        await self.query(["python", "install", request], cwd)

    async def installed_pythons(self, cwd: Path) -> list[str]:
        """The Python versions this machine has (uv-managed or found), newest first."""
        args = ["python", "list", "--only-installed", "--output-format", "json"]
        code, out, _ = await self.query(args, cwd)
        if code != 0:
            return []
        try:
            found = {str(entry["version"]) for entry in json.loads(out)}
        except (ValueError, TypeError, KeyError):
            return []
        return sorted(found, key=_version_order, reverse=True)

    async def freeze(self, venv: Path) -> dict[str, str]:
        """What an environment holds: each distribution's name and version (or the URL it
        was installed from)."""
        args = ["pip", "freeze", "--python", str(venv / "bin" / "python")]
        code, out, err = await self.query(args, venv)
        if code != 0:
            raise EnvError(
                f"could not list the built environment's packages: {_last(err)}",
                where="freeze",
                lines=err.splitlines()[-TAIL_LINES:],
            )
        return parse_freeze(out)


async def probe_python(path: str) -> Python:
    """Ask an interpreter its exact version and platform."""
    proc = await asyncio.create_subprocess_exec(
        path,
        "-I",
        "-S",
        "-c",
        _PROBE,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), QUERY_SECONDS)
        facts = json.loads(out)
    except (TimeoutError, ValueError):
        raise EnvError(f"the Python at {path} did not say its version", where="python") from None
    finally:
        await _stop(proc)
    platform = f"{facts['implementation']}-{facts['platform']}-{facts['libc'] or 'nolibc'}"
    return Python(path, facts["version"], platform)


def parse_freeze(text: str) -> dict[str, str]:
    """``uv pip freeze``'s lines as name -> version (``name @ url``: the URL)."""
    versions: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        for sep in ("==", " @ "):
            if sep in line:
                name, _, version = line.partition(sep)
                versions[name.strip()] = version.strip()
                break
    return versions


def failure(where: str, lines: list[str]) -> EnvError:
    """uv failed: an EnvError whose message is uv's most telling line, final when it says
    the requirements cannot be met (and nothing says the network or the disk failed)."""
    text = "\n".join(lines)
    final = any(s in text for s in FINAL_SIGNS) and not any(s in text for s in TRANSIENT_SIGNS)
    if "Python" in text and "not found" not in text:  # this worker's Python: others may do
        final = False
    step = {"resolve": "resolving", "install": "installing", "venv": "creating the venv"}
    doing = step.get(where, where)
    return EnvError(
        f"uv failed {doing} the environment: {telling_line(lines)}",
        where=where,
        final=final,
        lines=lines,
    )


def telling_line(lines: Sequence[str]) -> str:
    """The line that says most about a failure: uv's "Because ..." explanation, else its
    ``error:`` line, else its last line."""
    cleaned = [_strip_marks(line) for line in lines if line.strip()]
    for line in cleaned:
        if line.startswith("Because"):
            return line
    for line in cleaned:
        if line.lower().startswith("error:"):
            return line[len("error:") :].strip()
    return cleaned[-1] if cleaned else "(uv said nothing)"


def _strip_marks(line: str) -> str:
    """A line of uv's without its indent and tree marks (a cross, arrows, ``cause:``)."""
    line = line.strip().lstrip(_MARKS).strip()
    return line[len("cause:") :].strip() if line.startswith("cause:") else line


def _last(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _version_order(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


async def _pump(stream: asyncio.StreamReader, on_line: OnLine, tail: deque[str]) -> None:
    """Pass each line of ``stream`` on as soon as it is complete, until its end."""
    pending = b""
    while chunk := await stream.read(65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_LINE:
            lines.append(pending)
            pending = b""
        for raw in lines:
            _emit(raw, on_line, tail)
    if pending:
        _emit(pending, on_line, tail)


def _emit(raw: bytes, on_line: OnLine, tail: deque[str]) -> None:
    line = raw[:MAX_LINE].decode(errors="replace").rstrip("\r")
    tail.append(line)
    on_line(line)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Kill a uv process's whole group unless it has ended, and reap it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


# --------------------------------------------------------------------------- builds


@dataclass(frozen=True)
class BuildInputs:
    """What one build installs: the spec, its files' bytes (by name), the interpreter,
    the torch build (None: uv's default), and the fleet's lock (None: resolve here)."""

    spec: EnvSpec
    files: Mapping[str, bytes]
    python: Python
    torch_backend: str | None
    fleet_lock: str | None
    # what the worker reads: a uv.lock must come from there (portable_lock)
    find_links: tuple[str, ...] = ()
    index_url: str | None = None

    def text(self, name: str) -> bytes:
        return self.files[name]


@dataclass(frozen=True)
class Result:
    """What a build installed: the lock's text (the pinned list or uv.lock), and the
    same text as ``new_lock`` when this build resolved it (None: it was given one, the
    job's uv.lock or the fleet's)."""

    installed: str
    new_lock: str | None


async def build(
    uv: Uv, inputs: BuildInputs, venv: Path, work: Path, on_line: OnLine, deadline: float
) -> Result:
    """Build the environment into ``venv`` (``work``: a folder for the spec's files and
    uv's lock)."""
    work.mkdir(parents=True)
    run = _Runner(uv, on_line, deadline, work)
    if inputs.spec.kind is EnvKind.PROJECT:
        return await _build_project(run, inputs, venv, work)
    return await _build_requirements(run, inputs, venv, work)


@dataclass(frozen=True)
class _Runner:
    uv: Uv
    on_line: OnLine
    deadline: float
    work: Path

    async def __call__(
        self, where: str, args: list[str], env: Mapping[str, str] | None = None
    ) -> None:
        await self.uv.run(
            args, where=where, on_line=self.on_line, deadline=self.deadline, cwd=self.work, env=env
        )


async def _build_requirements(run: _Runner, inputs: BuildInputs, venv: Path, work: Path) -> Result:
    spec, index = inputs.spec, run.uv.index
    torch = ["--torch-backend", inputs.torch_backend] if inputs.torch_backend else []
    pinned = work / "pinned.txt"
    new_lock: str | None = None
    if inputs.fleet_lock is not None and not spec.upgrade:
        pinned.write_text(inputs.fleet_lock)
    else:
        sources = []
        if spec.requirements is not None:
            (work / "requirements.txt").write_bytes(inputs.text(spec.requirements.name))
            sources.append("requirements.txt")
        if spec.with_:
            (work / "with.txt").write_text("".join(f"{r.strip()}\n" for r in spec.with_))
            sources.append("with.txt")
        args = ["pip", "compile", "--universal", "--python-version", inputs.python.minor]
        args += ["--no-header", "-o", pinned.name, *index, *torch, *sources]
        await run("resolve", args)
        new_lock = pinned.read_text()
    await _make_venv(run, inputs.python, venv)
    python = str(venv / "bin" / "python")
    args = ["pip", "sync", "--python", python, *index, *torch, pinned.name]
    await run("install", args)
    return Result(pinned.read_text(), new_lock)


async def _build_project(run: _Runner, inputs: BuildInputs, venv: Path, work: Path) -> Result:
    spec, index = inputs.spec, run.uv.index
    assert spec.project is not None
    (work / "pyproject.toml").write_bytes(inputs.text(spec.project.name))
    lock = work / "uv.lock"
    new_lock: str | None = None
    interpreter = ["--python", inputs.python.path]
    if spec.lock is not None:  # the job's own, as it is, from what this worker reads
        mine = inputs.text(spec.lock.name).decode("utf-8", errors="replace")
        lock.write_text(portable_lock(mine, inputs.find_links, inputs.index_url))
    elif inputs.fleet_lock is not None and not spec.upgrade:
        lock.write_text(portable_lock(inputs.fleet_lock, inputs.find_links, inputs.index_url))
    else:
        await run("resolve", ["lock", *interpreter, *index])
        new_lock = lock.read_text()
    await _make_venv(run, inputs.python, venv)
    args = ["sync", "--frozen", "--no-install-project", *interpreter, *index]
    await run("install", args, {"UV_PROJECT_ENVIRONMENT": str(venv)})
    return Result(lock.read_text(), new_lock)


async def _make_venv(run: _Runner, python: Python, venv: Path) -> None:
    """A relocatable venv: its scripts find their Python wherever the folder is, so the
    build can be renamed into the cache when done."""
    await run("venv", ["venv", "--relocatable", "--python", python.path, str(venv)])


async def compile_bytecode(venv: Path, site: Path, timeout: float) -> str | None:
    """Compile the environment's modules (``python -m compileall``, on every core), as
    the worker; why it failed, or None. Its process group is killed at ``timeout`` or
    when the caller is cancelled. A module that does not compile (a test file written
    for another Python) is left out, as pip and uv leave it."""
    proc = await asyncio.create_subprocess_exec(
        str(venv / "bin" / "python"),
        "-I",  # isolated: no PYTHON* variables, no user site
        "-S",  # no site: a .pth an installed wheel ships is never run, as the worker
        "-m",
        "compileall",
        "-q",
        "-f",  # every module: a .pyc a job planted meanwhile is replaced
        "-j",
        "0",
        str(site),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        start_new_session=True,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        return f"compiling bytecode took over {timeout:.0f} s"
    finally:
        await _stop(proc)
    # compileall exits 1 when a module did not compile: that one is left to run from source
    if proc.returncode not in (0, 1):
        return f"compileall exited {proc.returncode}: {_last(err.decode(errors='replace'))}"
    return None


#: PyPI's index, and the hosts its files come from.
PYPI = "https://pypi.org/simple"
PYPI_FILES = frozenset({"files.pythonhosted.org", "pypi.org"})


def portable_lock(text: str, find_links: Sequence[str], index_url: str | None) -> str:
    """A uv.lock, checked against what this worker may read, as it installs here: every
    package from a registry this worker reads (its index, else PyPI; a folder of wheels
    only when the worker has one), each file from that registry's host or, for a folder,
    a bare file name, which is read from the worker's own folder (the lock's folder path
    is where it was made, not here). EnvError (not final: another worker may read what
    this one does not) naming the package otherwise. Nothing else is contacted."""
    import tomllib
    from urllib.parse import urlsplit

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise EnvError(f"the uv.lock is not TOML: {exc}", where="lock", final=True) from None
    allowed = (index_url or PYPI).rstrip("/")
    hosts = {urlsplit(allowed).hostname} | (PYPI_FILES if allowed == PYPI else set())
    folders: set[str] = set()
    for package in data.get("package", []):
        name = str(package.get("name", "?"))
        source = package.get("source") or {}
        registry = source.get("registry")
        if registry is None:
            continue  # the project itself (the server refuses every other kind)
        files = [*package.get("wheels", []), *([package["sdist"]] if "sdist" in package else [])]
        if "://" in str(registry):
            if str(registry).rstrip("/") != allowed:
                raise _refused(name, f"its registry {registry} is not this worker's ({allowed})")
            for f in files:
                if urlsplit(str(f.get("url", ""))).hostname not in hosts:
                    raise _refused(name, f"a file of it is not on {allowed}")
            continue
        if not find_links:
            raise _refused(name, "it comes from a folder of wheels; this worker reads an index")
        for f in files:
            if not str(f.get("path", "")).endswith(ARCHIVES):
                raise _refused(name, f"its file {f.get('path') or f.get('url')!r} is not a wheel")
        folders.add(str(registry))
    # Made against a folder elsewhere: each file is read by its name from this worker's own
    # folder (whatever path the lock gives it: no path reaches past that folder).
    for folder in folders:
        text = text.replace(f'registry = "{folder}"', f'registry = "{find_links[0]}"')
    return re.sub(r'path = "(?:[^"]*[/\\])?([^"/\\]+)"', _file_name, text) if folders else text


#: What a folder of wheels holds.
ARCHIVES = (".whl", ".tar.gz", ".zip")


def _file_name(m: re.Match[str]) -> str:
    name = m.group(1)
    return f'path = "{name}"' if name.endswith(ARCHIVES) else m.group(0)


def _refused(package: str, why: str) -> EnvError:
    return EnvError(
        f"the uv.lock's package {package!r} cannot be installed here: {why}",
        where="lock",
        final=False,
    )
