"""A job's output bytes cut into lines, and a line redrawn in place passed on as it goes.

A progress bar (tqdm, a Lightning bar, ``print(..., end="\\r")``) redraws one line with
carriage returns and writes its newline only at the end, minutes or hours later. Cut at
newlines alone, nothing of it would be seen until then. So while a line that holds a
carriage return stays unfinished, its latest state (the last part between carriage
returns that holds more than blanks) is passed on as a *bar state* every ``BAR_EVERY``
seconds, the states between dropped: a bar costs a line every half second, however often
it redraws. When its newline comes, the line ends with its latest state. A line that ends
within ``BAR_EVERY`` of its first carriage return is passed on whole, as it was written.

Pure code with the clock passed in; :func:`gpufleet.worker.runner._pump` feeds it.
"""

from __future__ import annotations

from collections.abc import Callable

#: Seconds between the states of an unfinished line passed on (its first comes this long
#: after its first carriage return).
BAR_EVERY = 0.5
LINE_LIMIT = 1 << 20  # bytes of an unfinished line kept at most; longer lines are split
MAX_LINE = 1_000_000  # characters of one stored output line (LogLine.line)
OnLine = Callable[[str, str], None]


def latest(raw: bytes) -> bytes:
    """What a terminal shows last of a line redrawn with carriage returns: its last part
    that holds more than blanks (empty when none does)."""
    for part in reversed(raw.split(b"\r")):
        if part.strip():
            return part
    return b""


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r\n")


class Lines:
    """One stream's bytes (:meth:`feed`, then :meth:`end`) to ``on_line`` as finished
    lines and to ``on_bar`` as the states of an unfinished one (see the module's text).
    A bar state never ends with a newline or a carriage return."""

    def __init__(self, stream: str, on_line: OnLine, on_bar: OnLine) -> None:
        self.stream = stream
        self.on_line = on_line
        self.on_bar = on_bar
        self.pending = bytearray()  # the unfinished line, since its last state passed on
        self.since: float | None = None  # when ``pending`` first held a carriage return
        self.shown = b""  # the last bar state passed on of the unfinished line, if any

    def due(self, now: float) -> float | None:
        """Seconds until the unfinished line's state is due (0: now), None if none waits."""
        if self.since is None:
            return None
        return max(0.0, self.since + BAR_EVERY - now)

    def feed(self, chunk: bytes, now: float) -> None:
        """Bytes the job wrote, read at ``now``."""
        if b"\n" in chunk:
            first, *middle, rest = chunk.split(b"\n")
            self.pending += first
            self._finished(bytes(self.pending))
            for raw in middle:
                self._finished(raw)
            self.pending = bytearray(rest)
        else:
            self.pending += chunk
        if self.since is None and b"\r" in self.pending:
            self.since = now
        too_long = len(self.pending) > LINE_LIMIT
        if self.since is not None and (now >= self.since + BAR_EVERY or too_long):
            self.bar()
        elif too_long:  # no newline in sight: passed on in pieces
            self._emit(bytes(self.pending), self.on_line)
            self.pending = bytearray()

    def bar(self) -> None:
        """Pass on the unfinished line's latest state now (when it has a new one)."""
        state = latest(bytes(self.pending))
        self.pending = bytearray()
        self.since = None
        if state:
            self.shown = state
            self.on_bar(self.stream, _text(state)[: MAX_LINE - 1])

    def end(self) -> None:
        """The stream ended: an unfinished line is finished as it stands."""
        if self.pending or self.shown:
            self._finished(bytes(self.pending))
        self.pending = bytearray()
        self.since = None

    def _finished(self, raw: bytes) -> None:
        if self.shown:  # its states were passed on: it ends with its latest
            raw = latest(raw) or self.shown
            self.shown = b""
        self.since = None
        self._emit(raw, self.on_line)

    def _emit(self, raw: bytes, to: OnLine) -> None:
        text = _text(raw)
        for start in range(0, max(len(text), 1), MAX_LINE):  # pieces the server accepts
            to(self.stream, text[start : start + MAX_LINE])
