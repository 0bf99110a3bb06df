"""Starting a job's process: found as exec finds it, its exit seen, its output read, and
killed with the worker that started it (by the guard, its children too; and, where the
guard cannot start, with setpriv and without)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.worker import runner, spawn
from gpufleet.worker.runner import JobProcess, OnLine
from tests.procs import alive, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


@pytest.fixture(autouse=True)
def _guard_stopped() -> Iterator[None]:
    """A job started in this process has its guard started here: the test ends it."""
    yield
    spawn.stop_guard()


async def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, bytes, bytes]:
    proc = await spawn.spawn(argv, cwd, env, 1 << 16)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
    return await proc.wait(), out, err


def test_a_command_is_found_as_exec_finds_it(tmp_path: Path) -> None:
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/sh\necho hello from $1; echo oops >&2; exit 3\n")
    script.chmod(0o755)
    env = {"PATH": os.environ["PATH"]}
    assert asyncio.run(_run(["./hello.sh", "x"], tmp_path, env)) == (
        3,
        b"hello from x\n",
        b"oops\n",
    )
    assert asyncio.run(_run(["true"], tmp_path, env))[0] == 0
    with pytest.raises(FileNotFoundError):
        asyncio.run(_run(["no-such-command-here"], tmp_path, env))
    (tmp_path / "plain.txt").write_text("not a program")
    with pytest.raises(PermissionError):
        asyncio.run(_run(["./plain.txt"], tmp_path, env))


def test_the_exit_is_seen_and_many_quick_jobs_all_end(tmp_path: Path) -> None:
    async def killed() -> int:
        proc = await spawn.spawn(["sleep", "30"], tmp_path, dict(os.environ), 1 << 16)
        assert proc.returncode is None
        os.kill(proc.pid, signal.SIGTERM)
        return await asyncio.wait_for(proc.wait(), 10)

    assert asyncio.run(killed()) == -signal.SIGTERM

    async def many() -> list[int]:  # many quick jobs, several at once: every exit is seen
        limit = asyncio.Semaphore(8)

        async def one() -> int:
            async with limit:
                proc = await spawn.spawn(["true"], tmp_path, dict(os.environ), 1024)
                assert proc.stdout is not None
                await asyncio.wait_for(proc.stdout.read(), 10)
                return await asyncio.wait_for(proc.wait(), 10)

        return await asyncio.gather(*(one() for _ in range(300)))

    assert asyncio.run(many()) == [0] * 300


PARENT = """
import asyncio, os, signal, sys, time
from pathlib import Path
from gpufleet.worker import spawn
how = sys.argv[1]
if how != "guard":
    spawn._guarded = lambda: False
if how == "fallback":
    spawn._setpriv = lambda: None
async def main():
    if how == "guard":  # a guard someone killed is replaced, and told the running jobs
        first = await spawn.spawn(["sleep", "60"], Path("."), dict(os.environ), 1 << 16)
        os.kill(spawn._guard.proc.pid, signal.SIGKILL)
        spawn._guard.proc.wait()
    # the job, and a child it started (the shell waits for it)
    proc = await spawn.spawn(["sh", "-c", "sleep 60 & echo $!; wait"], Path("."),
                             dict(os.environ), 1 << 16)
    child = int(await proc.stdout.readline())
    pids = [proc.pid, child] + ([first.pid] if how == "guard" else [])
    print(*pids, flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["guard", "setpriv", "fallback"])
def test_a_job_dies_with_the_worker_that_started_it(how: str) -> None:
    if how == "setpriv" and spawn._setpriv() is None:
        pytest.skip("no setpriv on this machine")
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), how], stdout=subprocess.PIPE, text=True
    )
    started: list[int] = []
    try:
        assert parent.stdout is not None
        started = [int(p) for p in parent.stdout.readline().split()]
        job, child, *earlier = started
        assert alive(job) and alive(child)
        time.sleep(0.2)
        parent.kill()  # SIGKILL: the worker has no say
        parent.wait(10)
        wait_for(lambda: not alive(job), 10, f"the job ({how}) to die with its worker")
        for pid in earlier:  # started before its guard was killed and replaced
            wait_for(lambda pid=pid: not alive(pid), 10, "the earlier job to die too")
        if how == "guard":  # its whole group; parent-death signals reach only the job
            wait_for(lambda: not alive(child), 10, "the job's child to die with the worker")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for pid in started:  # what a parent-death signal leaves, or a failed check
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if parent.stdout is not None:
            parent.stdout.close()


