"""`gpufleet worker install`: the systemd unit, its root-only env file, the Windows script."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet import config
from gpufleet.cli import app, install, service_files
from gpufleet.cli.install import Given, build_service
from gpufleet.cli.service_files import WorkerService
from gpufleet.errors import ConfigError, GpufleetError

runner = CliRunner()
TOKEN = "gf_Secret-Token_123"
NASTY = "a b \"q\" 'q' $HOME ${X} `id` $(touch INJECTED) \\ %n ; # end"


def service(**kw: object) -> WorkerService:
    values: dict[str, object] = {
        "name": "gpu-1",
        "python": "/opt/venv/bin/python",
        "env": {"GPUFLEET_SERVER": "http://fleet:8000", "GPUFLEET_DRAIN_GRACE": "60"},
        "token": TOKEN,
        "drain_grace": 60.0,
    }
    values.update(kw)
    return WorkerService(**values)  # type: ignore[arg-type]


@pytest.fixture
def system_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The 'system' dirs moved under tmp_path, so no test can write to /etc."""
    unit_dir, env_dir = tmp_path / "etc-systemd", tmp_path / "etc-gpufleet"
    for module in (install, service_files):  # the command's defaults, and the root check
        monkeypatch.setattr(module, "UNIT_DIR", unit_dir)
        monkeypatch.setattr(module, "ENV_DIR", env_dir)
    return unit_dir, env_dir


