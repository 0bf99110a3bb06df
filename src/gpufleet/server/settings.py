"""The queue's settings, shared by the services that run it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.domain.checkpoints import KEEP
from gpufleet.domain.lifecycle import MOST_LOSSES
from gpufleet.domain.quota import OutputQuota


@dataclass(frozen=True)
class QueueSettings:
    """``lease_timeout``: seconds a lease lives without a heartbeat; ``prefer_cuda_grace``:
    seconds a job preferring CUDA waits for a GPU; ``retry_backoff``: base seconds between
    attempts; ``candidates``: jobs a claim looks at, at most; ``ephemeral_ttl``: seconds an
    offline ephemeral worker is kept before it is forgotten; ``log_retention``: seconds a
    finished job's output lines are kept after it ended, ``audit_retention``: seconds an
    audit record is kept (None: forever); ``output_quota``: how much of an attempt's output
    is stored (:mod:`gpufleet.domain.quota`)."""

    lease_timeout: float = 120.0
    prefer_cuda_grace: float = 300.0
    retry_backoff: float = 10.0
    candidates: int = 200
    ephemeral_ttl: float = 3600.0
    log_retention: float | None = 30 * 86400.0
    audit_retention: float | None = 90 * 86400.0
    output_quota: OutputQuota = field(default_factory=OutputQuota)
    # The newest checkpoint snapshots kept of each job (gpufleet.domain.checkpoints).
    checkpoint_keep: int = KEEP
    # Attempts a job may lose to its machines (worker lost, drained) before it fails.
    max_losses: int = MOST_LOSSES
    # The operator's sharing rules (fair share, caps, preemption, webhooks), a TOML file
    # read again when it changes (gpufleet.server.sharing); None: none.
    sharing_file: Path | None = None
    # Webhooks (gpufleet.server.hooks): destinations allowed besides public addresses
    # (host names, addresses, networks), and the server's own address and listening ports,
    # which a webhook may never reach.
    webhook_allow: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    own_ports: tuple[int, ...] = ()
