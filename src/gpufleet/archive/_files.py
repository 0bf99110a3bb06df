"""After unpacking: merging into a job directory, and hashing files."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO

from gpufleet.archive._rules import _CHUNK
from gpufleet.errors import GpufleetError

# --- after unpacking -----------------------------------------------------------------------


def _plan_merge(src: Path, target: Path, rel: str, moves: list[tuple[Path, Path]]) -> list[str]:
    """Fill ``moves`` for merging src into target; return the clashing relative paths."""
    clashes: list[str] = []
    for child in sorted(os.listdir(src)):
        here, there = src / child, target / child
        path = f"{rel}/{child}" if rel else child
        if not os.path.lexists(there):
            moves.append((here, there))
        elif here.is_dir() and there.is_dir() and not (here.is_symlink() or there.is_symlink()):
            clashes += _plan_merge(here, there, path, moves)
        else:
            clashes.append(path)
    return clashes


def merge_into(src_dir: Path, target: Path) -> None:
    """Move the entries of ``src_dir`` into ``target`` (created if needed), then remove
    ``src_dir``. Directories on both sides merge; any other clash raises
    :class:`GpufleetError` before anything is moved."""
    for path in (src_dir, target):
        if not path.is_dir() and (path is src_dir or os.path.lexists(path)):
            raise GpufleetError(f"cannot merge {src_dir} into {target}: {path} is not a directory")
    moves: list[tuple[Path, Path]] = []
    clashes = _plan_merge(src_dir, target, "", moves)
    if clashes:
        raise GpufleetError(
            f"cannot merge {src_dir} into {target}: both provide {', '.join(clashes)}; "
            "rename one of them",
            detail={"paths": clashes},
        )
    target.mkdir(parents=True, exist_ok=True)
    for here, there in moves:
        shutil.move(here, there)
    shutil.rmtree(src_dir)


# --- hashing -------------------------------------------------------------------------------


def copy_hashing(src: BinaryIO, dst: BinaryIO, chunk: int = _CHUNK) -> tuple[str, int]:
    """Copy ``src`` to ``dst``; return the SHA-256 (hex) and the number of bytes copied."""
    digest = hashlib.sha256()
    total = 0
    while data := src.read(chunk):
        digest.update(data)
        dst.write(data)
        total += len(data)
    return digest.hexdigest(), total
