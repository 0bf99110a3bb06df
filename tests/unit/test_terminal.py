"""What others wrote reaches the terminal as text: names, labels and errors with their
control characters shown as escapes, output lines with their colours and carriage
returns only (``gpufleet.terminal`` and the commands that print through it)."""

from __future__ import annotations

import io
import json
import re
import sys
import unicodedata
from collections import deque
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from gpufleet.terminal import for_terminal, visible

#: what a hostile name or line holds: a window title (OSC 0), a clipboard write (OSC 52),
#: a screen clear, cursor moves, a DCS string, a bare ESC, a CSI as one C1 byte, a BEL,
#: a backspace, a right-to-left override and isolate, and Rich markup
HOSTILE = (
    "\x1b]0;pwned\x07 \x1b]52;c;ZWNobyBwd25lZA==\x07 \x1b[2J\x1b[H \x1b[5A\x1b[2K "
    "\x1bP1$r0m\x1b\\ \x1b \x9b31m \x07\x08 \u202eevil\u202c \u2067x\u2069 [bold]b[/bold]"
)
SGR = re.compile("\x1b\\[[0-9;]*m")
BIDI = set("\u061c\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def controls(text: str) -> list[str]:
    """The characters a terminal would act on: C0 (tab and CR aside), DEL, C1, lone
    surrogates and the bidi controls; judged by Unicode's categories, not by the module's
    own list."""
    return [
        c
        for c in text
        if (unicodedata.category(c) in ("Cc", "Cs") and c not in "\t\r") or c in BIDI
    ]


def test_visible_shows_each_control_as_its_escape() -> None:
    assert visible("a\x1b]0;pwned\x07b") == "a\\x1b]0;pwned\\x07b"
    assert visible("\x1b[2J\x9b\x7f") == "\\x1b[2J\\x9b\\x7f"
    assert visible("left\u202eright\u2066") == "left\\u202eright\\u2066"
    assert visible("two\nlines\tand\ra CR\x00") == "two\\nlines\\tand\\ra CR\\x00"
    assert visible("plain, é, 日本, 🙂 [x]") == "plain, é, 日本, 🙂 [x]"


def test_for_terminal_keeps_colours_cr_and_tabs_and_escapes_the_rest() -> None:
    line = "\x1b[1;31mred\x1b[0m\t50%|##  |\r100%|####| \x1b]0;t\x07\x1b[2J\x1b[3A\x9b2J\u202e"
    assert for_terminal(line) == (
        "\x1b[1;31mred\x1b[0m\t50%|##  |\r100%|####| \\x1b]0;t\\x07\\x1b[2J\\x1b[3A\\x9b2J\\u202e"
    )
    # a CSI that is not a colour, and a DCS, are escaped even where they look like one
    assert for_terminal("\x1b[38:2:1:2:3m\x1bP\x1b[0m") == "\\x1b[38:2:1:2:3m\\x1bP\x1b[0m"


def test_a_line_that_leaves_a_colour_on_ends_with_a_reset() -> None:
    assert for_terminal("\x1b[8mhidden") == "\x1b[8mhidden\x1b[0m"
    assert for_terminal("\x1b[32mok\x1b[m") == "\x1b[32mok\x1b[m"
    assert for_terminal("plain") == "plain"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec=None, exclude_categories=())))
def test_visible_never_lets_a_control_through(text: str) -> None:
    shown = visible(text)
    assert not controls(shown) and "\t" not in shown and "\r" not in shown
    if not controls(text) and "\t" not in text and "\r" not in text:
        assert shown == text  # what holds no control is left alone


# lines made of the pieces that matter: SGR, other sequences, controls, plain text
_PIECES = st.sampled_from(
    ["\x1b[", "\x1b]", "\x1bP", "\x1b", "m", ";", "0", "31", "\x07", "\x9b", "\r", "\t", "a"]
)
_LINES = st.one_of(
    st.lists(_PIECES, max_size=30).map("".join),
    st.text(alphabet=st.characters(codec=None, exclude_categories=())),
)


@settings(max_examples=500, deadline=None)
@given(_LINES)
def test_for_terminal_lets_no_escape_through_but_a_colour(line: str) -> None:
    shown = for_terminal(line)
    rest = SGR.sub("", shown)
    assert "\x1b" not in rest, shown
    assert not controls(rest), shown
    assert "\n" not in shown


# ---- the commands that print what others wrote ------------------------------------------

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _job(**over: Any) -> dict[str, Any]:
    return {
        "id": "j-1",
        "name": "n" + HOSTILE,
        "status": "failed",
        "attempts": 1,
        "max_attempts": 3,
        "priority": 0,
        "worker": "w" + HOSTILE,
        "worker_id": "w-1",
        "gpus": [],
        "created_at": NOW,
        "started_at": NOW,
        "finished_at": NOW,
        "exit_code": 1,
        "error": "exit code 1" + HOSTILE,
        "stderr_tail": ["last" + HOSTILE],
        "spec": {"name": "n", "command": ["python", "-c", HOSTILE], "hyper": {HOSTILE: 1}},
        "history": [
            {
                "attempt": 1,
                "worker": "w" + HOSTILE,
                "worker_id": "w-1",
                "gpus": [],
                "claimed_at": NOW,
                "started_at": NOW,
                "finished_at": NOW,
                "exit_code": 1,
                "outcome": "failed",
                "error": HOSTILE,
            }
        ],
        "progress": {"message": HOSTILE, HOSTILE: 1},
        **over,
    }


