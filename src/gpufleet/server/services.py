"""The server's services, each named for what it does, built once per process.

- :class:`~gpufleet.server.submission.Submission`: submit jobs, apply manifests;
- :class:`~gpufleet.server.dispatch.Dispatch`: claims, ranked against the polls waiting;
- :class:`~gpufleet.server.leases.Leases`: the lease protocol (start, heartbeat, output,
  finish, release, a lease lost);
- :class:`~gpufleet.server.holders.Holders`: whether a lease-carrying write comes from
  the worker holding the attempt (its token, the attempt's secret);
- :class:`~gpufleet.server.upkeep.Upkeep`: the sweep, and the leases a worker gives up as
  it leaves, registers again or loses its token;
- :class:`~gpufleet.server.preemption.Preemption`: the sweep's preemption duty (a running
  job asked to make way for a waiting one of a higher priority);
- :class:`~gpufleet.server.notices.Notices`: followers and polls told of a write (once
  its transaction has committed, for one made through a transaction);
- :class:`~gpufleet.server.fleet.Fleet`: workers' lives, host policies, drain;
- :class:`~gpufleet.server.steering.Steering`: cancel, stop, requeue;
- :class:`~gpufleet.server.dataflow.DataFlow`: inputs, dependencies, artifacts;
- :class:`~gpufleet.server.explain.Explain`: why a job waits;
- :class:`~gpufleet.server.reads.Reads`: what clients read;
- :class:`~gpufleet.server.environments.EnvLocks`: the fleet-wide locks of job
  environments;
- :class:`~gpufleet.server.hooks.Webhooks` and :class:`~gpufleet.server.hooksend.Sender`:
  webhooks made, and their deliveries sent.

Routes call these and never the store. The store only persists; the lifecycle table in
:mod:`gpufleet.domain.lifecycle` decides every status change and
:mod:`gpufleet.scheduling` who may run what. Time comes from an injected clock, so the
policy is testable without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from gpufleet.domain.sharing import Sharing
from gpufleet.server.blobs import BlobService
from gpufleet.server.caps import Caps
from gpufleet.server.checkpoints import Checkpoints
from gpufleet.server.dataflow import DataFlow
from gpufleet.server.dispatch import Dispatch
from gpufleet.server.environments import EnvLocks
from gpufleet.server.explain import Explain
from gpufleet.server.fleet import Fleet, OnEvent, no_event
from gpufleet.server.holders import Holders
from gpufleet.server.hooks import Webhooks
from gpufleet.server.hooksend import Sender
from gpufleet.server.lease_secrets import LeaseSecrets
from gpufleet.server.leases import Leases
from gpufleet.server.metrics import Metrics
from gpufleet.server.notices import Notices
from gpufleet.server.preemption import Preemption
from gpufleet.server.reads import Reads
from gpufleet.server.retention import Retention
from gpufleet.server.settings import QueueSettings
from gpufleet.server.sharing import FairShare, SharingRules
from gpufleet.server.steering import Steering
from gpufleet.server.submission import Submission
from gpufleet.server.upkeep import Upkeep
from gpufleet.store import Store, Transaction


class Services:
    """One of each service, sharing one store, clock and change signal."""

    def __init__(
        self,
        store: Store,
        settings: QueueSettings,
        blobs: BlobService,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] = lambda: None,
        on_event: OnEvent = no_event,
        on_written: Callable[[str], None] = lambda _job_id: None,
        sharing: SharingRules | None = None,
    ) -> None:
        self.settings, self.store, self.clock, self.blobs = settings, store, clock, blobs
        self._share(sharing or SharingRules(settings.sharing_file))
        self.fleet = Fleet(
            store, settings.lease_timeout, settings.ephemeral_ttl, clock=clock, on_event=on_event
        )
        self.flow = DataFlow(store, blobs, clock, on_change)
        self.checkpoints = Checkpoints(store, blobs, settings.checkpoint_keep, clock)
        self.reads = Reads(store)
        self.submission = Submission(
            store, self.reads, self.fleet, self.flow, clock, on_change, self.metrics
        )
        self.steering = Steering(
            store, self.reads, self.flow, clock, on_change, self.metrics, on_written
        )
        self.explain = Explain(
            store, self.reads, self.fleet, settings.prefer_cuda_grace, clock, self.caps
        )
        self.notices = Notices(on_change, on_written)
        self.dispatch = Dispatch(
            store,
            settings,
            self.fleet,
            self.flow,
            LeaseSecrets(store),
            self.notices,
            clock,
            self.metrics,
            self.checkpoints,
            self.fair,
            self.caps,
        )
        self.leases = Leases(
            store, settings, self.fleet, self.dispatch, self.notices, clock, on_event, self.metrics
        )
        self.holders = Holders(store, self.fleet, self.leases, self.dispatch.secrets, clock)
        self.upkeep = Upkeep(store, self.fleet, self.leases, self.notices, clock, on_event)
        self.env_locks = EnvLocks(store, blobs, self.holders, clock, on_event)
        self._duties(settings, clock, on_event)

    def _duties(
        self, settings: QueueSettings, clock: Callable[[], float], on_event: OnEvent
    ) -> None:
        """The periodic duties besides leases: retention, preemption, webhooks."""
        self.retention = Retention(self.store, settings, clock)
        grace = settings.prefer_cuda_grace
        self.preemption = Preemption(
            self.store, self.fleet, self.sharing, self.notices, clock, on_event, grace
        )
        # A job a cap holds back preempts only a job whose leaving makes it room.
        self.preemption.held_now = self.caps.held_now
        hooks = Webhooks(self.store, settings, self.sharing, clock)
        self.hook_sender = Sender(self.store, hooks, clock)

    def _share(self, rules: SharingRules) -> None:
        """The sharing rules, and the services that apply them: fair share and caps (and
        the metrics, which count by user only if the rules say so)."""
        self.sharing = rules
        self.fair = FairShare(self.store, rules, self.clock)
        self.caps = Caps(self.store, rules)
        self.metrics = Metrics(per_user=rules.current().user_metrics)
        rules.on_change.append(self._rules_changed)

    def _rules_changed(self, rules: Sharing) -> None:
        self.metrics.per_user = rules.user_metrics

    @property
    def webhooks(self) -> Webhooks:
        """Webhooks made, listed and removed (the sender's)."""
        return self.hook_sender.hooks

    def transaction(self, job_ids: Sequence[str] = ()) -> AbstractContextManager[Transaction]:
        """A unit of work (:meth:`Store.transaction`): the services bound to it
        (``holders.within(tx)``, ``leases.within(tx)``) write through it, and tell of
        their writes once it has committed. ``job_ids``: the jobs it will change.

        What those services read from outside it is made first: the fleet's lease key is
        written once, by the first server to need it, and never from inside a
        transaction (on SQLite, the transaction holds the one writer)."""
        self.dispatch.secrets.ready()
        return self.store.transaction(job_ids)
