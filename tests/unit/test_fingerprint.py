"""Shared-mount digests remembered by the stat data of the tree (archive._fingerprint)."""

from __future__ import annotations

import os
from pathlib import Path

from gpufleet.archive import Remembered, fingerprint, remembered_digest, tree_digest


def _tree(root: Path) -> Path:
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "a.bin").write_bytes(b"a" * 1000)
    (root / "data" / "sub" / "b.txt").write_text("bee")
    return root / "data"


class Counting:
    def __init__(self) -> None:
        self.reads = 0

    def __call__(self, path: Path) -> str:
        self.reads += 1
        return tree_digest(path)


def test_an_unchanged_tree_is_read_once(tmp_path: Path) -> None:
    data, memory, digest = _tree(tmp_path), Remembered(tmp_path / "memo.json"), Counting()
    first = remembered_digest(data, memory, digest)
    again = remembered_digest(data, Remembered(tmp_path / "memo.json"), digest)  # a restart
    assert first == (tree_digest(data), False)
    assert again == (first[0], True)
    assert digest.reads == 1


def test_every_kind_of_change_is_read_again(tmp_path: Path) -> None:
    data, memory, digest = _tree(tmp_path), Remembered(tmp_path / "memo.json"), Counting()
    remembered_digest(data, memory, digest)
    a = data / "a.bin"
    st = a.stat()
    changes = [
        lambda: a.write_bytes(b"b" * 1000),  # same size, new content
        lambda: os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns)),  # mtime set back: ctime moves
        lambda: (data / "sub" / "b.txt").rename(data / "sub" / "c.txt"),
        lambda: (data / "new").write_text(""),
        lambda: a.chmod(0o755),
    ]
    seen = {fingerprint(data)}
    for n, change in enumerate(changes, start=2):
        change()
        value, remembered = remembered_digest(data, memory, digest)
        assert (value, remembered) == (tree_digest(data), False)
        assert digest.reads == n
        seen.add(fingerprint(data))
    assert len(seen) == len(changes) + 1


def test_a_tree_changing_while_it_is_read_is_not_remembered(tmp_path: Path) -> None:
    data, memory = _tree(tmp_path), Remembered(tmp_path / "memo.json")

    def changing(path: Path) -> str:
        value = tree_digest(path)
        (path / "a.bin").write_bytes(b"late")
        return value

    remembered_digest(data, memory, changing)
    assert memory.load() == {}
    assert remembered_digest(data, memory, tree_digest) == (tree_digest(data), False)


def test_an_unreadable_memory_is_an_empty_one(tmp_path: Path) -> None:
    memo = tmp_path / "memo.json"
    memo.write_text("{not json")
    data = _tree(tmp_path)
    assert remembered_digest(data, Remembered(memo), tree_digest) == (tree_digest(data), False)
    assert list(Remembered(memo).load().values()) == [tree_digest(data)]
