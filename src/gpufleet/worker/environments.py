"""The worker's cache of job environments: one venv per build key, built once with uv,
sealed read-only, shared by every job that asks for the same thing, and evicted least
recently used first when the cache outgrows its cap.

How a job gets its environment::

    cache = EnvCache(EnvSettings(root, cap_bytes, uv=uv.find_uv_bin()))
    plan = await cache.plan(spec, files, gpus, cuda_version)     # cheap: keys, Python
    built = await cache.ensure(plan, files, fleet_lock, on_line)  # builds, or reuses
    with built.hold:                       # the env is in use: never evicted meanwhile
        ... run the job with built.path / "bin" on its PATH ...
    if not cache.intact(plan.build_key):   # the job changed it (root, or its owner)
        cache.remove(plan.build_key)       # the next job rebuilds it

- ``plan(spec, files, gpus, cuda_version) -> Plan``: finds the Python (EnvError, final,
  naming the version and what the worker has, when it cannot), picks the torch build
  and computes the keys; ``built`` says whether the env is cached (and intact).
- ``ensure(plan, files, fleet_lock, on_line) -> Built``: builds the env unless it is
  cached, streaming each line uv prints to ``on_line``; concurrent calls for one key (in
  this process or another) build once. ``Built.hold`` is already held: release it (or
  use it as a context manager) when the job ends. ``Built.new_lock``: the lock this build
  resolved, for the server to record.
- ``hold(key) -> Hold``: marks an env in use (a shared ``flock`` on
  ``locks/<key>.use``, so it holds across processes) and records its last use.
- ``evict(keep=()) -> list[str]``: removes least recently used envs that nobody holds
  until the cache is under its cap; run after every build (never the one just built).
- ``listing() -> list[EnvInfo]``, ``intact(key) -> bool``, ``remove(key) -> bool``,
  ``pythons() -> list[str]`` (the versions this worker can provide, no downloads).

On disk, under ``root``: ``envs/<build key>/`` (one venv each), ``meta/``, ``locks/`` and
``tmp/`` (see :mod:`gpufleet.worker.envstore`). A build is made in
``tmp/<key>.<pid>.<random>`` and renamed into ``envs/`` only once complete, its meta
written first: an env in ``envs/`` with its meta is whole. What a killed worker left in
``tmp/`` is removed at start (when no process builds that key).

**Packages a job installs at run time.** The env is read-only; a job that needs more
installs into its own folder and names it in ``GPUFLEET_JOB_SITE``, which every env's
``_gpufleet_job_site.pth`` puts first on ``sys.path`` (as PYTHONPATH would)::

    export GPUFLEET_JOB_SITE="$PWD/.site"
    uv pip install --python "$(which python)" --target "$GPUFLEET_JOB_SITE" extra-pkg
    # or: python -m pip install --target "$GPUFLEET_JOB_SITE" extra-pkg (if pip is there)

uv has no variable for ``--target``: the job passes it. Its scripts land in
``$GPUFLEET_JOB_SITE/bin``.

**Keys.** The build key is the spec's key with the exact Python, the platform (the
interpreter's implementation, ``sysconfig`` platform and libc) and every option that
changes the result: the torch build and the index settings (``find_links``,
``index_url``, and the worker's index-related ``UV_*`` variables). The torch build
(``--torch-backend``) is chosen only for a requirements spec that names a PyTorch
package and only where uv reads the public index (it ignores configured indexes for
PyTorch packages); ``uv lock`` has no such option, so a project's own ``[tool.uv]``
indexes choose its torch build.

uv's own cache (``UV_CACHE_DIR`` from the worker's environment, or uv's default) is
shared by every build, so an env that overlaps an earlier one builds fast; envs copy
their files from it (``UV_LINK_MODE=copy`` unless the operator set it) so that nothing a
job does to an env reaches the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.domain.environments import (
    EnvKind,
    EnvSpec,
    build_key,
    lock_key,
    names_torch,
    torch_backend_for,
)
from gpufleet.worker import envbuild, envtree
from gpufleet.worker.envbuild import EnvError, Python, Uv
from gpufleet.worker.envsettings import EnvSettings
from gpufleet.worker.envstore import EnvInfo, EnvStore, Hold, try_lock
from gpufleet.worker.staging import human

__all__ = ["Built", "EnvCache", "EnvError", "EnvInfo", "EnvSettings", "Hold", "Plan"]

#: How often a build waiting for another process's build of the same key looks again.
WAIT_POLL = 0.1
#: Beyond the other build's own limit, how long a waiter waits before it gives up.
WAIT_MARGIN = 60.0

OnLine = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """What the cache decided before a build, cheaply."""

    spec: EnvSpec
    python: str  # the exact version, "3.11.7"
    interpreter: str  # its path
    platform: str  # "cpython-linux-x86_64-glibc-2.36"
    torch_backend: str | None  # passed as --torch-backend; None: not passed
    build_key: str
    lock_key: str  # where the server keeps the fleet's lock of this spec
    # already in the cache, and intact (ensure still rebuilds it for an upgrade, or when
    # the fleet's lock is not the one it was built from)
    built: bool

    @property
    def python_info(self) -> Python:
        return Python(self.interpreter, self.python, self.platform)


@dataclass(frozen=True)
class Built:
    """An environment ready for a job, and held for it (``hold``: release it when the
    job ends)."""

    plan: Plan
    path: Path  # the venv
    built_here: bool  # False: reused, or built meanwhile by another job
    seconds: float  # how long ensure took, waiting included
    new_lock: str | None  # the lock this build resolved (None: it installed one it had)
    versions: dict[str, str]  # what it holds: name -> version
    hold: Hold

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


class EnvCache:
    """The environments of one worker (several workers on a machine may share ``root``)."""

    def __init__(self, settings: EnvSettings, environ: Mapping[str, str] = os.environ) -> None:
        self.settings = settings
        self.store = EnvStore(settings.root)
        env = envbuild.uv_environment(
            environ,
            settings.uv_env,
            settings.python_downloads,
            settings.index_url,
            settings.allow_builds,
        )
        index = envbuild.index_args(settings.find_links, settings.index_url)
        self.uv = Uv(settings.uv, env, index)
        self._building: dict[str, asyncio.Lock] = {}
        self._compiling: dict[str, asyncio.Task[None]] = {}
        self._pythons: dict[str | None, Python] = {}
        self.leftovers = self.store.remove_leftovers()

    # ----------------------------------------------------------------- planning

    async def plan(
        self, spec: EnvSpec, files: Mapping[str, bytes], gpus: int, cuda_version: str | None
    ) -> Plan:
        """The Python, the torch build and the keys of ``spec`` on this worker.
        ``files``: the spec's files by name (their text says whether torch is named)."""
        python = await self.find_python(spec.python)
        torch = self.torch_backend(spec, files, gpus, cuda_version)
        options = {"torch": torch, "index": self.settings.index_options()}
        key = build_key(spec.key(), python.version, python.platform, options)
        built = await asyncio.to_thread(self.store.ready, key)
        return Plan(
            spec=spec,
            python=python.version,
            interpreter=python.path,
            platform=python.platform,
            torch_backend=torch,
            build_key=key,
            lock_key=lock_key(spec.key(), python.version, torch),
            built=built is not None,
        )

    def torch_backend(
        self, spec: EnvSpec, files: Mapping[str, bytes], gpus: int, cuda_version: str | None
    ) -> str | None:
        """The ``--torch-backend`` a build passes, or None: only for a requirements spec
        that names a PyTorch package, where uv reads the public index, and unless the
        worker says "none". "auto" picks the build the worker's driver runs."""
        choice = self.settings.torch_backend
        if choice == "none" or spec.kind is not EnvKind.REQUIREMENTS:
            return None
        if not self.settings.reads_public_index():
            return None
        texts = list(spec.with_)
        if spec.requirements is not None and spec.requirements.name in files:
            texts.append(files[spec.requirements.name].decode(errors="replace"))
        if not names_torch(texts):
            return None
        return torch_backend_for(cuda_version, gpus) if choice == "auto" else choice

    async def find_python(self, request: str | None) -> Python:
        """The interpreter for a requested version (None: the worker's own Python).
        EnvError (final) naming the version and those this worker has, when it has none."""
        if request in self._pythons:
            return self._pythons[request]
        path = sys.executable if request is None else await self._python_path(request)
        if path is None:
            have = await self.pythons()
            raise EnvError(
                f"this worker has no Python {request} (it has "
                f"{', '.join(have) or 'none that uv finds'}); ask for one of those",
                where="python",
                final=False,  # another worker may have it
            )
        python = await envbuild.probe_python(path)
        self._pythons[request] = python
        return python

    async def _python_path(self, request: str) -> str | None:
        path = await self.uv.find_python(request, self.store.tmp)
        if path is None and self.settings.python_downloads:
            await self.uv.install_python(request, self.store.tmp)
            path = await self.uv.find_python(request, self.store.tmp)
        return path

    async def pythons(self) -> list[str]:
        """The Python versions this worker can provide without a download, newest first."""
        return await self.uv.installed_pythons(self.store.tmp)

    # ----------------------------------------------------------------- building

    async def ensure(
        self,
        plan: Plan,
        files: Mapping[str, bytes],
        fleet_lock: str | None,
        on_line: OnLine,
    ) -> Built:
        """The plan's environment, built unless the cache has it, and held. Concurrent
        calls for one key build once (an asyncio lock here, an flock across processes):
        a waiter tells ``on_line`` so and gets ``built_here=False``. ``fleet_lock``: the
        lock the fleet recorded for the plan's lock key (ignored for ``upgrade`` and for
        a spec with its own uv.lock)."""
        started = time.monotonic()
        key = plan.build_key
        reused = await self._reuse(plan, fleet_lock, started, clean=False)
        if reused is not None:
            return reused
        lock = self._building.setdefault(key, asyncio.Lock())
        waits = lock.locked()
        if waits:
            on_line(f"environment {key[:12]}: waiting for another job's build of it")
        async with lock, self._build_lock(key, on_line, already_told=waits):
            reused = await self._reuse(plan, fleet_lock, started, clean=True, on_line=on_line)
            if reused is not None:
                return reused
            built = await self._build(plan, files, fleet_lock, on_line, started)
        self._compile_later(key)
        gone = await asyncio.to_thread(self.evict, (key,))
        for other in gone:
            on_line(f"environment {other[:12]}: removed to keep the cache under its cap")
        return built

    async def _reuse(
        self,
        plan: Plan,
        fleet_lock: str | None,
        started: float,
        clean: bool,
        on_line: OnLine | None = None,
    ) -> Built | None:
        """The cached env, held, if it is there, intact and what the job asks for (built
        from the fleet's lock, and not an ``upgrade``). ``clean`` (only under the build
        lock, so never between a build's meta and its rename): an env that is not so is
        removed, or EnvError when a job holds it."""
        key = plan.build_key
        meta = await asyncio.to_thread(self.store.ready, key)
        if meta is None or not _fits(meta, plan.spec, fleet_lock):
            if clean and not await asyncio.to_thread(self.remove, key):
                why = "was changed by a job" if meta is None else "holds other versions"
                await self._wait_unheld(key, f"environment {key[:12]} {why}", on_line)
            return None
        try:
            hold = self.hold(key)
        except EnvError:  # evicted meanwhile
            return None
        if not meta.get("compiled", True):  # a worker stopped before it compiled it
            self._compile_later(key)
        return Built(
            plan,
            self.store.env(key),
            built_here=False,
            seconds=time.monotonic() - started,
            new_lock=None,
            versions=dict(meta["versions"]),
            hold=hold,
        )

    async def _wait_unheld(self, key: str, what: str, on_line: OnLine | None) -> None:
        """Wait until no job holds the env, then remove it (to be built again): another
        job runs in it now. EnvError (not final) past the build's limit."""
        if on_line is not None:
            on_line(f"{what}, and a running job uses it: waiting for that job to end")
        give_up = time.monotonic() + self.settings.build_timeout
        while not await asyncio.to_thread(self.remove, key):
            if time.monotonic() > give_up:
                raise EnvError(f"{what}, and a running job used it too long", where="wait")
            await asyncio.sleep(WAIT_POLL * 5)

    @contextlib.asynccontextmanager
    async def _build_lock(self, key: str, on_line: OnLine, already_told: bool) -> Any:
        """Hold ``locks/<key>.build`` exclusively. Polled, not waited for in a thread: a
        cancelled job must not leave a thread that takes the lock later and keeps it."""
        fd = self.store.lock_file(key, "build")
        try:
            told = already_told
            give_up = time.monotonic() + self.settings.build_timeout + WAIT_MARGIN
            while not try_lock(fd, fcntl.LOCK_EX):
                if not told:
                    on_line(f"environment {key[:12]}: waiting for another worker's build of it")
                    told = True
                if time.monotonic() > give_up:
                    raise EnvError("another build of this environment took too long", where="wait")
                await asyncio.sleep(WAIT_POLL)
            yield
        finally:
            os.close(fd)

    async def _build(
        self,
        plan: Plan,
        files: Mapping[str, bytes],
        fleet_lock: str | None,
        on_line: OnLine,
        started: float,
    ) -> Built:
        key = plan.build_key
        _check_files(plan.spec, files)
        temp = self.store.temp(key)
        work = temp.with_name(temp.name + ".work")
        on_line(
            f"environment {key[:12]}: building {plan.spec.describe()} with Python "
            f"{plan.python}" + (f", torch {plan.torch_backend}" if plan.torch_backend else "")
        )
        inputs = envbuild.BuildInputs(
            plan.spec,
            files,
            plan.python_info,
            plan.torch_backend,
            fleet_lock,
            self.settings.find_links,
            self.settings.index_url or self.settings.uv_env.get("UV_INDEX_URL"),
        )
        deadline = time.monotonic() + self.settings.build_timeout  # waiting not counted
        try:
            result = await envbuild.build(self.uv, inputs, temp, work, on_line, deadline)
            versions = await self.uv.freeze(temp)
            meta, hold = await asyncio.to_thread(self._finish, plan, temp, versions, result)
        except OSError as exc:
            raise EnvError(f"building the environment failed: {exc}", where="disk") from exc
        finally:
            await asyncio.to_thread(_remove_all, temp, work)
        seconds = time.monotonic() - started
        on_line(f"environment {key[:12]}: built in {seconds:.1f} s, {human(meta['size'])}")
        return Built(plan, self.store.env(key), True, seconds, result.new_lock, versions, hold)

    def _finish(
        self, plan: Plan, temp: Path, versions: dict[str, str], result: envbuild.Result
    ) -> tuple[dict[str, Any], Hold]:
        """Seal the build, write its meta, and rename it into ``envs/``, held from
        before it is there (another process's eviction cannot take it first)."""
        envtree.add_job_site(temp)
        envtree.seal(temp)
        found = envtree.survey(temp)
        meta = {
            "key": plan.build_key,
            "spec_key": plan.spec.key(),
            "spec": plan.spec.describe(),
            "python": plan.python,
            "platform": plan.platform,
            "torch_backend": plan.torch_backend,
            "lock_key": plan.lock_key,
            "lock_sha256": _sha256(result.installed),
            "versions": versions,
            "size": found.size,
            "entries": found.entries,
            "survey": found.digest,
            "built_at": time.time(),
            "compiled": False,  # its bytecode comes after the job started (compile)
        }
        return meta, self.store.install(plan.build_key, temp, meta)

    # ----------------------------------------------------------------- bytecode

    def _compile_later(self, key: str) -> None:
        """Compile the env's bytecode in the background, once (its first job has started
        meanwhile: its imports compile in memory, later jobs read the .pyc files)."""
        if key in self._compiling:
            return
        task = asyncio.create_task(self._compile(key))
        self._compiling[key] = task
        task.add_done_callback(lambda _: self._compiling.pop(key, None))

    async def settled(self) -> None:
        """Wait until no bytecode is being compiled (tests; a worker that stops)."""
        while self._compiling:
            await asyncio.gather(*self._compiling.values(), return_exceptions=True)

    async def _compile(self, key: str) -> None:
        """Under the key's build lock (no build, check or other compile meanwhile) and
        held (never evicted meanwhile): open its folders to the worker, compile, seal
        again, and record the new survey. A failure leaves it running from source."""
        lock = self._building.setdefault(key, asyncio.Lock())
        async with lock, self._build_lock(key, lambda _: None, already_told=True):
            try:
                hold = self.hold(key)
            except EnvError:  # evicted or changed meanwhile
                return
            try:
                await self._compile_held(key)
            finally:
                hold.release()

    async def _compile_held(self, key: str) -> None:
        meta = self.store.read_meta(key)
        if meta is None or meta.get("compiled", True):
            return
        env = self.store.env(key)
        if meta.get("survey") != (await asyncio.to_thread(envtree.survey, env)).digest:
            return  # changed since its build: the check after its job removes it
        code = await asyncio.to_thread(envtree.survey, env, True)
        await asyncio.to_thread(envtree.unseal_folders, env)
        try:
            site = envtree.site_packages(env)
            failed = await envbuild.compile_bytecode(env, site, self.settings.build_timeout)
        finally:
            await asyncio.to_thread(envtree.seal, env)
        if (await asyncio.to_thread(envtree.survey, env, True)).digest != code.digest:
            return  # a job changed it meanwhile: the build's survey stands, and finds it
        found = await asyncio.to_thread(envtree.survey, env)
        meta.update(survey=found.digest, size=found.size, entries=found.entries, compiled=True)
        if failed:
            meta["compile_error"] = failed
        await asyncio.to_thread(self.store.write_meta, key, meta)

    # ----------------------------------------------------------------- using

    def hold(self, build_key: str) -> Hold:
        """Mark a built env in use (by a running job) and record its use: eviction never
        removes it while held. EnvError when it is not (or no longer) in the cache."""
        hold = self.store.use(build_key)
        if not self.store.whole(build_key):
            hold.release()
            raise EnvError(f"environment {build_key[:12]} is not in the cache", where="wait")
        return hold

    def intact(self, build_key: str) -> bool:
        """Whether the env is as it was built: every file, folder and link there, with the
        same size, mtime and mode (and nothing added)."""
        return self.store.intact(build_key)

    def unchecked(self, build_key: str) -> None:
        """A job that could change the env (it runs as the worker's own user) takes it:
        it is not reused before :meth:`check` finds it unchanged."""
        self.store.unchecked(build_key)

    def check(self, build_key: str) -> bool | None:
        """After such a job: survey the env. True: unchanged (ready again once no job
        holds it); False: changed, and removed (or, held by another job, left to be
        removed once unused; never reused meanwhile); None: it is gone already."""
        fd = self.store.lock_file(build_key, "build")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # not while its bytecode is being compiled
            if not self.store.whole(build_key):
                return None
            if self.store.intact(build_key):
                self.store.checked(build_key)
                return True
            self.store.remove_unheld(build_key)
            return False
        finally:
            os.close(fd)

    def remove(self, build_key: str) -> bool:
        """Remove an env (one a job changed) unless a job holds it; whether it went."""
        return self.store.remove_unheld(build_key)

    def evict(self, keep: Iterable[str] = ()) -> list[str]:
        """Remove the least recently used envs nobody holds until the cache is under its
        cap (never those in ``keep``); the keys removed."""
        keep = set(keep)
        entries = [(i.last_used, i.size, i.key) for i in self.store.infos(in_use=False)]
        total = sum(size for _, size, _ in entries)
        removed: list[str] = []
        for _, size, key in sorted(entries):
            if total <= self.settings.cap_bytes:
                break
            if key not in keep and self.store.remove_unheld(key):
                total -= size
                removed.append(key)
        return removed

    def listing(self) -> list[EnvInfo]:
        """The cached envs, most recently used first."""
        return sorted(self.store.infos(in_use=True), key=lambda i: i.last_used, reverse=True)

    def total_bytes(self) -> int:
        """The size of the cached envs, as measured at their builds."""
        return sum(info.size for info in self.store.infos(in_use=False))


def _fits(meta: Mapping[str, Any], spec: EnvSpec, fleet_lock: str | None) -> bool:
    """Whether a cached env is what a job asks for: not when it asks for a fresh
    resolution (``upgrade``), nor when the fleet's lock is not the one it was built from
    (the lock moved on: another worker's upgrade)."""
    if spec.upgrade:
        return False
    return fleet_lock is None or spec.locked or meta.get("lock_sha256") == _sha256(fleet_lock)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _check_files(spec: EnvSpec, files: Mapping[str, bytes]) -> None:
    """Every file of the spec is given, with the bytes the spec names."""
    for f in spec.files:
        data = files.get(f.name)
        if data is None or hashlib.sha256(data).hexdigest() != f.sha256:
            what = "missing" if data is None else "not the file the job sent (hash differs)"
            raise EnvError(f"the environment's {f.name} is {what}", where="files")


def _remove_all(*paths: Path) -> None:
    for path in paths:
        envtree.remove_tree(path)
