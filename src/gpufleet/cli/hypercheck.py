"""``apply`` checks each job's ``hyper.*`` keys against its script's own ``--help``.

A job whose command runs a Python script (``python train.py ...``, ``python -m pkg``,
``./train.py``) that uses argparse, click or typer has the script's ``--help`` run here,
in the manifest's folder, before anything is uploaded or applied: with a timeout, no
standard input, no network (the Python process's sockets refuse to connect), none of
gpufleet's own settings in its environment, and only its first ``HELP_BYTES`` read. A
key the script does not take refuses the manifest, naming the key and the closest
option. When the help cannot be had (a shell command, not a Python script, a missing
dependency, a timeout) the check is skipped with one line that says why: the job runs
as before, and fails on its worker if a key is wrong.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from gpufleet.domain.hyper import options_in_help, unknown_keys
from gpufleet.domain.manifest import Plan
from gpufleet.domain.models import JobSpec
from gpufleet.errors import ManifestError

TIMEOUT = 20.0  # seconds a script's --help may take
HELP_BYTES = 1 << 20  # what is read of its output
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?$")
_PARSERS = re.compile(rb"\b(argparse|click|typer)\b")

# Runs the script (or module) as __main__ with sockets that refuse to connect.
_BOOT = """
import os, runpy, socket, sys
def _refuse(*args, **kwargs):
    raise OSError("no network while gpufleet reads --help")
socket.socket.connect = socket.socket.connect_ex = _refuse
socket.create_connection = socket.getaddrinfo = _refuse
kind, target, *rest = sys.argv[1:]
sys.argv = [target, *rest]
if kind == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")
"""

Probe = tuple[str, ...]  # the boot's arguments: kind, script or module, its positionals


def check_hyper(plan: Plan, folder: Path, say: Callable[[str], None]) -> None:
    """Refuse ``plan`` (:class:`ManifestError`) if a job's ``hyper`` key is not an option
    of its script; ``say`` each script whose options could not be read, once."""
    read: dict[Probe | str, set[str] | str] = {}
    for spec in plan.jobs:
        if not spec.hyper:
            continue
        probe = help_probe(spec, folder)
        if probe not in read:
            read[probe] = probe if isinstance(probe, str) else script_options(probe, folder)
            if isinstance(read[probe], str):
                say(f"hyper.* keys not checked: {read[probe]} (first in job {spec.name})")
        options = read[probe]
        if isinstance(options, str):
            continue
        bad = unknown_keys(spec.hyper, spec.hyper_style, options)
        if bad:
            said = "; ".join(f'field "hyper.{b.key}": {probe[1]} {b}' for b in bad)
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
    source = _source(kind, target, folder)
    if source is None:
        return f"{target} is not in the manifest's folder"
    try:
        if not _PARSERS.search(source.read_bytes()[:HELP_BYTES]):
            return f"{target} uses none of argparse, click or typer"
    except OSError as exc:
        return f"cannot read {target}: {exc.strerror or exc}"
    positionals = []
    for word in rest:  # a subcommand's name, say: its options are its --help's
        if word.startswith("-"):
            break
        positionals.append(word)
    return (kind, target, *positionals)


def _source(kind: str, target: str, folder: Path) -> Path | None:
    if kind != "-m":
        places = [folder / target]
    else:
        base = folder.joinpath(*target.split("."))
        places = [base.with_suffix(".py"), base / "__main__.py"]
    for path in places:
        try:
            if path.is_file():
                return path
        except (OSError, ValueError):  # a name too long for a path, a NUL
            return None
    return None


def script_options(probe: Probe, folder: Path) -> set[str] | str:
    """The long options the script's ``--help`` lists, or why none could be read."""
    kind, target, *rest = probe
    argv = [sys.executable, "-c", _BOOT, kind or "-", target, *rest, "--help"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env.update(NO_COLOR="1", TERM="dumb", COLUMNS="200", CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as errors:
        try:
            code = subprocess.run(
                argv,
                cwd=folder,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=errors,
                timeout=TIMEOUT,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            return f"{target} --help took more than {TIMEOUT:g}s"
        except OSError as exc:
            return f"cannot run {target} --help: {exc.strerror or exc}"
        text = _read(out)
        problem = _read(errors).strip().splitlines()
    if code != 0:
        last = problem[-1][:200] if problem else "no message"
        return f"{target} --help exited {code} ({last})"
    options = options_in_help(text)
    return options or f"{target} --help listed no options"


def _read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read(HELP_BYTES).decode("utf-8", "replace")
