"""apply's check of a job's hyper.* keys against its script's own --help."""

from __future__ import annotations

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
    assert isinstance(found, tuple), found
    return script_options(found, folder)


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
    assert found == ("-m", "pkg.cli", "fit")
    options = script_options(found, tmp_path)
    assert isinstance(options, set) and "--batch-size" in options


def test_the_help_run_has_no_network_and_a_time_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    online = "import argparse, socket\nsocket.create_connection(('127.0.0.1', 9))\n"
    said = probe(tmp_path, "online.py", online + ARGPARSE)
    assert isinstance(said, str) and "no network while gpufleet reads --help" in said
    monkeypatch.setattr(hypercheck, "TIMEOUT", 0.5)
    said = probe(tmp_path, "slow.py", "import argparse, time\ntime.sleep(30)\n")
    assert said == "slow.py --help took more than 0.5s"


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
