"""How far the worker's download of a job's inputs is: said at its start, once a second
while it runs (however many chunks arrive) and at its end, in bytes, rate and ETA."""

from __future__ import annotations

import asyncio
import hashlib
import io
import time
from pathlib import Path
from typing import Any

from gpufleet import archive
from gpufleet.domain import progress
from gpufleet.wire import StagedInput
from gpufleet.worker.cache import BlobCache
from gpufleet.worker.downloads import Download, amount, rate, span
from gpufleet.worker.staging import Stager

MiB = 1 << 20
Told = list[tuple[dict[str, Any], str | None, bool]]


def test_a_report_says_bytes_rate_and_eta_in_words_and_in_its_record() -> None:
    told: Told = []
    now = [0.0]
    download = Download(lambda *said: told.append(said), clock=lambda: now[0])
    download.begin(200 * MiB)
    download.got(120 * MiB)
    now[0] = 120 / 35
    download.report()
    record, line, finished = told[-1]
    assert line == "downloading inputs 120.0/200.0 MiB, 35 MiB/s, ETA 2s"
    assert not finished  # a state of its bar, drawn over by the next
    assert record["bytes"] == 120 * MiB and record["bytes_total"] == 200 * MiB
    assert record["bytes_per_s"] == 35 * MiB and record["eta_s"] == 2
    assert progress.fraction(progress.check(record)) == 0.6  # a record the server takes
    assert progress.metrics_of(progress.check(record)) == {}  # and no metric to plot
    download.end(ok=True)
    record, line, finished = told[-1]
    assert finished and line is not None and line.startswith("inputs downloaded: 120.0 MiB in")
    assert told[0] == (
        {"message": "downloading inputs 0.0/200.0 MiB", "bytes": 0, "bytes_total": 200 * MiB},
        None,
        False,
    )


def test_words_for_sizes_rates_and_times() -> None:
    assert amount(3 * MiB // 2, 20 << 30) == "0.0/20.0 GiB"
    assert amount(500, 900) == "500/900 B"
    assert rate(3.5 * MiB) == "3.5 MiB/s" and rate(512 * 1024) == "512 KiB/s"
    assert span(2.4) == "2s" and span(65) == "1m05s" and span(7380) == "2h03m"


def test_a_download_of_many_chunks_is_reported_at_a_bounded_rate() -> None:
    told: Told = []

    async def run() -> None:
        download = Download(lambda *said: told.append(said), every=0.05)
        download.begin(100_000 * 4096)

        def chunks() -> None:  # the fetching thread: 100 000 chunks in about half a second
            for n in range(100_000):
                download.got(4096)
                if n % 10_000 == 0:
                    time.sleep(0.05)

        await asyncio.to_thread(chunks)
        download.end(ok=True)

    asyncio.run(run())
    assert 3 <= len(told) <= 30  # its start, its end, and one a tick: not one a chunk
    assert told[-1][2] and told[-1][0]["bytes"] == 100_000 * 4096


def test_staging_reports_only_what_it_downloads(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "data.bin").write_bytes(b"x" * 300_000)
    packed = io.BytesIO()
    archive.pack_path(pkg, packed)
    sha, size = hashlib.sha256(packed.getvalue()).hexdigest(), len(packed.getvalue())
    (blobs / sha).write_bytes(packed.getvalue())

    def fetch(wanted: str, dest: Path, received: Any = None) -> int:
        data = (blobs / wanted).read_bytes()
        dest.write_bytes(data)
        if received is not None:
            received(len(data))
        return len(data)

    stager = Stager(
        BlobCache(tmp_path / "cache", 1 << 30, fetch),
        (),
        archive.Limits(),
        archive.Remembered(tmp_path / "digests.json"),
    )
    inputs = [StagedInput(kind="blob", sha256=sha, size=size, dest=".", label="pkg")]
    for run in ("first", "cached"):
        told: Told = []
        work = tmp_path / run
        work.mkdir()
        asyncio.run(
            stager.stage(
                inputs, work, lambda _msg: None, Download(lambda *s, told=told: told.append(s))
            )
        )
        assert (work / "data.bin").stat().st_size == 300_000
        if run == "first":
            assert told[0][0]["bytes_total"] == size
            assert told[-1][1] is not None and told[-1][1].startswith("inputs downloaded")
        else:
            assert told == []  # a cache hit downloads nothing: nothing to say


def test_inputs_another_job_fetched_meanwhile_are_said_to_come_from_the_cache() -> None:
    told: Told = []
    now = [0.0]
    download = Download(lambda *said: told.append(said), clock=lambda: now[0])
    download.begin(64 * MiB)
    now[0] = 3.2  # it waited on the other job's download of the same blob
    download.end(ok=True)
    assert told[-1][1] == "inputs ready: 64.0 MiB from the worker's cache, in 3.2s"
