"""``apply`` checks each job's ``hyper.*`` keys against its script's own ``--help``.

A job whose command runs a Python script (``python train.py ...``, ``python -m pkg``,
``./train.py``) that uses argparse, click or typer has the script's ``--help`` run here,
before anything is uploaded or applied. The script is looked up where the job will see
it: in the package unpacked at the job's working directory (``packages = ["src"]`` puts
``src/train.py`` there as ``train.py``), or in the manifest's folder for a job without
packages; a script whose path leaves the manifest's folder is not run.

It runs as you, as ``python train.py --help`` would, with these limits: a timeout after
which its whole process group is killed (and the group is killed after it exits too, so
nothing it started outlives ``apply`` unless it left the group), no standard input, an
environment of ``PATH``, the locale, ``PYTHONPATH`` and ``VIRTUAL_ENV`` only (no tokens
or keys of yours) with a fresh ``HOME``, config, cache and temporary folder removed
after, and only its first ``HELP_BYTES`` read. On Linux, where ``unshare`` can give it
a network namespace of its own (unprivileged user namespaces allowed), it runs with no
network at all; elsewhere it has your network.

A key the script does not take refuses the manifest, naming the key and the closest
option. When the help cannot be had, or the script passes on options it does not know
(``parse_known_args``), the check is skipped with one line that says why: the job runs as
before, and fails on its worker if a key is wrong.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import IO, NamedTuple

from gpufleet.domain.hyper import options_in_help, unknown_keys
from gpufleet.domain.manifest import Plan
from gpufleet.domain.models import InputKind, JobSpec
from gpufleet.errors import ManifestError

TIMEOUT = 20.0  # seconds a script's --help may take
HELP_BYTES = 1 << 20  # what is read of its output and of its source
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?$")
_PARSERS = re.compile(rb"\b(argparse|click|typer)\b")
# A parser that passes on what it does not know: any key would be "taken".
_FORWARDS = re.compile(rb"\bparse_known_\w*args\b|\bignore_unknown_options\b|\ballow_extra_args\b")
_NO_ABBREV = re.compile(rb"\ballow_abbrev\s*=\s*False\b")
_KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "PYTHONPATH", "VIRTUAL_ENV")

# Runs the script (or module) as __main__, as `python SCRIPT` or `python -m MODULE` would.
_BOOT = """
import os, runpy, sys
kind, target, *rest = sys.argv[1:]
sys.argv = [target, *rest]
if kind == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")
"""


class Probe(NamedTuple):
    """What to run for a script's --help: ``run`` (a path or a module, per ``kind``)
    in the folder ``where``, with the ``positionals`` the job gives before its first
    option (a subcommand's name: its options are its own --help's)."""

    kind: str  # "-m" or ""
    target: str  # the script as the job's command names it
    run: str
    where: Path
    positionals: tuple[str, ...]
    abbrev: bool  # argparse: a unique prefix of an option is taken for it


def check_hyper(plan: Plan, folder: Path, say: Callable[[str], None]) -> None:
    """Refuse ``plan`` (:class:`ManifestError`) if a job's ``hyper`` key is not an option
    of its script; ``say`` each script whose options could not be read, once."""
    read: dict[Probe | str, set[str] | str] = {}
    for spec in plan.jobs:
        if not spec.hyper:
            continue
        probe = help_probe(spec, folder)
        if probe not in read:
            read[probe] = probe if isinstance(probe, str) else script_options(probe)
            if isinstance(read[probe], str):
                say(f"hyper.* keys not checked: {read[probe]} (first in job {spec.name})")
        options = read[probe]
        if isinstance(options, str) or isinstance(probe, str):
            continue
        bad = unknown_keys(spec.hyper, spec.hyper_style, options, prefixes=probe.abbrev)
        if bad:
            said = "; ".join(f'field "hyper.{b.key}": {probe.target} {b}' for b in bad)
            raise ManifestError(
                f'{plan.path}: job "{spec.name}": {said} (checked against its --help; '
                "apply --no-hyper-check skips this)",
                detail={"file": plan.path, "job": spec.name, "field": f"hyper.{bad[0].key}"},
            )


def help_probe(spec: JobSpec, folder: Path) -> Probe | str:
    """What to run for the job's script's --help, or why it cannot be run."""
    if spec.shell:
        return "a shell command"
    argv = list(spec.command)
    if _PYTHON.match(Path(argv[0]).name):
        argv = argv[1:]
        while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):
            argv = argv[1:]  # the interpreter's own options (-u, -O)
        if argv[:1] == ["-c"]:
            return "python -c runs no script"
    elif not argv[0].endswith(".py"):
        return f"{argv[0]} is not a Python script"
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        return "no script named"
    kind, target, rest = ("-m", argv[1], argv[2:]) if argv[0] == "-m" else ("", argv[0], argv[1:])
    found = _where_job_sees(spec, kind, target, folder)
    if isinstance(found, str):
        return found
    where, run, source = found
    if not source.resolve().is_relative_to(folder.resolve()):
        return f"{target} is outside the manifest's folder"
    try:
        text = source.read_bytes()[:HELP_BYTES]
    except OSError as exc:
        return f"cannot read {target}: {exc.strerror or exc}"
    if not _PARSERS.search(text):
        return f"{target} uses none of argparse, click or typer"
    if _FORWARDS.search(text):
        return f"{target} passes on options it does not know (parse_known_args)"
    positionals = []
    for word in rest:
        if word.startswith("-"):
            break
        positionals.append(word)
    abbrev = b"argparse" in text and not _NO_ABBREV.search(text)
    return Probe(kind, target, run, where, tuple(positionals), abbrev)


def _where_job_sees(
    spec: JobSpec, kind: str, target: str, folder: Path
) -> tuple[Path, str, Path] | str:
    """The folder to run in, what to run there, and the script's file: from the job's
    package that puts the script where its command names it, else (a job without
    packages) from the manifest's folder."""
    if kind == "-m":
        base = target.replace(".", "/")
        names = [f"{base}.py", f"{base}/__main__.py"]
    else:
        names = [target]
    packages = [i for i in spec.inputs if i.kind == InputKind.LOCAL]
    missing = "the job's packages" if packages else "the manifest's folder"
    try:
        if not packages:
            for name in names:
                if (folder / name).is_file():
                    return folder, target, folder / name
        for package in reversed(packages):  # a later one unpacks over an earlier one
            for name in names:
                found = _in_package(folder / package.ref, package.dest, name)
                if found is not None:
                    where, inside = found
                    run = _module(inside) if kind == "-m" else inside
                    return where, run, where / inside
    except (OSError, ValueError):  # a name too long for a path, a NUL
        pass
    return f"{target} is not in {missing}"