def _rendered(thing: Any) -> str:
    """What a colour terminal receives when Rich prints ``thing``."""
    console = Console(file=io.StringIO(), force_terminal=True, width=300, color_system="standard")
    console.print(thing)
    return console.file.getvalue()  # type: ignore[attr-defined]


def _only_colours(text: str) -> None:
    rest = SGR.sub("", text)
    assert "\x1b" not in rest and not controls(rest.replace("\n", "")), repr(text)


def test_the_jobs_table_shows_names_errors_and_markup_as_text() -> None:
    from gpufleet.cli.jobs import job_table
    from gpufleet.wire import JobOut

    drawn = _rendered(job_table([JobOut.model_validate(_job())]))
    _only_colours(drawn)
    assert "\\x1b]0;pwned\\x07" in drawn and "[bold]b[/bold]" in drawn


def test_show_prints_a_job_and_its_stderr_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufleet.cli import show
    from gpufleet.wire import JobDetail

    console = Console(file=io.StringIO(), force_terminal=True, width=300)
    monkeypatch.setattr(show, "out", console)
    show.show_detail(JobDetail.model_validate(_job()))
    drawn = console.file.getvalue()  # type: ignore[attr-defined]
    _only_colours(drawn)
    assert drawn.count("\\u202eevil") >= 5  # name, worker, error, stderr, command...


def test_the_workers_table_shows_names_and_labels_as_text() -> None:
    from gpufleet.cli.choose import choice_table, worker_table
    from gpufleet.wire import Candidate, GpuModel, WorkerOut

    w = WorkerOut.model_validate(
        {
            "id": "w-1",
            "name": "w" + HOSTILE,
            "status": "available",
            "pool": "default",
            "labels": {"k" + HOSTILE: "v" + HOSTILE},
            "gpus": [],
            "gpus_simulated": False,
            "slots": {},
            "running": ["j" + HOSTILE],
            "ephemeral": False,
            "registered_at": NOW,
            "last_heartbeat": NOW,
            "capability": {
                "hostname": "h" + HOSTILE,
                "cores": 1,
                "ram_mib": 1024,
                "tools": {"sleap-nn": HOSTILE},
            },
        }
    )
    drawn = _rendered(worker_table([w]))
    _only_colours(drawn)
    assert "\\x1b[2J" in drawn
    # --select's list: the name and the GPU the job gets, as text
    gpu = {"index": 0, "name": "g" + HOSTILE, "total_mib": 1024, "free_mib": 1024}
    w = w.model_copy(update={"gpus": [GpuModel.model_validate(gpu)]})
    pick = Candidate(
        worker=w, fits=True, reason=None, free_gpu_mib=1024, gpus=[0], assigned_free_mib=1024
    )
    drawn = _rendered(choice_table([pick]))
    _only_colours(drawn)
    assert drawn.count("\\x1b]0;pwned") == 2  # its name and its GPU's, cut to fit


def test_watch_shows_a_job_and_its_last_lines_with_their_colours_only() -> None:
    from gpufleet.cli.watch import Seen, view
    from gpufleet.wire import JobDetail

    seen = Seen(tail=deque(maxlen=5))
    seen.take("log", {"stream": "stdout", "line": "\x1b[32mgreen\x1b[0m" + HOSTILE})
    seen.take("log", {"stream": "stderr", "line": "10%\r50%\r100% done"})
    seen.take("progress", {"record": {"progress": 0.5, "message": HOSTILE, "loss": 1.0}})
    drawn = _rendered(view(JobDetail.model_validate(_job(status="running")), seen))
    _only_colours(drawn)
    assert "\\x1b]52;c;" in drawn
    assert "100% done" in drawn and "10%" not in drawn  # a redrawn bar: its last state


def _line(text: str, stream: str = "stdout") -> Any:
    from gpufleet.wire import LogEntry

    return LogEntry(seq=1, attempt=1, stream=stream, line=text, ts=NOW)


def test_logs_escape_lines_keep_them_raw_or_give_ascii_json(
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    from gpufleet.cli.jobs import _print_lines

    line = "\x1b[31mred\x1b[0m\r" + HOSTILE + " é"
    _print_lines([_line(line), _line("err" + HOSTILE, "stderr")], as_json=False)
    said = capsysbinary.readouterr()
    _only_colours(said.out.decode())
    _only_colours(said.err.decode())
    assert said.out.startswith(b"\x1b[31mred\x1b[0m\r\\x1b]0;pwned\\x07")

    _print_lines([_line(line), _line("err" + HOSTILE, "stderr")], as_json=False, raw=True)
    said = capsysbinary.readouterr()
    assert said.out == (line + "\n").encode()
    assert said.err == ("err" + HOSTILE + "\n").encode()

    _print_lines([_line(line)], as_json=True)
    printed = capsysbinary.readouterr().out
    assert printed.isascii() and b"\x1b" not in printed
    assert json.loads(printed)["line"] == line


def test_an_error_quoting_what_others_wrote_is_printed_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpufleet.cli as cli
    from gpufleet.errors import NotFound

    def refuse() -> None:
        raise NotFound("no job named 'x\x1b]0;pwned\x07\u202e'")

    monkeypatch.setattr(cli, "app", refuse)
    monkeypatch.setattr(sys, "argv", ["gpufleet"])
    with pytest.raises(SystemExit):
        cli.main()
    said = capsys.readouterr().err
    assert said == "error: no job named 'x\\x1b]0;pwned\\x07\\u202e'\n"
