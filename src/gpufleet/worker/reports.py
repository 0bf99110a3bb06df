"""A worker's start and finish reports, sent together while one is on its way.

A report goes at once when no other is on its way; those that come meanwhile (the other
slots' jobs starting and ending) go together in the next call, ``POST /v1/reports``, and
each gets its own answer: the same result or error its own call would have had. So an
idle worker reports with no wait, and a busy one with fewer calls. A server from before
``/v1/reports`` (it answers 404 for the path) gets each report as its own call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from gpufleet.client import AsyncClient
from gpufleet.client._api import error_of
from gpufleet.errors import GpufleetError, NotFound
from gpufleet.wire import (
    MOST_REPORTS,
    FinishReport,
    FinishRequest,
    JobOut,
    ReportBatch,
    StartReport,
    StartRequest,
)

T = TypeVar("T")
ALONE_FOR = 300.0  # seconds to send reports alone after a server lacked /v1/reports
# A report waiting to be sent: its job and the body its own call would carry.
Waiting = tuple[str, StartRequest | FinishRequest]


class Retrying(Protocol):
    def __call__(self, what: str, call: Callable[[], Awaitable[T]]) -> Awaitable[T]: ...


class Reports:
    """Sends a worker's start and finish reports, batching those that wait."""

    def __init__(self, client: AsyncClient, retrying: Retrying) -> None:
        self.client = client
        self.retrying = retrying
        self._alone_until = 0.0  # a server lacked /v1/reports: one call a report till then
        self._waiting: list[tuple[Waiting, asyncio.Future[Any]]] = []
        self._sender: asyncio.Task[None] | None = None

    @property
    def batched(self) -> bool:
        """Whether reports go in batches now (else each alone: a server lacked the path
        lately; after a while, as during an upgrade of the servers, batches are tried again)."""
        return time.monotonic() >= self._alone_until

    async def start(self, job_id: str, body: StartRequest) -> None:
        """The job's process runs: ``POST /v1/jobs/{job_id}/start``, perhaps batched."""
        await self._report((job_id, body))

    async def finish(self, job_id: str, body: FinishRequest) -> JobOut:
        """The attempt ended: ``POST /v1/jobs/{job_id}/finish``, perhaps batched."""
        out: JobOut = await self._report((job_id, body))
        return out

    async def _report(self, report: Waiting) -> Any:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((report, done))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_waiting())
        return await done

    async def _send_waiting(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:MOST_REPORTS], self._waiting[MOST_REPORTS:]
            try:
                outcomes = await self._send([r for r, _ in batch])
            except asyncio.CancelledError:
                for _, done in batch + self._waiting:
                    done.cancel()
                self._waiting = []
                raise
            except Exception as exc:  # the call failed whole: so did each report in it
                outcomes = [exc] * len(batch)
            for (_, done), outcome in zip(batch, outcomes, strict=True):
                if done.done():  # its caller was cancelled
                    continue
                if isinstance(outcome, Exception):
                    done.set_exception(outcome)
                else:
                    done.set_result(outcome)

    async def _send(self, batch: list[Waiting]) -> list[Any]:
        """Each report's result (None for a start, a finish's job) or its error."""
        if self.batched:
            reports = ReportBatch(reports=[_report(job_id, body) for job_id, body in batch])
            try:
                answer = await self.retrying("reports", lambda: self.client.reports(reports))
            except NotFound:  # a report's own 404 is in its result: this server lacks the path
                self._alone_until = time.monotonic() + ALONE_FOR
            else:
                if len(answer.results) != len(batch):
                    raise GpufleetError(
                        f"the server answered {len(answer.results)} results to {len(batch)} reports"
                    )
                return [
                    error_of(r.status, r.error) if r.error is not None else r.job
                    for r in answer.results
                ]
        return [await self._alone(job_id, body) for job_id, body in batch]

    async def _alone(self, job_id: str, body: StartRequest | FinishRequest) -> Any:
        """One report as its own call, for a server from before ``/v1/reports`` (and so
        from before a start's ``started_at``)."""
        try:
            if isinstance(body, StartRequest):
                old = body.model_copy(update={"started_at": None})
                return await self.retrying("start", lambda: self.client.start(job_id, old))
            return await self.retrying("finish", lambda: self.client.finish(job_id, body))
        except GpufleetError as exc:
            return exc


def _report(job_id: str, body: StartRequest | FinishRequest) -> StartReport | FinishReport:
    """The report of ``job_id`` in a batch: the body its own call would carry, with the job."""
    if isinstance(body, StartRequest):
        return StartReport(kind="start", job_id=job_id, **dict(body))
    return FinishReport(kind="finish", job_id=job_id, **dict(body))
