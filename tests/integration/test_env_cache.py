"""The worker's environment cache with the real uv, pointed at a folder of hand-made
wheels (no network): builds, reuse, locks, concurrency, failures, the size cap and the
seal (gpufleet.worker.environments)."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ParamSpec

import pytest
import uv

from gpufleet.domain.environments import EnvFile, EnvSpec
from gpufleet.worker import envtree
from gpufleet.worker.envbuild import EnvError, Uv, uv_environment
from gpufleet.worker.environments import Built, EnvCache, EnvSettings
from gpufleet.worker.envtree import JOB_SITE_VAR, site_packages
from tests.wheels import make_wheel

UV = uv.find_uv_bin()
P = ParamSpec("P")


def in_loop(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Run an async test in a loop of its own (the suite has no async plugin)."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@pytest.fixture(scope="module")
def uv_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uv cache for the file's builds, as a worker's builds share one."""
    return tmp_path_factory.mktemp("uv-cache")


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    for version in ("1.0", "1.1"):
        make_wheel(folder, "gfdemo", version, scripts=["gfdemo-version"])
    return folder


def settings_for(root: Path, wheels: Path, uv_cache: Path, cap: int = 10**10) -> EnvSettings:
    return EnvSettings(
        root=root,
        cap_bytes=cap,
        uv=UV,
        find_links=(str(wheels),),
        uv_env={"UV_CACHE_DIR": str(uv_cache)},
    )


@pytest.fixture
def cache(tmp_path: Path, wheels: Path, uv_cache: Path) -> EnvCache:
    return EnvCache(settings_for(tmp_path / "envs", wheels, uv_cache))


class Lines(list[str]):
    """What ``ensure`` told its ``on_line``."""

    def __call__(self, line: str) -> None:
        self.append(line)

    def say(self, words: str) -> bool:
        return any(words in line for line in self)


async def build(
    cache: EnvCache,
    spec: EnvSpec,
    files: dict[str, bytes] | None = None,
    fleet_lock: str | None = None,
    lines: Lines | None = None,
) -> Built:
    files = files or {}
    plan = await cache.plan(spec, files, gpus=0, cuda_version=None)
    built = await cache.ensure(plan, files, fleet_lock, lines if lines is not None else Lines())
    await cache.settled()  # its bytecode, compiled once the job has it
    return built


def run_python(built: Built, code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(built.python), "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": os.environ["PATH"], **(env or {})},
    )
    return done.stdout.strip()


def file_of(name: str, data: bytes) -> EnvFile:
    return EnvFile(name, hashlib.sha256(data).hexdigest(), len(data))


# --------------------------------------------------------------------------- building


@in_loop
async def test_a_pinned_requirement_is_built_once_and_runs_from_the_cache(
    cache: EnvCache, tmp_path: Path
) -> None:
    spec = EnvSpec(with_=("gfdemo==1.0",))
    plan = await cache.plan(spec, {}, gpus=0, cuda_version=None)
    assert not plan.built and plan.python.startswith("3.")
    lines = Lines()
    built = await cache.ensure(plan, {}, None, lines)
    assert built.built_here and built.versions == {"gfdemo": "1.0"}
    assert built.new_lock is not None and "gfdemo==1.0" in built.new_lock
    assert lines.say("+ gfdemo==1.0")  # uv's own words, passed on
    version, executable = run_python(
        built, "import gfdemo, sys; print(gfdemo.__version__, sys.executable)"
    ).split()
    assert version == "1.0"
    assert Path(executable).is_relative_to(tmp_path / "envs" / "envs" / plan.build_key)
    # Its scripts run from where the build was renamed to (a relocatable venv).
    script = built.path / "bin" / "gfdemo-version"
    assert subprocess.run([script], capture_output=True, text=True, timeout=60).stdout == "1.0\n"
    [info] = cache.listing()
    assert info.in_use and info.python == plan.python and info.size > 0
    assert "--with gfdemo==1.0" in info.describe() and "in use" in info.describe()
    built.hold.release()
    await cache.settled()  # its bytecode compiled (which holds it meanwhile)
    assert not cache.listing()[0].in_use
    assert not any((tmp_path / "envs" / "tmp").iterdir())  # the build's folders are gone

    again = await build(cache, spec)
    assert (await cache.plan(spec, {}, 0, None)).built
    assert not again.built_here and again.new_lock is None
    assert again.versions == {"gfdemo": "1.0"} and again.path == built.path
    again.hold.release()


