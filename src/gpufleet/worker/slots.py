"""A worker's slots: one per GPU plus CPU slots; which are free right now.

``changed`` is set whenever a slot frees (and when the worker starts to drain, or its
owner policy takes a GPU or closes claims), so the claim loop can send a poll with the
fresh slots at once."""

from __future__ import annotations

import asyncio

from gpufleet.domain.models import GpuInfo
from gpufleet.wire import FreeGpuModel


class Slots:
    def __init__(self, cpu_slots: int, gpus: tuple[GpuInfo, ...]) -> None:
        self.cpu_total = cpu_slots
        self.cpu_free = cpu_slots
        self.gpus = {g.index: g for g in gpus}
        self.gpus_free = set(self.gpus)
        self.changed = asyncio.Event()
        # The workstation's owner's (gpufleet.worker.owner): GPUs its processes hold, and
        # whether its rules (idle, hours, battery, a yield) close this worker to new jobs.
        self.owned: set[int] = set()
        self.closed = False

    def any_free(self) -> bool:
        if self.closed:
            return False
        return self.cpu_free > 0 or bool(self.gpus_free - self.owned)

    def owner_took_all(self) -> bool:
        """Whether nothing is free because the owner's rules took what was."""
        return (self.closed or bool(self.owned)) and not self.any_free()

    def owners(self, gpus: list[int]) -> bool:
        """Whether a lease on ``gpus`` would start on the owner's GPU or while the owner's
        rules close this worker."""
        return self.closed or bool(set(gpus) & self.owned)

    def free_gpus(self, live: tuple[GpuInfo, ...]) -> list[FreeGpuModel]:
        free_mib = {g.index: g.free_mib for g in live}
        return [
            FreeGpuModel(index=i, free_mib=free_mib.get(i, self.gpus[i].free_mib))
            for i in sorted(self.gpus_free - self.owned)
        ]

    def fits(self, gpus: list[int]) -> bool:
        """Whether a lease on ``gpus`` (none: a CPU slot) has its slot free here."""
        if gpus:
            return set(gpus) <= self.gpus_free
        return self.cpu_free > 0

    def take(self, gpus: list[int]) -> None:
        if gpus:
            self.gpus_free -= set(gpus)
        else:
            self.cpu_free -= 1

    def give(self, gpus: list[int]) -> None:
        if gpus:
            self.gpus_free |= set(gpus) & set(self.gpus)
        else:
            self.cpu_free = min(self.cpu_total, self.cpu_free + 1)
        self.changed.set()