_WATCHED = """
import asyncio, os, sys, threading
from pathlib import Path
from gpufleet.worker import spawn

async def main():
    before = threading.active_count()
    most = 0
    async def one(code):
        nonlocal most
        proc = await spawn.spawn(["sh", "-c", f"sleep 0.2; exit {code}"], Path.cwd(),
                                 dict(os.environ), 1 << 16)
        most = max(most, threading.active_count() - before)
        await proc.stdout.read()
        return await proc.wait()
    codes = await asyncio.gather(*(one(n) for n in range(10)))
    print(most, codes)

asyncio.run(main())
"""


def test_the_worker_waits_for_its_jobs_without_a_thread_each(tmp_path: Path) -> None:
    """Python 3.11's asyncio starts a thread per child to wait for it; the worker's loop
    waits on pidfds instead where there are (Linux 5.3 and later, as here), and still sees
    every exit code."""
    out = subprocess.run(
        [sys.executable, "-c", _WATCHED], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    threads, codes = out.stdout.split(" ", 1)
    assert codes.strip() == str(list(range(10)))
    if spawn._pidfds():
        assert threads == "0"


def test_the_guard_never_holds_the_workers_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_TOKEN", "gf_secret_never_in_the_guard")
    monkeypatch.setenv("GPUFLEET_LABEL_NOTE", "kept")
    assert asyncio.run(_run(["true"], tmp_path, {"PATH": os.environ["PATH"]}))[0] == 0
    guard = spawn._guard.proc
    assert guard is not None and guard.poll() is None
    seen = Path(f"/proc/{guard.pid}/environ").read_bytes()
    assert b"GPUFLEET_LABEL_NOTE=kept" in seen  # the environment was read
    assert b"gf_secret_never_in_the_guard" not in seen


def test_the_guard_kills_the_groups_it_holds_and_not_those_reaped() -> None:
    """The guard's own protocol: ``+G`` watches a group, ``-G`` forgets it; at the end of
    its input it kills only the groups it still holds."""
    kept, killed = (subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2))
    guard = subprocess.Popen([sys.executable, "-I", "-S", "-c", spawn.GUARD], stdin=subprocess.PIPE)
    try:
        assert guard.stdin is not None
        guard.stdin.write(b"+%d\n+%d\n-%d\n" % (kept.pid, killed.pid, kept.pid))
        guard.stdin.close()  # as when the worker ends
        guard.wait(10)
        assert killed.wait(10) == -signal.SIGKILL
        assert kept.poll() is None, "a group the guard was told is reaped is left alone"
    finally:
        for proc in (guard, kept, killed):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


_KILLED_WHILE_STARTING = """
import asyncio, os, signal, sys, time
from pathlib import Path
from gpufleet.worker import spawn

async def killed_now(self, limit):  # the worker is killed before the job's pipes connect
    Path("job.pid").write_text(str(self.pid))
    os.kill(os.getpid(), signal.SIGKILL)

spawn.Child.connect = killed_now
asyncio.run(spawn.spawn(["sleep", "60"], Path.cwd(), dict(os.environ), 1 << 16))
"""


@pytest.mark.skipif(not spawn._pidfds(), reason="the loop waits on pidfds only on Linux 5.3+")
def test_a_worker_killed_while_a_job_starts_leaves_no_job_behind(tmp_path: Path) -> None:
    """The guard is told of a job before the worker's loop does anything else, so no kill
    of the worker falls between the job's start and its being guarded."""
    parent = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_STARTING], cwd=tmp_path, timeout=60
    )
    assert parent.returncode == -signal.SIGKILL
    pidfile = tmp_path / "job.pid"
    job = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 10, "the job"))
    try:
        wait_for(lambda: not alive(job), 10, "the job to die with the worker")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job, signal.SIGKILL)


