"""What a running job sends the server besides its start and finish reports: its
output while it runs, and the archive of its outputs at its end."""

from __future__ import annotations

import asyncio
import os
from functools import partial
from pathlib import Path

from gpufleet.client import AsyncClient, Client
from gpufleet.domain.models import DEFAULT_OUTPUTS
from gpufleet.errors import Conflict, GpufleetError
from gpufleet.wire import ArtifactAttach, LogAppend, LogLine
from gpufleet.worker.calls import Retrying
from gpufleet.worker.log import say
from gpufleet.worker.running import Running, StopReason
from gpufleet.worker.staging import human, pack_outputs
from gpufleet.worker.stopping import Stopper

FLUSH_SECONDS = 1.0
MAX_BATCH = 5000
# Characters of output in one log request: JSON-escaped, well under the server's body limit.
MAX_BATCH_CHARS = 2_000_000


class Uploads:
    """Sends jobs' output and outputs. ``work_dir`` holds the archives on their way;
    ``stopper`` acts on what the server answers (stop the job early, or kill it)."""

    def __init__(
        self,
        client: AsyncClient,
        data: Client,
        retrying: Retrying,
        stopper: Stopper,
        work_dir: Path,
    ) -> None:
        self.client = client
        self.data = data  # the blocking client, run in threads, for the archive's bytes
        self.retrying = retrying
        self.stopper = stopper
        self.work_dir = work_dir

    async def flush(self, run: Running) -> None:
        """Send the job's unsent output, a batch at a time (each at most MAX_BATCH lines
        and, past the first, MAX_BATCH_CHARS characters); a batch is removed once the
        server has it."""
        while batch := run.backlog.peek(MAX_BATCH, MAX_BATCH_CHARS):
            lines = [LogLine(stream=stream, line=line) for stream, line in batch]
            # first: the lines sent before, so a batch sent again is stored once
            body = LogAppend(
                attempt=run.lease.attempt,
                secret=run.lease.secret,
                lines=lines,
                first=run.backlog.acked,
            )
            stop = await self.retrying(
                "log upload", partial(self.client.output, run.lease.job_id, body), give_up=60
            )
            run.backlog.sent()
            if stop is not None and run.proc is not None and run.proc.proc.returncode is None:
                self.stopper.stop_early(run, stop)

    async def flush_loop(self, run: Running) -> None:
        """Send the job's output (and its progress file's records) every FLUSH_SECONDS;
        a stale lease kills the job."""
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            try:
                run.read_progress()
                await self.flush(run)
            except Conflict:
                say(f"job {run.lease.job_id}: lease is stale (409); killing it")
                self.stopper.kill(run, StopReason.LOST)
                return
            except GpufleetError as exc:
                say(f"job {run.lease.job_id}: log upload failed: {exc.message}")

    async def collect(self, run: Running, workdir: Path) -> str | None:
        """Archive the job's outputs, upload them and attach them to the attempt. Returns
        why that failed, or None (also when no output matched: nothing to keep)."""
        lease = run.lease
        if not lease.spec.outputs:  # the job keeps nothing: no archive, and nothing to say
            return None
        # named with this process's id, so a later worker knows a dead one's leftovers
        out = self.work_dir / f".artifact.{os.getpid()}.{lease.job_id}-{lease.attempt}.tar.zst"
        try:
            packed = await asyncio.to_thread(pack_outputs, workdir, lease.spec.outputs, out)
            for skipped in packed.skipped:
                run.note(f"output skipped: {skipped}")
            if not packed.entries:
                if tuple(lease.spec.outputs) != DEFAULT_OUTPUTS:  # asked for, not found: say so
                    run.note(f"outputs {', '.join(lease.spec.outputs)} matched no files")
                return None
            sent = await self.retrying(
                "artifact upload", partial(asyncio.to_thread, self.data.put_blob, out), give_up=600
            )
            body = ArtifactAttach(attempt=lease.attempt, secret=lease.secret, sha256=sent.sha256)
            await self.retrying(
                "artifact", partial(self.client.attach_artifact, lease.job_id, body), give_up=600
            )
            run.note(
                f"artifact: {packed.files} file(s), {human(packed.bytes)} "
                f"({human(sent.size)} packed, {sent.sha256[:12]})"
            )
            return None
        except GpufleetError as exc:
            run.note(f"artifact not kept: {exc.message}")
            return f"artifact not kept: {exc.message}"
        except OSError as exc:
            run.note(f"artifact not kept: {exc.strerror or exc}")
            return f"artifact not kept: {exc.strerror or exc}"
        finally:
            out.unlink(missing_ok=True)
