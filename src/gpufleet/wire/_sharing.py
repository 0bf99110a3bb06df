"""Sharing on the wire: each user's use of each pool (``GET /v1/usage``)."""

from __future__ import annotations

from pydantic import Field

from gpufleet.wire._base import Wire


class UsageRow(Wire):
    """One user's use of one pool: in the window asked, decayed for fair share, and now."""

    owner: str = Field(description="the user: the name of the tokens that submitted its jobs")
    pool: str
    gpu_hours: float = Field(description="GPU-hours its jobs held in the window")
    cpu_hours: float = Field(description="CPU-slot-hours its GPU-less jobs held in the window")
    weight: float = Field(description="its weight in the operator's sharing rules")
    share: float = Field(description="its share of the pool by weight, of the users listed")
    used_share: float = Field(
        description="its part of the pool's decayed usage, of the users listed: above its "
        "share it waits behind those below theirs"
    )
    standing: float = Field(
        description="used_share / share: under 1, below its share (its jobs go first)"
    )
    gpus_now: int = Field(description="GPUs its jobs hold now")
    cpu_slots_now: int = Field(description="CPU slots its jobs hold now")
    jobs_now: int = Field(description="its jobs claimed or running now")


class UsageOut(Wire):
    """Usage by user and pool, over a window, with the rules that rank it."""

    window_hours: float
    fair_share: bool = Field(description="whether claims rank by fair share")
    half_life_hours: float = Field(description="the half-life usage decays with")
    rows: list[UsageRow]
