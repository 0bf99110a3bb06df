"""Getting a job's inputs into its directory before it starts, and its outputs out after.

Packages and dependencies' artifacts come from the cache and are unpacked (safely: see
:mod:`gpufleet.archive`) into the job directory; shared-mount paths are checked by hash
and linked, never copied. Outputs are archived and uploaded as the attempt's artifact.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

from gpufleet import archive
from gpufleet.domain.models import covering_mount
from gpufleet.errors import GpufleetError
from gpufleet.wire import StagedInput
from gpufleet.worker.cache import BlobCache
from gpufleet.worker.downloads import Download
from gpufleet.worker.downloads import size as size_text

Note = Callable[[str], None]


class InputError(GpufleetError):
    """An input could not be staged; the attempt fails with this message."""

    code = "input_error"


def human(n: int | None) -> str:
    """``n`` bytes as the download reports write them (``200.0 MiB``), or ``?``."""
    return "?" if n is None else size_text(n)


class Stager:
    def __init__(
        self,
        cache: BlobCache,
        mounts: tuple[str, ...],
        limits: archive.Limits,
        digests: archive.Remembered,
    ) -> None:
        self.cache = cache
        self.mounts = mounts
        self.limits = limits
        self.digests = digests  # shared-mount hashes, by the tree's fingerprint

    async def stage(
        self,
        inputs: list[StagedInput],
        workdir: Path,
        note: Note,
        download: Download | None = None,
    ) -> None:
        """Put every input in place, or raise InputError saying which one failed and why.
        ``download`` is told how far the download of those not in the cache is."""
        fetched = [
            inp
            for inp in inputs
            if inp.kind != "path" and inp.sha256 is not None and not self.cache.has(inp.sha256)
        ]
        if download is None or not fetched:
            await self._stage(inputs, workdir, note, None)
            return
        download.begin(sum(inp.size or 0 for inp in fetched))
        ok = False
        try:
            await self._stage(inputs, workdir, note, download)
            ok = True
        finally:
            download.end(ok)

    async def _stage(
        self, inputs: list[StagedInput], workdir: Path, note: Note, download: Download | None
    ) -> None:
        for index, inp in enumerate(inputs):
            name = inp.label or (inp.sha256 or "")[:12]
            try:
                if inp.kind == "path":
                    await self._link(inp, workdir, note)
                elif inp.sha256 is None:
                    note(f"input {name}: that job left no artifact; nothing to unpack")
                else:
                    await self._unpack(inp, index, workdir, note, download)
            except GpufleetError as exc:
                raise InputError(f"input {name}: {exc.message}") from exc
            except OSError as exc:
                raise InputError(f"input {name}: {exc.strerror or exc}") from exc

    async def _unpack(
        self, inp: StagedInput, index: int, workdir: Path, note: Note, download: Download | None
    ) -> None:
        try:
            await self._unpack_once(inp, index, workdir, note, download)
        except FileNotFoundError:  # evicted by a worker sharing the cache: fetch it again
            await self._unpack_once(inp, index, workdir, note, download)

    async def _unpack_once(
        self, inp: StagedInput, index: int, workdir: Path, note: Note, download: Download | None
    ) -> None:
        assert inp.sha256 is not None
        path, hit = await self.cache.get(inp.sha256, download.got if download else None)
        try:
            how = "cache hit" if hit else "downloaded"
            note(f"input {inp.label or inp.sha256[:12]} ({human(inp.size)}): {how}")
            scratch = workdir / f".gpufleet-input-{index}"
            shutil.rmtree(scratch, ignore_errors=True)
            size = path.stat().st_size
            target = _inside(workdir, inp.dest)
            await asyncio.to_thread(self._extract, path, scratch, size)
            await asyncio.to_thread(archive.merge_into, scratch, target)
        finally:
            self.cache.release(inp.sha256)

    def _extract(self, path: Path, scratch: Path, size: int) -> None:
        with open(path, "rb") as f:
            archive.extract(f, scratch, self.limits, compressed_size=size)

    async def _link(self, inp: StagedInput, workdir: Path, note: Note) -> None:
        assert inp.path is not None
        mount = covering_mount(inp.path, self.mounts)
        if mount is None:
            raise InputError(f"{inp.path} is under no --mount of this worker")
        if not Path(inp.path).exists():
            raise InputError(f"{inp.path} does not exist on this worker (mount {mount})")
        digest, remembered = await asyncio.to_thread(
            archive.remembered_digest, Path(inp.path), self.digests, archive.tree_digest
        )
        if digest != inp.sha256:
            raise InputError(
                f"{inp.path} on this worker does not match what was submitted "
                f"(hash {digest[:12]}, expected {(inp.sha256 or '')[:12]}); "
                "the shared copy changed or differs between machines"
            )
        link = workdir / (Path(inp.path).name if inp.dest == "." else inp.dest)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(inp.path, target_is_directory=Path(inp.path).is_dir())
        how = "unchanged since it was hashed" if remembered else "checked by hash"
        note(f"input {inp.path}: shared mount, {how}, linked as {link.name}")


def _inside(workdir: Path, dest: str) -> Path:
    """``workdir / dest``, refusing a path that goes through a link: an earlier input
    linked there (a shared mount) must not receive a package's files."""
    target = workdir
    for part in Path(dest).parts:
        target = target / part
        if target.is_symlink():
            raise InputError(
                f"destination {dest!r} goes through {target.name!r}, a link (another input "
                "placed there?); give this input a destination of its own"
            )
    return target


def pack_outputs(workdir: Path, patterns: list[str], out: Path) -> archive.Packed:
    """Archive the job's outputs into ``out`` (not inside the job directory)."""
    with open(out, "wb") as f:
        return archive.pack_outputs(workdir, patterns, f)
