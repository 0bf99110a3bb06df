"""Package and artifact archives: deterministic packing, and unpacking that refuses attacks."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import stat
import tarfile
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet import archive
from gpufleet.archive import (
    Entry,
    Limits,
    extract,
    merge_into,
    pack_outputs,
    pack_path,
    scan,
    tree_digest,
)
from gpufleet.errors import GpufleetError, InsufficientStorage, UnsafeArchive

Member = tuple[tarfile.TarInfo, bytes]


# --- helpers -------------------------------------------------------------------------------


def member(
    name: str,
    data: bytes = b"",
    *,
    kind: bytes = tarfile.REGTYPE,
    mode: int = 0o644,
    link: str = "",
    pax: dict[str, str] | None = None,
) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = len(data)
    info.linkname = link
    if pax:
        info.pax_headers = pax
    return info, data


def tar_zst(members: list[Member]) -> bytes:
    """A hand-built archive: any member tarfile can write, however hostile."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return zstandard.ZstdCompressor().compress(raw.getvalue())


def pack(src: Path, **kwargs: object) -> bytes:
    out = io.BytesIO()
    pack_path(src, out, **kwargs)  # type: ignore[arg-type]
    return out.getvalue()


def unpacked(blob: bytes) -> bytes:
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)) as reader:
        return reader.read()


def listing(root: Path) -> dict[str, tuple[str, object, int]]:
    """Every path under root: kind, content (or link target) and permission bits."""
    found: dict[str, tuple[str, object, int]] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        mode = path.lstat().st_mode
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path), 0)
        elif path.is_dir():
            found[rel] = ("dir", None, stat.S_IMODE(mode))
        else:
            found[rel] = ("file", path.read_bytes(), stat.S_IMODE(mode))
    return found


