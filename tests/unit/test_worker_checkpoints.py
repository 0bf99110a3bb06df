"""A job's checkpoint folder as its worker reads and writes it: what a job may put there
(links, hard links, deep trees, odd names) never makes the worker read or write outside
it, nor stop keeping the folder."""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpufleet.domain.checkpoints import SnapFile, Snapshot
from gpufleet.worker.checkpoints import FolderSync, look, restore


@dataclass
class Sent:
    sent: int


@dataclass
class FakeData:
    """The blob calls a checkpoint folder makes, on a dict."""

    blobs: dict[str, bytes] = field(default_factory=dict)

    def put_blob(self, path: Path, sha256: str | None = None) -> Sent:
        data = path.read_bytes()
        self.blobs[hashlib.sha256(data).hexdigest()] = data
        return Sent(len(data))

    def get_blob(self, sha256: str, dest: Path) -> int:
        dest.write_bytes(self.blobs[sha256])
        return len(self.blobs[sha256])


def _snap(data: FakeData, files: dict[str, bytes]) -> Snapshot:
    listed = []
    for path, body in files.items():
        sha = hashlib.sha256(body).hexdigest()
        data.blobs[sha] = body
        listed.append(SnapFile(path, sha, len(body)))
    return Snapshot(1, "job", 1, 0.0, tuple(listed), {})


def _sync(root: Path, data: FakeData, owner: int | None = None) -> tuple[FolderSync, list[Any]]:
    posted: list[Any] = []

    async def post(files: list[SnapFile], progress: dict[str, int]) -> Snapshot:
        posted.append(files)
        return Snapshot(len(posted), "job", 1, 0.0, tuple(files), progress)

    return FolderSync(root, "ck", data, post, owner=owner), posted  # type: ignore[arg-type]


def test_restore_never_follows_a_link_planted_at_its_staging_folder(tmp_path: Path) -> None:
    # an input (a shared-mount path, linked under the name the worker stages in) points
    # the staging folder elsewhere: the worker, maybe root, must not write or delete there
    root, victim = tmp_path / "job", tmp_path / "victim"
    (root / "ck").mkdir(parents=True)
    victim.mkdir()
    (victim / "keep.txt").write_text("theirs")
    (root / f".gpufleet-restore-{os.getpid()}").symlink_to(victim)
    data = FakeData()
    done, _ = restore(data, _snap(data, {"state.json": b"{}"}), root, "ck")  # type: ignore[arg-type]
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (root / "ck" / "state.json").read_bytes() == b"{}"
    assert done.files == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")
def test_a_file_the_job_user_does_not_own_is_never_sent(tmp_path: Path) -> None:
    # a job (run as uid 4242 by a root worker) hard-links a file only root may read into
    # its folder: O_NOFOLLOW does not see a hard link, the owner check does
    root = tmp_path / "job"
    (root / "ck").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("root's")
    secret.chmod(0o600)
    os.link(secret, root / "ck" / "linked")
    mine = root / "ck" / "mine"
    mine.write_text("job's")
    os.chown(mine, 4242, 4242)
    data = FakeData()
    sync, posted = _sync(root, data, owner=4242)
    asyncio.run(sync.sync({}, settled=False))
    assert [f.path for f in posted[0]] == ["mine"]
    assert b"root's" not in data.blobs.values()
    assert "linked" not in look(root, "ck", owner=4242)


def test_a_deep_tree_is_looked_at_without_failing(tmp_path: Path) -> None:
    # deeper than Python's recursion limit, and than the worker's open files allow
    root = tmp_path / "job"
    (root / "ck").mkdir(parents=True)
    (root / "ck" / "top.pt").write_text("x")
    fd = os.open(root / "ck", os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1200):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    try:
        assert list(look(root, "ck")) == ["top.pt"]
    finally:
        _unnest(root / "ck")


def _unnest(folder: Path) -> None:
    """Remove a chain of nested "d" folders one level at a time (pytest's own cleanup
    recurses, and would fail on it)."""
    while (folder / "d" / "d").exists():
        (folder / "d" / "d").rename(folder / "next")
        (folder / "d").rmdir()
        (folder / "next").rename(folder / "d")
    (folder / "d").rmdir()


def test_a_name_that_is_not_utf8_is_left_out_and_the_rest_kept(tmp_path: Path) -> None:
    root = tmp_path / "job"
    (root / "ck").mkdir(parents=True)
    (root / "ck" / "good\nname").write_text("x")
    with open(os.fsencode(root / "ck") + b"/bad\xff", "wb") as f:
        f.write(b"y")
    data = FakeData()
    sync, posted = _sync(root, data)
    asyncio.run(sync.sync({}, settled=False))
    assert [f.path for f in posted[0]] == ["good\nname"]