_GUARD_KILLED_MIDWAY = """
import asyncio, os, sys
from pathlib import Path
from gpufleet.worker import spawn

async def main():
    job = await spawn.spawn(["sleep", "60"], Path.cwd(), dict(os.environ), 1 << 16)
    print(job.pid, spawn._guard.proc.pid, flush=True)
    first = spawn._guard.proc
    for _ in range(600):  # no job starts or ends meanwhile: the loop replaces the guard
        await asyncio.sleep(0.05)
        if spawn._guard.proc is not first and spawn._guard.proc is not None:
            print(spawn._guard.proc.pid, flush=True)
            break
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.skipif(not spawn._pidfds(), reason="the loop follows the guard by a pidfd")
def test_a_killed_guard_is_replaced_at_once_and_the_running_job_stays_guarded(
    tmp_path: Path,
) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _GUARD_KILLED_MIDWAY],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    job = 0
    try:
        assert parent.stdout is not None
        job, guard = (int(p) for p in parent.stdout.readline().split())
        time.sleep(1.2)  # a guard that dies as it starts is left to the next job's start
        os.kill(guard, signal.SIGKILL)
        replacement = int(parent.stdout.readline())
        assert replacement != guard and alive(replacement)
        parent.kill()  # the worker dies with no job started since: its job dies too
        parent.wait(10)
        wait_for(lambda: not alive(job), 10, "the job to die with its worker")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if job:
            with contextlib.suppress(ProcessLookupError):
                os.kill(job, signal.SIGKILL)
        if parent.stdout is not None:
            parent.stdout.close()


def test_a_guard_that_stops_reading_is_replaced_not_waited_for() -> None:
    """Telling the guard never blocks the worker: a guard whose pipe is full (frozen) is
    killed and a new one, told every group, takes its place."""
    group = subprocess.Popen(["sleep", "60"], start_new_session=True)
    guard = spawn.Guard()
    try:
        assert guard.ensure() and guard.proc is not None
        frozen = guard.proc
        os.kill(frozen.pid, signal.SIGSTOP)
        for _ in range(100_000):  # a pipe holds 64 KiB: far fewer lines fill it
            guard.watch(group.pid)
            guard.reaped(group.pid)
            if guard.proc is not frozen:
                break
        assert frozen.poll() == -signal.SIGKILL, "the frozen guard is replaced"
        guard.watch(group.pid)
        guard.close()  # the new guard holds the group, and kills it as it ends
        assert group.wait(10) == -signal.SIGKILL
    finally:
        guard.close()
        if group.poll() is None:
            group.kill()
        group.wait(10)


def _children() -> list[int]:
    """This process's children that are not the guard (a live or unreaped job)."""
    import psutil

    guard = spawn._guard.proc.pid if spawn._guard.proc is not None else None
    return [p.pid for p in psutil.Process().children() if p.pid != guard]


@pytest.mark.skipif(not spawn._pidfds(), reason="the loop waits on pidfds only on Linux 5.3+")
@pytest.mark.parametrize("fails", ["guard", "loop"])
def test_a_job_that_cannot_be_guarded_or_waited_for_is_killed_and_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """Where the guard cannot be told of a job, or the loop cannot wait for it (out of
    descriptors), the start fails and the job is not left running, nor a zombie, nor
    held by the guard (whose later copies would kill the group id, maybe reused)."""

    def refused(*_: object) -> None:
        raise OSError(24, "Too many open files")

    async def start() -> None:
        assert spawn._guard.ensure()
        if fails == "guard":
            monkeypatch.setattr(spawn._guard, "_say", refused)
        else:
            monkeypatch.setattr(spawn.Child, "__init__", refused)
        await spawn.spawn(["sleep", "60"], tmp_path, dict(os.environ), 1 << 16)

    before = _children()
    with pytest.raises(OSError):
        asyncio.run(start())
    assert _children() == before and spawn._guard.groups == set()


@pytest.mark.skipif(not spawn._pidfds(), reason="the loop follows the guard by a pidfd")
def test_a_guard_killed_as_it_starts_is_replaced_a_moment_later(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int | None]:
        job = await spawn.spawn(["sleep", "60"], tmp_path, dict(os.environ), 1 << 16)
        assert spawn._guard.proc is not None
        first, replacement = spawn._guard.proc.pid, None
        os.kill(first, signal.SIGKILL)  # within its first second
        for _ in range(100):  # no job starts or ends meanwhile
            await asyncio.sleep(0.05)
            now = spawn._guard.proc
            if now is not None and now.pid != first and now.poll() is None:
                replacement = now.pid
                break
        os.killpg(job.pid, signal.SIGKILL)
        await job.wait()
        spawn.reaped(job.pid)
        return first, replacement

    first, replacement = asyncio.run(scenario())
    assert replacement is not None and replacement != first


# ---- a job's end and the rest of its output (the runner) -----------------------------


@pytest.fixture(params=["pidfd", "asyncio"])
def waited_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The loop learns of a job's exit from a pidfd, or (a kernel without pidfds) asyncio."""
    if request.param == "asyncio":
        monkeypatch.setattr(spawn, "_pidfds", lambda: False)
    return str(request.param)


def test_a_job_ends_when_its_process_exits_though_a_process_it_left_holds_its_output(
    tmp_path: Path, waited_by: str
) -> None:
    """A job's script that exits leaving a background process writing to its output is
    over: the wait returns at the exit, the reap kills what was left in its group, and
    the output it wrote is read (the job does not run on until the leftover ends)."""
    lines: list[tuple[str, str]] = []

    async def main() -> tuple[int | None, int]:
        argv = ["sh", "-c", "(sleep 60; echo late) & echo $! > left; echo early; exit 0"]
        job = await JobProcess.start(argv, tmp_path, dict(os.environ), _keep(lines))
        code = await job.wait(20)
        await asyncio.wait_for(job.reap(tmp_path), 20)
        return code, int((tmp_path / "left").read_text())

    code, left = asyncio.run(main())
    assert code == 0
    assert lines == [("stdout", "early")]
    assert wait_for(lambda: not alive(left), 10), "the process the job left still runs"


