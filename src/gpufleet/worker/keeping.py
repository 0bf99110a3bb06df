"""What a job's run does with its checkpoint folder: made (and the latest snapshot
restored into it) before the command starts, synced while it runs, and synced a last time
after it ends (gpufleet.worker.checkpoints does the looking, hashing and sending)."""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial
from pathlib import Path

from gpufleet.client import AsyncClient, Client
from gpufleet.domain import checkpoints
from gpufleet.domain.checkpoints import SnapFile, Snapshot
from gpufleet.errors import Conflict, GpufleetError
from gpufleet.wire import CheckpointFile, CheckpointIn
from gpufleet.worker.calls import Retrying
from gpufleet.worker.checkpoints import FolderError, FolderSync, opened_dir, restore, snapshot_of
from gpufleet.worker.log import say
from gpufleet.worker.running import Running
from gpufleet.worker.staging import human

#: Seconds the end of a job waits for a snapshot being sent before it gives up on it.
STOP_WAIT = 60.0


class Keeping:
    """Checkpoint folders of the jobs a worker runs."""

    def __init__(self, client: AsyncClient, data: Client, retrying: Retrying) -> None:
        self.client = client
        self.data = data  # the blocking client, run in threads, for blobs
        self.retrying = retrying

    async def prepare(self, run: Running, workdir: Path) -> str | None:
        """Make the job's checkpoint folder and restore the lease's snapshot into it;
        why that failed (the attempt then fails: starting over from nothing would throw
        the kept work away), or None."""
        lease = run.lease
        rel = lease.spec.checkpoint_dir
        if rel is None:
            return None
        owner = run.user.uid if run.user is not None else None  # its files, none linked in
        run.sync = FolderSync(workdir, rel, self.data, partial(self._post, run), owner)
        try:
            await asyncio.to_thread(_make, workdir, rel)
        except (FolderError, OSError) as exc:
            return f"checkpoint folder {rel}: {exc}"
        if lease.checkpoint is None:
            return None
        snap = snapshot_of(lease.checkpoint)
        run.note(
            f"restoring checkpoint {snap.id} (attempt {snap.attempt}"
            f"{_at(snap)}): {len(snap.files)} file(s), {human(snap.bytes)}"
        )
        try:
            done, seen = await asyncio.to_thread(restore, self.data, snap, workdir, rel)
        except (FolderError, OSError) as exc:
            return f"checkpoint folder {rel}: {exc}"
        except GpufleetError as exc:
            return f"checkpoint {snap.id} not restored: {exc.message}"
        run.restored = done
        run.sync.restored(snap, seen)
        run.note(f"restored checkpoint {snap.id} in {done.seconds:.1f}s")
        return None

    @staticmethod
    def env(run: Running, workdir: Path) -> dict[str, str]:
        """The variables the job's process finds of its checkpoint folder and restore."""
        rel = run.lease.spec.checkpoint_dir
        if rel is None:
            return {}
        snap = run.sync.last if run.sync is not None and run.restored is not None else None
        return {checkpoints.DIR_ENV: str(workdir / rel), **checkpoints.resumed_env(snap)}

    def start(self, run: Running) -> asyncio.Task[None] | None:
        """Sync the folder while the job runs (None: it has none)."""
        if run.sync is None:
            return None
        note = partial(_once, run, set())
        return asyncio.create_task(run.sync.loop(lambda: dict(run.latest), note))

    async def stop(self, run: Running, task: asyncio.Task[None] | None) -> None:
        """End the sync loop: a snapshot it is sending is recorded first (so the last
        sync does not send it again), unless that takes past STOP_WAIT."""
        if task is None or run.sync is None:
            return
        run.sync.closing = True
        run.sync.wanted.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), STOP_WAIT)
        except TimeoutError:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def last(self, run: Running) -> None:
        """The job has ended: sync its folder as it is, unless its attempt is over at the
        server already (then nothing of it is taken)."""
        if run.sync is None or run.abandoned:
            return
        try:
            await self.retrying(
                "checkpoint", partial(run.sync.sync, dict(run.latest), False), give_up=120
            )
        except Conflict:
            say(f"job {run.lease.job_id}: last checkpoint refused: the lease is gone")
        except (GpufleetError, FolderError, OSError) as exc:
            run.note(f"last checkpoint not kept: {getattr(exc, 'message', exc)}")

    async def _post(
        self, run: Running, files: list[SnapFile], progress: dict[str, int]
    ) -> Snapshot:
        lease = run.lease
        body = CheckpointIn(
            attempt=lease.attempt,
            secret=lease.secret,
            files=[CheckpointFile(path=f.path, sha256=f.sha256, size=f.size) for f in files],
            progress=progress,
        )
        out = await self.client.record_checkpoint(lease.job_id, body)
        snap = snapshot_of(out)
        run.note(f"checkpoint {snap.id}: {len(snap.files)} file(s), {human(snap.bytes)}{_at(snap)}")
        return snap


def _make(workdir: Path, rel: str) -> None:
    with opened_dir(workdir, rel):
        pass


def _at(snap: Snapshot) -> str:
    if snap.epoch is not None:
        return f", epoch {snap.epoch}"
    if snap.step is not None:
        return f", step {snap.step}"
    return ""


def _once(run: Running, said: set[str], message: str) -> None:
    """A sync's trouble, said in the job's output once per kind."""
    if message not in said:
        said.add(message)
        run.note(message)