def _in_package(local: Path, dest: str, name: str) -> tuple[Path, str] | None:
    """Where the package ``local`` (unpacked at ``dest``) holds the job's file ``name``:
    (the package's folder, the file's path in it)."""
    parts = [p for p in PurePosixPath(name.replace("\\", "/")).parts if p != "."]
    at = [p for p in PurePosixPath(dest).parts if p != "."]
    if ".." in parts or parts[: len(at)] != at or len(parts) <= len(at):
        return None
    inside = "/".join(parts[len(at) :])
    if local.is_dir() and (local / inside).is_file():
        return local, inside
    if local.is_file() and local.suffix != ".zip" and inside == local.name:
        return local.parent, inside
    return None


def _module(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__main__").replace("/", ".")


def script_options(probe: Probe) -> set[str] | str:
    """The long options the script's ``--help`` lists, or why none could be read."""
    argv = [sys.executable, "-c", _BOOT, probe.kind or "-", probe.run, *probe.positionals]
    with (
        tempfile.TemporaryDirectory(prefix="gpufleet-help-") as home,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as errors,
    ):
        code = _run([*_no_network(), *argv, "--help"], probe.where, _env(Path(home)), out, errors)
        text = _read(out)
        problem = _read(errors).strip().splitlines()
    if code is None:
        return f"{probe.target} --help took more than {TIMEOUT:g}s"
    if isinstance(code, str):
        return f"cannot run {probe.target} --help: {code}"
    if code != 0:
        last = problem[-1][:200] if problem else "no message"
        return f"{probe.target} --help exited {code} ({last})"
    options = options_in_help(text)
    return options or f"{probe.target} --help listed no options"


def _run(
    argv: list[str], cwd: Path, env: dict[str, str], out: IO[bytes], errors: IO[bytes]
) -> int | str | None:
    """Run ``argv`` in a session of its own; its exit code, None past ``TIMEOUT``, or why
    it could not start. The whole process group is killed once it is done either way."""
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=errors,
            start_new_session=True,
        )
    except OSError as exc:
        return str(exc.strerror or exc)
    try:
        return proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group ended
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _env(home: Path) -> dict[str, str]:
    """An environment of the caller's PATH, locale and Python paths only, with ``home``
    as HOME and for config, cache and temporary files."""
    env = {k: v for k, v in os.environ.items() if k in _KEPT_ENV or k.startswith("LC_")}
    for name in ("config", "cache", "tmp"):
        (home / name).mkdir()
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_CACHE_HOME=str(home / "cache"),
        TMPDIR=str(home / "tmp"),
        NO_COLOR="1",
        TERM="dumb",
        COLUMNS="200",
        CUDA_VISIBLE_DEVICES="",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


@functools.cache
def _no_network() -> tuple[str, ...]:
    """``unshare``'s words that run a command with no network, where this machine lets
    an unprivileged user do that (Linux with user namespaces); else none."""
    tool = shutil.which("unshare") if sys.platform.startswith("linux") else None
    if tool is None:
        return ()
    words = (tool, "--net", "--map-root-user")
    try:
        done = subprocess.run(
            [*words, sys.executable, "-c", ""],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ()
    return words if done.returncode == 0 else ()


def _read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read(HELP_BYTES).decode("utf-8", "replace")
