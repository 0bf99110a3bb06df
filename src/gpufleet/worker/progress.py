"""A running job's progress records, from its progress file and its ``::gpufleet::`` lines.

The worker names a file in ``GPUFLEET_PROGRESS_FILE``; the job appends JSON lines to it.
:class:`ProgressFile` reads what was appended since the last read (whole lines only, a
bounded amount at a time) and :class:`Progress` turns each line into a record for the
job's event log. A line that is not a record is counted; the first one is shown in the
job's output once, with why, and the count at the end. A bad line never stops a job.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.domain import progress

READ_LIMIT = 4 << 20  # bytes of the file read at one go


class ProgressFile:
    """New whole lines of an append-only file, from where the last read ended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._partial = b""

    def read(self, final: bool = False) -> list[str]:
        """Lines appended since the last call; with ``final``, a last line with no newline
        too (the job has ended: nothing more comes)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read(READ_LIMIT)
        except OSError:  # not made yet, or gone
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > progress.MAX_LINE * 4:  # no newline in sight: a bad line
            lines.append(self._partial)
            self._partial = b""
        if final and self._partial.strip():
            lines.append(self._partial)
            self._partial = b""
        return [raw.decode("utf-8", "replace") for raw in lines if raw.strip()]


class Progress:
    """Turns a job's progress lines into records (``emit``), and says what it refused
    (``note``, once for the first bad line, and :meth:`summary` at the end)."""

    def __init__(
        self,
        emit: Callable[[str], None],
        note: Callable[[str], None],
        seen: Callable[[dict[str, Any]], None] = lambda _record: None,
    ) -> None:
        self.emit = emit
        self.note = note
        self.seen = seen  # each record taken, as a dict
        self.bad = 0
        self.good = 0

    def line(self, text: str, where: str) -> None:
        """One line that should be a record, read from ``where``."""
        try:
            record = progress.parse(text)
        except progress.BadProgress as exc:
            self.bad += 1
            if self.bad == 1:
                shown = text.strip()[:200]
                self.note(
                    f"a progress line from {where} was not understood ({exc}): {shown!r}; "
                    "more such lines are counted, not shown"
                )
            return
        self.good += 1
        self.seen(record)
        self.emit(progress.encode(record))

    def marked(self, line: str) -> bool:
        """If ``line`` (from stdout or stderr) is a ``::gpufleet::`` line, take it as a
        record and say so: it is not output."""
        if not line.startswith(progress.MARK):
            return False
        self.line(line[len(progress.MARK) :], "the job's output")
        return True

    def summary(self) -> str | None:
        if self.bad == 0:
            return None
        return f"{self.bad} progress line(s) were not understood and were skipped"
