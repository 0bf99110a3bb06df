"""What a job's detail says of preemption: who preempted it, and whom it preempted."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from gpufleet.wire._base import Wire


class JobRef(Wire):
    """Another job, as a preemption names it: its id and name, its owner and priority,
    and when the preemption was asked."""

    job_id: str
    name: str
    owner: str = Field("", description="the token's name that submitted it ('' : none)")
    priority: int
    at: datetime | None = Field(None, description="when the preemption was asked")


class PreemptionOut(Wire):
    """A job's preemptions: the one being carried out (``requested_at``: its worker
    vacates it now), the last one (``preempted_at``, by ``by``; it is protected from
    another for the server's protection time after it), and the jobs it preempted."""

    requested_at: datetime | None = Field(
        None, description="when it was asked to make way, while its worker vacates it"
    )
    preempted_at: datetime | None = Field(None, description="when it was last preempted")
    by: JobRef | None = Field(None, description="the job that last preempted it")
    preempted: list[JobRef] = Field(
        default_factory=list,
        description="the jobs whose latest preemption was to free a slot for this one",
    )
