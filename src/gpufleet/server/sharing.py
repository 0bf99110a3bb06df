"""The operator's sharing rules as the server holds them, read again when the file changes,
and fair share: each user's usage, decayed, against its weight.

:class:`SharingRules` reads the sharing file (``--sharing``, else ``sharing.toml`` in the
data folder if there is one) at start, where a mistake stops the server naming the file
and key, and looks at the file again at most once a second: an edited file takes effect
without a restart, and one with a mistake is refused in the log while the rules before it
stay. :class:`FairShare` answers, per pool, each user's standing (usage over weight) for
claims to rank by, cached for a moment, and the usage report ``gpufleet usage`` shows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpufleet.config.files import read_toml
from gpufleet.domain import fairshare, sharing
from gpufleet.domain.sharing import Sharing
from gpufleet.errors import ConfigError
from gpufleet.store import RunningUse, UsageStore

log = logging.getLogger("gpufleet.server")

FILE_NAME = "sharing.toml"
#: Seconds between looks at the file, and how long a pool's standings are reused.
LOOK_EVERY = 1.0
STANDING_TTL = 1.0
#: Usage slices are kept at least this long (seconds), for ``gpufleet usage --window``.
KEEP_USAGE = 400 * 86400.0


class SharingRules:
    """The rules in force: those of ``path`` (re-read when it changes), or fixed ones."""

    def __init__(
        self,
        path: Path | None = None,
        fixed: Sharing | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import time

        self.path = path
        self.clock = clock or time.monotonic
        self._rules = fixed or Sharing()
        self._seen: tuple[int, int] | None = None
        self._looked = -LOOK_EVERY
        self._lock = threading.Lock()
        self.on_change: list[Callable[[Sharing], None]] = []
        if path is not None and fixed is None:
            self._load(strict=True)

    def current(self) -> Sharing:
        """The rules now; the file looked at again if a second has passed."""
        if self.path is not None and self.clock() - self._looked >= LOOK_EVERY:
            self._load(strict=False)
        return self._rules

    def set(self, rules: Sharing) -> None:
        """New rules (tests, and the file's): each listener is told."""
        self._rules = rules
        for listener in self.on_change:
            listener(rules)

    def _load(self, strict: bool) -> None:
        assert self.path is not None
        with self._lock:
            self._looked = self.clock()
            try:
                st = self.path.stat()
            except FileNotFoundError:
                seen = None
            else:
                seen = (st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return
            self._seen = seen
            try:
                rules = (
                    Sharing()
                    if seen is None
                    else sharing.parse(read_toml(self.path), str(self.path))
                )
            except ConfigError as exc:
                if strict:
                    raise
                log.error("sharing rules not changed: %s", exc.message)
                return
        if seen is not None:
            log.warning("sharing rules read from %s", self.path)
        elif not strict:
            log.warning("sharing file %s is gone: no fair share, caps or preemption now", self.path)
        self.set(rules)


def rules_file(given: Path | None, data_dir: Path) -> Path | None:
    """The sharing file: the one given (it must exist), else ``sharing.toml`` in the data
    folder, looked for (a file made later is read then)."""
    if given is not None:
        if not given.is_file():
            raise ConfigError(f"--sharing: no file {given}")
        return given
    return data_dir / FILE_NAME


@dataclass(frozen=True)
class UserUse:
    """One user's use of one pool: GPU-seconds and CPU-slot-seconds in the window, decayed
    usage, weight, share of the pool (by the weights of those with any use), and what it
    holds now (GPUs, CPU slots, jobs)."""

    owner: str
    pool: str
    gpu_seconds: float
    cpu_seconds: float
    decayed: Mapping[str, float]
    weight: float
    share: float
    used_share: float
    gpus_now: int
    cpu_now: int
    jobs_now: int


class FairShare:
    """Standings for claims, and the usage report; one per server process."""

    def __init__(self, store: UsageStore, rules: SharingRules, clock: Callable[[], float]) -> None:
        self.store = store
        self.rules = rules
        self.clock = clock
        self._cache: dict[str, tuple[float, dict[str, fairshare.Standing]]] = {}
        self._lock = threading.Lock()
        rules.on_change.append(self._rules_changed)
        self._rules_changed(rules.current())

    def _rules_changed(self, rules: Sharing) -> None:
        self.store.usage_width = fairshare.bucket_width(rules.half_life)
        with self._lock:
            self._cache.clear()

    def on(self) -> bool:
        return self.rules.current().fair_share

    def standings(self, pool: str) -> dict[str, fairshare.Standing]:
        """Each user's standing in ``pool`` now (usage decayed, and its weight); read at
        most once a second per pool, so a burst of claims reads it once."""
        now = self.clock()
        with self._lock:
            hit = self._cache.get(pool)
            if hit is not None and 0 <= now - hit[0] < STANDING_TTL:
                return hit[1]
        rules = self.rules.current()
        usage = self._decayed(pool, now, rules.half_life)
        found = {o: fairshare.Standing(u, rules.user(o).weight) for o, u in usage.items()}
        with self._lock:
            self._cache[pool] = (now, found)
        return found

    def prune(self) -> int:
        """Drop usage slices neither fair share (a few half-lives) nor ``gpufleet usage``
        (a window of up to a year) reads any more; how many."""
        keep = max(fairshare.HORIZON * self.rules.current().half_life, KEEP_USAGE)
        return self.store.prune_usage(self.clock() - keep)

    def _decayed(self, pool: str, now: float, half_life: float) -> dict[str, dict[str, float]]:
        """Each user's usage of ``pool`` by kind, decayed to ``now``."""
        since = now - fairshare.HORIZON * half_life
        out: dict[str, dict[str, float]] = {}
        for s in self.store.usage_slices(since, pool):
            kinds = out.setdefault(s.owner, {})
            age = now - (s.start + s.width / 2)
            kinds[s.kind] = kinds.get(s.kind, 0.0) + s.seconds * fairshare.decay(age, half_life)
        for r in self.store.running_use(pool):
            if r.started_at is None:
                continue
            kinds = out.setdefault(r.owner, {})
            kind = fairshare.kind(r.gpus)
            units = fairshare.amount(r.gpus)
            kinds[kind] = kinds.get(kind, 0.0) + fairshare.running(
                r.started_at, now, units, half_life
            )
        return out

    def report(self, window: float, pool: str | None = None) -> list[UserUse]:
        """Per user and pool: use in the last ``window`` seconds, decayed usage, weight,
        share and standing, and what it holds now."""
        now = self.clock()
        rules = self.rules.current()
        since = now - window
        raw: dict[tuple[str, str], dict[str, float]] = {}
        for s in self.store.usage_slices(since, pool):
            part = max(0.0, min(1.0, (s.start + s.width - since) / s.width))
            row = raw.setdefault((s.owner, s.pool), {})
            row[s.kind] = row.get(s.kind, 0.0) + s.seconds * part
        running = self.store.running_use(pool)
        for r in running:
            if r.started_at is None:
                continue
            row = raw.setdefault((r.owner, r.pool), {})
            held = max(0.0, now - max(r.started_at, since)) * fairshare.amount(r.gpus)
            kind = fairshare.kind(r.gpus)
            row[kind] = row.get(kind, 0.0) + held
        decayed: dict[tuple[str, str], dict[str, float]] = {}
        for p in {k[1] for k in raw} | {r.pool for r in running}:
            for owner, kinds in self._decayed(p, now, rules.half_life).items():
                decayed[(owner, p)] = kinds
                raw.setdefault((owner, p), {})
        return _rows(raw, decayed, running, rules)


def _rows(
    raw: Mapping[tuple[str, str], Mapping[str, float]],
    decayed: Mapping[tuple[str, str], Mapping[str, float]],
    running: list[RunningUse],
    rules: Sharing,
) -> list[UserUse]:
    out = []
    pools = sorted({p for _, p in raw})
    for pool in pools:
        owners = sorted(o for o, p in raw if p == pool)
        weights = {o: rules.user(o).weight for o in owners}
        share = fairshare.shares(weights)
        used = {o: sum(decayed.get((o, pool), {}).values()) for o in owners}
        used_share = fairshare.shares(used) if sum(used.values()) else dict.fromkeys(owners, 0.0)
        for owner in owners:
            mine = [r for r in running if r.owner == owner and r.pool == pool]
            kinds = raw[(owner, pool)]
            out.append(
                UserUse(
                    owner=owner,
                    pool=pool,
                    gpu_seconds=kinds.get(fairshare.GPU, 0.0),
                    cpu_seconds=kinds.get(fairshare.CPU, 0.0),
                    decayed=dict(decayed.get((owner, pool), {})),
                    weight=weights[owner],
                    share=share[owner],
                    used_share=used_share[owner],
                    gpus_now=sum(len(r.gpus) for r in mine),
                    cpu_now=sum(1 for r in mine if not r.gpus),
                    jobs_now=len(mine),
                )
            )
    return out


__all__ = ["FairShare", "SharingRules", "UserUse", "rules_file"]
