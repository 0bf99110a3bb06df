"""Hashing files, and the fanout that writes and hashes a stream at once."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from gpufleet.streams import Fanout, file_hasher, file_sha256


def test_file_sha256_and_a_hasher_that_goes_on_from_a_prefix(tmp_path: Path) -> None:
    data = os.urandom(3_000_001)
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    go_on = file_hasher(tmp_path / "f", 1_234_567)
    go_on.update(data[1_234_567:])
    assert go_on.hexdigest() == hashlib.sha256(data).hexdigest()
    assert file_hasher(tmp_path / "f", 0).hexdigest() == hashlib.sha256().hexdigest()


def test_every_sink_gets_every_buffer_in_order() -> None:
    seen: dict[str, list[int]] = {"a": [], "b": []}
    hasher = hashlib.sha256()
    with Fanout([seen["a"].append, seen["b"].append, hasher.update], depth=3) as fan:
        for i in range(200):
            fan.feed(i.to_bytes(4, "big"))
        fan.wait()
    expected = [i.to_bytes(4, "big") for i in range(200)]
    assert seen["a"] == seen["b"] == expected
    assert hasher.hexdigest() == hashlib.sha256(b"".join(expected)).hexdigest()


def test_no_more_than_depth_buffers_are_held_by_the_sinks() -> None:
    gate = threading.Event()
    taken: list[bytes] = []

    def slow(data: bytes) -> None:
        gate.wait(10)
        taken.append(data)

    fan = Fanout([slow], depth=2)
    try:
        fan.submit(b"1")
        fan.submit(b"2")
        assert not fan.has_room()
        with pytest.raises(RuntimeError, match="no room"):
            fan.submit(b"3")
        gate.set()
        fan.room()
        fan.submit(b"3")
        fan.wait()
    finally:
        gate.set()
        fan.close()
    assert taken == [b"1", b"2", b"3"]


def test_a_failing_sink_breaks_the_stream_for_good() -> None:
    written: list[bytes] = []

    def disk(data: bytes) -> None:
        if data == b"full":
            raise OSError(28, "No space left on device")
        written.append(data)

    with Fanout([disk, hashlib.sha256().update]) as fan:
        fan.feed(b"one")
        fan.feed(b"full")
        with pytest.raises(OSError, match="No space"):
            fan.wait()
        # the error is not swallowed by having been seen once
        with pytest.raises(OSError, match="No space"):
            fan.feed(b"two")
        with pytest.raises(OSError, match="No space"):
            fan.wait()
    assert written == [b"one"]


def test_a_fanout_needs_a_sink() -> None:
    with pytest.raises(ValueError, match="sink"):
        Fanout([])
