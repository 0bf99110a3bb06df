"""The SDK reads each answer type with one validator per process: the wire's models build
theirs on first use, so a validator made per call would build it again at every call
(the worker's claims and reports cost a third more CPU that way)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gpufleet.client import _ops as ops
from gpufleet.client._api import _adapter
from gpufleet.wire import BlobOut, StartRequest


@dataclass
class Answer:
    status_code: int
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.content.decode()


def blobs(n: int) -> bytes:
    return json.dumps(
        [{"sha256": f"{i:064x}", "size": i, "created_at": "2026-11-26T10:00:00Z"} for i in range(n)]
    ).encode()


def test_every_call_of_a_kind_reads_its_answer_with_the_same_validator() -> None:
    assert [b.size for b in ops.blobs(10).parse(Answer(200, blobs(2)))] == [0, 1]
    made = _adapter.cache_info().currsize
    for n in range(1, 6):
        got = ops.blobs(10).parse(Answer(200, blobs(n)))
        assert len(got) == n and all(isinstance(b, BlobOut) for b in got)
    assert _adapter.cache_info().currsize == made  # no new validator for the same type
    assert ops.start("j-1", StartRequest(attempt=1)).parse(Answer(204, b"")) is None