@in_loop
async def test_a_project_is_installed_from_its_own_uv_lock_as_it_is(
    cache: EnvCache, tmp_path: Path, wheels: Path, uv_cache: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    pyproject = b'[project]\nname = "job"\nversion = "0"\ndependencies = ["gfdemo"]\n'
    (project / "pyproject.toml").write_bytes(pyproject)
    only_old = tmp_path / "old-wheels"
    only_old.mkdir()
    shutil.copy(wheels / "gfdemo-1.0-py3-none-any.whl", only_old)
    env = uv_environment(os.environ, {"UV_CACHE_DIR": str(uv_cache)}, False)
    lock_cmd = [UV, "lock", "--no-index", "--find-links", str(only_old), "--python", sys.executable]
    subprocess.run(lock_cmd, cwd=project, env=env, check=True, capture_output=True, timeout=60)
    uv_lock = (project / "uv.lock").read_bytes()
    files = {"pyproject.toml": pyproject, "uv.lock": uv_lock}
    spec = EnvSpec(project=file_of("pyproject.toml", pyproject), lock=file_of("uv.lock", uv_lock))

    built = await build(cache, spec, files)
    assert built.versions == {"gfdemo": "1.0"}  # the lock's, though 1.1 is at hand
    assert built.new_lock is None  # the job's own lock: nothing for the fleet to record
    assert run_python(built, "import gfdemo; print(gfdemo.__version__)") == "1.0"
    built.hold.release()

    unlocked = EnvSpec(project=file_of("pyproject.toml", pyproject))
    fresh = await build(cache, unlocked, {"pyproject.toml": pyproject})
    assert fresh.versions == {"gfdemo": "1.1"}
    assert fresh.new_lock is not None and 'version = "1.1"' in fresh.new_lock
    fresh.hold.release()


@in_loop
async def test_the_fleet_lock_holds_a_resolution_until_an_upgrade_moves_it(
    cache: EnvCache, tmp_path: Path, wheels: Path, uv_cache: Path
) -> None:
    spec = EnvSpec(with_=("gfdemo",))
    first = await build(cache, spec)
    assert first.versions == {"gfdemo": "1.1"}  # the highest there is
    fleet_lock = first.new_lock
    assert fleet_lock is not None
    first.hold.release()

    make_wheel(wheels, "gfdemo", "1.2")
    other_worker = EnvCache(settings_for(tmp_path / "other", wheels, uv_cache))
    pinned = await build(other_worker, spec, fleet_lock=fleet_lock)
    assert pinned.built_here and pinned.versions == {"gfdemo": "1.1"} and pinned.new_lock is None
    pinned.hold.release()

    upgraded = await build(
        other_worker, EnvSpec(with_=("gfdemo",), upgrade=True), fleet_lock=fleet_lock
    )
    assert upgraded.built_here and upgraded.versions == {"gfdemo": "1.2"}
    assert upgraded.new_lock is not None and "gfdemo==1.2" in upgraded.new_lock
    upgraded.hold.release()

    # The fleet still records the old lock: a job that follows it gets it back.
    back = await build(other_worker, spec, fleet_lock=fleet_lock)
    assert back.built_here and back.versions == {"gfdemo": "1.1"}
    back.hold.release()


@in_loop
async def test_concurrent_jobs_wanting_one_environment_build_it_once(cache: EnvCache) -> None:
    spec = EnvSpec(with_=("gfdemo==1.1",))
    plan = await cache.plan(spec, {}, 0, None)
    said = (Lines(), Lines())
    first, second = await asyncio.gather(*(cache.ensure(plan, {}, None, s) for s in said))
    # Either may win the build (both start at once); the other waits for it.
    assert sorted([first.built_here, second.built_here]) == [False, True]
    one, two = (first, second) if first.built_here else (second, first)
    waiter = said[1] if first.built_here else said[0]
    assert waiter.say("waiting for another job's build")
    assert one.path == two.path and two.versions == {"gfdemo": "1.1"}
    assert cache.listing()[0].in_use
    one.hold.release()
    assert cache.listing()[0].in_use  # the second job still holds it
    two.hold.release()
    await cache.settled()
    assert not cache.listing()[0].in_use


@in_loop
async def test_a_build_in_another_process_is_waited_for(cache: EnvCache) -> None:
    spec = EnvSpec(with_=("gfdemo==1.0",))
    plan = await cache.plan(spec, {}, 0, None)
    # Another worker's build holds the key's build lock (a flock: any open file conflicts).
    other = cache.store.lock_file(plan.build_key, "build")
    fcntl.flock(other, fcntl.LOCK_EX)
    lines = Lines()
    task = asyncio.create_task(cache.ensure(plan, {}, None, lines))
    await asyncio.sleep(0.5)
    assert not task.done() and lines.say("waiting for another worker's build")
    os.close(other)
    built = await asyncio.wait_for(task, 60)
    assert built.built_here and built.versions == {"gfdemo": "1.0"}
    built.hold.release()


# A worker process of its own that ensures one environment and says whether it built it.
WORKER = """
import asyncio, faulthandler, json, sys
from pathlib import Path
faulthandler.dump_traceback_later(50, exit=True)  # a hang says where, before the test's 60 s
from gpufleet.domain.environments import EnvSpec
from gpufleet.worker.environments import EnvCache, EnvSettings

root, uv, wheels, uv_cache = sys.argv[1:]
settings = EnvSettings(
    Path(root), 10**10, uv, find_links=(wheels,), uv_env={"UV_CACHE_DIR": uv_cache}
)

async def main():
    cache = EnvCache(settings)
    plan = await cache.plan(EnvSpec(with_=("gfdemo==1.1",)), {}, 0, None)
    built = await cache.ensure(plan, {}, None, lambda line: None)
    print(json.dumps([built.built_here, built.versions]))

asyncio.run(main())
"""


def test_two_worker_processes_sharing_a_cache_build_an_environment_once(
    tmp_path: Path, wheels: Path, uv_cache: Path
) -> None:
    argv = [sys.executable, "-c", WORKER, str(tmp_path / "shared"), UV, str(wheels), str(uv_cache)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        answers = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.communicate()  # reaped, its pipe closed
    assert sorted(here for here, _ in answers) == [False, True]
    assert all(versions == {"gfdemo": "1.1"} for _, versions in answers)
    assert len(EnvCache(settings_for(tmp_path / "shared", wheels, uv_cache)).listing()) == 1


@in_loop
async def test_a_half_built_environment_is_never_used_and_its_leftovers_go(
    cache: EnvCache, tmp_path: Path, wheels: Path, uv_cache: Path
) -> None:
    spec = EnvSpec(with_=("gfdemo==1.0",))
    plan = await cache.plan(spec, {}, 0, None)
    # A worker killed mid-build: its folder in tmp/, and a venv in envs/ with no meta.
    leftover = cache.store.temp(plan.build_key)
    (leftover / "lib").mkdir(parents=True)
    shutil.copytree(leftover, cache.store.env(plan.build_key))
    (cache.store.env(plan.build_key) / "pyvenv.cfg").write_text("home = /nowhere\n")
    restarted = EnvCache(cache.settings)
    assert restarted.leftovers == 1 and not leftover.exists()
    assert not (await restarted.plan(spec, {}, 0, None)).built and restarted.listing() == []
    built = await restarted.ensure(plan, {}, None, Lines())
    assert built.built_here and built.versions == {"gfdemo": "1.0"}
    assert run_python(built, "import gfdemo; print(gfdemo.__version__)") == "1.0"
    built.hold.release()


# --------------------------------------------------------------------------- failures


@in_loop
async def test_a_requirement_that_does_not_exist_fails_finally_naming_it(
    cache: EnvCache, tmp_path: Path
) -> None:
    lines = Lines()
    with pytest.raises(EnvError) as caught:
        await build(cache, EnvSpec(with_=("nosuchpkg",)), lines=lines)
    err = caught.value
    assert err.final and err.where == "resolve"
    assert "nosuchpkg" in err.message and "\n" not in err.message
    assert any("nosuchpkg" in line for line in err.lines) and lines.say("nosuchpkg")
    assert cache.listing() == [] and not any((tmp_path / "envs" / "tmp").iterdir())


@in_loop
async def test_a_python_the_worker_lacks_fails_naming_what_it_has(
    cache: EnvCache,
) -> None:
    have = await cache.pythons()
    assert have and all(v.startswith("3.") for v in have)
    with pytest.raises(EnvError) as caught:
        await cache.plan(EnvSpec(with_=("gfdemo",), python="3.4"), {}, 0, None)
    err = caught.value
    assert not err.final and err.where == "python"  # another worker may have it
    assert "no Python 3.4" in err.message and have[0] in err.message


@in_loop
async def test_uv_lines_come_as_printed_and_a_build_past_its_limit_is_killed(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "slow-uv"
    pid_file = tmp_path / "child.pid"
    fake.write_text(f"#!/bin/sh\necho resolving\nsleep 30 &\necho $! > {pid_file}\nwait\n")
    fake.chmod(0o755)
    lines = Lines()
    started = time.monotonic()
    with pytest.raises(EnvError) as caught:
        await Uv(str(fake), {"PATH": os.environ["PATH"]}, []).run(
            [], where="resolve", on_line=lines, deadline=started + 1.0, cwd=tmp_path
        )
    assert time.monotonic() - started < 10
    assert caught.value.where == "timeout" and not caught.value.final
    assert lines == ["resolving"] and caught.value.lines == ["resolving"]
    child = int(pid_file.read_text())
    assert not _alive(child)  # its whole process group went


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split()[2] != "Z"


# --------------------------------------------------------------------------- the cap


@in_loop
async def test_eviction_removes_the_least_recently_used_and_never_a_held_one(
    tmp_path: Path, wheels: Path, uv_cache: Path
) -> None:
    cache = EnvCache(settings_for(tmp_path / "envs", wheels, uv_cache, cap=1))
    old = await build(cache, EnvSpec(with_=("gfdemo==1.0",)))
    old.hold.release()
    lines = Lines()
    new = await build(cache, EnvSpec(with_=("gfdemo==1.1",)), lines=lines)
    # Over the cap: the unused one went, the one just built (and held) stays.
    assert [i.key for i in cache.listing()] == [new.plan.build_key]
    assert not old.path.exists() and lines.say("removed to keep the cache under its cap")
    assert cache.evict() == []  # held: never removed, however far over the cap
    assert new.path.is_dir()
    new.hold.release()
    assert cache.evict() == [new.plan.build_key] and cache.listing() == []


@in_loop
async def test_the_least_recently_used_goes_first(cache: EnvCache) -> None:
    keys = []
    for version in ("1.0", "1.1"):
        built = await build(cache, EnvSpec(with_=(f"gfdemo=={version}",)))
        built.hold.release()
        keys.append(built.plan.build_key)
    time.sleep(0.02)
    cache.hold(keys[0]).release()  # the older build, used since
    sizes = {i.key: i.size for i in cache.listing()}
    cache = EnvCache(replace(cache.settings, cap_bytes=sizes[keys[0]]))  # room for one
    assert cache.evict() == [keys[1]]
    assert [i.key for i in cache.listing()] == [keys[0]]


# --------------------------------------------------------------------------- the seal


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A cache folder any user may pass through (pytest's own tmp is root's alone), so
    that a refused write is refused by the seal, not by a folder above it."""
    root = Path(tempfile.mkdtemp(prefix="gpufleet-envs-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root")
@in_loop
async def test_jobs_of_other_users_cannot_write_into_an_environment(
    open_root: Path, wheels: Path, uv_cache: Path
) -> None:
    cache = EnvCache(settings_for(open_root / "cache", wheels, uv_cache))
    built = await build(cache, EnvSpec(with_=("gfdemo==1.0",)))
    package = site_packages(built.path) / "gfdemo" / "__init__.py"
    assert as_nobody("cat", str(package)).stdout.startswith('__version__ = "1.0"')  # reachable
    changed = as_nobody("sh", "-c", f"echo 'x = 1' >> {package}")
    added = as_nobody("touch", str(package.parent / "extra.py"))
    assert changed.returncode != 0 and "Permission denied" in changed.stderr
    assert added.returncode != 0 and "Permission denied" in added.stderr
    assert cache.intact(built.plan.build_key)
    built.hold.release()


@in_loop
async def test_a_changed_environment_is_detected_and_rebuilt(
    cache: EnvCache, tmp_path: Path
) -> None:
    spec = EnvSpec(with_=("gfdemo==1.0",))
    built = await build(cache, spec)
    key = built.plan.build_key
    cache.unchecked(key)  # as the worker marks it for a job of its own user
    # A job running as root imports from it: Python finds its .pyc files and writes none.
    assert run_python(built, "import gfdemo; print(gfdemo.__version__)") == "1.0"
    assert cache.intact(key)
    package = site_packages(built.path) / "gfdemo" / "__init__.py"
    package.chmod(0o644)
    package.write_text('__version__ = "evil"\n')
    assert not cache.intact(key)
    built.hold.release()
    assert not (await cache.plan(spec, {}, 0, None)).built  # not reused unchecked
    assert cache.check(key) is False  # the worker's check after the job: removed
    rebuilt = await build(cache, spec)
    assert rebuilt.built_here and cache.intact(key)
    assert run_python(rebuilt, "import gfdemo; print(gfdemo.__version__)") == "1.0"
    rebuilt.hold.release()


@in_loop
async def test_a_checked_environment_is_ready_without_a_survey(
    cache: EnvCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = EnvSpec(with_=("gfdemo==1.0",))
    built = await build(cache, spec)
    key = built.plan.build_key
    cache.unchecked(key)
    built.hold.release()
    assert cache.check(key) is True  # unchanged: ready again
    surveys = []
    real = envtree.survey
    monkeypatch.setattr(envtree, "survey", lambda root: surveys.append(root) or real(root))
    again = await build(cache, spec)
    assert not again.built_here and surveys == []  # a warm start walks none of its files
    again.hold.release()


@in_loop
async def test_a_job_adds_packages_of_its_own_through_its_job_site(
    cache: EnvCache, tmp_path: Path
) -> None:
    built = await build(cache, EnvSpec(with_=("gfdemo==1.0",)))
    job_site = tmp_path / "job" / ".site"
    job_site.mkdir(parents=True)
    (job_site / "jobextra.py").write_text("WHERE = 'job site'\n")
    code = "import jobextra; print(jobextra.WHERE)"
    assert run_python(built, code, {JOB_SITE_VAR: str(job_site)}) == "job site"
    assert cache.intact(built.plan.build_key)
    built.hold.release()


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("gpus", "cuda", "setting", "expected"),
    [
        (0, None, "auto", "cpu"),
        (2, "12.8", "auto", "cu128"),
        (2, "12.8", "none", None),
        (2, "12.8", "cu126", "cu126"),
    ],
)
@in_loop
async def test_the_torch_build_follows_the_workers_gpus_and_driver(
    tmp_path: Path, gpus: int, cuda: str | None, setting: str, expected: str | None
) -> None:
    settings = EnvSettings(root=tmp_path / "c", cap_bytes=10**9, uv=UV, torch_backend=setting)
    cache = EnvCache(settings)
    reqs = b"numpy\ntorch==2.8.0\n"
    spec = EnvSpec(requirements=file_of("requirements.txt", reqs))
    plan = await cache.plan(spec, {"requirements.txt": reqs}, gpus, cuda)
    assert plan.torch_backend == expected
    no_torch = await cache.plan(EnvSpec(with_=("numpy",)), {}, gpus, cuda)
    assert no_torch.torch_backend is None


@in_loop
async def test_a_cpu_and_a_gpu_worker_never_share_a_torch_build(tmp_path: Path) -> None:
    cache = EnvCache(EnvSettings(root=tmp_path / "c", cap_bytes=10**9, uv=UV))
    spec = EnvSpec(with_=("torch",))
    cpu = await cache.plan(spec, {}, gpus=0, cuda_version=None)
    gpu = await cache.plan(spec, {}, gpus=2, cuda_version="12.8")
    assert cpu.build_key != gpu.build_key and cpu.lock_key != gpu.lock_key
    plain = await cache.plan(EnvSpec(with_=("numpy",)), {}, gpus=0, cuda_version=None)
    assert plain.build_key == (await cache.plan(EnvSpec(with_=("numpy",)), {}, 2, "12.8")).build_key


@in_loop
async def test_an_index_of_the_workers_own_means_no_torch_build_and_another_key(
    tmp_path: Path, wheels: Path, uv_cache: Path
) -> None:
    spec = EnvSpec(with_=("torch",))
    folder = EnvCache(settings_for(tmp_path / "a", wheels, uv_cache))
    index_var = EnvCache(
        EnvSettings(tmp_path / "b", 10**9, UV, uv_env={"UV_INDEX_URL": "http://127.0.0.1:9/simple"})
    )
    public = EnvCache(EnvSettings(tmp_path / "c", 10**9, UV))
    plans = [await c.plan(spec, {}, 2, "12.8") for c in (folder, index_var, public)]
    assert [p.torch_backend for p in plans] == [None, None, "cu128"]
    assert len({p.build_key for p in plans}) == 3


@in_loop
async def test_the_bytecode_is_compiled_after_the_job_has_its_environment(
    cache: EnvCache,
) -> None:
    spec = EnvSpec(with_=("gfdemo==1.0",))
    plan = await cache.plan(spec, {}, 0, None)
    built = await cache.ensure(plan, {}, None, Lines())
    package = site_packages(built.path) / "gfdemo"
    # the job may start now: its imports compile in memory (it writes no .pyc)
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    assert run_python(built, "import gfdemo; print(gfdemo.__version__)", env) == "1.0"
    await cache.settled()
    assert list((package / "__pycache__").glob("__init__.cpython-*.pyc"))  # compiled after
    assert cache.intact(plan.build_key)  # and sealed again, its survey recorded
    assert stat.S_IMODE((package / "__pycache__").stat().st_mode) == 0o555
    built.hold.release()
