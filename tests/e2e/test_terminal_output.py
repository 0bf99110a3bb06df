"""The CLI, given names and lines with terminal escapes, prints no raw escape except a
job's colours in ``logs`` (issue 30's must-show): a real server and worker, a job and a
worker named by a hostile user, a job whose output tries a window title, a clipboard
write, a screen clear and cursor moves, and the CLI run as a user runs it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.e2e.conftest import PYTHON, Fleet

#: a window title (OSC 0), a clipboard write (OSC 52), a screen clear and home, a cursor
#: move, a DCS string, a bare ESC, a CSI as its one C1 character, a BEL, a right-to-left
#: override and an isolate's end, and Rich markup
HOSTILE = (
    "\x1b]0;pwned\x07\x1b]52;c;cHduZWQ=\x07\x1b[2J\x1b[H\x1b[3A\x1bP1$r0m\x1b\\ \x1b(0"
    "\x9b2J\x07\u202eevil\u2069 [bold]b[/bold]"
)
#: what a terminal must never receive from what others wrote
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\u2069")
SGR = re.compile("\x1b\\[[0-9;]*m")
#: the job: colours, a progress bar redrawn with CRs, then the hostile text on both streams
JOB_STDOUT = "\x1b[31mred\x1b[0m plain\n10%\r50%\r100%\n" + HOSTILE + "\n"
JOB_STDERR = "last words " + HOSTILE + "\n"
SCRIPT = (
    "import sys\n"
    f"sys.stdout.write({JOB_STDOUT!r}); sys.stdout.flush()\n"
    f"sys.stderr.write({JOB_STDERR!r})\n"
    "sys.exit(3)\n"
)


def run(fleet: Fleet, *args: str) -> tuple[bytes, bytes]:
    """The CLI's stdout and stderr as bytes (text mode would turn a CR into a newline)."""
    done = subprocess.run(
        [PYTHON, "-m", "gpufleet", *args], env=fleet.env, capture_output=True, timeout=90
    )
    return done.stdout, done.stderr


def shown(fleet: Fleet, *args: str) -> str:
    """What a command printed, both streams, checked to hold no raw escape at all."""
    out, err = run(fleet, *args)
    text = (out + err).decode()  # strict: a lone 0x9b byte would fail here
    leaked = [c for c in RAW if c in text]
    assert not leaked, f"gpufleet {args[0]} printed {leaked}: {text!r}"
    return text


def colours_only(text: str) -> str:
    """``text`` with its colour sequences (SGR) taken out, checked to hold nothing raw."""
    rest = SGR.sub("", text)
    leaked = [c for c in RAW if c in rest]
    assert not leaked, f"printed {leaked} besides colours: {text!r}"
    return rest


def test_the_cli_prints_no_raw_escape_but_a_jobs_colours(fleet: Fleet, tmp_path: Path) -> None:
    fleet.start_server()
    # (no "/" in a worker's name: the test's fixture names its work folder by it)
    worker = fleet.start_worker("w" + HOSTILE.replace("/", ""), "--labels", "team=" + HOSTILE)
    script = tmp_path / "hostile.py"
    script.write_text(SCRIPT)

    # submit --wait follows the job's output and says how it ended
    out, err = run(
        fleet,
        "submit",
        "--wait",
        "--max-attempts",
        "1",
        "--name",
        "j" + HOSTILE,
        "--results",
        str(tmp_path / "results"),
        "--",
        PYTHON,
        str(script),
    )
    followed = colours_only((out + err).decode())
    assert "\x1b[31mred\x1b[0m plain" in out.decode() and "10%\r50%\r100%" in out.decode()
    assert "\\x1b]0;pwned\\x07" in followed and "\\u202eevil" in followed
    job = out.decode().strip().splitlines()[-1]
    assert fleet.job(job)["status"] == "failed"

    # what others wrote, in every view of the job and the fleet, as visible escapes
    for args in (["jobs"], ["show", job], ["workers"], ["status"], ["audit"], ["watch", job]):
        text = shown(fleet, *args)
        if args[0] in ("jobs", "show", "workers", "watch"):
            assert "\\x1b]52;c;cHduZWQ=\\x07" in text, f"gpufleet {args[0]}: {text!r}"
            assert "[bold]b" in text  # markup printed, not applied
    pending = run(fleet, "submit", "--name", "p" + HOSTILE, "--require-cuda", "--", "true")[0]
    assert "\\x1b[2J" in shown(fleet, "why", pending.decode().split()[-1])
    run(fleet, "tokens", "create", "--name", "t" + HOSTILE, "--role", "submitter")
    assert "\\x1b]0;pwned" in shown(fleet, "tokens", "ls")
    missing = "nope" + HOSTILE.replace("/", "")
    assert "\\x1b]0;pwned" in shown(fleet, "show", missing)  # the server's 404 quotes it

    # logs: the job's colours and CRs pass, nothing else; -f the same; --raw as written
    for follow in ([], ["-f"]):
        out, err = run(fleet, "logs", *follow, job)
        assert out.decode().startswith("\x1b[31mred\x1b[0m plain\n10%\r50%\r100%\n\\x1b]0;pwned")
        colours_only(out.decode())
        assert "last words \\x1b]0;pwned\\x07" in colours_only(err.decode())
    out, err = run(fleet, "logs", "--raw", job)
    assert out == JOB_STDOUT.encode(), out
    assert err == JOB_STDERR.encode(), err

    # the worker's log names the job (someone else's name) with escapes too
    log = worker.text()
    assert "\\x1b]0;pwned" in log and not [c for c in RAW if c in log], log
