"""Capability detection, driven by a fake NVML and a fake nvidia-smi (no GPU in CI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpufleet.domain.models import Capability, GpuInfo
from gpufleet.errors import ConfigError
from gpufleet.worker.capability import (
    capability_json,
    detect,
    live_gpus,
    parse_simulated_gpus,
)
from gpufleet.worker.nvml import (
    SMI_COMMAND,
    Nvml,
    cuda_version_text,
    live_free_mib,
    live_readings,
    parse_nvidia_smi,
    probe_nvidia_smi,
    probe_nvml,
    shared,
)

MIB = 1024 * 1024


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError."""


@dataclass
class FakeMemory:
    total: int
    free: int
    used: int = 0


@dataclass
class FakeDevice:
    name: bytes | str
    total_mib: int
    free_mib: int
    uuid: str
    compute_capability: tuple[int, int] = (8, 6)
    util: int | None = None  # None: the driver does not say
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, MiB)


def two_gpus() -> list[FakeDevice]:
    return [
        FakeDevice(b"NVIDIA GeForce RTX 3090", 24576, 20000, "GPU-aaaa-0000"),
        FakeDevice("NVIDIA RTX A4000", 16376, 16000, "GPU-bbbb-1111"),
    ]


@dataclass
class FakeNvml:
    """The handful of pynvml functions gpufleet calls, over in-memory devices."""

    devices: list[FakeDevice] = field(default_factory=two_gpus)
    fail_on: str | None = None
    calls: list[str] = field(default_factory=list)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.fail_on == name:
            raise FakeNvmlError(f"{name} failed")

    def nvmlInit(self) -> None:
        self._call("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        self._call("nvmlDeviceGetHandleByIndex")
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: FakeDevice) -> bytes | str:
        self._call("nvmlDeviceGetName")
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> FakeMemory:
        self._call("nvmlDeviceGetMemoryInfo")
        return FakeMemory(total=handle.total_mib * MIB, free=handle.free_mib * MIB)

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        self._call("nvmlDeviceGetUUID")
        return handle.uuid

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeDevice) -> tuple[int, int]:
        self._call("nvmlDeviceGetCudaComputeCapability")
        return handle.compute_capability

    NVMLError = FakeNvmlError

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> Any:
        self._call("nvmlDeviceGetUtilizationRates")
        if handle.util is None:
            raise FakeNvmlError("not supported")
        return SimpleNamespace(gpu=handle.util, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[Any]:
        self._call("nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=p, usedGpuMemory=m * MIB) for p, m in handle.processes]

    def nvmlSystemGetDriverVersion(self) -> bytes:
        self._call("nvmlSystemGetDriverVersion")
        return b"550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion")
        return 12040


SMI_OUTPUT = """\
0, NVIDIA GeForce RTX 3090, 24576, 23800, GPU-5f2a1c3e-0000-1111-2222-333344445555, 8.6, 550.54.15
1, NVIDIA A100-SXM4-80GB, 81920, 81050, GPU-9b8c7d6e-aaaa-bbbb-cccc-ddddeeeeffff, 8.0, 550.54.15
"""


def fake_smi(output: str = SMI_OUTPUT) -> Any:
    seen: list[list[str]] = []

    def run(argv: list[str]) -> str:
        seen.append(argv)
        return output

    run.seen = seen  # type: ignore[attr-defined]
    return run


# ----------------------------------------------------------------------- NVML


def test_probe_nvml_reads_every_gpu_and_the_driver_stack() -> None:
    nvml = FakeNvml()

    probe = probe_nvml(nvml)

    assert probe is not None
    assert probe.gpus == (
        GpuInfo(0, "NVIDIA GeForce RTX 3090", 24576, 20000, "GPU-aaaa-0000", "8.6"),
        GpuInfo(1, "NVIDIA RTX A4000", 16376, 16000, "GPU-bbbb-1111", "8.6"),
    )
    assert all(isinstance(gpu.name, str) for gpu in probe.gpus)
    assert probe.driver_version == "550.54.15"
    assert probe.cuda_version == "12.4"
    assert nvml.calls[0] == "nvmlInit" and "nvmlShutdown" not in nvml.calls
    shared(nvml).close()  # at exit
    assert nvml.calls[-1] == "nvmlShutdown"


def test_probe_nvml_is_none_when_init_fails_and_does_not_shut_down() -> None:
    nvml = FakeNvml(fail_on="nvmlInit")

    assert probe_nvml(nvml) is None
    assert "nvmlShutdown" not in nvml.calls


@pytest.mark.parametrize(
    "failing",
    ["nvmlDeviceGetCount", "nvmlDeviceGetMemoryInfo", "nvmlSystemGetCudaDriverVersion"],
)
def test_a_failing_nvml_query_is_none_and_nvml_stays_up(failing: str) -> None:
    nvml = FakeNvml(fail_on=failing)

    assert probe_nvml(nvml) is None
    assert probe_nvml(nvml) is None
    assert nvml.calls.count("nvmlInit") == 1 and "nvmlShutdown" not in nvml.calls


def test_probe_nvml_survives_a_failing_shutdown() -> None:
    nvml = FakeNvml(fail_on="nvmlShutdown")
    probe = probe_nvml(nvml)

    assert probe is not None
    assert len(probe.gpus) == 2
    shared(nvml).close()
    shared(nvml).close()  # once
    assert nvml.calls.count("nvmlShutdown") == 1


def test_nvml_is_initialised_once_per_process_however_often_it_is_read() -> None:
    """A worker reads free memory at every heartbeat and claim: one nvmlInit for all."""
    nvml = FakeNvml()
    probe_nvml(nvml)
    for _ in range(100):
        assert live_free_mib(nvml) == {0: 20000, 1: 16000}
    assert nvml.calls.count("nvmlInit") == 1 and "nvmlShutdown" not in nvml.calls


def test_an_nvml_that_failed_to_start_is_tried_again_a_minute_later() -> None:
    now = [0.0]
    nvml = FakeNvml(fail_on="nvmlInit")
    handle = Nvml(nvml, retry=60, clock=lambda: now[0])
    for t in (0.0, 10.0, 59.0):
        now[0] = t
        assert handle.read(lambda lib: lib.nvmlDeviceGetCount()) is None
    assert nvml.calls.count("nvmlInit") == 1
    now[0], nvml.fail_on = 61.0, None  # the driver is loaded now
    assert handle.read(lambda lib: lib.nvmlDeviceGetCount()) == 2
    assert nvml.calls.count("nvmlInit") == 2


def test_probe_nvml_with_no_devices_reports_no_gpus_but_the_driver() -> None:
    probe = probe_nvml(FakeNvml(devices=[]))

    assert probe is not None
    assert probe.gpus == ()
    assert probe.driver_version == "550.54.15"


@pytest.mark.parametrize(
    ("encoded", "text"), [(12040, "12.4"), (11080, "11.8"), (12000, "12.0"), (13010, "13.1")]
)
def test_cuda_version_text(encoded: int, text: str) -> None:
    assert cuda_version_text(encoded) == text


def test_live_free_mib_reads_free_memory_per_index() -> None:
    assert live_free_mib(FakeNvml()) == {0: 20000, 1: 16000}
    assert live_free_mib(FakeNvml(fail_on="nvmlInit")) is None


# ----------------------------------------------------------------- nvidia-smi


def test_parse_nvidia_smi_two_gpus() -> None:
    probe = parse_nvidia_smi(SMI_OUTPUT)

    assert probe.gpus == (
        GpuInfo(
            0,
            "NVIDIA GeForce RTX 3090",
            24576,
            23800,
            "GPU-5f2a1c3e-0000-1111-2222-333344445555",
            "8.6",
        ),
        GpuInfo(
            1,
            "NVIDIA A100-SXM4-80GB",
            81920,
            81050,
            "GPU-9b8c7d6e-aaaa-bbbb-cccc-ddddeeeeffff",
            "8.0",
        ),
    )
    assert probe.driver_version == "550.54.15"
    assert probe.cuda_version is None


def test_parse_nvidia_smi_empty_output_has_no_gpus() -> None:
    probe = parse_nvidia_smi("\n")

    assert probe.gpus == ()
    assert probe.driver_version is None


@pytest.mark.parametrize(
    "bad",
    [
        "0, RTX 3090, 24576\n",
        "zero, RTX 3090, 24576, 23800, GPU-x, 8.6, 550.54.15\n",
        "0, RTX 3090, [N/A], 23800, GPU-x, 8.6, 550.54.15\n",
    ],
)
def test_parse_nvidia_smi_rejects_malformed_rows(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_nvidia_smi(bad)


def test_probe_nvidia_smi_runs_the_query_command() -> None:
    run = fake_smi()

    probe = probe_nvidia_smi(run)

    assert probe is not None
    assert [gpu.name for gpu in probe.gpus] == ["NVIDIA GeForce RTX 3090", "NVIDIA A100-SXM4-80GB"]
    assert run.seen == [list(SMI_COMMAND)]


def test_probe_nvidia_smi_is_none_on_failure_or_garbage() -> None:
    def fails(argv: list[str]) -> str:
        raise subprocess.CalledProcessError(9, argv, "", "NVIDIA-SMI has failed")

    assert probe_nvidia_smi(fails) is None
    assert probe_nvidia_smi(fake_smi("this is not csv, at all\n")) is None


def test_probe_nvidia_smi_is_none_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name, path=None: None)

    assert probe_nvidia_smi() is None


# ----------------------------------------------------------------- simulation


def test_parse_simulated_gpus() -> None:
    gpus = parse_simulated_gpus("RTX 4090:24, A100 80GB:80,T4:16")

    assert gpus == (
        GpuInfo(0, "RTX 4090", 24 * 1024, 24 * 1024, "SIM-0", simulated=True),
        GpuInfo(1, "A100 80GB", 80 * 1024, 80 * 1024, "SIM-1", simulated=True),
        GpuInfo(2, "T4", 16 * 1024, 16 * 1024, "SIM-2", simulated=True),
    )


def test_parse_simulated_gpus_repeats_and_fractions() -> None:
    gpus = parse_simulated_gpus("2xA100:80,T4:15.5")

    assert [(g.index, g.name, g.total_mib, g.uuid) for g in gpus] == [
        (0, "A100", 81920, "SIM-0"),
        (1, "A100", 81920, "SIM-1"),
        (2, "T4", 15872, "SIM-2"),
    ]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("A100", '"A100"'),
        (":80", '":80"'),
        ("A100:", '"A100:"'),
        ("A100:big", '"A100:big"'),
        ("A100:0", '"A100:0"'),
        ("A100:-8", '"A100:-8"'),
        ("A100:nan", '"A100:nan"'),
        ("A100:inf", '"A100:inf"'),
        ("0xA100:80", '"0xA100:80"'),
        ("A100:80,,T4:16", "item 2"),
        ("A100:80,", "item 2"),
        ("", "item 1"),
    ],
)
def test_parse_simulated_gpus_rejects_bad_items(text: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_simulated_gpus(text)

    message = str(caught.value)
    assert message.startswith("--simulate-gpus: ")
    assert named in message
    assert "NAME:VRAM_GIB" in message


def test_missing_colon_message() -> None:
    with pytest.raises(
        ConfigError, match=r'item "A100" must look like NAME:VRAM_GIB \(e\.g\. "A100:80"'
    ):
        parse_simulated_gpus("A100")


# ------------------------------------------------------------------- detect()


def test_detect_uses_nvml(tmp_path: Path) -> None:
    run = fake_smi()

    cap = detect(nvml_lib=FakeNvml(), smi_run=run, cwd=tmp_path)

    assert [gpu.name for gpu in cap.gpus] == ["NVIDIA GeForce RTX 3090", "NVIDIA RTX A4000"]
    assert not cap.gpus_simulated
    assert not any(gpu.simulated for gpu in cap.gpus)
    assert (cap.driver_version, cap.cuda_version) == ("550.54.15", "12.4")
    assert run.seen == []


def test_detect_falls_back_to_nvidia_smi(tmp_path: Path) -> None:
    cap = detect(nvml_lib=FakeNvml(fail_on="nvmlInit"), smi_run=fake_smi(), cwd=tmp_path)

    assert [gpu.name for gpu in cap.gpus] == ["NVIDIA GeForce RTX 3090", "NVIDIA A100-SXM4-80GB"]
    assert cap.driver_version == "550.54.15"
    assert not cap.gpus_simulated


def test_detect_without_any_gpu_source(tmp_path: Path) -> None:
    def no_smi(argv: list[str]) -> str:
        raise FileNotFoundError(argv[0])

    cap = detect(nvml_lib=FakeNvml(fail_on="nvmlInit"), smi_run=no_smi, cwd=tmp_path)

    assert cap.gpus == ()
    assert cap.driver_version is None


def test_detect_simulated_never_touches_nvml(tmp_path: Path) -> None:
    nvml = FakeNvml()

    cap = detect(simulate="2xA100:80,T4:16", nvml_lib=nvml, cwd=tmp_path)

    assert cap.gpus_simulated
    assert len(cap.gpus) == 3
    assert all(gpu.simulated for gpu in cap.gpus)
    assert (cap.driver_version, cap.cuda_version) == (None, None)
    assert nvml.calls == []


def test_detect_simulated_rejects_bad_text(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='"A100"'):
        detect(simulate="A100", cwd=tmp_path)


def test_detect_on_this_machine(tmp_path: Path) -> None:
    cap = detect(cwd=tmp_path)

    assert cap.cores >= 1
    assert cap.ram_mib > 0
    assert cap.disk_free_mib > 0
    assert cap.hostname
    assert cap.python.count(".") == 2
    assert not cap.gpus_simulated
    assert cap.git_commit is None  # tmp_path is not a git work tree


def test_detect_on_this_machine_finds_no_gpu() -> None:
    if probe_nvml() is not None or shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has an NVIDIA driver")

    cap = detect()

    assert cap.gpus == ()
    assert cap.driver_version is None
    assert cap.cuda_version is None


def test_detect_reads_the_git_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    for name in list(os.environ):
        if name.startswith("GIT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    repo = tmp_path / "repo"
    repo.mkdir()
    identity = ["-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([git, "init", "-q", str(repo)], check=True)
    subprocess.run(
        [git, *identity, "commit", "-q", "--allow-empty", "-m", "x"], cwd=repo, check=True
    )
    head = subprocess.run(
        [git, "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()
    (repo / "sub").mkdir()

    assert detect(cwd=repo / "sub", simulate="T4:16").git_commit == head
    assert detect(cwd=repo / ".git", simulate="T4:16").git_commit is None


def test_detect_without_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name, path=None: None)

    assert detect(cwd=tmp_path, nvml_lib=FakeNvml()).git_commit is None


# ------------------------------------------------------------------ live state


def test_live_gpus_refreshes_free_memory() -> None:
    nvml = FakeNvml()
    cap = detect(nvml_lib=nvml)
    nvml.devices[0].free_mib = 1234

    live = live_gpus(cap, nvml)

    assert [gpu.free_mib for gpu in live] == [1234, 16000]
    assert [gpu.total_mib for gpu in live] == [24576, 16376]
    assert [gpu.free_mib for gpu in cap.gpus] == [20000, 16000]


def test_live_gpus_read_utilisation_where_the_driver_gives_it() -> None:
    nvml = FakeNvml()
    cap = detect(nvml_lib=nvml)
    nvml.devices[0].util = 87
    nvml.devices[0].processes = [(4242, 5000), (4243, 1000)]

    live = live_gpus(cap, nvml)
    assert [gpu.util_percent for gpu in live] == [87, None]  # GPU 1 does not say
    readings = live_readings(nvml)
    assert readings is not None
    assert readings[0].processes == ((4242, 5000), (4243, 1000))
    assert readings[1].processes == ()


def test_live_gpus_unchanged_without_nvml() -> None:
    nvml = FakeNvml()
    cap = detect(nvml_lib=nvml)

    assert live_gpus(cap, FakeNvml(fail_on="nvmlInit")) == cap.gpus


def test_live_gpus_leaves_simulated_gpus_alone() -> None:
    nvml = FakeNvml()
    cap = detect(simulate="A100:80")

    assert live_gpus(cap, nvml) == cap.gpus
    assert nvml.calls == []


def test_capability_json_round_trips_through_json() -> None:
    cap = detect(nvml_lib=FakeNvml())

    data = json.loads(json.dumps(capability_json(cap)))

    assert data["gpus"][0]["name"] == "NVIDIA GeForce RTX 3090"
    assert data["gpus"][1]["compute_capability"] == "8.6"
    assert data["cuda_version"] == "12.4"
    assert data["gpus_simulated"] is False
    gpus = tuple(GpuInfo(**g) for g in data["gpus"])
    assert (
        Capability(
            **{
                **data,
                "gpus": gpus,
                "mounts": tuple(data["mounts"]),
                "pythons": tuple(data["pythons"]),
            }
        )
        == cap
    )


def test_tools_on_a_jobs_path_are_offered_with_their_versions(tmp_path: Path) -> None:
    from gpufleet.worker.capability import find_tools
    from tests.sleap_pkg import FAKE_SLEAP

    assert find_tools(path=str(FAKE_SLEAP)) == {"sleap-nn": "0.3.5"}
    assert find_tools(path=str(tmp_path)) == {}
    broken = tmp_path / "sleap-nn"
    broken.write_text("#!/bin/sh\necho 'no torch here' >&2\nexit 1\n")
    broken.chmod(0o755)
    notes: list[str] = []
    assert find_tools(path=str(tmp_path), notes=notes) == {}
    assert notes == [f"sleap-nn is on PATH ({broken}) but `sleap-nn --version` failed; not offered"]
