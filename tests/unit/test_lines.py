"""A job's output cut into lines: a progress bar redrawn with carriage returns is passed
on as its latest state every half second while it runs (the states between dropped), and
ends as its last state; a line that ends quickly is kept as written."""

from __future__ import annotations

from gpufleet.worker.lines import BAR_EVERY, LINE_LIMIT, MAX_LINE, Lines, latest


class Seen:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.bars: list[tuple[str, str]] = []

    def lines_of(self) -> Lines:
        return Lines(
            "stderr",
            lambda s, line: self.lines.append((s, line)),
            lambda s, state: self.bars.append((s, state)),
        )


def test_a_tqdm_bar_passes_on_its_latest_state_every_half_second_and_ends_with_its_last() -> None:
    seen = Seen()
    lines = seen.lines_of()
    now = 0.0
    for n in range(101):  # a redraw every 50 ms for 5 s, as tqdm writes it
        lines.feed(f"\r{n:3d}%|{'#' * (n // 10):10s}|".encode(), now)
        if (wait := lines.due(now)) is not None and wait == 0:
            lines.bar()
        now += 0.05
    lines.feed(b"\r100%|##########| done\n", now)
    states = [state for _, state in seen.bars]
    assert 8 <= len(states) <= 11  # one a half second, not one a redraw
    assert 9 <= int(states[0].split("%")[0]) <= 11  # the first after half a second
    assert all("\r" not in s and "\n" not in s for s in states)
    assert seen.lines == [("stderr", "100%|##########| done")]  # the last state only


def test_print_with_a_carriage_return_end_shows_its_last_state_and_its_newline_ends_it() -> None:
    seen = Seen()
    lines = seen.lines_of()
    lines.feed(b"step 1\rstep 2\r", 0.0)
    assert lines.due(0.1) is not None and lines.due(0.1) > 0  # not yet: it may end soon
    lines.feed(b"step 3\r", BAR_EVERY)
    assert seen.bars == [("stderr", "step 3")]
    lines.feed(b"\n", BAR_EVERY + 0.1)  # print() after the loop
    assert seen.lines == [("stderr", "step 3")]  # not an empty line over the bar


def test_a_line_that_ends_within_half_a_second_is_kept_as_written() -> None:
    seen = Seen()
    lines = seen.lines_of()
    lines.feed(b"10%\r50%\r", 0.0)
    lines.feed(b"100%\nnext\r\n", 0.2)
    assert seen.bars == []
    assert seen.lines == [("stderr", "10%\r50%\r100%"), ("stderr", "next")]
    assert lines.due(0.3) is None


def test_an_unfinished_bar_at_the_end_is_finished_as_its_last_state() -> None:
    seen = Seen()
    lines = seen.lines_of()
    lines.feed(b"\r 5%", 0.0)
    lines.feed(b"\r 7%", 1.0)
    lines.end()
    assert seen.bars == [("stderr", "7%".rjust(3))]
    assert seen.lines == [("stderr", " 7%")]


def test_a_long_line_without_newline_is_passed_on_in_pieces_none_dropped() -> None:
    seen = Seen()
    lines = seen.lines_of()
    lines.feed(b"x" * (LINE_LIMIT + 10), 0.0)
    lines.feed(b"yz\n", 0.0)
    *pieces, last = [line for _, line in seen.lines]
    assert "".join(pieces) == "x" * (LINE_LIMIT + 10) and last == "yz"
    assert all(len(piece) <= MAX_LINE for piece in pieces)


def test_latest_is_what_a_terminal_shows_last() -> None:
    assert latest(b"\r 1%\r 2%") == b" 2%"
    assert latest(b"a\rb\r") == b"b"
    assert latest(b"a\r   \r") == b"a"  # a cleared bar keeps its last state
    assert latest(b"\r\r") == b""