def sh_value(env_file: Path, var: str, cwd: Path) -> str:
    """What a POSIX shell reads from the file (systemd's EnvironmentFile= quoting agrees)."""
    script = f'set -a; . "{env_file}"; printf %s "${var}"'
    done = subprocess.run(
        ["sh", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout


# --------------------------------------------------------------------------- env file


def test_env_file_values_stay_literal_and_inject_nothing(tmp_path: Path) -> None:
    svc = service(env={"GPUFLEET_SERVER": "http://h:1/x$y", "GPUFLEET_LABELS": NASTY})
    env_file = tmp_path / "w.env"
    env_file.write_text(service_files.render_env_file(svc, masked=False))
    assert sh_value(env_file, "GPUFLEET_LABELS", tmp_path) == NASTY
    assert sh_value(env_file, "GPUFLEET_SERVER", tmp_path) == "http://h:1/x$y"
    assert sh_value(env_file, "GPUFLEET_TOKEN", tmp_path) == TOKEN
    assert not (tmp_path / "INJECTED").exists()
    # one line per variable plus two comment lines: nothing broke a line
    assert len(env_file.read_text().splitlines()) == 2 + 3


@pytest.mark.parametrize("flag", ["--labels", "--pool", "--server"])
def test_a_newline_in_a_value_is_refused_naming_the_flag(flag: str) -> None:
    value = "http://h:1/a\nGPUFLEET_TOKEN=stolen" if flag == "--server" else "a=1\nX=2"
    given = Given(**{flag.removeprefix("--"): value})  # type: ignore[arg-type]
    with pytest.raises(GpufleetError) as exc:
        build_service(given, token_file=None, python="/p", user=None, windows=False)
    assert flag in exc.value.message


def test_print_masks_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    text = service_files.render_env_file(service(), masked=True)
    assert TOKEN not in text and 'GPUFLEET_TOKEN="****"' in text


# --------------------------------------------------------------------------- unit


def test_unit_drains_on_stop_and_never_holds_the_token() -> None:
    env_file = Path("/etc/gpufleet/worker-gpu-1.env")
    unit = service_files.render_unit(service(drain_grace=120.0), env_file)
    lines = unit.splitlines()
    assert TOKEN not in unit
    assert "EnvironmentFile=/etc/gpufleet/worker-gpu-1.env" in lines
    assert "ExecStart=/opt/venv/bin/python -m gpufleet worker" in lines
    for line in (
        "After=network-online.target",
        "Restart=always",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        "TimeoutStopSec=150",  # longer than the 120 s drain grace, by the worker's slack
        "WantedBy=multi-user.target",
    ):
        assert line in lines


def test_exec_start_keeps_spaces_percent_and_dollar_literal() -> None:
    unit = service_files.render_unit(service(python="/opt/my env/100%/$py"), Path("/e/100% x.env"))
    assert 'ExecStart="/opt/my env/100%%/$$py" -m gpufleet worker' in unit
    assert "EnvironmentFile=/e/100%% x.env" in unit


def test_user_and_dirs_go_into_the_unit(tmp_path: Path) -> None:
    unit = service_files.render_unit(service(user="gpu", name=None), tmp_path / "w.env")
    assert "User=gpu" in unit.splitlines()
    assert "StateDirectory=gpufleet/worker" in unit.splitlines()
    assert "Description=gpufleet worker (named after the host)" in unit.splitlines()


@pytest.mark.parametrize("name", ["a b", "../x", "x/y", "-x", "é", ""])
def test_a_name_that_cannot_be_a_unit_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="--name"):
        service_files.check_name(name)


# --------------------------------------------------------------------------- building


def test_settings_become_gpufleet_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUFLEET_TOKEN", TOKEN)
    (tmp_path / "nfs").mkdir()
    given = Given(
        server="https://fleet.example:8443/",
        pool="train",
        name="gpu-1",
        labels="rack=a b",
        slots=2,
        mount=("nfs",),
        cache_size="20G",
        drain_grace=5,
    )
    svc = build_service(given, token_file=None, python="/p", user=None, windows=False)
    assert svc.env == {
        "GPUFLEET_SERVER": "https://fleet.example:8443",
        "GPUFLEET_POOL": "train",
        "GPUFLEET_NAME": "gpu-1",
        "GPUFLEET_LABELS": "rack=a b",
        "GPUFLEET_SLOTS": "2",
        "GPUFLEET_MOUNT": str(tmp_path / "nfs"),
        "GPUFLEET_WORK_DIR": "/var/lib/gpufleet/worker-gpu-1/work",
        "GPUFLEET_CACHE_DIR": "/var/cache/gpufleet/worker-gpu-1",
        "GPUFLEET_CACHE_SIZE": "20G",
        "GPUFLEET_DRAIN_GRACE": "5",
    }
    assert svc.token == TOKEN and svc.token_source == "GPUFLEET_TOKEN"
    assert svc.stop_timeout == 35


def test_bad_labels_and_sizes_are_refused() -> None:
    for given, flag in ((Given(labels="oops"), "--labels"), (Given(cache_size="lots"), "--cache")):
        with pytest.raises(ConfigError, match=flag):
            build_service(given, token_file=None, python="/p", user=None, windows=False)


def test_no_token_anywhere_is_a_clear_error() -> None:
    with pytest.raises(ConfigError) as exc:
        build_service(Given(), token_file=None, python="/p", user=None, windows=False)
    assert "no token" in exc.value.message
    assert "GPUFLEET_TOKEN" in exc.value.message and "--token-file" in exc.value.message


def test_token_from_file_or_from_the_saved_credentials(tmp_path: Path) -> None:
    config.save_token("http://fleet:8000", "gf_admin")
    fleet = Given(server="http://fleet:8000")
    with pytest.raises(ConfigError, match="no token"):  # never the admin's
        build_service(fleet, token_file=None, python="/p", user=None, windows=False)
    config.save_worker_token("http://fleet:8000", "gf_saved")
    svc = build_service(
        Given(server="http://fleet:8000"), token_file=None, python="/p", user=None, windows=False
    )
    assert svc.token == "gf_saved" and "credentials.json" in svc.token_source
    token_file = tmp_path / "token"
    token_file.write_text("gf_from_file\n")
    svc = build_service(Given(), token_file=token_file, python="/p", user=None, windows=False)
    assert svc.token == "gf_from_file"


def test_unreadable_or_empty_token_file_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path in (tmp_path / "missing", empty):
        with pytest.raises(ConfigError, match=f"--token-file {path}"):
            build_service(Given(), token_file=path, python="/p", user=None, windows=False)


# --------------------------------------------------------------------------- writing


def test_written_files_have_their_modes_and_the_token_only_in_the_env_file(
    tmp_path: Path,
) -> None:
    unit_path, env_path = service_files.write_systemd(
        service(), tmp_path / "units", tmp_path / "env", euid=os.geteuid()
    )
    assert stat.S_IMODE(env_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(unit_path.stat().st_mode) == 0o644
    assert env_path.stat().st_uid == os.geteuid()
    assert TOKEN in env_path.read_text() and TOKEN not in unit_path.read_text()
    assert f"EnvironmentFile={env_path}" in unit_path.read_text()
    assert sorted(p.name for p in (tmp_path / "env").iterdir()) == ["worker-gpu-1.env"]


def test_the_env_file_is_never_readable_by_others_not_even_while_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / "worker-gpu-1.env").write_text("old\n")
    os.chmod(env_dir / "worker-gpu-1.env", 0o644)  # a world-readable file from before
    seen: list[int] = []
    real_replace = os.replace

    def spy(src: str, dst: Path) -> None:
        if str(dst).endswith(".env"):
            seen.append(stat.S_IMODE(os.stat(src).st_mode))
            assert TOKEN in Path(src).read_text()  # the token is in it by now
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    old_umask = os.umask(0)  # a permissive umask changes nothing
    try:
        _, env_path = service_files.write_systemd(service(), tmp_path / "u", env_dir, euid=0)
    finally:
        os.umask(old_umask)
    assert seen == [0o600]
    assert stat.S_IMODE(env_path.stat().st_mode) == 0o600


def test_not_root_is_refused_for_the_system_dirs(system_dirs: tuple[Path, Path]) -> None:
    unit_dir, env_dir = system_dirs
    with pytest.raises(ConfigError, match="needs root") as exc:
        service_files.write_systemd(service(), unit_dir, env_dir, euid=1000)
    assert str(unit_dir) in exc.value.message and "--print" in exc.value.message
    assert not unit_dir.exists() and not env_dir.exists()


def test_a_missing_user_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--user no-such-user-x"):
        service_files.write_systemd(service(user="no-such-user-x"), tmp_path, tmp_path, euid=0)


# --------------------------------------------------------------------------- the CLI


def test_cli_not_root_exits_non_zero_and_writes_nothing(
    system_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(install, "current_euid", lambda: 1000)
    monkeypatch.setenv("GPUFLEET_TOKEN", TOKEN)
    result = runner.invoke(app, ["worker", "install", "--systemd", "--name", "gpu-1"])
    assert result.exit_code != 0
    assert "needs root" in str(result.exception)
    assert not any(d.exists() for d in system_dirs)


def test_cli_writes_and_prints_the_systemctl_commands(
    system_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(install, "current_euid", lambda: 0)
    monkeypatch.setenv("GPUFLEET_TOKEN", TOKEN)
    result = runner.invoke(app, ["worker", "install", "--systemd", "--pool", "train"])
    assert result.exit_code == 0, result.output
    unit_dir, env_dir = system_dirs
    assert (unit_dir / "gpufleet-worker.service").is_file()
    assert 'GPUFLEET_POOL="train"' in (env_dir / "worker.env").read_text()
    assert "systemctl daemon-reload && systemctl enable --now gpufleet-worker.service" in (
        result.output
    )
    assert TOKEN not in result.output


def test_cli_print_writes_nothing(
    system_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_TOKEN", TOKEN)
    result = runner.invoke(app, ["worker", "install", "--systemd", "--print"])
    assert result.exit_code == 0, result.output
    assert "[Service]" in result.output and 'GPUFLEET_TOKEN="****"' in result.output
    assert TOKEN not in result.output
    assert not any(d.exists() for d in system_dirs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["worker", "install"], "choose one of --systemd or --windows"),
        (["worker", "install", "--systemd", "--windows"], "choose one"),
        (["worker", "install", "--systemd", "--out", "x.ps1"], "--out: not an option"),
        (["worker", "install", "--windows", "--python", "p", "--user", "u"], "--user"),
        (["worker", "--pool", "x", "install", "--systemd"], "go after it"),
        (["worker", "install", "--windows"], "needs --python"),
    ],
)
def test_cli_misuse_is_a_clear_error(args: list[str], message: str) -> None:
    result = runner.invoke(app, args, env={"GPUFLEET_TOKEN": TOKEN})
    assert result.exit_code != 0
    assert message in str(result.exception)


def test_worker_without_a_subcommand_still_runs_the_worker(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = runner.invoke(
        app,
        [
            "worker",
            "--server",
            "http://127.0.0.1:9",
            "--simulate-gpus",
            "A100:80",
            "--mount",
            str(missing),
        ],
    )
    assert result.exit_code != 0
    assert f"--mount {missing}: no such folder" in str(result.exception)


def test_cli_print_as_a_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, "GPUFLEET_TOKEN": TOKEN}
    argv = [sys.executable, "-m", "gpufleet", "worker", "install", "--systemd", "--print"]
    done = subprocess.run(
        [*argv, "--name", "gpu-1", "--labels", "who=O'Brien $x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert TOKEN not in done.stdout + done.stderr
    assert "# /etc/systemd/system/gpufleet-worker-gpu-1.service" in done.stdout
    assert f"ExecStart={os.path.abspath(sys.executable)} -m gpufleet worker" in done.stdout
    assert 'GPUFLEET_LABELS="who=O\'Brien \\$x"' in done.stdout
    assert list(tmp_path.iterdir()) == []
    helped = subprocess.run(
        [sys.executable, "-m", "gpufleet", "worker", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0
    assert "--drain-grace" in helped.stdout and "install" in helped.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_accepts_the_unit(tmp_path: Path) -> None:
    spaced = tmp_path / "my env" / "python"  # an interpreter path that needs quoting
    spaced.parent.mkdir()
    spaced.symlink_to(sys.executable)
    unit_path, _ = service_files.write_systemd(
        service(python=str(spaced), user="root"), tmp_path / "u", tmp_path / "e 100%", euid=0
    )
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert unit_path.name not in done.stderr, done.stderr


# --------------------------------------------------------------------------- Windows


def windows_script(**kw: object) -> str:
    svc = service(python="C:\\Program Files\\Python 3.11\\python.exe", **kw)
    return service_files.render_windows(svc, masked=False)


def test_windows_token_goes_only_into_the_locked_token_file() -> None:
    script = windows_script()
    token_lines = [line for line in script.splitlines() if TOKEN in line]
    assert token_lines == [
        f"Set-Content -LiteralPath $TokenFile -NoNewline -Encoding ascii -Value '{TOKEN}'"
    ]
    # the file is locked to SYSTEM and Administrators before the token goes in
    lock = script.index("icacls $TokenFile /inheritance:r /grant:r '*S-1-5-18:F' '*S-1-5-32-544:F'")
    assert lock < script.index(token_lines[0])
    action = next(line for line in script.splitlines() if "New-ScheduledTaskAction" in line)
    assert "-File" in action and "$Launcher" in action and "GPUFLEET" not in action
    assert (
        "$env:GPUFLEET_TOKEN = (Get-Content -Raw -LiteralPath (Join-Path $PSScriptRoot "
        "'worker-gpu-1.token')).Trim()" in script
    )


def test_windows_task_starts_at_boot_restarts_and_never_times_out() -> None:
    script = windows_script()
    assert "New-ScheduledTaskTrigger -AtStartup" in script
    assert "-RestartCount 999 -RestartInterval (New-TimeSpan -Minutes 1)" in script
    assert "-ExecutionTimeLimit ([TimeSpan]::Zero)" in script
    assert "Register-ScheduledTask -TaskName $TaskName" in script
    assert "$TaskName = 'gpufleet-worker-gpu-1'" in script


def test_windows_values_are_quoted_literally() -> None:
    env = {
        "GPUFLEET_SERVER": "http://fleet:8000",
        "GPUFLEET_LABELS": "who=O'Brien,q=\u2019x\u2019,d=$env:PATH,b=`n",
        "GPUFLEET_WORK_DIR": "D:\\jobs dir\\w",
    }
    script = windows_script(env=env)
    assert "$env:GPUFLEET_LABELS = 'who=O''Brien,q=\u2019\u2019x\u2019\u2019,d=$env:PATH,b=`n'" in (
        script
    )
    assert "$env:GPUFLEET_WORK_DIR = 'D:\\jobs dir\\w'" in script
    assert "-FilePath 'C:\\Program Files\\Python 3.11\\python.exe'" in script
    # the launcher is one here-string: it ends exactly once, at its own closing line
    lines = script.splitlines()
    assert lines.count("$LauncherText = @'") == 1
    assert [i for i, line in enumerate(lines) if line.startswith("'@")] == [
        next(i for i, line in enumerate(lines) if "exit 0" in line) + 3
    ]


def test_windows_paths_must_be_absolute_windows_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_TOKEN", TOKEN)
    with pytest.raises(ConfigError, match="--work-dir jobs: give an absolute Windows path"):
        build_service(Given(work_dir="jobs"), token_file=None, python="p", user=None, windows=True)
    svc = build_service(
        Given(work_dir="D:\\jobs", mount=("\\\\nas\\share",)),
        token_file=None,
        python="p",
        user=None,
        windows=True,
    )
    assert svc.env["GPUFLEET_WORK_DIR"] == "D:\\jobs"
    assert svc.env["GPUFLEET_MOUNT"] == "\\\\nas\\share"


def test_windows_script_is_written_0600_and_print_masks(tmp_path: Path) -> None:
    out = tmp_path / "install worker.ps1"
    env = {"GPUFLEET_TOKEN": TOKEN}
    base = ["worker", "install", "--windows", "--python", "C:\\Python\\python.exe"]
    result = runner.invoke(app, [*base, "--out", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and TOKEN in out.read_text()
    assert TOKEN not in result.output
    shown = runner.invoke(app, [*base, "--print"], env=env)
    assert shown.exit_code == 0 and TOKEN not in shown.output and "'****'" in shown.output


# --------------------------------------------------------------------------- slot users


def test_slot_users_run_the_worker_as_root_with_gpufleet_run_as(
    system_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFLEET_TOKEN", TOKEN)
    result = runner.invoke(
        app, ["worker", "install", "--systemd", "--print", "--slot-users", "2", "--slots", "1"]
    )
    assert result.exit_code == 0, result.output
    shown = result.output
    for n in (1, 2):
        assert "--system --no-create-home --user-group --shell" in shown
        assert f" gpufleet-slot{n}\n" in shown
    assert 'GPUFLEET_RUN_AS="gpufleet-slot1,gpufleet-slot2"' in shown
    assert "StateDirectoryMode=0711" in shown and "CacheDirectoryMode=0700" in shown
    assert "\nUser=" not in shown  # root
    assert not any(d.exists() for d in system_dirs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slot-users", "2", "--user", "gpufleet"], "the worker must run as root"),
        (["--run-as", "a,b", "--slot-users", "2"], "give one of them"),
        (["--run-as", "a b"], "--run-as 'a b': not a valid user name"),
        (["--slot-users", "0"], "--slot-users"),
    ],
)
def test_slot_user_misuse_is_a_clear_error(args: list[str], message: str) -> None:
    result = runner.invoke(
        app, ["worker", "install", "--systemd", "--print", *args], env={"GPUFLEET_TOKEN": TOKEN}
    )
    assert result.exit_code != 0
    assert message in str(result.exception) + result.output


def test_run_as_users_must_exist(tmp_path: Path) -> None:
    svc = service(run_as=("no-such-slot-x",))
    with pytest.raises(ConfigError, match="--run-as no-such-slot-x: no such user"):
        service_files.write_systemd(svc, tmp_path, tmp_path, euid=0)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="useradd needs root")
def test_install_makes_the_slot_users_it_is_asked_for(
    system_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    names = tuple(f"gfinst{os.urandom(3).hex()}{n}" for n in (1, 2))
    monkeypatch.setattr(install, "slot_user_names", lambda count: names[:count])
    monkeypatch.setattr(install, "current_euid", lambda: 0)
    monkeypatch.setenv("GPUFLEET_TOKEN", TOKEN)
    try:
        result = runner.invoke(app, ["worker", "install", "--systemd", "--slot-users", "2"])
        assert result.exit_code == 0, result.output
        import pwd

        assert [pwd.getpwnam(n).pw_name for n in names] == list(names)
        env_file = system_dirs[1] / "worker.env"
        assert f'GPUFLEET_RUN_AS="{names[0]},{names[1]}"' in env_file.read_text()
        again = runner.invoke(app, ["worker", "install", "--systemd", "--slot-users", "2"])
        assert again.exit_code == 0, again.output  # users that exist are kept
    finally:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True, timeout=30, check=False)
