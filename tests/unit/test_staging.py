"""The worker's side of the data plane without a server: its blob cache and staging of
inputs into a job directory. Downloads are a function given to the cache (the SDK in the
real worker); here it copies from a folder of blobs."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet import archive
from gpufleet.errors import ServerUnavailable
from gpufleet.streams import file_sha256
from gpufleet.wire import StagedInput
from gpufleet.worker.cache import BlobCache
from gpufleet.worker.staging import InputError, Stager


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_workers_temp_files_are_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    sha = "a" * 64
    dead, me = dead_pid(), os.getpid()
    (tmp_path / sha).write_bytes(b"a cached blob")
    left = [tmp_path / f".{sha}.{dead}.beef", tmp_path / f".{sha}.{dead}.beef.partial"]
    for p in left:
        p.write_bytes(b"half a download")
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    # written a moment ago by a pid this worker cannot see (another container): kept
    (tmp_path / f".{sha}.{dead}.fade.partial").write_bytes(b"being written")
    (tmp_path / f".{sha}.{me}.cafe.partial").write_bytes(b"a download in progress")
    cache = BlobCache(tmp_path, 1 << 30, fetch=lambda _sha, _dest: 0)
    assert cache.leftovers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [sha, f".{sha}.{dead}.fade.partial", f".{sha}.{me}.cafe.partial"]
    )


def test_a_blob_evicted_by_a_neighbour_at_the_last_moment_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = "c" * 64
    root = tmp_path / "cache"
    fetched: list[str] = []

    def fetch(wanted: str, dest: Path) -> int:
        fetched.append(wanted)
        dest.write_bytes(b"fresh")
        return 5

    cache = BlobCache(root, 1 << 30, fetch)
    (root / sha).write_bytes(b"stale")
    real_utime = os.utime

    def neighbour_evicts_first(path: Path, *args: object) -> None:
        Path(path).unlink(missing_ok=True)  # the neighbour's eviction wins the race
        real_utime(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("gpufleet.worker.cache.os.utime", neighbour_evicts_first)
    path, hit = asyncio.run(cache.get(sha))
    monkeypatch.undo()
    assert (hit, path.read_bytes(), fetched) == (False, b"fresh", [sha])
    cache.release(sha)
    cache.max_bytes = 0
    assert cache.evict() == [sha]  # released: nothing pins it


def test_a_failed_download_does_not_pin_the_blob(tmp_path: Path) -> None:
    sha = "b" * 64

    def unreachable(_sha: str, _dest: Path) -> int:
        raise ServerUnavailable("server down")

    cache = BlobCache(tmp_path / "cache", 0, fetch=unreachable)
    with pytest.raises(ServerUnavailable):
        asyncio.run(cache.get(sha))
    (tmp_path / "cache" / sha).write_bytes(b"x")  # arrived later, by a neighbour
    assert cache.evict() == [sha]  # not held in use by the failed try


def test_a_package_is_not_unpacked_through_a_shared_input_link(tmp_path: Path) -> None:
    shared = tmp_path / "mnt" / "digits"
    shared.mkdir(parents=True)
    (shared / "train.csv").write_text("1,2,3\n")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    src = tmp_path / "pkg"
    src.mkdir()
    (src / "evil.txt").write_text("written into the shared dataset?")
    packed = io.BytesIO()
    archive.pack_path(src, packed)
    sha = hashlib.sha256(packed.getvalue()).hexdigest()
    (blobs / sha).write_bytes(packed.getvalue())

    def fetch(wanted: str, dest: Path) -> int:
        dest.write_bytes((blobs / wanted).read_bytes())
        return dest.stat().st_size

    stager = Stager(
        BlobCache(tmp_path / "cache", 1 << 30, fetch),
        (str(tmp_path / "mnt"),),
        archive.Limits(),
        archive.Remembered(tmp_path / "mount-digests.json"),
    )
    work = tmp_path / "job"
    work.mkdir()
    inputs = [
        StagedInput(
            kind="path",
            dest="data",
            sha256=archive.tree_digest(shared),
            path=str(shared),
            label="shared",
        ),
        StagedInput(kind="blob", dest="data", sha256=sha, label="pkg"),
    ]
    with pytest.raises(InputError, match="link"):
        asyncio.run(stager.stage(inputs, work, lambda _msg: None))
    assert sorted(p.name for p in shared.iterdir()) == ["train.csv"]
    assert file_sha256(shared / "train.csv") == hashlib.sha256(b"1,2,3\n").hexdigest()
