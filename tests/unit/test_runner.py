"""What a job's process is given: argv with hyperparameters, environment, exit wording."""

from __future__ import annotations

import sys
from pathlib import Path

from gpufleet.domain.models import GpuInfo, HyperStyle, hyper_flags
from gpufleet.worker.runner import build_argv, describe_exit, job_env, oom_kills
from gpufleet.worker.slots import Slots

HYPER = {"epochs": 3, "batch_size": 64, "use_amp": True, "no_cache": False, "layers": [1, 2]}


def test_dash_style_is_what_argparse_scripts_expect() -> None:
    assert hyper_flags(HYPER) == [
        "--epochs",
        "3",
        "--batch-size",
        "64",
        "--use-amp",
        "--layers",
        "[1, 2]",
    ]


def test_verbatim_style_passes_keys_and_values_as_written() -> None:
    assert hyper_flags(HYPER, HyperStyle.VERBATIM) == [
        "--epochs",
        "3",
        "--batch_size",
        "64",
        "--use_amp",
        "true",
        "--no_cache",
        "false",
        "--layers",
        "[1, 2]",
    ]


def test_argv_and_shell_commands() -> None:
    assert build_argv(["python", "t.py"], {"e": 1}, shell=False) == ["python", "t.py", "--e", "1"]
    shell = build_argv(["echo $HOME"], {"msg": "it's", "dry_run": True}, shell=True)
    assert shell[:2] == ["/bin/sh", "-c"]
    assert shell[2] == "echo $HOME --msg 'it'\"'\"'s' --dry-run"


def test_job_env_pins_gpus_and_puts_our_python_first() -> None:
    env = job_env(
        {"PATH": "/usr/bin", "KEEP": "1"}, {"SEED": "4"}, [2, 5], {"GPUFLEET_JOB_ID": "j"}
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert env["SEED"] == "4" and env["KEEP"] == "1" and env["GPUFLEET_JOB_ID"] == "j"
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    cpu = job_env({"CUDA_VISIBLE_DEVICES": "0"}, {}, [], {})
    assert cpu["CUDA_VISIBLE_DEVICES"] == "", "a CPU slot must not see the host's GPUs"


def test_exit_codes_in_words() -> None:
    assert describe_exit(0) is None
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by SIGKILL"


def test_an_oom_kill_and_a_shell_reported_signal_say_so() -> None:
    assert describe_exit(-9, oom=True) == (
        "killed by SIGKILL: out of memory (the kernel's OOM killer killed it)"
    )
    assert describe_exit(-15, oom=True) == "killed by SIGTERM"  # not the OOM killer's signal
    assert describe_exit(137) == ("exit code 137 (128+SIGKILL: a process it ran was killed)")
    assert describe_exit(137, oom=True).endswith("out of memory (the kernel's OOM killer ran)")
    assert describe_exit(300) == "exit code 300"


def test_oom_kills_reads_the_kernels_counter(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 12\noom_kill 7\npgfault 3\n")
    assert oom_kills(vmstat) == 7
    assert oom_kills(tmp_path / "missing") == 0  # not Linux, or an old kernel: unknown


def test_slots_hand_out_gpus_and_cpu_and_take_them_back() -> None:
    gpus = (GpuInfo(0, "A", 1024, 1024), GpuInfo(1, "B", 2048, 2048))
    slots = Slots(1, gpus)
    slots.take([1])
    slots.take([])
    assert [g.index for g in slots.free_gpus(())] == [0] and slots.cpu_free == 0
    slots.give([1])
    slots.give([])
    assert slots.any_free() and slots.cpu_free == 1 and slots.gpus_free == {0, 1}
    live = (GpuInfo(0, "A", 1024, 100),)
    assert slots.free_gpus(live)[0].free_mib == 100


def test_the_workers_secrets_are_not_passed_to_jobs() -> None:
    from gpufleet.worker.spawn import is_secret_env

    for name in ("GPUFLEET_TOKEN", "GPUFLEET_SHARE_TOKEN", "GPUFLEET_SESSION", "gpufleet_token"):
        assert is_secret_env(name), name
    for name in ("GPUFLEET_JOB_ID", "GPUFLEET_SERVER", "TOKENIZERS_PARALLELISM", "PATH"):
        assert not is_secret_env(name), name
