"""Webhooks: word when a job ends (:mod:`gpufleet.domain.webhooks`)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, field_validator

from gpufleet.domain.webhooks import EVENTS, parse_events
from gpufleet.wire._base import Name, PoolName, Strict, Wire


class WebhookCreate(Strict):
    """A webhook. Without ``pool`` or ``job`` it is told of the caller's own jobs (those
    its token's name owns); ``pool``: of every job of the pool (operators and admins);
    ``job``: of one job (its submitter's, or an operator's)."""

    url: str = Field(
        min_length=1,
        max_length=2000,
        description="http(s) URL the events are POSTed to (a Slack incoming webhook "
        "works as it is); never shown again, lists show its host",
    )
    secret: str | None = Field(
        None,
        min_length=16,
        max_length=200,
        description="the HMAC-SHA256 key deliveries are signed with; leave it out to have "
        "one made, shown once in the answer",
    )
    events: list[str] = Field(
        default_factory=list,
        max_length=len(EVENTS),
        description=f"some of {', '.join(EVENTS)}; default: succeeded, failed, preempted "
        "(running_past is added when running_past is set)",
    )
    running_past: float | None = Field(
        None, gt=0, le=365 * 86400, description="seconds: tell once when a job runs longer"
    )
    pool: PoolName | None = None
    job: Name | None = None

    @field_validator("events")
    @classmethod
    def _events(cls, v: list[str]) -> list[str]:
        return list(parse_events(v)) if v else []


class WebhookOut(Wire):
    """A webhook as lists show it: never its URL (only the host) or its secret."""

    id: str
    scope: Literal["user", "pool", "job"]
    target: str = Field(description="the user, pool or job whose jobs it is told of")
    host: str
    events: list[str]
    running_past: float | None = None
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str | None = Field(
        None, description="the secret the server made, shown this once; None if you gave one"
    )
