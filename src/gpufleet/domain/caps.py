"""Caps: the most GPUs and CPU slots a user or a pool may hold at once, and the longest a
job of a pool may run (the sharing file's ``max_gpus``, ``max_cpu_slots``, ``max_run``).

What a user or pool **holds** is the slots of its jobs claimed or running now: a job on
GPUs holds its GPUs, a job without one holds a CPU slot. A user's cap counts its jobs in
every pool; a pool's counts every user's jobs in it. A claim that would take a holder past
its cap is not made, and the job waits; nothing here ever ends a running job, so a cap
lowered under what is held leaves the jobs running and only stops new claims.

The server checks twice: while ranking, on what it read without locks (so a capped job is
not offered), and again inside the claim's write, serialized per holder, on what is held
then (:class:`Recheck`): two claims at the same instant on two server replicas cannot both
take the last GPU of a user.

Nothing here does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpufleet.domain.sharing import Share, Sharing

#: The two kinds of holder, named as the sharing file's tables are.
USERS, POOLS = "users", "pools"
Holder = tuple[str, str]  # (USERS or POOLS, name)

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class Held:
    """What a holder holds now: GPUs, and CPU slots (jobs that hold no GPU)."""

    gpus: int = 0
    cpu_slots: int = 0

    def plus(self, gpus: int, jobs: int = 1) -> Held:
        """With ``jobs`` more jobs of ``gpus`` GPUs each (0: a CPU slot each)."""
        if gpus > 0:
            return Held(self.gpus + gpus * jobs, self.cpu_slots)
        return Held(self.gpus, self.cpu_slots + jobs)


Holdings = Mapping[Holder, Held]


@dataclass(frozen=True)
class Ask:
    """What a claim would take: ``gpus`` GPUs (0: a CPU slot) for ``owner``'s job in
    ``pool``."""

    job_id: str
    owner: str
    pool: str
    gpus: int


def _capped(share: Share) -> bool:
    return share.max_gpus is not None or share.max_cpu_slots is not None


def any_caps(rules: Sharing) -> bool:
    """Whether the rules cap what any user or pool may hold (else a claim checks none)."""
    return any(_capped(s) for s in (*rules.users.values(), *rules.pools.values()))


def holders(rules: Sharing, owner: str, pool: str) -> list[Holder]:
    """The capped holders a job of ``owner`` in ``pool`` counts against."""
    found = []
    if _capped(rules.user(owner)):
        found.append((USERS, owner))
    if _capped(rules.pool(pool)):
        found.append((POOLS, pool))
    return found


def capped_holders(rules: Sharing) -> tuple[list[str], list[str]]:
    """Every capped user and every capped pool."""
    users = sorted(n for n, s in rules.users.items() if _capped(s))
    pools = sorted(n for n, s in rules.pools.items() if _capped(s))
    return users, pools


def tally(rows: Iterable[tuple[str, str, int, int]]) -> dict[Holder, Held]:
    """What each user and pool holds, from rows of (owner, pool, GPUs of each job, jobs)."""
    out: dict[Holder, Held] = {}
    for owner, pool, gpus, jobs in rows:
        for holder in ((USERS, owner), (POOLS, pool)):
            out[holder] = out.get(holder, Held()).plus(gpus, jobs)
    return out


def without(held: Holdings, owner: str, pool: str, gpus: int) -> dict[Holder, Held]:
    """What is held once a job of ``owner`` in ``pool`` on ``gpus`` GPUs (0: a CPU slot)
    has left its slot."""
    out = dict(held)
    for holder in ((USERS, owner), (POOLS, pool)):
        now = out.get(holder, Held())
        if gpus > 0:
            out[holder] = Held(max(0, now.gpus - gpus), now.cpu_slots)
        else:
            out[holder] = Held(now.gpus, max(0, now.cpu_slots - 1))
    return out


def cap_key(holder: Holder, field: str) -> str:
    """The cap's key as the sharing file spells it: ``users.alice.max_gpus``."""
    kind, name = holder
    shown = name if _BARE_KEY.match(name) else '"' + name.replace('"', '\\"') + '"'
    return f"{kind}.{shown}.{field}"


def _units(n: int, gpus: bool) -> str:
    if gpus:
        return "GPU" if n == 1 else "GPUs"
    return "CPU slot" if n == 1 else "CPU slots"


def _message(holder: Holder, field: str, cap: int, held: int, need: int) -> str:
    """Why a cap holds a job back, naming who holds what."""
    kind, name = holder
    gpus = field == "max_gpus"
    who = name if kind == USERS else f"pool {name}"
    whose = "their" if kind == USERS else "its"
    key = cap_key(holder, field)
    if need > cap:
        return (
            f"the job needs {need} {_units(need, gpus)}, over the cap of {cap} on {who} (cap {key})"
        )
    text = f"{who} holds {held} of {whose} {cap} {_units(cap, gpus)}"
    if held < cap:  # room, but not for this job
        text += f" and the job needs {need}"
    return f"{text} (cap {key})"


def refusal(rules: Sharing, ask: Ask, held: Holdings) -> str | None:
    """Why a cap holds ``ask`` back (the first cap it would pass), or None."""
    field = "max_gpus" if ask.gpus > 0 else "max_cpu_slots"
    need = max(ask.gpus, 1)
    for holder in holders(rules, ask.owner, ask.pool):
        share = rules.user(holder[1]) if holder[0] == USERS else rules.pool(holder[1])
        cap: int | None = getattr(share, field)
        now = held.get(holder, Held())
        has = now.gpus if ask.gpus > 0 else now.cpu_slots
        if cap is not None and has + need > cap:
            return _message(holder, field, cap, has, need)
    return None


@dataclass(frozen=True)
class Recheck:
    """The caps a claim's write checks again, serialized per holder, on what is held
    then: the store locks :meth:`holders` (in their order), reads what they hold, and
    offers only the claims :meth:`allowed` keeps."""

    rules: Sharing
    asks: Mapping[str, Ask]  # by job id: each offered claim's

    def holders(self) -> list[Holder]:
        """The capped holders of the claims offered, sorted (the order locks go in)."""
        found = {h for a in self.asks.values() for h in holders(self.rules, a.owner, a.pool)}
        return sorted(found)

    def allowed(self, job_ids: Sequence[str], held: Holdings) -> list[str]:
        """Those of ``job_ids`` no cap holds back (each alone: a claim takes one)."""
        return [
            j
            for j in job_ids
            if j not in self.asks or refusal(self.rules, self.asks[j], held) is None
        ]


def run_limit(rules: Sharing, pool: str, own: float | None) -> tuple[float | None, bool]:
    """A job's timeout under its pool's ``max_run``: the shorter of the two, and whether
    it is the pool's."""
    most = rules.pool(pool).max_run
    if most is None or (own is not None and own <= most):
        return own, False
    return most, True


def timed_out_text(seconds: float, pool: str | None) -> str:
    """How a job stopped at its timeout is described (naming the pool's limit, if it was
    the pool's)."""
    text = f"timed out after {seconds:g}s"
    if pool is not None:
        text += f", the longest a job of pool {pool} may run ({cap_key((POOLS, pool), 'max_run')})"
    return text
