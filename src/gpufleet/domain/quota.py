"""A job's output quota: how much of an attempt's stdout and stderr the server stores.

A job's code is untrusted and its worker belongs to the fleet, so the server meters what
it stores. An attempt may have stored, at any moment, at most::

    allowance = min(total, burst + rate * seconds since the attempt was claimed)

It depends only on the attempt's claim time and the bytes counted so far (both in the
attempt's row), so several servers sharing one database enforce one quota. A line that
does not fit is dropped, with every line after it, until the attempt has half its burst
of room back (never, past the total): one marker line says where the cut began, and the
attempt's row counts the bytes dropped. Progress records are the job's too (its
``::gpufleet::`` lines, its progress file): they are counted and cut like its output, or a
job could fill the database through them; the job's row still keeps its latest progress
and metrics (``show`` and ``watch`` stay current). State records are the server's, never
counted. The job runs on either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Streams the quota meters: what the job wrote (its output and its progress records).
METERED_STREAMS = frozenset({"stdout", "stderr", "progress"})
#: What a stored line costs in the database besides its text (its row's ids, stream,
#: time and index entry, about): a flood of empty lines is not free.
ROW_BYTES = 64
MARKER = "[gpufleet] output cut: "


def size_text(n: float) -> str:
    """``n`` bytes as an operator wrote them: 1 GiB, 64 MiB, 1.5 KiB."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if n < 1024:
            break
        n, unit = n / 1024, bigger
    return f"{n:.1f}".removesuffix(".0") + f" {unit}"


def line_cost(line: str) -> int:
    """The bytes a stored line (output or progress) counts: its UTF-8 text, a newline and
    its row."""
    return len(line.encode("utf-8", "surrogatepass")) + 1 + ROW_BYTES


@dataclass(frozen=True)
class OutputQuota:
    """The operator's quota on one attempt's output: ``total`` bytes at most, at ``rate``
    bytes a second on average, ``burst`` bytes ahead of the rate."""

    total: int = 1 << 30
    rate: int = 1 << 20
    burst: int = 64 << 20

    def allowance(self, seconds: float) -> int:
        """The bytes an attempt claimed ``seconds`` ago may have stored by now."""
        return min(self.total, self.burst + int(self.rate * max(0.0, seconds)))

    def resumes_at(self) -> int:
        """The room a cut attempt needs back before its output is stored again: half the
        burst, so an attempt held at the rate is cut once a burst, not once a batch."""
        return self.burst // 2

    def marker(self, seconds: float) -> str:
        """The line that marks where an attempt's output was cut, and why."""
        if self.allowance(seconds) >= self.total:
            return (
                f"{MARKER}this attempt passed its output quota of {size_text(self.total)}; "
                "the rest of its output is dropped (the job runs on)"
            )
        return (
            f"{MARKER}this attempt passed its output rate of {size_text(self.rate)}/s "
            f"(beyond a {size_text(self.burst)} burst); its output is dropped until "
            f"{size_text(self.resumes_at())} of room is back (the job runs on)"
        )


@dataclass(frozen=True)
class Account:
    """What an attempt's output has used: bytes ``counted`` (stored), bytes ``dropped``,
    and whether its output is being cut now."""

    counted: int = 0
    dropped: int = 0
    cut: bool = False


@dataclass(frozen=True)
class Admitted:
    """Of a batch: the lines to store (a new cut's marker among them, where it began),
    the attempt's account after it, and the marker if a cut began."""

    lines: list[tuple[str, str]]
    account: Account
    marker: str | None


def admit(
    lines: Sequence[tuple[str, str]], account: Account, quota: OutputQuota, seconds: float
) -> Admitted:
    """Meter a batch of an attempt's lines (its attempt claimed ``seconds`` ago): output
    is stored while it fits the allowance; the first line that does not begins a cut."""
    room = quota.allowance(seconds) - account.counted
    counted, dropped, cut = account.counted, account.dropped, account.cut
    if cut and room >= quota.resumes_at():
        cut = False
    kept: list[tuple[str, str]] = []
    marker = None
    for stream, line in lines:
        if stream not in METERED_STREAMS:
            kept.append((stream, line))
            continue
        cost = line_cost(line)
        if not cut and cost <= room:
            kept.append((stream, line))
            room -= cost
            counted += cost
            continue
        if not cut:
            cut, marker = True, quota.marker(seconds)
            kept.append(("stderr", marker))
        dropped += cost
    return Admitted(kept, Account(counted, dropped, cut), marker)
