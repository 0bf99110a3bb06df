"""Hostile jobs: a job tries to get its worker's token, and every way fails.

The job (tests/e2e/hostile_job.py, sent as a package) reads its parent's and every
worker-like process's ``/proc/PID/environ``, reads their memory through ``/proc/PID/mem``
at the addresses their maps give, ptraces them, reads the worker's token file,
configuration dir, cache and work-dir root, and, beside a second job on the same worker,
that job's folder. It reports each way; the test asserts each was denied and that the
worker's token is nowhere in the job's output or artifact.

Real ``gpufleet server`` and ``gpufleet worker`` processes and real Unix users, made for
the session with useradd and removed after: the suite needs root (as in CI), and skips
with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import PYTHON, Fleet, Proc, alive, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0,
        reason="hostile-job suite: needs root, to make Unix users and run a worker as them",
    ),
]

HOSTILE = Path(__file__).with_name("hostile_job.py")
#: The neighbour: keeps a secret in its folder until the test tells it to stop.
NEIGHBOUR = (
    "import os, secrets, time\n"
    "s = secrets.token_hex(16)\n"
    "open('secret.txt', 'w').write(s)\n"
    "print('SECRET', s, flush=True)\n"
    "for _ in range(1200):\n"
    "    if os.path.exists('stop'):\n"
    "        break\n"
    "    time.sleep(0.05)\n"
)


@dataclass(frozen=True)
class Users:
    slots: tuple[str, str]  # the --run-as users of configuration (a)
    own: str  # the user configuration (b)'s worker and its jobs run as


def _useradd(name: str) -> None:
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/bin/false", name],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _userdel(name: str) -> None:
    subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True, timeout=30, check=False)
    subprocess.run(["userdel", name], capture_output=True, timeout=30, check=False)


def _as(user: str) -> list[str]:
    return ["setpriv", "--reuid", user, "--regid", user, "--init-groups"]


def _cannot_run_python(user: str) -> str | None:
    """Why ``user`` cannot run this Python with gpufleet, started as the worker starts a job
    (None: it can)."""
    try:
        ran = subprocess.run(
            [PYTHON, "-c", "import gpufleet"],
            user=user,
            group=user,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError as exc:
        return str(exc)
    return ran.stderr.strip()[-300:] if ran.returncode else None


def _ways_in() -> list[Path]:
    """The folders other users must pass through to run this Python with gpufleet: those
    above the interpreter, its libraries and the package (a virtualenv made from an
    interpreter under /root, or a clone in a private temp folder, sits behind 0700)."""
    import gpufleet

    ends = {
        Path(os.path.realpath(PYTHON)).parent,
        Path(sys.prefix),
        Path(os.path.realpath(sys.base_prefix)),
        Path(gpufleet.__file__).resolve().parent,
    }
    return sorted({d for end in ends for d in (end, *end.parents)})


@contextlib.contextmanager
def _opened(folders: list[Path]) -> Iterator[None]:
    """Let others pass through ``folders`` (o+x: traverse, not list) for the session, and
    put each mode back after, as it was."""
    was: dict[Path, int] = {}
    try:
        for folder in folders:
            mode = folder.stat().st_mode & 0o7777
            if not mode & stat.S_IXOTH:
                was[folder] = mode
                folder.chmod(mode | stat.S_IXOTH)
        yield
    finally:
        for folder, mode in was.items():
            folder.chmod(mode)


@pytest.fixture(scope="session")
def users() -> Iterator[Users]:
    """Three users of this session only: two slot users and a worker's own user. Where
    this Python sits behind a folder closed to others, the way to it is opened for the
    session (traverse only) and closed again after."""
    if shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("hostile-job suite: needs useradd and setpriv (util-linux)")
    tag = os.urandom(3).hex()
    names = [f"gfslot{tag}a", f"gfslot{tag}b", f"gfown{tag}"]
    made: list[str] = []
    try:
        for name in names:
            _useradd(name)
            made.append(name)
        with _opened(_ways_in()):
            problem = _cannot_run_python(names[0])
            if problem:
                pytest.skip(
                    f"hostile-job suite: another user cannot run {PYTHON} with gpufleet, "
                    f"even with the folders above it opened to pass through: {problem}"
                )
            yield Users((names[0], names[1]), names[2])
    finally:
        for name in made:
            _userdel(name)


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder other users may pass through (not list), for the worker's files: pytest's
    own temp folders are closed to them."""
    path = Path(tempfile.mkdtemp(prefix="gpufleet-hostile-"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _worker_token(fleet: Fleet) -> str:
    made = fleet.cli("tokens", "create", "--name", "box", "--role", "worker")
    return made.stdout.strip()


def _token_file(base: Path, token: str) -> Path:
    """The root-only environment file `gpufleet worker install` writes, which systemd reads
    before it starts the worker."""
    secrets = base / "etc"
    secrets.mkdir(mode=0o700)
    path = secrets / "worker.env"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'GPUFLEET_TOKEN="{token}"\n')
    return path


def _start(fleet: Fleet, prefix: list[str], env: dict[str, str], *args: str) -> Proc:
    argv = [*prefix, PYTHON, "-m", "gpufleet", "worker", "--name", "box", "--heartbeat", "0.5"]
    proc = Proc([*argv, *args], {**fleet.env, **env}, fleet.root / "worker-box.log")
    fleet.procs.append(proc)
    wait_for(
        lambda: "registered" in proc.text() or proc.popen.poll() is not None,
        30,
        "the worker to register",
    )
    assert proc.popen.poll() is None, proc.text()
    return proc


def _package(root: Path) -> Path:
    pkg = root / "hostile"
    pkg.mkdir()
    shutil.copy(HOSTILE, pkg / "hostile_job.py")
    return pkg


def _submit(fleet: Fleet, *argv: str, package: Path | None = None) -> str:
    with_package = ["--package", str(package)] if package else []
    out = fleet.cli("submit", "--max-attempts", "1", *with_package, "--", *argv)
    return out.stdout.strip().splitlines()[-1]


def _everything_of(fleet: Fleet, job: str, into: Path) -> tuple[list[dict[str, object]], str]:
    """The job's report, and all it left: its output and its artifact's files."""
    logs = fleet.cli("logs", job)
    fleet.cli("download", job, "-o", str(into))
    files = "".join(p.read_text(errors="replace") for p in into.rglob("*") if p.is_file())
    report = json.loads((into / "outputs" / "report.json").read_text())
    return report, logs.stdout + logs.stderr + files


def _assert_no_token(token: str, text: str) -> None:
    for shown in (token, token.encode().hex(), token[3:]):
        assert shown not in text, "the job got its worker's token"


def _ways(report: list[dict[str, object]], *starts: str) -> dict[str, str]:
    return {str(r["way"]): str(r["result"]) for r in report if str(r["way"]).startswith(starts)}


def _assert_denied(ways: dict[str, str]) -> None:
    assert ways, "the job tried none of these ways"
    for way, result in ways.items():
        assert result.startswith("denied"), f"{way}: {result}"


def test_jobs_of_slot_users_reach_neither_the_worker_nor_each_other(
    fleet: Fleet, users: Users, base: Path
) -> None:
    """(a) The recommended setup: the worker as root with ``--run-as`` slot users. Every
    way fails: the worker's /proc files, its memory and ptrace are root's; its token file,
    configuration, cache and work-dir root are closed; the other job's folder is its own
    user's."""
    fleet.start_server()
    token = _worker_token(fleet)
    env_file = _token_file(base, token)
    config = base / "config"
    config.mkdir(mode=0o700)
    (config / "credentials.json").write_text(json.dumps({"servers": {fleet.url: token}}))
    cache = base / "cache"
    env = {"GPUFLEET_TOKEN": token, "GPUFLEET_CONFIG_DIR": str(config)}
    env["HOSTILE_FILES"] = os.pathsep.join([str(env_file), str(env_file.parent), str(cache)])
    worker = _start(
        fleet,
        [],
        env,
        "--slots",
        "2",
        "--run-as",
        ",".join(users.slots),
        "--work-dir",
        str(base / "work"),
        "--cache-dir",
        str(cache),
    )
    assert f"jobs run as {', '.join(users.slots)}" in worker.text()

    neighbour = _submit(fleet, "python", "-c", NEIGHBOUR)
    fleet.wait_status(neighbour, "running")
    their_dir = base / "work" / f"{neighbour}-1"
    wait_for(lambda: (their_dir / "secret.txt").exists(), 30, "the neighbour's secret")
    hostile = _submit(
        fleet, "python", "hostile_job.py", str(worker.popen.pid), their_dir.name,
        package=_package(fleet.root),
    )  # fmt: skip
    assert fleet.wait_status(hostile, "succeeded", "failed")["status"] == "succeeded"
    (their_dir / "stop").touch()
    assert fleet.wait_status(neighbour, "succeeded", "failed")["status"] == "succeeded"

    report, left = _everything_of(fleet, hostile, fleet.root / "got")
    _assert_no_token(token, left)
    assert any(f"worker {worker.popen.pid} among them: True" in str(r["result"]) for r in report)
    _assert_denied(_ways(report, "proc environ", "proc mem", "ptrace"))
    _assert_denied(_ways(report, "file ", "config dir", "credentials", "work root"))
    _assert_denied(_ways(report, "neighbour"))
    secret = fleet.cli("logs", neighbour).stdout.split("SECRET ", 1)[1].split()[0]
    assert secret not in left, "the job read the other job's folder"
    ids = {str(r["result"]).split()[1] for r in report if r["way"] == "identity"}
    assert ids == {str(pwd.getpwnam(users.slots[1]).pw_uid)}, "not the second slot user"


def test_a_job_of_the_workers_own_user_cannot_read_the_workers_memory(
    fleet: Fleet, users: Users, base: Path
) -> None:
    """(b) Worker and jobs as one user that is not root. The worker (and its guard) are
    non-dumpable, so /proc/PID/environ, /proc/PID/mem and ptrace fail for its jobs, and
    the token file is root's, as systemd keeps it. The worker's configuration, cache and
    work dir are that user's, so its jobs can read them, and two jobs can read each other's
    folders: that is why ``--run-as`` is the recommended setup, and only what this setup
    can protect is asserted here."""
    fleet.start_server()
    token = _worker_token(fleet)
    env_file = _token_file(base, token)
    own = base / "own"
    own.mkdir()
    shutil.chown(own, users.own, users.own)
    env = {
        "GPUFLEET_TOKEN": token,
        "GPUFLEET_CONFIG_DIR": str(own / "config"),
        "HOME": str(own),
        "XDG_CACHE_HOME": str(own / "cache"),
        "HOSTILE_FILES": str(env_file),
    }
    worker = _start(
        fleet, _as(users.own), env, "--work-dir", str(own / "work"), "--cache-dir", str(own / "c")
    )
    hostile = _submit(
        fleet, "python", "hostile_job.py", str(worker.popen.pid), package=_package(fleet.root)
    )
    assert fleet.wait_status(hostile, "succeeded", "failed")["status"] == "succeeded"
    report, left = _everything_of(fleet, hostile, fleet.root / "got")
    _assert_no_token(token, left)
    assert any(f"worker {worker.popen.pid} among them: True" in str(r["result"]) for r in report)
    _assert_denied(_ways(report, "proc environ", "proc mem", "ptrace", "file "))
    ids = {str(r["result"]).split()[1] for r in report if r["way"] == "identity"}
    assert ids == {str(pwd.getpwnam(users.own).pw_uid)}
    _assert_undumpable(worker.popen.pid, pwd.getpwnam(users.own).pw_uid)


def _assert_undumpable(worker: int, uid: int) -> None:
    """The worker and its guard (its child running ``-I -S -c``, started with the first
    job) are non-dumpable: the kernel gives their /proc files to root, though they run as
    ``uid``."""
    guards = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _parent(int(p.name)) == worker and _is_guard(int(p.name))
    ]
    assert guards, "the worker's guard was not found"
    for pid in (worker, *guards):
        status = Path(f"/proc/{pid}/status").read_text()
        assert f"\nUid:\t{uid}\t" in status, status
        assert Path(f"/proc/{pid}/environ").stat().st_uid == 0, f"{pid} is dumpable"


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _is_guard(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[1:4] == [b"-I", b"-S", b"-c"]


#: A job that reports progress through its file, keeps an output, notes who it runs as and
#: where its home is, and leaves a process behind in a session of its own.
ORDINARY = (
    "import os, subprocess, gpufleet\n"
    "gpufleet.report(epoch=1, epochs=1, loss=0.5)\n"
    "os.makedirs('outputs', exist_ok=True)\n"
    "open('outputs/model.txt', 'w').write('weights')\n"
    "open(os.path.join(os.environ['HOME'], '.cache-probe'), 'w').write('ok')\n"
    "import tempfile\n"
    "tempfile.NamedTemporaryFile(delete=False).write(b'scratch')\n"
    "left = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
    "print('LEFT', left.pid, 'USER', os.environ['USER'], 'HOME', os.environ['HOME'],\n"
    "      'TMP', tempfile.gettempdir())\n"
)


def test_a_slot_users_job_runs_as_any_job_and_leaves_nothing_running(
    fleet: Fleet, users: Users, base: Path
) -> None:
    fleet.start_server()
    worker = _start(
        fleet, [], {}, "--run-as", users.slots[0], "--work-dir", str(base / "work")
    )  # fmt: skip
    job = _submit(fleet, "python", "-c", ORDINARY)
    done = fleet.wait_status(job, "succeeded", "failed")
    assert done["status"] == "succeeded", fleet.cli("logs", job).stderr
    assert done["progress"] == {"epoch": 1, "epochs": 1, "loss": 0.5}
    said = fleet.cli("logs", job).stdout.split()
    assert said[said.index("USER") + 1] == users.slots[0]
    assert said[said.index("HOME") + 1] == str(base / "work" / f"{job}-1")
    # its temp files in its own folder, not in the /tmp every slot user shares
    assert said[said.index("TMP") + 1] == str(base / "work" / f"{job}-1" / ".tmp")
    assert f"as {users.slots[0]}" in worker.text()
    fleet.cli("download", job, "-o", str(fleet.root / "got"))
    assert (fleet.root / "got" / "outputs" / "model.txt").read_text() == "weights"
    left = int(said[said.index("LEFT") + 1])
    wait_for(lambda: not alive(left), 10, "the process the job left to be killed")
    folder = (base / "work" / f"{job}-1").stat()
    assert folder.st_uid == pwd.getpwnam(users.slots[0]).pw_uid
    assert folder.st_mode & 0o777 == 0o700
    assert (base / "work").stat().st_mode & 0o777 == 0o711


def _refused(fleet: Fleet, prefix: list[str], *args: str, env: dict[str, str] | None = None) -> str:
    """What a worker that must not start says as it exits (with code 1)."""
    argv = [*prefix, PYTHON, "-m", "gpufleet", "worker", "--name", "nope", *args]
    log = fleet.root / f"refused-{len(fleet.procs)}.log"
    proc = Proc(argv, {**fleet.env, **(env or {})}, log)
    fleet.procs.append(proc)
    assert proc.popen.wait(30) == 1, proc.text()
    return proc.text()


def test_run_as_is_refused_where_it_cannot_keep_jobs_apart(
    fleet: Fleet, users: Users, base: Path
) -> None:
    fleet.start_server()
    work = ("--work-dir", str(base / "work"))
    own = base / "own"
    own.mkdir()
    shutil.chown(own, users.own, users.own)
    as_own = ("--work-dir", str(own / "work"), "--cache-dir", str(own / "cache"))
    mine = {"GPUFLEET_CONFIG_DIR": str(own / "config")}
    said = _refused(fleet, _as(users.own), "--run-as", users.slots[0], *as_own, env=mine)
    assert "--run-as needs the worker to run as root" in said, said
    said = _refused(fleet, [], "--run-as", "nosuchuser-gf", *work)
    assert "--run-as nosuchuser-gf: no such user on this machine" in said, said
    said = _refused(fleet, [], "--slots", "2", "--run-as", users.slots[0], *work)
    assert "gives 1 user(s), but this worker runs up to 2 jobs at once" in said, said
    closed = fleet.root / "closed" / "work"  # under pytest's own folder, mode 0700
    said = _refused(fleet, [], "--run-as", users.slots[0], "--work-dir", str(closed))
    assert f"user {users.slots[0]} cannot reach the work dir {closed}" in said, said


#: A job that tries to change the environment it runs in: its packages, its bin/, modes.
TAMPER = (
    "import os, sys, sysconfig\n"
    "site = sysconfig.get_paths()['purelib']\n"
    "target = os.path.join(site, 'gfdemo', '__init__.py')\n"
    "tries = {\n"
    "    'site-packages': lambda: open(target, 'a').write('\\nTAMPERED = True\\n'),\n"
    "    'new module': lambda: open(os.path.join(site, 'evil.py'), 'w').write('x = 1'),\n"
    "    'bin': lambda: open(os.path.join(os.path.dirname(sys.executable), 'evil'), 'w'),\n"
    "    'chmod': lambda: os.chmod(target, 0o666),\n"
    "}\n"
    "for what, act in tries.items():\n"
    "    try:\n"
    "        act()\n"
    "        print('WROTE', what, flush=True)\n"
    "    except OSError as exc:\n"
    "        print('DENIED', what, exc.errno, flush=True)\n"
)
#: What the next job of that environment sees of it.
LOOK = (
    "import os, sys, sysconfig, gfdemo\n"
    "site = sysconfig.get_paths()['purelib']\n"
    "bad = [hasattr(gfdemo, 'TAMPERED'), os.path.exists(os.path.join(site, 'evil.py')),\n"
    "       os.path.exists(os.path.join(os.path.dirname(sys.executable), 'evil'))]\n"
    "print('CHANGED' if any(bad) else 'UNCHANGED', gfdemo.__version__, flush=True)\n"
)


def test_a_slot_users_job_cannot_change_its_environment(
    fleet: Fleet, users: Users, base: Path
) -> None:
    """A ``--run-as`` worker builds a job's environment as root and seals it: the job's
    slot user can read and run it, but every write into it fails, and the next job of the
    environment sees it as built."""
    from tests.wheels import make_wheel

    fleet.start_server()
    token = _worker_token(fleet)
    wheels = base / "wheels"
    make_wheel(wheels, "gfdemo", "1.0")
    env = {"GPUFLEET_TOKEN": token, "UV_CACHE_DIR": str(base / "uv-cache")}
    _start(
        fleet,
        [],
        env,
        "--run-as",
        ",".join(users.slots),
        "--work-dir",
        str(base / "work"),
        "--cache-dir",
        str(base / "cache"),
        "--env-cache-dir",
        str(base / "envs"),
        "--env-find-links",
        str(wheels),
    )
    tamper = fleet.cli("submit", "--with", "gfdemo==1.0", "--", "python", "-c", TAMPER)
    job = tamper.stdout.strip().splitlines()[-1]
    assert fleet.wait_status(job, "succeeded", "failed", timeout=90)["status"] == "succeeded"
    said = fleet.cli("logs", job).stdout
    assert said.count("DENIED") == 4, said
    assert "WROTE" not in said
    look = fleet.cli("submit", "--with", "gfdemo==1.0", "--", "python", "-c", LOOK)
    after = look.stdout.strip().splitlines()[-1]
    detail = fleet.wait_status(after, "succeeded", "failed", timeout=90)
    assert detail["status"] == "succeeded"
    assert "UNCHANGED 1.0" in fleet.cli("logs", after).stdout
    assert detail["history"][-1]["environment"]["built"] is False  # the same, sealed one


# A checkpointing job that tries to smuggle root's files into its checkpoint folder (a
# symbolic and a hard link to /etc/shadow), then, resumed as another slot user, lists
# what it got back and writes to it.
CHECKPOINTED = r"""
import json, os, sys, time
ck = os.environ["GPUFLEET_CHECKPOINT_DIR"]
state = os.path.join(ck, "state.json")
if os.environ.get("GPUFLEET_RESUMED"):
    with open(state, "a") as f:  # restored as this attempt's user's own file
        f.write(" ")
    print("RESTORED", json.dumps(sorted(os.listdir(ck))), open(state).read(), flush=True)
    sys.exit(0)
with open(state + ".tmp", "w") as f:
    f.write('{"epoch": 3}')
os.replace(state + ".tmp", state)
for make in (os.symlink, os.link):
    try:
        make("/etc/shadow", os.path.join(ck, "shadow-" + make.__name__))
    except OSError as exc:
        print(make.__name__, "refused:", exc.strerror, flush=True)
print("::gpufleet:: " + json.dumps({"epoch": 3, "checkpoint": True}), flush=True)
print("saved", flush=True)
time.sleep(120)
"""


def test_a_slot_users_checkpoint_keeps_only_its_own_files_and_resumes_as_another(
    fleet: Fleet, users: Users, base: Path
) -> None:
    fleet.start_server()
    work = ("--work-dir", str(base / "work"))
    first = _start(fleet, [], {}, "--run-as", users.slots[0], *work)
    argv = ["submit", "--checkpoint-dir", "ck", "--grace-period", "5", "--"]
    job = fleet.cli(*argv, "python", "-c", CHECKPOINTED).stdout.split()[-1]
    with fleet.client() as c:
        wait_for(lambda: c.checkpoints(job), 30, "the job's first snapshot")
        assert [f.path for f in c.checkpoints(job)[0].files] == ["state.json"]
    first.signal(signal.SIGTERM)  # vacated: its grace signal, its checkpoint kept
    first.popen.wait(30)
    _start(fleet, [], {}, "--run-as", users.slots[1], *work)
    done = fleet.wait_status(job, "succeeded", "failed", timeout=60)
    said = fleet.cli("logs", job).stdout
    assert done["status"] == "succeeded", said
    assert 'RESTORED ["state.json"] {"epoch": 3} ' in said, said
    with fleet.client() as c:
        kept = {f.path for s in c.checkpoints(job) for f in s.files}
    assert kept == {"state.json"}, "no link to root's files was ever kept"
