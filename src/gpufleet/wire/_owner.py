"""What a worker under an owner policy tells the server at each heartbeat: why it takes
no new jobs, and the foreign processes that make a GPU the workstation owner's."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gpufleet.domain.owner import ForeignProcess, OwnerState
from gpufleet.wire._base import Strict

MOST_FOREIGN = 64
MOST_REASONS = 8


class ForeignProcessModel(Strict):
    gpu: int = Field(ge=0, le=1024)
    pid: int = Field(ge=0, le=2**31)
    name: str | None = Field(None, max_length=64, description="its name, when readable")
    mib: int = Field(ge=0, le=2**40, description="GPU memory it uses, MiB")


class OwnerStateModel(Strict):
    """A worker's owner policy, as it stands: ``reasons`` it takes no new jobs (empty:
    it takes them), the foreign processes on its GPUs, and the GPUs that are the owner's
    (nothing starts there)."""

    reasons: list[Annotated[str, Field(max_length=300)]] = Field(
        default_factory=list, max_length=MOST_REASONS
    )
    foreign: list[ForeignProcessModel] = Field(default_factory=list, max_length=MOST_FOREIGN)
    owned: list[Annotated[int, Field(ge=0, le=1024)]] = Field(default_factory=list, max_length=1024)

    @classmethod
    def from_domain(cls, s: OwnerState) -> OwnerStateModel:
        return cls(
            reasons=[r[:300] for r in s.reasons[:MOST_REASONS]],
            foreign=[ForeignProcessModel(**p.__dict__) for p in s.foreign[:MOST_FOREIGN]],
            owned=list(s.owned),
        )

    def to_domain(self) -> OwnerState:
        return OwnerState(
            tuple(self.reasons),
            tuple(ForeignProcess(**p.model_dump()) for p in self.foreign),
            tuple(self.owned),
        )