def assert_refused(
    blob: bytes, tmp_path: Path, rule: str, limits: Limits = Limits(), size: int | None = None
) -> None:
    """scan and extract both refuse; nothing appears anywhere, not even a temp dir."""
    with pytest.raises(UnsafeArchive, match=rule):
        scan(io.BytesIO(blob), limits, size)
    area = tmp_path / "area"
    parent = area / "parent"
    parent.mkdir(parents=True)
    dest = parent / "dest"
    with pytest.raises(UnsafeArchive, match=rule):
        extract(io.BytesIO(blob), dest, limits, size)
    assert not os.path.lexists(dest)
    assert list(parent.iterdir()) == []
    assert [p.name for p in area.iterdir()] == ["parent"], "something was written outside dest"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A folder with nested and empty dirs, an exec file, links, unicode and empty files."""
    root = tmp_path / "tree"
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a" / "b" / "c.txt").write_text("deep\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "private.bin").write_bytes(bytes(range(256)))
    (root / "private.bin").chmod(0o600)
    (root / "zero").write_bytes(b"")
    (root / "ünï cødé.txt").write_text("ü")
    (root / "link").symlink_to("a/b/c.txt")
    (root / "a" / "up").symlink_to("../run.sh")
    (root / "a" / "dirlink").symlink_to("b")
    return root


EXPECTED_TREE = {
    "a": ("dir", None, 0o755),
    "a/b": ("dir", None, 0o755),
    "a/b/c.txt": ("file", b"deep\n", 0o644),
    "a/dirlink": ("link", "b", 0),
    "a/up": ("link", "../run.sh", 0),
    "empty": ("dir", None, 0o755),
    "link": ("link", "a/b/c.txt", 0),
    "private.bin": ("file", bytes(range(256)), 0o644),
    "run.sh": ("file", b"#!/bin/sh\necho hi\n", 0o755),
    "zero": ("file", b"", 0o644),
    "ünï cødé.txt": ("file", "ü".encode(), 0o644),
}


# --- packing -------------------------------------------------------------------------------


def test_round_trip_keeps_files_modes_links_and_empty_dirs(tree: Path, tmp_path: Path) -> None:
    blob = pack(tree)
    packed = extract(io.BytesIO(blob), tmp_path / "out", compressed_size=len(blob))
    assert listing(tmp_path / "out") == EXPECTED_TREE
    assert packed.files == 5 and packed.bytes == 5 + 256 + 18 + 2
    assert Entry("a/dirlink", 0, "link") in packed.entries


def test_entries_sorted_dirs_first_and_metadata_normalized(tree: Path) -> None:
    blob = pack(tree)
    with tarfile.open(fileobj=io.BytesIO(unpacked(blob))) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(EXPECTED_TREE)
    assert names.index("a") < names.index("a/b") < names.index("a/b/c.txt")
    for m in members:
        assert (m.uid, m.gid, m.uname, m.gname, m.mtime) == (0, 0, "", "", 0)
    assert scan(io.BytesIO(blob)).entries == tuple(
        Entry(n, len(c) if isinstance(c, bytes) else 0, k) for n, (k, c, _) in EXPECTED_TREE.items()
    )


def test_same_content_gives_identical_bytes(tree: Path, tmp_path: Path) -> None:
    first = pack(tree)
    assert pack(tree) == first
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy, symlinks=True)
    for path in copy.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000), follow_symlinks=False)
        if os.geteuid() == 0:
            os.lchown(path, 1234, 5678)
    (copy / "private.bin").chmod(0o640)
    assert pack(copy) == first
    assert hashlib.sha256(pack(copy)).hexdigest() == hashlib.sha256(first).hexdigest()
    (copy / "zero").write_bytes(b"x")
    assert pack(copy) != first


def test_excludes_and_gpufleetignore(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    for rel in (".git/HEAD", "__pycache__/m.cpython-311.pyc", "pkg/m.pyc", ".DS_Store"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    for rel in ("data/raw/big.bin", "data/keep.csv", "train.py", "run.log", "pkg/m.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    (root / ".gpufleetignore").write_text("# local junk\n*.log\n\ndata/raw/\n")
    paths = [e.path for e in pack_path(root, io.BytesIO()).entries]
    assert paths == [
        ".gpufleetignore",
        "data",
        "data/keep.csv",
        "pkg",
        "pkg/m.py",
        "train.py",
    ]
    custom = pack_path(root, io.BytesIO(), excludes=("pkg",)).entries
    assert ".git/HEAD" in [e.path for e in custom] and "pkg" not in [e.path for e in custom]


def test_single_file_is_stored_under_its_name(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"weights")
    blob = pack(tmp_path / "model.pt")
    extract(io.BytesIO(blob), tmp_path / "out")
    assert listing(tmp_path / "out") == {"model.pt": ("file", b"weights", 0o644)}


def test_absolute_link_inside_the_folder_becomes_relative(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    (root / "sub").mkdir(parents=True)
    (root / "data.txt").write_text("d")
    (root / "sub" / "latest").symlink_to(root / "data.txt")
    extract(io.BytesIO(pack(root)), tmp_path / "out")
    assert os.readlink(tmp_path / "out" / "sub" / "latest") == "../data.txt"
    assert (tmp_path / "out" / "sub" / "latest").read_text() == "d"


@pytest.mark.parametrize("target", ["../outside", "/etc/passwd", "a/../../x"])
def test_pack_refuses_a_link_leaving_the_folder(tmp_path: Path, target: str) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "bad").symlink_to(target)
    with pytest.raises(UnsafeArchive, match=r"proj/bad -> .*link leaves the folder"):
        pack_path(root, io.BytesIO())


def test_pack_refuses_a_fifo(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    os.mkfifo(root / "pipe")
    with pytest.raises(UnsafeArchive, match=r"proj/pipe: fifo cannot go in an archive"):
        pack_path(root, io.BytesIO())


def test_pack_names_a_missing_path(tmp_path: Path) -> None:
    with pytest.raises(GpufleetError, match=r"nope does not exist"):
        pack_path(tmp_path / "nope", io.BytesIO())


def write_zip(path: Path, entries: list[tuple[str, bytes, int]]) -> None:
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as zf:
        warnings.simplefilter("ignore")  # zipfile warns about the duplicates we write on purpose
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, data)


def test_zip_converts_to_the_same_archive_as_the_folder(tmp_path: Path) -> None:
    write_zip(
        tmp_path / "p.zip",
        [
            ("sub/b.txt", b"b", 0o100644),
            ("a.txt", b"a", 0o100644),
            ("run.sh", b"#!", 0o100755),
            ("empty/", b"", 0o040755),
            ("ln", b"sub/b.txt", 0o120777),
        ],
    )
    root = tmp_path / "p"
    (root / "sub").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "sub" / "b.txt").write_text("b")
    (root / "a.txt").write_text("a")
    (root / "run.sh").write_text("#!")
    (root / "run.sh").chmod(0o755)
    (root / "ln").symlink_to("sub/b.txt")
    assert pack(tmp_path / "p.zip") == pack(root)
    assert tree_digest(tmp_path / "p.zip") == tree_digest(root)


@pytest.mark.parametrize(
    ("entries", "rule"),
    [
        ([("../x", b"x", 0o100644)], r"'\.\.' component"),
        ([("/abs", b"x", 0o100644)], "absolute path"),
        ([("a", b"1", 0o100644), ("a", b"2", 0o100644)], "duplicate name"),
        ([("ln", b"../../etc", 0o120777)], "leaves the zip"),
        ([("ln", b"d", 0o120777), ("ln/x", b"1", 0o100644)], "is a link"),
        ([("dev", b"", 0o020644)], "character device"),
    ],
)
def test_zip_with_unsafe_entries_is_refused_at_pack_time(
    tmp_path: Path, entries: list[tuple[str, bytes, int]], rule: str
) -> None:
    write_zip(tmp_path / "bad.zip", entries)
    with pytest.raises(UnsafeArchive, match=rule):
        pack_path(tmp_path / "bad.zip", io.BytesIO())


def test_a_broken_zip_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad.zip").write_bytes(b"not a zip")
    with pytest.raises(GpufleetError, match=r"bad\.zip is not a valid zip"):
        pack_path(tmp_path / "bad.zip", io.BytesIO())


# --- pack_outputs --------------------------------------------------------------------------


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "job"
    for rel in ("outputs/ckpt/1.pt", "outputs/log.txt", "model.pt", "ckpt/a.pt", "ckpt/a.txt"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(rel)
    (work / "outputs" / "leak").symlink_to("/etc")
    (work / "outputs" / "best").symlink_to("ckpt/1.pt")
    os.mkfifo(work / "outputs" / "pipe")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.pt").write_text("s")
    (work / "linked").symlink_to(outside)
    return work


def test_pack_outputs_globs_dedups_and_skips_what_leaves(workdir: Path, tmp_path: Path) -> None:
    out = io.BytesIO()
    patterns = ["outputs", "outputs/**", "*.pt", "ckpt/*.pt", "linked/*.pt", "nothing/*"]
    packed = pack_outputs(workdir, patterns, out)
    assert [e.path for e in packed.entries] == [
        "ckpt",
        "ckpt/a.pt",
        "model.pt",
        "outputs",
        "outputs/best",
        "outputs/ckpt",
        "outputs/ckpt/1.pt",
        "outputs/log.txt",
    ]
    assert packed.skipped == (
        "outputs/leak -> /etc: link leaves the job directory",
        "outputs/pipe: fifo cannot go in an archive",
    )
    extract(io.BytesIO(out.getvalue()), tmp_path / "got")
    assert (tmp_path / "got" / "outputs" / "best").read_text() == "outputs/ckpt/1.pt"


def test_pack_outputs_with_no_match_is_empty(workdir: Path) -> None:
    out = io.BytesIO()
    packed = pack_outputs(workdir, ["*.onnx"], out)
    assert (packed.entries, packed.files, packed.bytes) == ((), 0, 0)
    assert scan(io.BytesIO(out.getvalue())).entries == ()


@pytest.mark.parametrize("pattern", ["/etc/*", "../x", "outputs/../../x", "C:\\x"])
def test_pack_outputs_refuses_patterns_leaving_the_workdir(workdir: Path, pattern: str) -> None:
    with pytest.raises(UnsafeArchive, match="output pattern"):
        pack_outputs(workdir, [pattern], io.BytesIO())


def test_pack_outputs_skips_a_link_escaping_through_another_link(tmp_path: Path) -> None:
    work = tmp_path / "job"
    (work / "out" / "a" / "b").mkdir(parents=True)
    (work / "out" / "a" / "b" / "c").symlink_to("../..")  # resolves to out/, inside
    (work / "out" / "e").symlink_to("a/b/c/../../..")  # lexically out/a, really job's parent
    packed = pack_outputs(work, ["out"], io.BytesIO())
    assert [s.split(":")[0] for s in packed.skipped] == ["out/e -> a/b/c/../../.."]
    assert "out/a/b/c" in [e.path for e in packed.entries]


# --- attacks: scan and extract both refuse, nothing is left behind ------------------------

ATTACKS: dict[str, tuple[list[Member], str]] = {
    "absolute path": ([member("/tmp/evil", b"x")], "absolute path"),
    "dotdot": ([member("../evil", b"x")], r"'\.\.' component"),
    "dotdot deep": ([member("a/../../evil", b"x")], r"'\.\.' component"),
    "absolute link": ([member("l", kind=tarfile.SYMTYPE, link="/etc")], "absolute link"),
    "relative link out": (
        [
            member("d", kind=tarfile.DIRTYPE, mode=0o755),
            member("d/l", kind=tarfile.SYMTYPE, link="../.."),
        ],
        "leaves the archive root",
    ),
    "through a link": (
        [member("l", kind=tarfile.SYMTYPE, link="."), member("l/evil", b"x")],
        "'l' is a link",
    ),
    "link after its children": (
        [member("d/evil", b"x"), member("d", kind=tarfile.SYMTYPE, link="sub")],
        "earlier members use this name as a directory",
    ),
    "link chain": (
        [
            member("a/b", kind=tarfile.DIRTYPE, mode=0o755),
            member("a/b/c", kind=tarfile.SYMTYPE, link="../.."),
            member("e", kind=tarfile.SYMTYPE, link="a/b/c/.."),
        ],
        "through other links",
    ),
    "hard link": ([member("h", kind=tarfile.LNKTYPE, link="/etc/passwd")], "hard link"),
    "char device": ([member("c", kind=tarfile.CHRTYPE)], "character device"),
    "block device": ([member("b", kind=tarfile.BLKTYPE)], "block device"),
    "fifo": ([member("f", kind=tarfile.FIFOTYPE)], "fifo"),
    "other type": ([member("x", kind=b"V")], "member type"),
    "setuid": ([member("s", b"x", mode=0o4755)], "setuid"),
    "setgid dir": ([member("d", kind=tarfile.DIRTYPE, mode=0o2755)], "setgid"),
    "sticky": ([member("d", kind=tarfile.DIRTYPE, mode=0o1777)], "sticky"),
    "duplicate": ([member("a", b"1"), member("a", b"2")], "duplicate name"),
    "duplicate spelled differently": ([member("a/b", b"1"), member("./a//b", b"2")], "duplicate"),
    "file then dir of same name": (
        [member("a", b"1"), member("a/b", b"2")],
        "'a' is a file",
    ),
    "nul name": ([member("x", b"x", pax={"path": "a\x00b"})], "NUL byte"),
    "empty name": ([member("", b"x")], "empty name"),
    "root as a file": ([member("./", b"x")], "archive root itself"),
    "windows drive": ([member("C:\\evil", b"x")], "Windows absolute"),
    "windows backslash": ([member("\\evil", b"x")], "Windows absolute"),
    "backslash inside": ([member("a\\..\\..\\evil", b"x")], "backslash"),
    # cheap to send, costly to check if every parent were spelled out
    "too deep": ([member("a/" * 2000 + "f", b"x")], "levels of folders"),
    "name too long": ([member("n" * 5000, b"x")], "longer than 4096 bytes"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_is_refused_and_leaves_nothing(tmp_path: Path, attack: str) -> None:
    members, rule = ATTACKS[attack]
    assert_refused(tar_zst([member("ok.txt", b"fine"), *members]), tmp_path, rule)


def test_deep_but_real_trees_unpack(tmp_path: Path) -> None:
    deep = "/".join(f"level{i}" for i in range(200)) + "/leaf.txt"
    dest = tmp_path / "out"
    extract(io.BytesIO(tar_zst([member(deep, b"found me")])), dest)
    assert (dest / deep).read_bytes() == b"found me"


def test_too_many_files(tmp_path: Path) -> None:
    blob = tar_zst([member(f"f{i}", b"x") for i in range(5)])
    assert_refused(blob, tmp_path, "more than 3 entries", Limits(max_files=3))
    assert scan(io.BytesIO(blob), Limits(max_files=5)).files == 5


def test_bytes_over_the_limit_stop_at_the_member_that_passes_it(tmp_path: Path) -> None:
    blob = tar_zst([member(f"f{i}", bytes(600 << 10)) for i in range(3)])
    assert_refused(blob, tmp_path, "'f1': unpacked size passes", Limits(max_bytes=1 << 20))


def test_ratio_limit_applies_past_the_floor(tmp_path: Path) -> None:
    blob = tar_zst([member("zeros", bytes(4 << 20))])
    limits = Limits(max_ratio=10.0, ratio_floor=1 << 20)
    assert_refused(blob, tmp_path, "unpacked size passes", limits, size=len(blob))
    assert scan(io.BytesIO(blob), limits).bytes == 4 << 20, "without a size, only max_bytes"


def test_limits_allowed() -> None:
    limits = Limits(max_bytes=10_000, max_ratio=10.0, ratio_floor=100)
    assert limits.allowed(None) == 10_000
    assert limits.allowed(5) == 100
    assert limits.allowed(50) == 500
    assert limits.allowed(5_000) == 10_000
    assert Limits().allowed(1 << 20) == 1 << 30


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """3 GiB of zeros in one member, compressed to about 100 KB."""
    info = tarfile.TarInfo("zeros")
    info.size = 3 << 30
    compressor = zstandard.ZstdCompressor(level=3).compressobj()
    parts = [compressor.compress(info.tobuf(tarfile.PAX_FORMAT))]
    mib = bytes(1 << 20)
    parts += [compressor.compress(mib) for _ in range(3 << 10)]
    parts.append(compressor.flush())
    return b"".join(parts)


def test_bomb_at_default_limits_stops_at_once(bomb: bytes, tmp_path: Path) -> None:
    assert len(bomb) < 4 << 20
    started = time.monotonic()
    assert_refused(bomb, tmp_path, "'zeros': unpacked size passes", size=len(bomb))
    assert time.monotonic() - started < 5, "the data must not be decompressed"


def test_oversized_tar_headers_are_cut_off(tmp_path: Path) -> None:
    blob = tar_zst([member("ok", b"x", pax={"comment": "x" * (3 << 20)})])
    assert_refused(blob, tmp_path, "expands past")


def test_corrupt_stream_is_refused(tmp_path: Path) -> None:
    assert_refused(os.urandom(4096), tmp_path, "not a valid gpufleet archive")


def test_zstd_of_something_else_is_refused(tmp_path: Path) -> None:
    blob = zstandard.ZstdCompressor().compress(b"hello " * 1000)
    assert_refused(blob, tmp_path, "not a valid gpufleet archive")


def test_truncated_archive_is_refused(tree: Path, tmp_path: Path) -> None:
    (tree / "big.bin").write_bytes(os.urandom(300_000))
    blob = pack(tree)
    assert_refused(blob[: len(blob) // 2], tmp_path, "not a valid gpufleet archive")


def test_archive_cut_between_members_is_refused(tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for info, data in (member("a", b"1"), member("b", b"2")):
            tar.addfile(info, io.BytesIO(data))
    cut = zstandard.ZstdCompressor().compress(raw.getvalue()[:1024])  # "a" and nothing after
    assert_refused(cut, tmp_path, "damaged or missing tar header")


def test_extract_refuses_an_existing_dest(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_text("mine")
    with pytest.raises(GpufleetError, match="already exists"):
        extract(io.BytesIO(pack(tree)), dest)
    assert listing(dest) == {"keep": ("file", b"mine", 0o644)}


def test_full_disk_becomes_insufficient_storage(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(src: object, fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(archive._unpack, "_copy_to_fd", no_space)
    parent = tmp_path / "cache"
    parent.mkdir()
    with pytest.raises(InsufficientStorage, match="no space left on device while unpacking"):
        extract(io.BytesIO(pack(tree)), parent / "pkg")
    assert list(parent.iterdir()) == []


def test_dot_slash_names_and_root_entry_are_accepted(tmp_path: Path) -> None:
    blob = tar_zst(
        [member("./", kind=tarfile.DIRTYPE, mode=0o755), member("./a/b.txt", b"b", mode=0o755)]
    )
    packed = extract(io.BytesIO(blob), tmp_path / "out")
    assert [e.path for e in packed.entries] == ["a/b.txt"]
    assert listing(tmp_path / "out") == {
        "a": ("dir", None, 0o755),
        "a/b.txt": ("file", b"b", 0o755),
    }


# --- merge, digest, hashing ----------------------------------------------------------------


def make(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_merge_into_merges_directories(tmp_path: Path) -> None:
    src, target = tmp_path / "src", tmp_path / "target"
    make(src, {"a.txt": "a", "shared/new.txt": "n", "only/x": "x"})
    make(target, {"shared/old.txt": "o", "mine": "m"})
    merge_into(src, target)
    assert not src.exists()
    assert {k: v[1] for k, v in listing(target).items() if v[0] == "file"} == {
        "a.txt": b"a",
        "mine": b"m",
        "only/x": b"x",
        "shared/new.txt": b"n",
        "shared/old.txt": b"o",
    }


def test_merge_into_a_new_target(tmp_path: Path) -> None:
    make(tmp_path / "src", {"d/f": "f"})
    merge_into(tmp_path / "src", tmp_path / "new" / "target")
    assert (tmp_path / "new" / "target" / "d" / "f").read_text() == "f"


@pytest.mark.parametrize(
    ("theirs", "clash"),
    [
        ({"a.txt": "other"}, "a.txt"),
        ({"shared/new.txt": "x"}, "shared/new.txt"),
        ({"only": "f"}, "only"),
    ],
)
def test_merge_into_clash_moves_nothing(tmp_path: Path, theirs: dict[str, str], clash: str) -> None:
    src, target = tmp_path / "src", tmp_path / "target"
    make(src, {"a.txt": "a", "shared/new.txt": "n", "only/x": "x", "fresh": "f"})
    make(target, {"shared/old.txt": "o", **theirs})
    before = (listing(src), listing(target))
    with pytest.raises(GpufleetError, match=f"both provide {clash}"):
        merge_into(src, target)
    assert (listing(src), listing(target)) == before


def test_merge_into_needs_directories(tmp_path: Path) -> None:
    make(tmp_path, {"src/a": "a", "file": "f"})
    with pytest.raises(GpufleetError, match="file is not a directory"):
        merge_into(tmp_path / "src", tmp_path / "file")
    with pytest.raises(GpufleetError, match="missing is not a directory"):
        merge_into(tmp_path / "missing", tmp_path / "target")
    assert (tmp_path / "src" / "a").read_text() == "a"


def test_tree_digest_follows_content_not_mtime(tree: Path) -> None:
    digest = tree_digest(tree)
    assert digest == hashlib.sha256(unpacked(pack(tree))).hexdigest()
    os.utime(tree / "run.sh", (5, 5))
    assert tree_digest(tree) == digest
    data = bytearray((tree / "private.bin").read_bytes())
    data[100] ^= 1
    (tree / "private.bin").write_bytes(bytes(data))
    assert tree_digest(tree) != digest
    assert len(tree_digest(tree / "run.sh")) == 64


def test_copy_hashing(tmp_path: Path) -> None:
    data = os.urandom(3_000_001)
    dst = io.BytesIO()
    assert archive.copy_hashing(io.BytesIO(data), dst, chunk=1 << 16) == (
        hashlib.sha256(data).hexdigest(),
        len(data),
    )
    assert dst.getvalue() == data


# --- property ------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "é", "x y", ".h", "run"])
TREES = st.dictionaries(
    st.lists(NAMES, min_size=1, max_size=3).map("/".join),
    st.tuples(st.binary(max_size=200), st.booleans()),
    max_size=8,
)


@settings(max_examples=30, deadline=None)
@given(TREES)
def test_random_trees_round_trip_and_pack_deterministically(
    files: dict[str, tuple[bytes, bool]],
) -> None:
    # a path cannot be both a file and a folder: keep only the deepest ones
    files = {p: v for p, v in files.items() if not any(o.startswith(p + "/") for o in files)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "src"
        root.mkdir()
        for rel, (data, executable) in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
            (root / rel).chmod(0o755 if executable else 0o600)
        blob = pack(root)
        assert pack(root) == blob
        extract(io.BytesIO(blob), Path(tmp) / "out")
        got = listing(Path(tmp) / "out")
        assert {p: v[1:] for p, v in got.items() if v[0] == "file"} == {
            p: (data, 0o755 if x else 0o644) for p, (data, x) in files.items()
        }
        assert tree_digest(Path(tmp) / "out") == tree_digest(root)


def test_a_zips_one_folder_packs_as_the_zip_of_its_contents(tmp_path: Path) -> None:
    """A SLEAP package made by older tools holds one top-level folder: packing that folder
    as the root gives the same archive as the flat zip, and the rest is left out."""
    flat = [("a.txt", b"a", 0o100644), ("sub/b.txt", b"b", 0o100644)]
    write_zip(tmp_path / "flat.zip", flat)
    nested = [(f"pkg/{name}", data, mode) for name, data, mode in flat]
    write_zip(tmp_path / "nested.zip", [*nested, ("other.txt", b"o", 0o100644)])
    flat_out, nested_out = io.BytesIO(), io.BytesIO()
    pack_path(tmp_path / "flat.zip", flat_out)
    packed = pack_path(tmp_path / "nested.zip", nested_out, root="pkg")
    assert nested_out.getvalue() == flat_out.getvalue() and packed.files == 2
    write_zip(tmp_path / "out.zip", [*nested, ("pkg/ln", b"../other.txt", 0o120777)])
    with pytest.raises(UnsafeArchive, match="link leaves pkg/"):
        pack_path(tmp_path / "out.zip", io.BytesIO(), root="pkg")
