"""apply's check of a job's hyper.* keys against its script's own --help."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from gpufleet.cli import hypercheck
from gpufleet.cli.hypercheck import check_hyper, help_probe, script_options
from gpufleet.domain.hyper import options_in_help, unknown_keys
from gpufleet.domain.manifest import parse_manifest
from gpufleet.domain.models import HyperStyle, JobSpec
from gpufleet.errors import ManifestError

ARGPARSE = """\
import argparse
p = argparse.ArgumentParser()
p.add_argument("--batch-size", "--bs", type=int)
p.add_argument("--use-amp", action="store_true")
p.parse_args()
"""
CLICK = """\
import click
@click.command()
@click.option("--batch-size", type=int)
@click.option("--amp/--no-amp")
def main(batch_size, amp):
    pass
main()
"""
TYPER = """\
import typer
def main(batch_size: int = 8, learning_rate: float = 0.1, amp: bool = False) -> None:
    pass
typer.run(main)
"""


def probe(folder: Path, name: str, text: str) -> set[str] | str:
    (folder / name).write_text(text)
    found = help_probe(JobSpec(name="j", command=("python", name)), folder)
    assert isinstance(found, hypercheck.Probe), found
    return script_options(found)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ARGPARSE, {"--batch-size", "--bs", "--use-amp", "--help"}),
        (CLICK, {"--batch-size", "--amp", "--no-amp", "--help"}),
        (TYPER, {"--batch-size", "--learning-rate", "--amp", "--no-amp"}),
    ],
)
def test_the_options_of_argparse_click_and_typer_scripts_are_read(
    tmp_path: Path, text: str, expected: set[str]
) -> None:
    found = probe(tmp_path, "train.py", text)
    assert isinstance(found, set) and expected <= found


def test_a_key_the_script_does_not_take_is_named_with_the_closest_option() -> None:
    options = {"--batch-size", "--epochs", "--use-amp"}
    hyper = {"batchsize": 8, "epochs": 2, "use_amp": False, "lr": 0.1}
    bad = unknown_keys(hyper, HyperStyle.DASH, options)
    # a false boolean adds no flag (dash style): nothing to refuse
    assert [(b.key, b.flag, b.closest) for b in bad] == [
        ("batchsize", "--batchsize", "--batch-size"),
        ("lr", "--lr", None),
    ]
    verbatim = unknown_keys({"batch_size": 8}, HyperStyle.VERBATIM, options)
    assert [b.flag for b in verbatim] == ["--batch_size"]


def test_help_text_options_are_found_in_any_layout() -> None:
    text = "│ --batch-size  INTEGER │\n  -e, --epochs=N  [--dry-run]\n  x--not-one --.\n"
    assert options_in_help("\x1b[1m--bold\x1b[0m " + text) == {
        "--bold",
        "--batch-size",
        "--epochs",
        "--dry-run",
    }


@pytest.mark.parametrize(
    ("command", "shell", "why"),
    [
        (("python train.py --epochs 2",), True, "a shell command"),
        (("bash", "run.sh"), False, "bash is not a Python script"),
        (("python", "-c", "print(1)"), False, "python -c runs no script"),
        (("python", "missing.py"), False, "missing.py is not in the manifest's folder"),
        (("python", "plain.py"), False, "plain.py uses none of argparse, click or typer"),
        (("python", "-m", "nowhere"), False, "nowhere is not in the manifest's folder"),
    ],
)
def test_a_script_whose_help_cannot_be_run_says_why(
    tmp_path: Path, command: tuple[str, ...], shell: bool, why: str
) -> None:
    (tmp_path / "plain.py").write_text("print('hello')\n")
    assert help_probe(JobSpec(name="j", command=command, shell=shell), tmp_path) == why


def test_a_module_and_a_subcommand_are_asked_for_their_own_help(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "cli.py").write_text(ARGPARSE)
    spec = JobSpec(name="j", command=("python3", "-u", "-m", "pkg.cli", "fit", "--seed", "1"))
    found = help_probe(spec, tmp_path)
    assert isinstance(found, hypercheck.Probe), found
    assert (found.kind, found.run, found.where, found.positionals) == (
        "-m",
        "pkg.cli",
        tmp_path,
        ("fit",),
    )
    options = script_options(found)
    assert isinstance(options, set) and "--batch-size" in options


def test_the_help_run_sees_none_of_the_callers_secrets_or_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_TOKEN", "gft-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("HOME", str(tmp_path))
    dump = "import json, os\njson.dump(dict(os.environ), open('env.json', 'w'))\n"
    assert isinstance(probe(tmp_path, "train.py", dump + ARGPARSE), set)
    env = json.loads((tmp_path / "env.json").read_text())
    assert "gft-secret" not in env.values() and "aws-secret" not in env.values()
    assert env["PATH"] == os.environ["PATH"]
    assert env["HOME"] != str(tmp_path) and not Path(env["HOME"]).exists()  # removed after
    assert env["TMPDIR"].startswith(env["HOME"])


GRANDCHILD = """\
import argparse, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open("grandchild.pid", "w").write(str(child.pid))
{then}
p = argparse.ArgumentParser()
p.add_argument("--epochs")
p.parse_args()
"""


def _alive(pid: int) -> bool:
    for _ in range(50):  # a killed process is reaped by init a moment later
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("then", ["time.sleep(60)", "pass"])
def test_what_the_script_started_is_killed_at_the_timeout_or_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    monkeypatch.setattr(hypercheck, "TIMEOUT", 1.0)
    started = time.monotonic()
    said = probe(tmp_path, "train.py", GRANDCHILD.format(then=then))
    assert time.monotonic() - started < 15
    if then == "pass":
        assert isinstance(said, set) and "--epochs" in said
    else:
        assert said == "train.py --help took more than 1s"
    pid = int((tmp_path / "grandchild.pid").read_text())
    assert not _alive(pid)


@pytest.mark.skipif(not hypercheck._no_network(), reason="no unprivileged network namespace")
def test_the_help_run_has_no_network_where_unshare_allows(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        online = f"import argparse, socket\nsocket.create_connection(('127.0.0.1', {port}))\n"
        said = probe(tmp_path, "online.py", online + ARGPARSE)
    assert isinstance(said, str) and said.startswith("online.py --help exited 1"), said


def test_a_script_outside_the_manifests_folder_is_not_run(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"import argparse\nopen({str(marker)!r}, 'w')\n")
    (proj / "link.py").symlink_to(tmp_path / "evil.py")
    for command in (
        ("python", "../evil.py"),
        ("python", "link.py"),
        ("python", str(tmp_path / "evil.py")),
    ):
        plan = parse_manifest(
            f'schema_version = 1\nname = "p"\n[[jobs]]\nname = "a"\n'
            f"command = {list(command)!r}\nhyper.x = 1\n".replace("'", '"'),
            "plan.toml",
        )
        said: list[str] = []
        check_hyper(plan, proj, said.append)
        assert said == [
            f"hyper.* keys not checked: {command[1]} is outside the manifest's folder "
            "(first in job a)"
        ]
    assert not marker.exists()


def _check(folder: Path, jobs: str) -> tuple[list[str], str | None]:
    plan = parse_manifest(f'schema_version = 1\nname = "p"\n{jobs}', "plan.toml")
    said: list[str] = []
    try:
        check_hyper(plan, folder, said.append)
    except ManifestError as exc:
        return said, str(exc)
    return said, None


def test_a_script_that_forwards_unknown_options_is_not_checked(tmp_path: Path) -> None:
    forwards = ARGPARSE.replace("p.parse_args()", "args, rest = p.parse_known_args()")
    (tmp_path / "train.py").write_text(forwards)
    said, refused = _check(
        tmp_path, '[[jobs]]\nname = "a"\ncommand = "python train.py"\nhyper.lr = 1\n'
    )
    assert refused is None
    assert said == [
        "hyper.* keys not checked: train.py passes on options it does not know "
        "(parse_known_args) (first in job a)"
    ]


@pytest.mark.parametrize(
    ("text", "key", "refused"),
    [
        (ARGPARSE, "batch", False),  # --batch: a unique prefix of --batch-size
        (ARGPARSE, "use", False),
        (ARGPARSE.replace("--bs", "--batch-norm"), "batch", True),  # ambiguous
        (ARGPARSE.replace("ArgumentParser()", "ArgumentParser(allow_abbrev=False)"), "batch", True),
        (CLICK, "batch", True),  # click takes no abbreviations
    ],
)
def test_argparse_takes_a_unique_prefix_of_an_option(
    tmp_path: Path, text: str, key: str, refused: bool
) -> None:
    (tmp_path / "train.py").write_text(text)
    job = f'[[jobs]]\nname = "a"\ncommand = "python train.py"\nhyper.{key} = 1\n'
    said, error = _check(tmp_path, job)
    assert said == []
    assert (error is not None) == refused, error


def test_the_script_is_looked_up_in_the_package_the_job_runs_in(tmp_path: Path) -> None:
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "train.py").write_text(ARGPARSE)
    (tmp_path / "src" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "src" / "pkg" / "cli.py").write_text(ARGPARSE)
    (tmp_path / "train.py").write_text("import argparse\nraise SystemExit('the wrong one')\n")
    jobs = [
        ('packages = ["src"]', "python train.py"),
        ('packages = ["code=src"]', "python code/train.py"),
        ('packages = ["src"]', "python -m pkg.cli"),
        ('packages = ["src/train.py"]', "python train.py"),
    ]
    for packages, command in jobs:
        job = f'[[jobs]]\nname = "a"\ncommand = "{command}"\n{packages}\nhyper.batchsize = 1\n'
        said, error = _check(tmp_path, job)
        assert said == [] and error is not None and "did you mean --batch-size?" in error, (
            packages,
            said,
        )
    job = '[[jobs]]\nname = "a"\ncommand = "python other.py"\npackages = ["src"]\nhyper.x = 1\n'
    assert _check(tmp_path, job) == (
        ["hyper.* keys not checked: other.py is not in the job's packages (first in job a)"],
        None,
    )


def test_a_manifest_is_refused_once_a_key_is_not_an_option(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(ARGPARSE)
    (tmp_path / "broken.py").write_text("import argparse\nraise SystemExit('no torch')\n")
    text = (
        'schema_version = 1\nname = "p"\n'
        '[[jobs]]\nname = "a"\ncommand = "python broken.py"\nhyper.x = 1\n'
        '[[jobs]]\nname = "b"\ncommand = "python broken.py"\nhyper.y = 1\n'
        '[[jobs]]\nname = "c"\ncommand = "python train.py"\nhyper.batchsize = 8\n'
    )
    plan = parse_manifest(text, "plan.toml")
    said: list[str] = []
    with pytest.raises(ManifestError) as info:
        check_hyper(plan, tmp_path, said.append)
    assert said == [
        "hyper.* keys not checked: broken.py --help exited 1 (no torch) (first in job a)"
    ]
    assert 'job "c": field "hyper.batchsize": train.py takes no --batchsize' in str(info.value)
    assert "(did you mean --batch-size?)" in str(info.value)
    assert info.value.detail == {"file": "plan.toml", "job": "c", "field": "hyper.batchsize"}
