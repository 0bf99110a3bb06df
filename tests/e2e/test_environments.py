"""A job brings its own Python environment: real workers build it with the real uv, from a
folder of wheels the test writes (the workers' configuration points uv at that folder
alone: nothing else is contacted), and keep it in their caches.

The package is ``gfdemo``, in versions the test chooses; gpufleet's own environment never
has it, so a job that imports it runs in the environment its worker built, or fails.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import PYTHON, Fleet, Proc, wait_for
from tests.wheels import make_wheel, slow_uv

#: What the jobs run: the version of gfdemo they see, and their interpreter.
PRINT = "import gfdemo, sys; print('VERSION', gfdemo.__version__, sys.executable)"
UV = str(Path(PYTHON).with_name("uv"))


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    make_wheel(folder, "gfdemo", "1.0")
    make_wheel(folder, "gfdemo", "1.1")
    return folder


@pytest.fixture
def envs(fleet: Fleet, tmp_path: Path) -> Fleet:
    """A server whose workers share one uv cache (as workers on one machine would)."""
    fleet.env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    fleet.start_server()
    return fleet


def _worker(fleet: Fleet, name: str, wheels: Path, *args: str) -> Proc:
    env_dir = fleet.root / f"envs-{name}"
    return fleet.start_worker(
        name, "--env-find-links", str(wheels), "--env-cache-dir", str(env_dir), *args
    )


def _submit(fleet: Fleet, *args: str, code: str = PRINT) -> str:
    out = fleet.cli("submit", *args, "--", "python", "-c", code)
    return out.stdout.strip().splitlines()[-1]


def _ran(fleet: Fleet, job_id: str) -> tuple[str, str]:
    """The version of gfdemo the job printed, and its interpreter."""
    logs = fleet.cli("logs", job_id).stdout
    line = next(x for x in logs.splitlines() if x.startswith("VERSION "))
    _, version, executable = line.split(" ", 2)
    return version, executable


def _used(detail: dict[str, Any]) -> dict[str, Any]:
    """The environment the job's latest attempt ran with, as `show --json` has it."""
    env = detail["history"][-1]["environment"]
    assert env is not None, detail
    return env


