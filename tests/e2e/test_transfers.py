"""Blob transfers through the SDK against a real server: downloads over both of its HTTP
paths, direct (``http.client``) and through a proxy (httpx), and uploads. A relay between
client and server cuts connections the way a flaky network does, and counts what crossed."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pty
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufleet.client import Client
from gpufleet.client._transfer import Sent
from gpufleet.config import load_token
from gpufleet.errors import HashMismatch, NotFound
from tests.e2e.conftest import Fleet
from tests.e2e.relay import Relay

MIB = 1 << 20


@dataclass
class Served:
    url: str
    token: str | None
    data: bytes
    sha256: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@pytest.fixture
def served(fleet: Fleet, tmp_path: Path) -> Served:
    """A real server holding one 8 MiB blob."""
    url = fleet.start_server()
    data = os.urandom(8 * MIB)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    with fleet.client() as c:
        sha = c.put_blob(src).sha256
    return Served(url, load_token(url), data, sha)


@pytest.fixture(params=["direct", "proxied"])
def through(
    request: pytest.FixtureRequest, served: Served, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Client, Relay, str]]:
    """A client whose every connection goes through a relay: as its server URL (the
    direct path), or as its HTTP proxy (the httpx path). The first connection is cut
    after 3 MiB."""
    relay = Relay(served.port, cuts=[3 * MIB])
    for name in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    if request.param == "proxied":
        monkeypatch.setenv("HTTP_PROXY", relay.url)
        client = Client(served.url, served.token)
    else:
        client = Client(relay.url, served.token)
    try:
        yield client, relay, request.param
    finally:
        client.close()
        relay.close()


def test_a_download_cut_mid_way_resumes_where_it_stopped(
    served: Served, through: tuple[Client, Relay, str], tmp_path: Path
) -> None:
    client, relay, path = through
    dest = tmp_path / "got.bin"
    received = client.get_blob(served.sha256, dest)
    # a proxy is sent the whole URL; the server itself, just the path
    head = bytes(relay.legs[0].sent).split(b"\r\n\r\n")[0].split(b"\r\n")
    expected = b"GET http://" if path == "proxied" else b"GET /v1/blobs/"
    assert head[0].startswith(expected), head[0]
    if path == "direct":  # the stored bytes, no content coding, asked for exactly once
        codings = [h for h in head if h.lower().startswith(b"accept-encoding:")]
        assert [h.lower() for h in codings] == [b"accept-encoding: identity"], codings
    assert dest.read_bytes() == served.data
    assert not dest.with_name("got.bin.partial").exists()
    # The second request asked for the rest, from exactly where the cut left the file:
    # no byte crossed twice.
    blob_legs = [(leg, r) for leg, r in zip(relay.legs, relay.ranges(), strict=True) if leg.head]
    first, second = blob_legs[0][0], blob_legs[-1][0]
    assert 0 < first.body < len(served.data)
    assert blob_legs[-1][1] == f"bytes={first.body}-"
    assert second.body == len(served.data) - first.body
    assert received == len(served.data)


def test_a_partial_file_from_an_earlier_try_is_resumed(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    dest = tmp_path / "got.bin"
    half = len(served.data) // 2
    dest.with_name("got.bin.partial").write_bytes(served.data[:half])
    with fleet.client() as c:
        received = c.get_blob(served.sha256, dest)
    assert received == len(served.data) - half
    assert dest.read_bytes() == served.data


def test_a_complete_partial_file_is_verified_and_kept(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    dest = tmp_path / "got.bin"
    dest.with_name("got.bin.partial").write_bytes(served.data)
    with fleet.client() as c:
        assert c.get_blob(served.sha256, dest) == 0
    assert dest.read_bytes() == served.data


def test_a_partial_file_with_wrong_bytes_is_refused_and_removed(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    dest = tmp_path / "got.bin"
    wrong = bytearray(served.data[: 3 * MIB])
    wrong[1000] ^= 0xFF
    dest.with_name("got.bin.partial").write_bytes(wrong)
    with fleet.client() as c, pytest.raises(HashMismatch, match=served.sha256):
        c.get_blob(served.sha256, dest)
    assert list(tmp_path.glob("got.bin*")) == []
    # nothing stale is left to poison the next try, which succeeds
    with fleet.client() as c:
        c.get_blob(served.sha256, dest)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == served.sha256


def test_an_unknown_blob_is_named_and_nothing_is_written(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    missing = "0" * 64
    with fleet.client() as c, pytest.raises(NotFound, match=missing):
        c.get_blob(missing, tmp_path / "got.bin")
    assert list(tmp_path.glob("got.bin*")) == []


def _put_through(relay: Relay, served: Served, src: Path) -> Sent:
    """``src`` uploaded by a client whose connections go through ``relay`` (closed after)."""
    try:
        with Client(relay.url, served.token) as c:
            return c.put_blob(src)
    finally:
        relay.close()


def test_an_upload_cut_mid_way_resumes_from_what_the_server_kept(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    relay = Relay(served.port, cuts=[], up_cuts=[12 * MIB])
    data = os.urandom(40 * MIB)  # over the size that goes through a resumable session
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    sent = _put_through(relay, served, src)
    assert sent.sha256 == hashlib.sha256(data).hexdigest()
    offsets = [
        int(line.split(b":")[1])
        for leg in relay.legs
        for line in bytes(leg.sent).split(b"\r\n")
        if line.lower().startswith(b"upload-offset:")
    ]
    # the first PATCH started at 0; a later one went on from what the server had kept
    assert offsets[0] == 0 and 0 < offsets[-1] <= 12 * MIB, offsets
    assert relay.legs[0].up == 12 * MIB
    # no restart from zero: after the cut, about the rest of the file crossed, no more
    assert sum(leg.up for leg in relay.legs[1:]) < len(data) - offsets[-1] + MIB
    back = tmp_path / "back.bin"
    with fleet.client() as c:
        c.get_blob(sent.sha256, back)
    assert back.read_bytes() == data


def test_an_upload_whose_last_answer_is_lost_is_not_sent_again(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    relay = Relay(served.port, cuts=[], drop_answer_with=b'"complete":true')
    data = os.urandom(40 * MIB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    sent = _put_through(relay, served, src)  # the session is gone; the server has the blob: done
    assert sent.sha256 == hashlib.sha256(data).hexdigest() and sent.sent == len(data)
    assert sum(leg.up for leg in relay.legs) < len(data) + MIB  # sent once
    with fleet.client() as c:
        assert c.has_blob(sent.sha256) == len(data)


def test_a_large_file_is_sent_while_hashed_and_named_by_what_the_server_received(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    data = os.urandom(40 * MIB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    relay = Relay(served.port, cuts=[])
    sent = _put_through(relay, served, src)
    assert sent.sha256 == hashlib.sha256(data).hexdigest() and sent.sent == len(data)
    # the session was opened without a hash: nothing waited for the file to be hashed
    opened = [bytes(leg.sent) for leg in relay.legs if b"POST /v1/uploads" in leg.sent]
    assert opened and b'"sha256":null' in opened[0].replace(b" ", b"")
    back = tmp_path / "back.bin"
    with fleet.client() as c:
        c.get_blob(sent.sha256, back)
    assert back.read_bytes() == data


def test_sending_stops_once_the_hash_shows_the_server_has_the_file(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    data = os.urandom(40 * MIB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    with fleet.client() as c:
        first = c.put_blob(src)  # someone sent it before
    copy = tmp_path / "copy.bin"  # the same bytes, never hashed on this side
    copy.write_bytes(data)
    # 4 s for the whole file: the hash (on a core nothing else wants) needs far less
    relay = Relay(served.port, cuts=[], up_rate=10 * MIB)
    again = _put_through(relay, served, copy)
    assert again.sha256 == first.sha256 and again.size == len(data)
    assert again.sent < len(data) - 10 * MIB, again  # it stopped a second or more early
    with fleet.client() as c:  # the abandoned session went; the blob stays
        assert c.has_blob(first.sha256) == len(data)
    assert list((fleet.root / "data" / "blobs" / "uploads").iterdir()) == []


def test_a_file_written_while_it_is_sent_is_refused_by_name(
    served: Served, fleet: Fleet, tmp_path: Path
) -> None:
    src = tmp_path / "ckpt.bin"
    src.write_bytes(os.urandom(40 * MIB))
    relay = Relay(served.port, cuts=[], up_rate=20 * MIB)  # 2 s for the whole file
    outcome: list[BaseException | Sent] = []

    def put() -> None:
        try:
            with Client(relay.url, served.token) as c:
                outcome.append(c.put_blob(src))
        except BaseException as exc:
            outcome.append(exc)

    sender = threading.Thread(target=put)
    sender.start()
    try:
        deadline = time.monotonic() + 20
        while not any(leg.up > 4 * MIB for leg in relay.legs) and time.monotonic() < deadline:
            time.sleep(0.02)
        with open(src, "r+b") as f:  # a training run rewrites its checkpoint meanwhile
            f.seek(30 * MIB)
            f.write(os.urandom(MIB))
        sender.join(60)
    finally:
        relay.close()
    assert len(outcome) == 1 and isinstance(outcome[0], HashMismatch), outcome
    assert f"{src} changed while it was sent" in outcome[0].message


def test_a_re_put_of_an_unchanged_file_neither_reads_nor_sends_it(
    served: Served, fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpufleet.archive import Remembered
    from gpufleet.client import _transfer
    from gpufleet.client._packages import put_remembered

    reads: list[Path] = []  # the file read to hash it, before or while it is sent
    real, ahead = _transfer.file_sha256, _transfer._Ahead
    monkeypatch.setattr(_transfer, "file_sha256", lambda p: reads.append(p) or real(p))
    monkeypatch.setattr(_transfer, "_Ahead", lambda p, has: reads.append(p) or ahead(p, has))
    memory = Remembered(tmp_path / "blobs.json")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(40 * MIB))
    with fleet.client() as c:
        first = put_remembered(c, src, remembered=memory)
        again = put_remembered(c, src, remembered=memory)
        assert first.sent == 40 * MIB and len(reads) == 1  # hashed while it was sent
        assert again == _transfer.Sent(first.sha256, 40 * MIB, 0) and len(reads) == 1
        changed = os.urandom(40 * MIB)  # same size, new content (and mtime, ctime)
        src.write_bytes(changed)
        third = put_remembered(c, src, remembered=memory)
    assert third.sha256 == hashlib.sha256(changed).hexdigest() and third.sent == 40 * MIB
    assert len(reads) == 2


def _cli_on_a_terminal(fleet: Fleet, *args: str) -> bytes:
    """Run the CLI with its stderr on a pseudo-terminal; what the terminal showed."""
    primary, secondary = pty.openpty()
    shown = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):  # EIO once the child's side is closed
            while data := os.read(primary, 65536):
                shown.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpufleet", *args],
            env={**fleet.env, "TERM": "xterm-256color", "COLUMNS": "120"},
            stdout=subprocess.PIPE,
            stderr=secondary,
            timeout=120,
            check=True,
        )
    finally:
        os.close(secondary)
        reader.join(10)
        os.close(primary)
    assert done.stdout  # the hash or the JSON, on stdout either way
    return bytes(shown)


def test_progress_bars_show_on_a_terminal_and_never_with_json_or_off_one(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(48 * MIB))
    quiet = _cli_on_a_terminal(fleet, "blobs", "put", "--json", str(big))
    assert b"upload big.bin" not in quiet and b"\x1b[" not in quiet
    big.write_bytes(os.urandom(48 * MIB))
    shown = _cli_on_a_terminal(fleet, "blobs", "put", str(big))
    assert b"upload big.bin" in shown and b"MiB" in shown
    big.write_bytes(os.urandom(48 * MIB))
    piped = fleet.cli("blobs", "put", str(big))  # stderr is a pipe here, not a terminal
    assert "upload big.bin" not in piped.stderr and "\x1b[" not in piped.stderr
