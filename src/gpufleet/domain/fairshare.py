"""Fair share: what each user has used, decayed with a half-life, against its weight.

Usage is GPU-seconds (a job's GPUs times the seconds it ran; a CPU job's seconds are
CPU-slot-seconds, kept apart). An ended attempt is charged into **buckets** of its
owner and pool: time slices of :func:`bucket_width` seconds, each a row the store adds to
(an attempt of several slices is split among them). Reading usage decays each bucket from
its middle to now, ``2 ** -(age / half_life)``, and adds the running attempts so far, so
a long run counts while it runs and nothing is charged twice.

A user's **standing** is its decayed usage over its weight: among waiting jobs of one
priority, a claim takes the job whose owner's standing is lowest first. Equal standings
(nobody has used anything) leave the order to age.

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Usage's half-life when the operator names none: a week (Slurm's PriorityDecayHalfLife).
HALF_LIFE = 7 * 86400.0
#: Kinds of usage: GPU-seconds, and CPU-slot-seconds of jobs that hold no GPU.
GPU, CPU = "gpu", "cpu"
#: Buckets older than this many half-lives weigh under 1/256 of a new one: not read.
HORIZON = 8
#: A charge is split among at most this many buckets (a longer run takes wider pieces).
MOST_PIECES = 64


def bucket_width(half_life: float) -> float:
    """The width of a usage bucket: a power of two seconds near a sixteenth of the
    half-life, between 1 s and an hour (the same widths on every server)."""
    target = max(1.0, min(3600.0, half_life / 16))
    return float(2 ** math.floor(math.log2(target)))


def kind(gpus: Iterable[int]) -> str:
    return GPU if tuple(gpus) else CPU


def amount(gpus: Iterable[int]) -> int:
    """How many units an attempt holds: its GPUs, or one CPU slot."""
    return max(1, len(tuple(gpus)))


def pieces(start: float, end: float, units: int, width: float) -> list[tuple[float, float]]:
    """The charge of ``units`` held from ``start`` to ``end``, split by bucket: (bucket
    start, unit-seconds) pairs. A run longer than :data:`MOST_PIECES` buckets is split in
    that many pieces, each charged to the bucket its middle falls in."""
    if end <= start:
        return []
    out: dict[float, float] = {}
    first = math.floor(start / width) * width
    count = math.ceil((end - first) / width)
    if count <= MOST_PIECES:
        at = first
        while at < end:
            lo, hi = max(start, at), min(end, at + width)
            out[at] = out.get(at, 0.0) + (hi - lo) * units
            at += width
    else:
        step = (end - start) / MOST_PIECES
        for n in range(MOST_PIECES):
            middle = start + (n + 0.5) * step
            key = math.floor(middle / width) * width
            out[key] = out.get(key, 0.0) + step * units
    return sorted(out.items())


def decay(age: float, half_life: float) -> float:
    return float(2.0 ** (-max(0.0, age) / half_life))


def decayed(buckets: Iterable[tuple[float, float, float]], now: float, half_life: float) -> float:
    """Usage of (start, width, unit-seconds) buckets, each decayed from its middle."""
    return sum(s * decay(now - (b + w / 2), half_life) for b, w, s in buckets)


def running(started: float, now: float, units: int, half_life: float) -> float:
    """Usage of an attempt running since ``started``: its unit-seconds so far, decayed as
    if charged evenly (the exact integral of the decay)."""
    held = max(0.0, now - started)
    if held == 0:
        return 0.0
    rate = math.log(2) / half_life
    return units * (1 - math.exp(-rate * held)) / rate


@dataclass(frozen=True)
class Standing:
    """One user's usage (decayed unit-seconds, by kind) and weight."""

    usage: Mapping[str, float]
    weight: float

    def of(self, what: str) -> float:
        """Decayed usage of ``what`` (GPU or CPU) per unit of weight: lower goes first."""
        return self.usage.get(what, 0.0) / self.weight


def shares(weights: Mapping[str, float]) -> dict[str, float]:
    """Each name's fraction of the whole, by weight."""
    total = sum(weights.values())
    return {k: (w / total if total else 0.0) for k, w in weights.items()}
