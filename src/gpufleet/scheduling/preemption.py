"""Preemption: which running job, if any, a waiting job of a higher priority makes way for.

A waiting job may preempt only when no worker can take it now and no slot it could use is
coming free soon. Its victim is the lowest-ranked running job (the lowest priority, then
the newest start) that allows it (its own flag, or its pool's), of a strictly lower
priority, not preempted within its protection, whose slot the waiting job would fit once
freed (:func:`gpufleet.scheduling.matching.now_reason` on the worker's free resources plus
that slot). A slot is coming when a job holding one the waiting job could use is already
on its way out (asked to stop, pause or make way, or its worker drains) or reaches its
timeout within the victim's grace period: then the waiting job waits instead. Each
waiting job has one victim at a time, and a slot coming free is counted for one waiting
job only.

Pure: :func:`plan` takes the fleet as the server sees it and the time, and decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from gpufleet.domain.sharing import Preemption
from gpufleet.scheduling.matching import (
    Assignment,
    FreeGpu,
    FreeResources,
    JobView,
    WorkerView,
    effective_gpus,
    now_reason,
)


@dataclass(frozen=True)
class Holder:
    """A claimed or running job, as preemption sees it: ``allows`` (its own flag or its
    pool's policy), ``leaving`` (asked to stop, pause or make way, or its worker drains),
    ``making_way_for`` (the waiting job it is being vacated for), ``ends_by`` (its timeout
    deadline) and ``grace`` (its grace period, seconds)."""

    job_id: str
    lease: int
    priority: int
    gpus: tuple[int, ...] = ()
    started_at: float | None = None
    allows: bool = False
    preempted_at: float | None = None
    grace: float = 30.0
    ends_by: float | None = None
    leaving: bool = False
    making_way_for: str | None = None


@dataclass(frozen=True)
class Slots:
    """One worker: how it is judged, what it has free, and the jobs that hold the rest."""

    view: WorkerView
    free: FreeResources
    held: tuple[Holder, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What one waiting job does now: preempt ``victim`` (on ``worker``), or wait (``why``)."""

    job: JobView
    why: str
    victim: Holder | None = None
    worker: WorkerView | None = None


#: Whether the caps let a waiting job take a slot now (``None``), or once ``Holder`` has
#: left its slot (its slot counted against the same user's or pool's cap no more).
Room = Callable[[JobView, "Holder | None"], bool]


def _anywhere(job: JobView, leaving: Holder | None) -> bool:
    return True


@dataclass
class _Spoken:
    """The slots already counted this round: each coming slot goes to one waiting job."""

    ids: set[str] = field(default_factory=set)


def freed(worker: Slots, holder: Holder) -> FreeResources:
    """``worker``'s free resources once ``holder`` has left its slot (a GPU it held has
    the free memory the worker registered it with)."""
    if not holder.gpus:
        return replace(worker.free, cpu_slots=worker.free.cpu_slots + 1)
    known = {g.index: g.free_mib for g in effective_gpus(worker.view)}
    back = tuple(FreeGpu(i, known[i]) for i in holder.gpus if i in known)
    return replace(worker.free, gpus=worker.free.gpus + back)


def _fits(job: JobView, free: FreeResources, worker: Slots, now: float, grace: float) -> bool:
    return isinstance(now_reason(job, worker.view, free, now, grace), Assignment)


def may_lose_slot(holder: Holder, priority: int, rules: Preemption, now: float) -> bool:
    """Whether ``holder`` may be preempted by a waiting job of ``priority``."""
    protected = holder.preempted_at is not None and now - holder.preempted_at < rules.protection
    return (
        holder.started_at is not None
        and holder.allows
        and holder.priority < priority
        and not holder.leaving
        and not protected
    )


def _victim_rank(pair: tuple[Slots, Holder]) -> tuple[int, float, str]:
    """The lowest priority first, then the newest start."""
    h = pair[1]
    return (h.priority, -(h.started_at or 0.0), h.job_id)


def _coming(
    job: JobView,
    workers: Sequence[Slots],
    now: float,
    within: float,
    cuda_grace: float,
    spoken: _Spoken,
    room: Room = _anywhere,
) -> Holder | None:
    """A job on its way out of a slot ``job`` could use (the caps letting it), not counted
    for another job."""
    for w in workers:
        for h in w.held:
            soon = h.leaving or (h.ends_by is not None and h.ends_by <= now + within)
            if (
                soon
                and h.job_id not in spoken.ids
                and _fits(job, freed(w, h), w, now, cuda_grace)
                and room(job, h)
            ):
                return h
    return None


def decide(
    job: JobView,
    workers: Sequence[Slots],
    rules: Preemption,
    now: float,
    cuda_grace: float,
    spoken: _Spoken | None = None,
    room: Room = _anywhere,
) -> Decision:
    """Whether the waiting ``job`` preempts now, and whom (one waiting job; :func:`plan`
    decides for several in their order). ``room``: what the caps let it take; a job a cap
    holds back now may preempt only a job whose leaving makes it room."""
    spoken = spoken if spoken is not None else _Spoken()
    priority = job.spec.priority
    held = [(w, h) for w in workers for h in w.held]
    mine = next((h for _, h in held if h.making_way_for == job.id), None)
    if mine is not None:
        return Decision(job, f"job {mine.job_id} is still making way for it")
    if room(job, None) and any(_fits(job, w.free, w, now, cuda_grace) for w in workers):
        return Decision(job, "a worker can take it now")
    able = sorted(
        (
            (w, h)
            for w, h in held
            if h.job_id not in spoken.ids
            and may_lose_slot(h, priority, rules, now)
            and _fits(job, freed(w, h), w, now, cuda_grace)
            and room(job, h)
        ),
        key=_victim_rank,
    )
    if not able:
        if not room(job, None):
            return Decision(job, "a cap holds it back, and no job it may preempt frees room")
        return Decision(job, "no running job it may preempt holds a slot it could use")
    worker, victim = able[0]
    soon = _coming(job, workers, now, victim.grace, cuda_grace, spoken, room)
    if soon is not None:
        spoken.ids.add(soon.job_id)
        return Decision(job, f"job {soon.job_id} frees a slot it could use soon")
    spoken.ids.add(victim.job_id)
    return Decision(job, f"preempts job {victim.job_id}", victim, worker.view)


def plan(
    waiting: Sequence[JobView],
    workers: Sequence[Slots],
    rules: Preemption,
    now: float,
    cuda_grace: float,
    room: Room = _anywhere,
) -> list[Decision]:
    """A decision for each waiting job (those that may preempt: priority and wait already
    checked), in their order: a slot coming free, or a victim chosen, is counted for the
    first job that can use it only. A job making way for one of ``waiting`` is that job's."""
    ids = {j.id for j in waiting}
    spoken = _Spoken({h.job_id for w in workers for h in w.held if h.making_way_for in ids})
    return [decide(job, workers, rules, now, cuda_grace, spoken, room) for job in waiting]


__all__ = ["Decision", "Holder", "Room", "Slots", "decide", "freed", "may_lose_slot", "plan"]