TICKS = """
import os, sys, time
os.setsid()  # out of the job's group: the reap's kill does not reach it
with open("left.tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename("left.tmp", "left")  # the job's script ends once this process is out
ticks, every, then = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
for n in range(ticks):
    print(f"tick {n}", flush=True)
    time.sleep(every)
time.sleep(then)
"""


async def _left_ticking(
    tmp_path: Path, ticks: int, every: float, then: float
) -> tuple[list[tuple[str, str]], float, int]:
    """A job whose script starts a process that leaves its group and writes ``ticks``
    lines ``every`` seconds to the job's stdout, then holds it silent ``then`` seconds.
    What the reap read, how long it took, and that process's pid."""
    (tmp_path / "ticks.py").write_text(TICKS)
    (tmp_path / "left").unlink(missing_ok=True)
    lines: list[tuple[str, str]] = []
    wait = "while [ ! -e left ]; do sleep 0.02; done"
    shell = f"{sys.executable} ticks.py {ticks} {every} {then} & {wait}; exit 0"
    job = await JobProcess.start(["sh", "-c", shell], tmp_path, dict(os.environ), _keep(lines))
    assert await job.wait(20) == 0
    began = time.monotonic()
    await asyncio.wait_for(job.reap(tmp_path), 60)
    return lines, time.monotonic() - began, int((tmp_path / "left").read_text())


def _end(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_output_still_coming_after_the_job_ends_is_read_while_it_comes(
    tmp_path: Path, waited_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a job's process ended, its output is read for as long as lines keep coming
    (here 4 s of them, from a process that left the job's group), and a pipe that stays
    silent for ``DRAIN_IDLE`` (here 2 s) is given up on, not waited for."""
    monkeypatch.setattr(runner, "DRAIN_IDLE", 2.0)
    lines, _, left = asyncio.run(_left_ticking(tmp_path, 80, 0.05, 0))
    try:
        assert lines == [("stdout", f"tick {n}") for n in range(80)]
    finally:
        _end(left)
    lines, took, left = asyncio.run(_left_ticking(tmp_path, 0, 0, 60))  # silent a minute
    try:
        assert lines == [] and took < 20, took
    finally:
        _end(left)


def test_output_that_never_ends_is_read_for_a_bounded_time_after_the_job_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that left the job's group and writes on and on does not keep the job
    from ending: its output is read ``DRAIN_MOST`` seconds at most (here 1 s)."""
    monkeypatch.setattr(runner, "DRAIN_MOST", 1.0)
    lines, took, left = asyncio.run(_left_ticking(tmp_path, 600, 0.05, 0))  # 30 s of it
    try:
        assert took < 15, took
        assert 0 < len(lines) < 600
    finally:
        _end(left)


def _keep(lines: list[tuple[str, str]]) -> OnLine:
    return lambda stream, line: lines.append((stream, line))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_a_job_runs_as_its_slot_user_and_its_reap_ends_all_that_user_runs(
    waited_by: str,
) -> None:
    """``--run-as``: the job runs as the slot user with none of the worker's groups; the
    reap kills every process of that user, also one that left the job's group, and the
    guard still kills the group of a job run as another user."""
    import pwd
    import shutil
    import tempfile

    from gpufleet.worker.isolation import SlotUser

    entry = pwd.getpwnam("nobody")
    user = SlotUser("nobody", entry.pw_uid, entry.pw_gid, "/")
    top = Path(tempfile.mkdtemp(prefix="gpufleet-spawn-"))
    top.chmod(0o711)
    lines: list[tuple[str, str]] = []

    async def main() -> tuple[int | None, int]:
        script = "id -u; id -G; setsid sleep 60 & echo $! > left; exit 0"
        job = await JobProcess.start(
            ["sh", "-c", script], top, {"PATH": os.defpath}, _keep(lines), user
        )
        code = await job.wait(20)
        left = int(wait_for(lambda: (top / "left").exists() and (top / "left").read_text(), 10))
        assert alive(left)
        await asyncio.wait_for(job.reap(top), 20)
        return code, left

    try:
        top.chmod(0o777)  # the job writes its file here
        code, left = asyncio.run(main())
    finally:
        shutil.rmtree(top)
    assert code == 0
    assert [line for _, line in lines] == [str(user.uid), str(user.gid)]
    wait_for(lambda: not alive(left), 10, "the process the job left to be killed")