def _requirements(tmp_path: Path, text: str, name: str = "requirements.txt") -> Path:
    path = tmp_path / "spec" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_a_pinned_requirements_file_runs_in_the_workers_environment(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    fleet = envs
    _worker(fleet, "w1", wheels)
    ours = subprocess.run([PYTHON, "-c", "import gfdemo"], capture_output=True, timeout=30)
    assert ours.returncode != 0  # gpufleet's own environment lacks the package
    req = _requirements(tmp_path, "gfdemo==1.0\n")

    first = _submit(fleet, "--with-requirements", str(req))
    detail = fleet.wait_status(first, "succeeded", "failed", timeout=90)
    assert detail["status"] == "succeeded", fleet.cli("logs", first).stdout
    version, executable = _ran(fleet, first)
    assert version == "1.0"
    assert executable.startswith(str(fleet.root / "envs-w1")), executable
    used = _used(detail)
    assert used["built"] is True and used["versions"]["gfdemo"] == "1.0"
    logs = fleet.cli("logs", first)
    assert "[env] " in logs.stdout + logs.stderr  # the build's lines, marked as such
    shown = fleet.cli("show", first).stdout
    assert "environment: requirements.txt" in shown
    assert "gfdemo==1.0" in shown  # the versions it ran with

    second = _submit(fleet, "--with-requirements", str(req))
    detail = fleet.wait_status(second, "succeeded", "failed", timeout=60)
    assert detail["status"] == "succeeded"
    assert _used(detail)["built"] is False  # the same environment: nothing built
    assert _used(detail)["key"] == used["key"]
    assert _ran(fleet, second) == (version, executable)


def test_a_pyproject_with_its_uv_lock_is_installed_as_locked(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    fleet = envs
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[project]\nname = "lab"\nversion = "0.1"\nrequires-python = ">=3.8"\n'
        'dependencies = ["gfdemo"]\n'
    )
    only_one = tmp_path / "only-1.0"
    make_wheel(only_one, "gfdemo", "1.0")
    subprocess.run(
        [UV, "lock", "--no-index", "--find-links", str(only_one)],
        cwd=project,
        check=True,
        capture_output=True,
        timeout=120,
        env={**fleet.env, "UV_PYTHON": PYTHON},
    )
    _worker(fleet, "w1", wheels)  # its folder has 1.1 too: the lock says 1.0

    job = _submit(fleet, "--with-requirements", str(project / "pyproject.toml"))
    detail = fleet.wait_status(job, "succeeded", "failed", timeout=90)
    assert detail["status"] == "succeeded", fleet.cli("logs", job).stdout
    assert _ran(fleet, job)[0] == "1.0"
    assert detail["spec"]["environment"]["lock"]["name"] == "uv.lock"


def test_an_unpinned_spec_resolves_once_for_the_whole_fleet(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    fleet = envs
    _worker(fleet, "w1", wheels)
    first = _submit(fleet, "--with", "gfdemo", "--worker", "w1")
    assert fleet.wait_status(first, "succeeded", "failed", timeout=90)["status"] == "succeeded"
    assert _ran(fleet, first)[0] == "1.1"

    make_wheel(wheels, "gfdemo", "1.2")  # a newer release appears
    _worker(fleet, "w2", wheels)  # a cold worker: no environment built yet
    second = _submit(fleet, "--with", "gfdemo", "--worker", "w2")
    detail = fleet.wait_status(second, "succeeded", "failed", timeout=90)
    assert detail["status"] == "succeeded"
    assert _used(detail)["built"] is True
    assert _ran(fleet, second)[0] == "1.1"  # the versions the fleet recorded

    fresh = _submit(fleet, "--with", "gfdemo", "--upgrade", "--worker", "w2")
    assert fleet.wait_status(fresh, "succeeded", "failed", timeout=90)["status"] == "succeeded"
    assert _ran(fleet, fresh)[0] == "1.2"


def test_two_jobs_that_need_one_new_environment_build_it_once(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    fleet = envs
    _worker(fleet, "w1", wheels, "--slots", "2")
    req = _requirements(tmp_path, "gfdemo==1.1\n")
    jobs = [_submit(fleet, "--with-requirements", str(req)) for _ in range(2)]
    details = [fleet.wait_status(j, "succeeded", "failed", timeout=90) for j in jobs]
    assert [d["status"] for d in details] == ["succeeded", "succeeded"]
    assert sorted(_used(d)["built"] for d in details) == [False, True]
    assert all(_ran(fleet, j)[0] == "1.1" for j in jobs)


def _spec_keys(fleet: Fleet, name: str) -> set[str]:
    workers = json.loads(fleet.cli("workers", "--json").stdout)
    (w,) = [w for w in workers if w["name"] == name]
    return {e["spec_key"] for e in w.get("environments") or []}


def _running(fleet: Fleet, name: str) -> list[str]:
    workers = json.loads(fleet.cli("workers", "--json").stdout)
    (w,) = [w for w in workers if w["name"] == name]
    running: list[str] = w["running"]
    return running


def test_the_worker_with_the_environment_built_gets_the_job(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    fleet = envs
    _worker(fleet, "warm", wheels)
    _worker(fleet, "cold", wheels)
    first = _submit(fleet, "--with", "gfdemo==1.0", "--worker", "warm")
    detail = fleet.wait_status(first, "succeeded", "failed", timeout=90)
    key = _used(detail)["spec_key"]
    wait_for(lambda: key in _spec_keys(fleet, "warm"), 30, "warm's heartbeat to list it")
    where = []
    for _ in range(10):
        # both idle and asking for work: a job never waits for a warm worker that is not
        wait_for(lambda: not _running(fleet, "warm"), 30, "warm to be idle")
        time.sleep(0.5)
        job = _submit(fleet, "--with", "gfdemo==1.0")
        where.append(fleet.wait_status(job, "succeeded", "failed", timeout=60)["worker"])
    assert where == ["warm"] * 10
    assert key not in _spec_keys(fleet, "cold")


def test_a_requirement_that_does_not_exist_fails_as_an_environment_failure(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    fleet = envs
    _worker(fleet, "w1", wheels, "--slots", "2")
    bad = _submit(fleet, "--with", "nosuchpkg==1.0", "--max-attempts", "3")
    good = _submit(fleet, "--with", "gfdemo==1.0")
    detail = fleet.wait_status(bad, "succeeded", "failed", timeout=90)
    assert detail["status"] == "failed"
    assert detail["failure"] == "environment"
    assert "nosuchpkg" in detail["error"]
    assert detail["attempts"] == 1  # it would fail the same way anywhere: not retried
    shown = fleet.cli("show", bad).stdout
    assert "nosuchpkg" in shown
    assert fleet.wait_status(good, "succeeded", "failed", timeout=90)["status"] == "succeeded"


def test_the_cache_cap_evicts_the_unused_environment_and_keeps_the_one_in_use(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    fleet = envs
    _worker(fleet, "w1", wheels, "--slots", "2", "--env-cache-size", "1")
    old = _submit(fleet, "--with", "gfdemo==1.0")
    old_key = _used(fleet.wait_status(old, "succeeded", timeout=90))["spec_key"]
    gate = tmp_path / "go"
    hold = (
        "import gfdemo, os, time\n"
        f"for _ in range(600):\n    if os.path.exists({str(gate)!r}): break\n"
        "    time.sleep(0.1)\n"
    )
    busy = _submit(fleet, "--with", "gfdemo==1.1", code=hold)
    busy_detail = fleet.wait_status(busy, "running", timeout=90)
    busy_key = _used(busy_detail)["spec_key"]
    new = _submit(fleet, "--with", "gfdemo==1.0", "--with", "gfdemo<1.1", code=PRINT)
    assert fleet.wait_status(new, "succeeded", "failed", timeout=90)["status"] == "succeeded"
    wait_for(
        lambda: old_key not in (keys := _spec_keys(fleet, "w1")) and busy_key in keys,
        30,
        "the unused environment to go and the one in use to stay",
    )
    gate.write_text("")
    assert fleet.wait_status(busy, "succeeded", timeout=60)["status"] == "succeeded"


def test_an_operator_builds_an_environment_ahead_and_why_says_where_it_is(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    fleet = envs
    _worker(fleet, "w1", wheels)
    _worker(fleet, "w2", wheels)
    built = fleet.cli("envs", "build", "--worker", "w1", "--with", "gfdemo==1.0", "--wait")
    assert "environment ready:" in built.stdout + built.stderr
    wait_for(lambda: _spec_keys(fleet, "w1"), 30, "w1's heartbeat to list its environment")
    listed = fleet.cli("envs", "list").stdout
    assert "w1" in listed and "--with gfdemo==1.0" in listed
    assert "w2" not in listed
    assert "ENVS" in fleet.cli("workers").stdout

    waiting = _submit(fleet, "--with", "gfdemo==1.0", "--gpus", "1")  # no worker has a GPU
    why = json.loads(fleet.cli("why", waiting, "--json").stdout)
    built_on = {w["name"]: w["environment_built"] for w in why["workers"]}
    assert built_on == {"w1": True, "w2": False}
    assert "its environment: built here" in fleet.cli("why", waiting).stdout
    fleet.cli("cancel", waiting)


def test_a_python_no_worker_has_is_refused_at_submit(envs: Fleet, wheels: Path) -> None:
    fleet = envs
    _worker(fleet, "w1", wheels)

    def pythons() -> list[str]:
        (w,) = json.loads(fleet.cli("workers", "--json").stdout)
        found: list[str] = w["capability"]["pythons"]
        return found

    wait_for(pythons, 60, "the worker to report its Pythons")  # found after it registered
    refused = fleet.cli(
        "submit", "--with", "gfdemo", "--python", "3.4", "--", "python", "-V", check=False
    )
    assert refused.returncode != 0
    assert "Python 3.4" in refused.stderr and "w1:" in refused.stderr
    jobs = json.loads(fleet.cli("jobs", "--json").stdout)
    assert jobs == []  # nothing was queued


def test_an_environment_a_root_job_changed_is_rebuilt_for_the_next_job(
    envs: Fleet, wheels: Path
) -> None:
    """A worker whose jobs run as its own user (root here, which permissions do not stop):
    the change is found when the job ends, the environment removed, and the next job of
    it gets one built afresh, as its spec says."""
    from tests.e2e.test_hostile_jobs import LOOK, TAMPER

    fleet = envs
    worker = _worker(fleet, "w1", wheels)
    job = _submit(fleet, "--with", "gfdemo==1.0", code=TAMPER)
    assert fleet.wait_status(job, "succeeded", "failed", timeout=90)["status"] == "succeeded"
    assert "WROTE site-packages" in fleet.cli("logs", job).stdout  # root: nothing stops it
    after = _submit(fleet, "--with", "gfdemo==1.0", code=LOOK)
    detail = fleet.wait_status(after, "succeeded", "failed", timeout=90)
    assert "UNCHANGED 1.0" in fleet.cli("logs", after).stdout
    assert _used(detail)["built"] is True
    assert f"job {job} changed environment" in worker.text()


def test_a_job_installs_packages_into_its_own_folder_never_into_the_environment(
    envs: Fleet, wheels: Path
) -> None:
    import ensurepip

    bundled = Path(ensurepip.__file__).with_name("_bundled")
    pip_wheel = next(bundled.glob("pip-*.whl"))
    (wheels / pip_wheel.name).write_bytes(pip_wheel.read_bytes())
    fleet = envs
    _worker(fleet, "w1", wheels)
    install = (
        "import os, subprocess, sys\n"
        "site = os.environ['GPUFLEET_JOB_SITE']\n"
        "subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-index',\n"
        f"    '--find-links', {str(wheels)!r}, '--target', site, 'gfdemo==1.1'], check=True)\n"
        "import importlib; importlib.invalidate_caches()\n" + PRINT
    )
    job = _submit(fleet, "--with", "gfdemo==1.0", "--with", "pip", code=install)
    detail = fleet.wait_status(job, "succeeded", "failed", timeout=120)
    assert detail["status"] == "succeeded", fleet.cli("logs", job).stderr
    assert _ran(fleet, job)[0] == "1.1"  # its own install, first on its sys.path
    after = _submit(fleet, "--with", "gfdemo==1.0", "--with", "pip")
    detail = fleet.wait_status(after, "succeeded", "failed", timeout=60)
    assert _ran(fleet, after)[0] == "1.0"  # the environment never saw it
    assert _used(detail)["built"] is False


def test_a_job_cancelled_while_its_environment_builds_stops_the_build(
    envs: Fleet, wheels: Path, tmp_path: Path
) -> None:
    import os

    import psutil

    fleet = envs
    slow = 577  # seconds: a number no other process sleeps
    path = os.pathsep.join(
        p for p in (str(slow_uv(tmp_path, slow)), fleet.env.get("PYTHONPATH")) if p
    )
    fleet.start_worker(
        "w1",
        "--env-find-links",
        str(wheels),
        "--env-cache-dir",
        str(fleet.root / "envs-w1"),
        env_extra={"PYTHONPATH": path},
    )

    def sleepers() -> list[psutil.Process]:
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [])[-2:] == ["sleep", str(slow)]
        ]

    job = _submit(fleet, "--with", "gfdemo==1.0")
    with fleet.client() as c:
        wait_for(
            lambda: "building environment" in str((c.job(job).progress or {}).get("message")),
            60,
            "the build to begin",
        )
    wait_for(sleepers, 30, "uv to be in its slow step")
    fleet.cli("cancel", job)
    wait_for(lambda: not sleepers(), 30, "the build's processes to be killed")
    # the worker's one slot is free again: a job without an environment runs at once
    other = _submit(fleet, code="print('VERSION none', 0)")
    assert fleet.wait_status(other, "succeeded", "failed", timeout=30)["status"] == "succeeded"
    assert fleet.job(job)["status"] == "cancelled"
