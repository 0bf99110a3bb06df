"""How far the worker's download of a job's inputs is, said as it goes.

A package of 200 MiB and one of 20 GiB alike: at its start, every ``EVERY`` seconds
while it runs, and at its end, the job's event log gets a progress record (bytes done,
``bytes``; of ``bytes_total``; at ``bytes_per_s``; ``eta_s``; and a ``message``) and its
output a line, "downloading inputs 120.0/200.0 MiB, 35 MiB/s, ETA 2s", drawn as a
progress bar's state (see :mod:`gpufleet.worker.lines`) until "inputs downloaded". Never
once a chunk: a download costs two records and a line, plus a record and a line a
second while it lasts. The fetching thread only counts bytes (:meth:`Download.got`);
what is said is said on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

#: Seconds between two reports of a download that runs (its start and end aside).
EVERY = 1.0
UNITS = ("B", "KiB", "MiB", "GiB", "TiB")

#: Where a report goes: the record, the line (None: none), and whether the line is
#: finished (the download's end) or a state of its bar.
Tell = Callable[[dict[str, Any], str | None, bool], None]


def _unit(n: float) -> tuple[float, str]:
    """The unit to write ``n`` bytes in, as (its size, its name)."""
    size = 1.0
    for name in UNITS:
        if n < size * 1024 or name == UNITS[-1]:
            return size, name
        size *= 1024
    return size, UNITS[-1]  # not reached


def amount(done: int, total: int) -> str:
    """``done`` of ``total`` bytes in the total's unit: ``120.0/200.0 MiB``."""
    size, name = _unit(total)
    if name == "B":
        return f"{done}/{total} B"
    return f"{done / size:.1f}/{total / size:.1f} {name}"


def size(n: int) -> str:
    """``n`` bytes as ``200.0 MiB``."""
    unit, name = _unit(n)
    return f"{n} B" if name == "B" else f"{n / unit:.1f} {name}"


def rate(per_s: float) -> str:
    """A rate as ``35 MiB/s`` (one decimal under 10)."""
    size, name = _unit(per_s)
    value = per_s / size
    return f"{value:.1f} {name}/s" if value < 10 and name != "B" else f"{value:.0f} {name}/s"


def span(seconds: float) -> str:
    """``2s``, ``1m05s``, ``2h03m``."""
    seconds = int(max(0.0, seconds) + 0.5)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Download:
    """One job's download of its inputs: :meth:`begin` with the bytes to fetch, then
    :meth:`got` from the fetching thread as bytes come, and :meth:`end`."""

    def __init__(
        self, tell: Tell, clock: Callable[[], float] = time.monotonic, every: float = EVERY
    ) -> None:
        self.tell = tell
        self.clock = clock
        self.every = every
        self.total = 0
        self.done = 0
        self.began: float | None = None
        self._ticker: asyncio.Task[None] | None = None

    def got(self, n: int) -> None:
        """``n`` more bytes arrived (called in the fetching thread: it only counts)."""
        self.done += n

    def begin(self, total: int) -> None:
        """The download of ``total`` bytes begins; reports follow while it runs."""
        self.total, self.done, self.began = total, 0, self.clock()
        self.tell(
            {"message": f"downloading inputs {amount(0, total)}", "bytes": 0, "bytes_total": total},
            None,
            False,
        )
        with contextlib.suppress(RuntimeError):  # no loop (a test): the start and end only
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            self.report()

    def _rate(self) -> float:
        took = self.clock() - (self.began or 0.0)
        return self.done / took if took > 0 else 0.0

    def report(self) -> None:
        """Say how far it is now (the ticker does, every ``every`` seconds)."""
        done, total, per_s = min(self.done, self.total), self.total, self._rate()
        record: dict[str, Any] = {"bytes": done, "bytes_total": total, "bytes_per_s": round(per_s)}
        said = f"downloading inputs {amount(done, total)}, {rate(per_s)}"
        if per_s > 0:
            record["eta_s"] = round(min(1e9, (total - done) / per_s))
            said += f", ETA {span(record['eta_s'])}"
        record["message"] = said
        self.tell(record, said, False)

    def end(self, ok: bool) -> None:
        """The download ended (``ok``: every input arrived); says so, and stops the
        reports."""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self.began is None:
            return
        took, per_s = self.clock() - self.began, self._rate()
        when = f"{took:.1f}s" if took < 10 else span(took)
        if ok and self.done == 0:  # another job fetched them meanwhile, into the cache
            said = f"inputs ready: {size(self.total)} from the worker's cache, in {when}"
        elif ok:
            said = f"inputs downloaded: {size(self.done)} in {when}, {rate(per_s)}"
            if self.done < self.total:
                said += f"; {size(self.total - self.done)} from the worker's cache"
        else:
            said = f"input download stopped at {amount(min(self.done, self.total), self.total)}"
        record = {"message": said, "bytes": self.done, "bytes_per_s": round(per_s)}
        self.tell(record, said, True)
        self.began = None
