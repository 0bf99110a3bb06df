"""``server/reads.py``: what clients read; a job is found by its id or its unique name."""

from __future__ import annotations

import pytest

from gpufleet.errors import NotFound
from gpufleet.server.services import Services
from tests.queue_steps import spec


def test_jobs_can_be_found_by_unique_name(queue: Services) -> None:
    a = queue.submission.submit(spec("only-one"))
    assert queue.reads.job("only-one").id == a.id
    queue.submission.submit(spec("twice"))
    queue.submission.submit(spec("twice"))
    with pytest.raises(NotFound, match="several"):
        queue.reads.job("twice")
