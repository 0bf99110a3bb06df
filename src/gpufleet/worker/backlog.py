"""A running job's output not yet sent to the server, in bounded memory and disk.

Lines are kept in memory up to ``memory`` bytes (a line costs its characters plus a fixed
overhead, so a flood of short lines is bounded too). Past that, they spill to files in
the job's spill directory, in segments; past ``disk`` bytes of segments, the oldest
segment is deleted and its unsent lines counted as dropped. The next batch sent then
begins with a marker line that says how many lines (and bytes) were dropped, so the
job's log shows the gap where it is.

Lines go out oldest first: :meth:`Backlog.peek` returns the next batch without removing
it, and :meth:`Backlog.sent` removes it once the server has it. A batch whose upload
failed is sent again, not lost.
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path

LINE_OVERHEAD = 120  # bytes a kept line costs beyond its characters (tuple, str header)
MARKER = (
    "[gpufleet] {lines} line(s) of output ({size}) dropped here: the server could not be "
    "reached and this worker keeps at most {limit} of unsent output per job"
)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class _Segment:
    path: Path
    size: int = 0  # bytes written
    lines: int = 0  # lines written
    read_at: int = 0  # byte offset of the next unsent line
    read_lines: int = 0  # lines sent


class Backlog:
    """Unsent output lines of one job, oldest first; see the module's docstring."""

    def __init__(
        self, spill_dir: Path, memory: int = 8 << 20, disk: int = 256 << 20, segments: int = 8
    ) -> None:
        self.spill_dir = spill_dir
        self.memory = memory
        self.disk = disk
        self.segment_size = max(1, disk // segments)
        self._mem: deque[tuple[str, str]] = deque()
        self._mem_bytes = 0
        self._segments: deque[_Segment] = deque()
        self._spilled = 0  # bytes in segments not yet deleted
        self._made = 0  # segments made: their file names
        self.dropped_lines = 0
        self.dropped_bytes = 0
        self._inflight: list[tuple[str, str]] = []  # the batch being sent
        self.acked = 0  # lines the server has (marker lines included): the next one's number

    def __len__(self) -> int:
        on_disk = sum(s.lines - s.read_lines for s in self._segments)
        return on_disk + len(self._mem) + len(self._inflight) + (1 if self.dropped_lines else 0)

    @property
    def memory_bytes(self) -> int:
        return self._mem_bytes

    def add(self, stream: str, line: str) -> None:
        self._mem.append((stream, line))
        self._mem_bytes += len(line) + LINE_OVERHEAD
        if self._mem_bytes > self.memory:
            self._spill()

    def update(self, stream: str, line: str) -> None:
        """Add a progress bar's latest state (a line that ends with a carriage return)
        in place of the newest unsent line, when that one is an earlier state of the
        same stream's bar, still in memory: each batch sent holds its latest state only."""
        newest = self._mem[-1] if self._mem else None
        if newest is not None and newest[0] == stream and newest[1].endswith("\r"):
            _, old = self._mem.pop()
            self._mem_bytes -= len(old) + LINE_OVERHEAD
        self.add(stream, line)

    def _spill(self) -> None:
        """Memory to the newest segment (a new one when it is full), then the oldest
        segments out while the spill is over its bound."""
        while self._mem:
            seg = self._segments[-1] if self._segments else None
            if seg is None or seg.size >= self.segment_size:
                self.spill_dir.mkdir(parents=True, exist_ok=True)
                self._made += 1
                seg = _Segment(self.spill_dir / f"{self._made:08d}.jsonl")
                self._segments.append(seg)
            data: list[bytes] = []
            written = 0
            while self._mem and seg.size + written < self.segment_size:
                data.append(json.dumps(self._mem.popleft()).encode() + b"\n")
                written += len(data[-1])
            with seg.path.open("ab") as f:
                f.writelines(data)
            seg.size += written
            seg.lines += len(data)
            self._spilled += written
        self._mem_bytes = 0
        while self._spilled > self.disk and len(self._segments) > 1:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        seg = self._segments.popleft()
        self.dropped_lines += seg.lines - seg.read_lines
        self.dropped_bytes += seg.size - seg.read_at
        self._spilled -= seg.size
        seg.path.unlink(missing_ok=True)

    def peek(self, max_lines: int, max_chars: int) -> list[tuple[str, str]]:
        """The next batch, oldest first (at least one line when any is left; at most
        ``max_lines``, and ``max_chars`` characters past the first). It stays the next
        batch until :meth:`sent`: a failed upload sends it again."""
        if self._inflight:
            return self._inflight
        out = self._inflight
        if self.dropped_lines:
            text = MARKER.format(
                lines=self.dropped_lines, size=_size(self.dropped_bytes), limit=_size(self.disk)
            )
            out.append(("stderr", text))
            self.dropped_lines = self.dropped_bytes = 0
        chars = 0
        if self._segments:
            seg = self._segments[0]
            with seg.path.open("rb") as f:
                f.seek(seg.read_at)
                while len(out) < max_lines and seg.read_at < seg.size:
                    raw = f.readline()
                    stream, line = json.loads(raw)
                    if out and chars + len(line) > max_chars:
                        break
                    out.append((stream, line))
                    chars += len(line)
                    seg.read_at += len(raw)
                    seg.read_lines += 1
            if seg.read_at >= seg.size:
                self._segments.popleft()
                self._spilled -= seg.size
                seg.path.unlink(missing_ok=True)
            return out
        while self._mem and len(out) < max_lines:
            stream, line = self._mem[0]
            if out and chars + len(line) > max_chars:
                break
            out.append(self._mem.popleft())
            chars += len(line)
            self._mem_bytes -= len(line) + LINE_OVERHEAD
        return out

    def sent(self) -> None:
        """The batch :meth:`peek` returned reached the server."""
        self.acked += len(self._inflight)
        self._inflight = []

    def clear(self) -> int:
        """Forget every unsent line (the files too); how many there were."""
        n = len(self)
        self._mem.clear()
        self._mem_bytes = 0
        self._segments.clear()
        self._spilled = 0
        self.dropped_lines = self.dropped_bytes = 0
        self._inflight = []
        shutil.rmtree(self.spill_dir, ignore_errors=True)
        return n
