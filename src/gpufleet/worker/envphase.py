"""The environment phase of a job: before its command starts, the worker gets the
environment the job named, built with uv or found in its cache (docs/environments.md).

The phase is part of the job a user watches: uv's lines go into the job's log, each
marked ``[env]``; a progress message says "building environment" with its time so far;
the start report says which environment the attempt ran with (its key, Python, the
versions installed, and how long it took). Its time is the build's own, under the
worker's ``env_build_timeout``, not the job's ``timeout``.

An unlocked spec is resolved once for each pool: before a build the worker asks the
server for the lock its pool recorded for it (:func:`domain.environments.lock_key`) and
installs exactly that (when it holds pinned registry packages only); the first build of
a spec in the pool records its resolution there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gpufleet.client import AsyncClient, Client
from gpufleet.domain.environments import (
    EnvKind,
    EnvSpec,
    requirements_text_problem,
    uv_lock_problem,
)
from gpufleet.domain.models import Capability
from gpufleet.errors import ConfigError, GpufleetError, NotFound
from gpufleet.wire import EnvLockPut, EnvUsed
from gpufleet.wire._environments import MOST_PACKAGES, PACKAGE_CHARS
from gpufleet.worker.cache import BlobCache
from gpufleet.worker.environments import Built, EnvCache, EnvError
from gpufleet.worker.envsettings import EnvSettings, uv_variables
from gpufleet.worker.isolation import SlotUser, check_reachable
from gpufleet.worker.options import WorkerOptions

T = TypeVar("T")
#: How a line of the environment's build reads in the job's log.
ENV_MARK = "[env] "
#: Seconds between the progress messages of a build that is still going.
TICK = 5.0
Retrying = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]


class EnvFailed(GpufleetError):
    """The job's environment could not be had: ``final`` when it would fail the same
    way on every worker (nothing to gain from a retry elsewhere), ``lines`` uv's last
    words."""

    def __init__(self, message: str, lines: list[str], final: bool) -> None:
        super().__init__(message)
        self.lines = lines
        self.final = final


@dataclass
class Prepared:
    """An environment ready for a job, held until :meth:`EnvPhase.done`."""

    built: Built
    used: EnvUsed  # for the start report

    def variables(self, path: str) -> dict[str, str]:
        """The job's variables: the environment's ``bin`` first on ``path`` (so
        ``python`` is its interpreter) and ``VIRTUAL_ENV``; PYTHONHOME, which would
        point its interpreter elsewhere, is left out by the caller."""
        venv = self.built.path
        return {
            "VIRTUAL_ENV": str(venv),
            "PATH": f"{venv / 'bin'}:{path}",
            # no .pyc into the shared environment (root ignores its seal): the worker
            # compiles its bytecode itself, once, after the first job started
            "PYTHONDONTWRITEBYTECODE": "1",
        }


@dataclass
class EnvPhase:
    """Getting environments for the jobs of one worker."""

    cache: EnvCache
    client: AsyncClient
    data: Client
    blobs: BlobCache
    capability: Capability
    retrying: Retrying
    # what the worker has built changed since the last heartbeat said it
    changed: bool = True
    # the pool the worker registered in, whose environment locks it reads (None: the
    # token's only pool, which a worker token has)
    pool: str | None = None
    _told: dict[str, float] = field(default_factory=dict)

    async def prepare(
        self,
        job_id: str,
        attempt: int,
        secret: str | None,
        spec: EnvSpec,
        say: Callable[[str], None],
        progress: Callable[[dict[str, Any]], None],
        writer: bool = True,
    ) -> Prepared:
        """Build (or find) ``spec``'s environment for an attempt. ``say``: a line of the
        job's log; ``progress``: a progress record of the job; ``writer``: the job runs
        as a user that could change the environment (the worker's own, not a slot
        user's, whose writes its seal refuses). Raises EnvFailed."""
        started = time.monotonic()
        progress({"message": "building environment"})
        ticker = asyncio.create_task(self._tick(started, progress))
        fleet_lock = None
        try:
            files = await self._files(spec)
            plan = await self.cache.plan(
                spec, files, len(self.capability.gpus), self.capability.cuda_version
            )
            if not spec.locked and not spec.upgrade:  # even when built: it may have moved on
                fleet_lock = await self._fleet_lock(plan.lock_key, spec.kind, say, plan.built)
            built = await self.cache.ensure(plan, files, fleet_lock, lambda line: say(line))
        except EnvError as exc:
            # what the fleet's lock pins may be missing from this worker's index alone
            final = exc.final and fleet_lock is None
            raise EnvFailed(f"environment: {exc.message}", list(exc.lines), final) from None
        except GpufleetError as exc:  # the server, for its files or its lock
            raise EnvFailed(f"environment: {exc.message}", [], False) from None
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        try:  # held now: whatever goes wrong from here lets it go
            return await self._ready(job_id, attempt, secret, built, say, progress, writer)
        except BaseException:
            built.hold.release()
            raise

    async def _ready(
        self,
        job_id: str,
        attempt: int,
        secret: str | None,
        built: Built,
        say: Callable[[str], None],
        progress: Callable[[dict[str, Any]], None],
        writer: bool,
    ) -> Prepared:
        if built.built_here:
            self.changed = True
        if writer:  # it could change what later jobs use: checked after it
            self.cache.unchecked(built.plan.build_key)
        try:
            if built.new_lock is not None:
                await self._record_lock(job_id, attempt, secret, built, say)
        except GpufleetError as exc:  # the job runs; the next build resolves again
            say(f"the fleet's lock of this environment was not recorded: {exc.message}")
        what = "built" if built.built_here else "ready (cached)"
        progress({"message": f"environment {what} in {built.seconds:.1f}s"})
        return Prepared(built, self.used(built))

    async def _tick(self, started: float, progress: Callable[[dict[str, Any]], None]) -> None:
        while True:
            await asyncio.sleep(TICK)
            progress({"message": f"building environment ({time.monotonic() - started:.0f}s)"})

    async def _files(self, spec: EnvSpec) -> dict[str, bytes]:
        """The spec's files, from the worker's blob cache (downloaded once)."""
        found = {}
        for f in spec.files:
            path, _ = await self.blobs.get(f.sha256)
            try:
                found[f.name] = await asyncio.to_thread(path.read_bytes)
            finally:
                self.blobs.release(f.sha256)
        return found

    async def _fleet_lock(
        self, key: str, kind: EnvKind, say: Callable[[str], None], built: bool
    ) -> str | None:
        """The lock the pool recorded for ``key``, or None (the first build resolves, as
        it does when the recorded lock asks for more than pinned registry packages: it
        is ignored, and the job's log says so).
        Asked even when the environment is built here: after an upgrade elsewhere (or a
        first build here that lost the race to record its lock), what is built here holds
        other versions, and is built again from the fleet's."""
        try:
            lock = await self.retrying(
                "environment lock", lambda: self.client.env_lock(key, self.pool)
            )
        except NotFound:
            return None
        path, _ = await self.blobs.get(lock.sha256)
        try:
            text = await asyncio.to_thread(path.read_text, encoding="utf-8")
        finally:
            self.blobs.release(lock.sha256)
        check = requirements_text_problem if kind == EnvKind.REQUIREMENTS else uv_lock_problem
        problem = check(text)
        if problem:
            say(f"ignoring the recorded lock of this environment ({problem}); resolving here")
            return None
        if not built:
            say(
                f"installing the versions the fleet recorded for this environment "
                f"(resolved by job {lock.job_id} on {lock.worker_name})"
            )
        return text

    async def _record_lock(
        self,
        job_id: str,
        attempt: int,
        secret: str | None,
        built: Built,
        say: Callable[[str], None],
    ) -> None:
        """Record the versions this build resolved as the fleet's lock of its spec (first
        writer wins; an upgrade replaces it)."""
        assert built.new_lock is not None
        plan = built.plan
        with tempfile.TemporaryDirectory(prefix="gpufleet-lock-") as tmp:
            file = Path(tmp) / "lock.txt"
            file.write_text(built.new_lock, encoding="utf-8")
            sent = await self.retrying(
                "environment lock upload", lambda: asyncio.to_thread(self.data.put_blob, file)
            )
        body = EnvLockPut(
            sha256=sent.sha256,
            spec_key=plan.spec.key(),
            python=".".join(plan.python.split(".")[:2]),
            torch_backend=plan.torch_backend,
            job_id=job_id,
            attempt=attempt,
            secret=secret,
            replace=plan.spec.upgrade,
        )
        out = await self.retrying(
            "environment lock", lambda: self.client.put_env_lock(plan.lock_key, body)
        )
        if out.sha256 == sent.sha256:
            say("recorded these versions as the fleet's lock of this environment")
        else:
            say(f"job {out.job_id} recorded this environment's lock first; later builds use it")

    @staticmethod
    def used(built: Built) -> EnvUsed:
        """What the start report says of the environment. Versions past the report's
        limits (a package installed from a long URL, an environment of thousands of
        packages) are cut, not refused: the job runs all the same."""
        versions = {
            name[:PACKAGE_CHARS]: version[:PACKAGE_CHARS]
            for name, version in sorted(built.versions.items())[:MOST_PACKAGES]
        }
        return EnvUsed(
            key=built.plan.build_key,
            spec_key=built.plan.spec.key(),
            python=built.plan.python[:32],
            built=built.built_here,
            seconds=round(built.seconds, 3),
            versions=versions,
            torch_backend=built.plan.torch_backend,
        )

    def done(self, prepared: Prepared) -> None:
        """The job's process ended: let its environment go."""
        prepared.built.hold.release()

    def check(self, prepared: Prepared, job_id: str, say: Callable[[str], None]) -> None:
        """After a job that could change its environment (it ran as the worker's own
        user): survey it, off the job's way (a large environment takes a second or two),
        and remove it if the job changed it; it is not reused until then."""
        key = prepared.built.plan.build_key
        if self.cache.check(key) is False:
            self.changed = True
            say(f"job {job_id} changed environment {key[:12]}: removed, the next job rebuilds it")

    def closed_to(self, users: Sequence[SlotUser]) -> str | None:
        """``--run-as``: why jobs running as ``users`` could not use the environments
        (their folder out of reach), or None. The cache's root is opened to pass through."""
        root = self.cache.settings.root
        root.chmod(0o711)
        # an environment's python is a link to the interpreter it was made from
        python = Path(os.path.realpath(sys.executable)).parent
        for folder in (root / "envs", python):
            try:
                check_reachable(folder, users)
            except ConfigError as exc:
                return f"jobs with an environment would fail: {exc.message}"
        return None

    def listing(self) -> list[Mapping[str, Any]]:
        """What the worker has built, for its heartbeat."""
        return [
            {
                "key": i.key,
                "spec_key": i.spec_key,
                "python": i.python,
                "size_bytes": i.size,
                "last_used": i.last_used,
                "describe": i.spec[:500],  # what it is built from: the rest has fields
                "torch_backend": i.torch_backend,
            }
            for i in self.cache.listing()
        ]


def env_cache(opts: WorkerOptions) -> EnvCache:
    """The worker's environment cache, as its operator set it up."""
    return EnvCache(
        EnvSettings(
            root=opts.env_cache_dir or opts.work_dir / "environments",
            cap_bytes=opts.env_cache_size,
            uv=uv_binary(),
            build_timeout=opts.env_build_timeout,
            python_downloads=opts.env_python_downloads,
            torch_backend=opts.env_torch_backend,
            find_links=tuple(  # a folder as uv reads it from any build's folder
                f if "://" in f else str(Path(f).expanduser().resolve())
                for f in opts.env_find_links
            ),
            index_url=opts.env_index_url,
            uv_env=uv_variables(),
            allow_builds=opts.env_allow_builds
            if opts.env_allow_builds is not None
            else os.geteuid() != 0,
        )
    )


def uv_binary() -> str:
    """The uv that came with gpufleet (the ``uv`` package): never one downloaded now."""
    try:
        import uv

        return str(uv.find_uv_bin())
    except (ImportError, FileNotFoundError):  # a build then fails saying uv is missing
        return shutil.which("uv") or "uv"
