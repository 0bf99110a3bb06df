"""The fleet: each worker's life (registered, available, draining, offline, removed) and
what it can take now, in one vocabulary.

A worker's status, as the API, the CLI and the docs say it:

- ``connecting``: registered, has not polled or heartbeated yet;
- ``available``: a job could start on it now (a free GPU; on a machine without GPUs, a
  free CPU slot);
- ``reserved``: nothing free, and a job is claimed but not started, or waits for it;
- ``busy``: every slot runs a job;
- ``draining``: runs what it has, takes nothing new;
- ``offline``: no heartbeat for a lease, or it stopped. An offline ephemeral worker is
  forgotten after ``ephemeral_ttl``; a persistent one stays until ``workers rm``.

Lifecycle events (registered, offline, removed) go to the audit log through ``on_event``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from gpufleet.domain import worker_lifecycle
from gpufleet.domain.ids import new_worker_id
from gpufleet.domain.models import ACTIVE, HostPolicy, JobSpec, JobStatus, WorkerStatus
from gpufleet.errors import Conflict, Forbidden, NotFound
from gpufleet.scheduling.matching import (
    FreeGpu,
    FreeResources,
    WorkerView,
    effective_gpus,
    ever_reason,
    reserve,
)
from gpufleet.store import (
    AccessStore,
    FleetStore,
    HostRow,
    Hosts,
    JobRow,
    JobStore,
    TokenRow,
    WorkerRow,
    json_columns,
)
from gpufleet.wire import CapabilityModel, WorkerRegister

Clock = Callable[[], float]
CLAIMER_TTL = 1.0  # seconds a polling worker's row is taken from the cache
#: A worker as the fleet keeps it (what routes hand back to :meth:`Fleet.state_of`).
WorkerRecord = WorkerRow
#: (event, target id, detail, the token that caused it if any) -> recorded in the audit log
OnEvent = Callable[[str, str, str, TokenRow | None], None]


def no_event(event: str, target: str, detail: str, token: TokenRow | None) -> None:
    return None


class FleetServiceStore(FleetStore, JobStore, AccessStore, Protocol):
    """What the fleet reads and writes: workers and hosts, the jobs they hold, and the
    tokens they enrolled with."""


@dataclass(frozen=True)
class HostDeclaration:
    """A manifest's ``[hosts.NAME]`` as the server applies it: the policy, the manifest
    and file it came from, when, and the token that applied it (if known)."""

    policy: HostPolicy
    manifest: str
    applied_at: float
    file: str | None = None
    applied_by: str | None = None

    @property
    def name(self) -> str:
        return self.policy.name

    @classmethod
    def of(cls, row: HostRow) -> HostDeclaration:
        origin = json_columns.host_origin(row.policy)
        return cls(
            json_columns.host_policy(row.policy),
            row.manifest,
            row.updated_at,
            origin.file,
            origin.applied_by,
        )


@dataclass(frozen=True)
class WorkerState:
    """A worker as a user sees it now: its status, what it runs, what it has free (after
    the jobs aimed at it took theirs)."""

    row: WorkerRow
    view: WorkerView
    status: WorkerStatus
    running: list[JobRow]
    free: FreeResources
    waiting: list[JobRow] = field(default_factory=list)  # aimed at it, holding a slot
    host: HostDeclaration | None = None  # the [hosts.NAME] that applies to it, if any


class Fleet:
    """Workers and host policies; one per server process."""

    def __init__(
        self,
        store: FleetServiceStore,
        lease_timeout: float,
        ephemeral_ttl: float,
        clock: Clock = time.time,
        on_event: OnEvent = no_event,
    ) -> None:
        self.store = store
        self.lease_timeout = lease_timeout
        self.ephemeral_ttl = ephemeral_ttl
        self.clock = clock
        self.on_event = on_event
        self._hosts: tuple[float, dict[str, HostDeclaration], dict[str, HostPolicy]] = (
            0.0,
            {},
            {},
        )
        self._claimers: dict[str, tuple[float, WorkerRow]] = {}
        self._claimers_swept = 0.0
        # Heartbeats that changed nothing but liveness, written together by flush_beats:
        # worker id -> (when, its GPUs' readings as JSON, None if it sent none)
        self._beats: dict[str, tuple[float, str | None]] = {}
        self._beats_lock = threading.Lock()

    # ---- host policies and views ------------------------------------------------------

    def declarations(self) -> dict[str, HostDeclaration]:
        """Host declarations from the last applied manifests, by host (cached for a second)."""
        return self._applied()[0]

    def policies(self) -> dict[str, HostPolicy]:
        """Host policies from the last applied manifests (cached for a second)."""
        return self._applied()[1]

    def _applied(self) -> tuple[dict[str, HostDeclaration], dict[str, HostPolicy]]:
        loaded_at, declared, policies = self._hosts
        if time.monotonic() - loaded_at < 1.0:
            return declared, policies
        declared = {h.name: HostDeclaration.of(h) for h in self.store.hosts()}
        policies = {name: d.policy for name, d in declared.items()}
        self._hosts = (time.monotonic(), declared, policies)
        return declared, policies

    def hosts(self, pools: Sequence[str] | None = None) -> list[HostDeclaration]:
        """Every host declaration by name; for ``pools``, those naming a worker of them."""
        found = sorted(self.declarations().values(), key=lambda d: d.name)
        if pools is None:
            return found
        mine = {w.name for w in self.store.list_workers(pools)}
        return [d for d in found if d.name in mine]

    def declaration_for(self, ref: str | None) -> HostDeclaration | None:
        """The declaration that applies to the worker ``ref`` (id or name), if any."""
        if not ref:
            return None
        hosts = self.declarations()
        if ref in hosts:
            return hosts[ref]
        w = self.store.get_worker(ref)
        return hosts.get(w.name) if w is not None else None

    def narrowed_note(self, spec: JobSpec) -> str | None:
        """For a job aimed at a worker whose host declaration offers none of the GPUs it
        has: that the job runs in a CPU slot, and which declaration says so."""
        req = spec.requirements
        if not req.worker or req.cpu_only:
            return None
        w = self.store.get_worker(req.worker)
        d = self.declarations().get(w.name) if w is not None else None
        if w is None or d is None or not w.capability.gpus or effective_gpus(self.view(w)):
            return None
        return (
            f"worker {w.name} has {len(w.capability.gpus)} GPU(s), but hosts.{w.name} in "
            f"{d.file or 'manifest ' + d.manifest} declares {', '.join(d.policy.narrowing())}:"
            " it offers none of them, so this job runs in a CPU slot (gpufleet hosts)"
        )

    def policies_after(self, hosts: Hosts) -> dict[str, HostPolicy]:
        """The host policies once a manifest's ``hosts`` are written (read fresh)."""
        after = hosts.after(self.store.hosts())
        return {name: json_columns.host_policy(raw) for name, raw in after.items()}

    def policies_changed(self) -> None:
        self._hosts = (0.0, {}, {})

    def view(self, w: WorkerRow, policies: Mapping[str, HostPolicy] | None = None) -> WorkerView:
        """How ``w`` is judged: its lifecycle status and its host's policy (from
        ``policies`` if given, else the applied ones)."""
        policies = self.policies() if policies is None else policies
        return WorkerView(
            id=w.id,
            name=w.name,
            status=self.lifecycle(w),
            capability=w.capability,
            labels=w.labels,
            pool=w.pool,
            policy=policies.get(w.name),
            cpu_slots=w.cpu_slots,
            environments=frozenset(e.spec_key for e in w.environments),
        )

    @staticmethod
    def lifecycle(w: WorkerRow) -> WorkerStatus:
        """The stored part of the status: offline, draining, connecting or available."""
        if w.status == WorkerStatus.OFFLINE:
            return WorkerStatus.OFFLINE
        if w.drain or w.status == WorkerStatus.DRAINING:
            return WorkerStatus.DRAINING
        if w.status == WorkerStatus.CONNECTING:
            return WorkerStatus.CONNECTING
        return WorkerStatus.AVAILABLE

    def free_resources(self, w: WorkerRow, active: list[JobRow]) -> FreeResources:
        """A worker's slots that no claimed or running job holds, with live GPU memory."""
        used_gpus = {g for j in active for g in j.gpus}
        cpu_used = sum(1 for j in active if not j.gpus)
        live = {g.index: g.free_mib for g in w.gpu_stats}
        gpus = tuple(
            FreeGpu(g.index, live.get(g.index, g.free_mib))
            for g in effective_gpus(self.view(w))
            if g.index not in used_gpus
        )
        return FreeResources(cpu_slots=max(0, w.cpu_slots - cpu_used), gpus=gpus)

    def state(
        self,
        w: WorkerRow,
        holding: list[JobRow],
        policies: Mapping[str, HostPolicy] | None = None,
    ) -> WorkerState:
        """``w``'s state, given the jobs it holds: those claimed or running on it, and the
        pending jobs aimed at it (which hold their slot before it claims them); with the
        host ``policies`` given, or else the applied ones."""
        view = self.view(w, policies)
        running = [j for j in holding if j.status in ACTIVE and j.worker_id == w.id]
        waiting = [j for j in holding if self._holds_slot(j, view)]
        free = reserve([j.spec for j in waiting], view, self.free_resources(w, running))
        status = view.status
        if status in (WorkerStatus.AVAILABLE, WorkerStatus.CONNECTING):
            status = self._load(view, free, running, bool(waiting)) or status
        return WorkerState(w, view, status, running, free, waiting, self.declarations().get(w.name))

    def _holds_slot(self, job: JobRow, view: WorkerView) -> bool:
        """A pending job aimed at the worker holds a slot only if the worker would claim
        it now: of its pool, its dependencies met, out of backoff, and one it may run."""
        return (
            job.status == JobStatus.PENDING
            and job.pool == view.pool
            and job.waiting == 0
            and (job.not_before is None or job.not_before <= self.clock())
            and ever_reason(job.spec, view) is None
        )

    @staticmethod
    def _load(
        view: WorkerView, free: FreeResources, running: list[JobRow], aimed: bool
    ) -> WorkerStatus | None:
        # A GPU machine is for GPU work: with every GPU taken it is busy, CPU slot or not.
        if free.gpus or (free.cpu_slots and not effective_gpus(view)):
            return None
        if aimed or any(j.status == JobStatus.CLAIMED for j in running):
            return WorkerStatus.RESERVED
        return WorkerStatus.BUSY

    def states(self, pools: Sequence[str] | None = None) -> list[WorkerState]:
        """Every worker (of ``pools``; None: all) with its state, in three queries."""
        rows = self.store.list_workers(pools)
        holding: dict[str, list[JobRow]] = {}
        for j in self.store.active_jobs():
            holding.setdefault(j.worker_id or "", []).append(j)
        aimed: dict[str, list[JobRow]] = {}
        for j in self.store.aimed_jobs():
            aimed.setdefault(j.target or "", []).append(j)
        out = []
        for w in rows:
            mine = holding.get(w.id, []) + aimed.get(w.id, [])
            if w.name != w.id:
                mine += aimed.get(w.name, [])
            out.append(self.state(w, mine))
        return out

    def state_of(self, w: WorkerRow) -> WorkerState:
        return self.state(w, self.store.holding(w))

    # ---- lookups ----------------------------------------------------------------------

    def worker(
        self, ref: str, pools: Sequence[str] | None = None, store: FleetStore | None = None
    ) -> WorkerRow:
        """The worker ``ref`` names (of ``pools``), read through ``store`` (a transaction's:
        a read made inside one takes no second connection), else this service's."""
        w = (store or self.store).get_worker(ref)
        if w is None or (pools is not None and w.pool not in pools):
            raise NotFound(f"no worker {ref!r}", detail={"worker": ref})
        return w

    def claimer(self, worker_id: str, store: FleetStore | None = None) -> WorkerRow:
        """A polling worker's row, cached for a second: claims are the hot path. Changes
        made through this service (register, heartbeat, drain) drop the cached row.
        ``store``: read through it on a miss (a transaction's, as :meth:`worker`)."""
        hit = self._claimers.get(worker_id)
        if hit and time.monotonic() - hit[0] < CLAIMER_TTL:
            return hit[1]
        w = self.worker(worker_id, store=store)
        self._cache_claimer(worker_id, w)
        return w

    def _cache_claimer(self, worker_id: str, w: WorkerRow) -> None:
        """Cache ``w``; a second after the last sweep, rows past their second are dropped
        (a large fleet's would otherwise stay, for the collector to walk)."""
        now = time.monotonic()
        self._claimers[worker_id] = (now, w)
        if now - self._claimers_swept >= CLAIMER_TTL:
            self._claimers_swept = now
            self._claimers = {
                k: hit for k, hit in list(self._claimers.items()) if now - hit[0] < CLAIMER_TTL
            }

    def forget(self, worker_id: str) -> None:
        self._claimers.pop(worker_id, None)

    def owned(
        self,
        worker_id: str,
        token_id: str,
        pools: Sequence[str] | None = None,
        fresh: bool = False,
    ) -> WorkerRow:
        """The worker, if ``token_id`` enrolled it: only that token may act as it. A worker
        of a pool outside ``pools`` is unknown (404). A worker registered before workers
        were bound to tokens is bound to the first token of its pool that acts as it.
        ``fresh``: read now (a heartbeat needs the drain flag as it is), not from the
        claimers' cache, which the read refreshes."""
        if fresh:
            w = self.worker(worker_id)
            self._cache_claimer(worker_id, w)
        else:
            w = self.claimer(worker_id)
        if pools is not None and w.pool not in pools:
            raise NotFound(f"no worker {worker_id!r}", detail={"worker": worker_id})
        if w.token_id is None and self.store.bind_worker(w.id, token_id):
            self.forget(w.id)
            w = self.claimer(worker_id)
        if w.token_id != token_id:
            raise Forbidden(
                f"worker {w.name} ({w.id}) was enrolled with another token; "
                "a token acts only as the workers it registered",
                detail={"worker": w.id},
            )
        return w

    # ---- lifecycle --------------------------------------------------------------------

    def register(self, req: WorkerRegister, pool: str, token: TokenRow | None) -> WorkerRow:
        """Register (or re-register) a worker by name into ``pool``, bound to the token
        enrolling it and carrying the labels that token fixes."""
        known = self.store.get_worker(req.name)
        if known is not None and known.name == req.name:
            self._check_reregister(known, req.name, pool, token.id if token else None)
        fixed = token.labels if token else {}
        labels = {**_declared(req, fixed, self._controlled(pool, fixed), pool), **fixed}
        now = self.clock()
        values = {
            "name": req.name,
            "pool": pool,
            "token_id": token.id if token else None,
            "labels": json.dumps(labels),
            "fixed_labels": json.dumps(fixed),
            "capability": req.capability.model_dump_json(),
            "cpu_slots": req.cpu_slots,
            "ephemeral": req.ephemeral,
            "status": worker_lifecycle.INITIAL.value,
            "drain": False,
            "drain_by": None,
            "gpu_stats": json.dumps([g.model_dump() for g in req.capability.gpus]),
            "registered_at": now,
            "last_heartbeat": now,
            "offline_since": None,
        }
        worker_id, returned = self.store.upsert_worker(new_worker_id(), values)
        self.forget(worker_id)
        if returned:
            gpus = len(req.capability.gpus)
            kind = "ephemeral" if req.ephemeral else "persistent"
            self.on_event(
                "worker.registered",
                worker_id,
                f"{req.name} in pool {pool}: {kind}, {gpus} GPU(s), {req.cpu_slots} CPU slot(s)",
                token,
            )
        return self.worker(worker_id)

    def _controlled(self, pool: str, own: dict[str, str]) -> set[str]:
        """Label keys a live worker token of ``pool`` fixes, other than the caller's own:
        in this pool only workers enrolled with such a token carry them, so a job asking
        for one can trust it."""
        now = self.clock()
        return {
            key
            for t in self.store.list_tokens()
            if t.role == "worker" and pool in t.pools and t.live(now)
            for key in t.labels
            if key not in own
        }

    def _check_reregister(
        self, known: WorkerRow, name: str, pool: str, token_id: str | None
    ) -> None:
        """A name stays with the token that enrolled it (until that token is revoked or
        expires), and a worker changes pool only with no job running."""
        owner = self.store.get_token(known.token_id) if known.token_id else None
        if owner is not None and owner.live(self.clock()) and known.token_id != token_id:
            raise Forbidden(
                f"worker name {name!r} is enrolled with another token; pick another "
                "--name, or revoke that token first",
                detail={"worker": known.id, "field": "name"},
            )
        if known.token_id is None and known.pool != pool:
            raise Forbidden(
                f"worker name {name!r} is in pool {known.pool!r}, not {pool!r}",
                detail={"worker": known.id, "field": "pool"},
            )
        if known.pool != pool and self.store.active_jobs(known.id):
            raise Conflict(
                f"worker {name!r} runs jobs of pool {known.pool!r}; it can move to pool "
                f"{pool!r} once they end",
                detail={"worker": known.id, "field": "pool"},
            )

    def revive(self, w: WorkerRow) -> WorkerRow:
        """A polling worker is alive (and past connecting), heartbeat or not."""
        change = worker_lifecycle.poll(w.id, w.status, self.clock())
        if change is None:
            return w
        if w.status == WorkerStatus.OFFLINE:
            self.on_event("worker.online", w.id, f"{w.name} polls again", None)
        self.store.change_worker(change)
        self.forget(w.id)
        return self.claimer(w.id)

    def beat(self, w: WorkerRow, draining: bool, gpu_stats: str | None) -> None:
        """Record a heartbeat: alive now, draining or not, and its GPUs' live memory. A
        worker offline until now is back (an event).

        A heartbeat that changes nothing but liveness (the usual one: the worker stays
        available, or draining) is kept in memory and written with the others by
        :meth:`flush_beats`, a transaction a second for the whole fleet rather than one
        each; one that changes the worker's status is written at once."""
        now = self.clock()
        status = worker_lifecycle.heartbeat_status(w.drain, draining)
        with self._beats_lock:
            if w.status == status:
                kept = self._beats.get(w.id)
                stats = gpu_stats if gpu_stats is not None or kept is None else kept[1]
                self._beats[w.id] = (now, stats)
                return
            kept = self._beats.pop(w.id, None)
        if w.status == WorkerStatus.OFFLINE:
            gone = now - (w.offline_since or now)
            self.on_event(
                "worker.online", w.id, f"{w.name} heartbeats again after {gone:.0f}s", None
            )
        stats = gpu_stats if gpu_stats is not None or kept is None else kept[1]
        change = worker_lifecycle.heartbeat(w.id, w.status, w.drain, draining, now, stats)
        if change is not None and not self.store.change_worker(change):
            # Its status moved since it was read (a poll on another replica): the beat
            # still says it is alive, written with the others.
            with self._beats_lock:
                self._beats[w.id] = (now, stats)
        self.forget(w.id)

    def built(self, w: WorkerRow, environments: str) -> None:
        """Record the environments in the worker's cache (a JSON list, all of them), as a
        heartbeat sent them: a worker sends them only when they changed."""
        self.store.set_worker_environments(w.id, environments)
        self.forget(w.id)

    def pythons(self, w: WorkerRow, pythons: list[str]) -> None:
        """Record the Python versions a worker can provide, as a heartbeat sent them once
        it had found them (after it registered: the search can take seconds)."""
        cap = replace(w.capability, pythons=tuple(pythons))
        self.store.set_worker_capability(w.id, CapabilityModel.from_domain(cap).model_dump_json())
        self.forget(w.id)

    def flush_beats(self) -> int:
        """Write the heartbeats kept in memory, in one transaction; how many. The server
        calls it every second and before it judges who went silent; beats a failed write
        took are kept for the next call (unless a newer one came meanwhile)."""
        with self._beats_lock:
            beats, self._beats = self._beats, {}
        if not beats:
            return 0
        try:
            self.store.record_beats([(w, at, stats) for w, (at, stats) in beats.items()])
        except Exception:
            with self._beats_lock:
                for worker_id, beat in beats.items():
                    self._beats.setdefault(worker_id, beat)
            raise
        return len(beats)

    def leave(self, w: WorkerRow, reason: str) -> None:
        """The worker stopped on purpose (drained, its one job done, a signal)."""
        if self.store.change_worker(worker_lifecycle.leave(w.id, self.clock())):
            self.on_event("worker.offline", w.id, f"{w.name} stopped: {reason}", None)
        self.forget(w.id)

    def drain(
        self, ref: str, pools: Sequence[str] | None = None, deadline: float | None = None
    ) -> WorkerRow:
        """Drain a worker: it takes nothing new; its running jobs may finish, or, with
        ``deadline`` (seconds), are vacated then (grace signal, last checkpoint, back to
        the queue). A second drain may set an earlier deadline, never a later one."""
        w = self.worker(ref, pools)
        by = None if deadline is None else self.clock() + deadline
        if w.drain_by is not None:
            by = w.drain_by if by is None else min(by, w.drain_by)
        self.store.drain_worker(w.id, by)
        self.forget(w.id)
        return self.worker(w.id)

    def remove(self, ref: str, pools: Sequence[str] | None, by: TokenRow) -> WorkerRow:
        """Forget an offline worker (its jobs' history keeps its name); 409 unless it is
        offline, so a running machine is never orphaned, and while jobs are aimed at it
        (they could never be claimed by a worker registered again: it gets a new id)."""
        w = self.worker(ref, pools)
        aimed = [j.id for j in self.store.holding(w) if j.status == JobStatus.PENDING]
        if aimed:
            raise Conflict(
                f"jobs {', '.join(aimed)} are aimed at worker {w.name} and wait for it; cancel "
                "them (or let the worker come back) before removing it",
                detail={"worker": w.id, "jobs": aimed},
            )
        state = self.state_of(w)
        if state.status != WorkerStatus.OFFLINE or not self.store.delete_worker(w.id):
            raise Conflict(
                f"worker {w.name} is {state.status.value}; only an offline worker can be "
                "removed: drain it (gpufleet drain) and let it stop, or stop its process",
                detail={"worker": w.id, "status": state.status.value},
            )
        self.forget(w.id)
        self.on_event("worker.removed", w.id, f"{w.name} removed by {by.name}", by)
        return w

    def sweep(self) -> list[str]:
        """Workers silent for a lease go offline; ephemeral ones offline for longer than
        ``ephemeral_ttl`` are forgotten. Returns the ids that went offline."""
        self.flush_beats()  # a beat still in memory is a worker alive
        now = self.clock()
        offline = self.store.mark_offline(now - self.lease_timeout)
        for worker_id in offline:
            self.forget(worker_id)
            self.on_event(
                "worker.offline", worker_id, f"no heartbeat for {self.lease_timeout:g}s", None
            )
        for worker_id in self.store.delete_gone_ephemeral(now - self.ephemeral_ttl):
            self.forget(worker_id)
            self.on_event(
                "worker.removed",
                worker_id,
                f"ephemeral, offline for over {self.ephemeral_ttl:g}s (--ephemeral-ttl)",
                None,
            )
        return offline


def _declared(
    req: WorkerRegister, fixed: dict[str, str], controlled: set[str], pool: str
) -> dict[str, str]:
    """The labels a worker declares. One its token fixes may only repeat the same value;
    one another worker token of the pool fixes is not the worker's to declare."""
    for key, value in req.labels.items():
        if key in fixed and fixed[key] != value:
            raise Forbidden(
                f"label {key}={value}: this worker's token fixes {key}={fixed[key]} (set by an "
                f"admin with tokens create --label); drop {key} from --labels",
                detail={"worker": req.name, "field": f"labels.{key}"},
            )
        if key not in fixed and key in controlled:
            raise Forbidden(
                f"label {key}={value}: in pool {pool!r}, {key} is fixed by worker tokens "
                f"(tokens create --label {key}=...), and only workers enrolled with one carry "
                f"it; drop {key} from --labels, or enroll this worker with such a token",
                detail={"worker": req.name, "field": f"labels.{key}"},
            )
    return dict(req.labels)
