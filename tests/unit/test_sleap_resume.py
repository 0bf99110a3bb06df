"""A SLEAP training resumed from its kept run folder: the command the worker gives
sleap-nn, and the run folder set aside before and made one again after."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpufleet.domain import sleap
from gpufleet.worker.jobs import adapter_for
from gpufleet.worker.sleap import EARLIER_BEST, EARLIER_LOG, TrainAdapter, run_folder

RUN = "models/260825.single_instance.n=12"
ARGV = [
    "sleap-nn",
    "train",
    "--config-name",
    "s.yaml",
    'trainer_config.ckpt_dir="models"',
    '++trainer_config.run_name="260825.single_instance.n=12"',
    "trainer_config.model_ckpt.save_last=false",
]
HEADER = "epoch,train/loss,val/loss\n"


def _argv(adapter: TrainAdapter) -> list[str]:
    async def opened() -> list[str]:
        await adapter.open()
        try:
            return adapter.argv(list(ARGV))
        finally:
            await adapter.close()

    return asyncio.run(opened())


def _adapter(tmp_path: Path, *, kept: str | None, resumed: bool) -> TrainAdapter:
    where = None if kept is None else tmp_path / kept
    adapter = adapter_for("sleap-train", ARGV, tmp_path, lambda r: None, where, resumed)
    assert isinstance(adapter, TrainAdapter)
    return adapter


def _restored(tmp_path: Path, log: str, last: bool = True) -> Path:
    run = tmp_path / RUN
    run.mkdir(parents=True)
    (run / "best.ckpt").write_bytes(b"best of epochs 0-1")
    (run / "training_log.csv").write_text(log)
    if last:
        (run / "last.ckpt").write_bytes(b"epoch 1")
    return run


def test_a_kept_run_folder_saves_its_last_checkpoint_each_epoch(tmp_path: Path) -> None:
    (tmp_path / RUN).mkdir(parents=True)
    argv = _argv(_adapter(tmp_path, kept=RUN, resumed=False))
    assert argv[-2:] == [
        "++trainer_config.save_ckpt=true",
        "++trainer_config.model_ckpt.save_last=true",
    ]
    assert "trainer_config.model_ckpt.save_last=false" not in argv
    assert not any(sleap.RESUME in a for a in argv)


def test_a_job_that_keeps_no_folder_is_run_as_before(tmp_path: Path) -> None:
    argv = _argv(_adapter(tmp_path, kept=None, resumed=False))
    assert argv[: len(ARGV)] == ARGV and len(argv) == len(ARGV) + 2  # its two ports


def test_a_resumed_attempt_goes_on_from_the_restored_last_checkpoint(tmp_path: Path) -> None:
    run = _restored(tmp_path, HEADER + "0,1.0,1.1\n1,0.8,0.9\n")
    adapter = _adapter(tmp_path, kept=RUN, resumed=True)

    async def resumed() -> list[str]:
        await adapter.open()
        # what sleap-nn would see: no best.ckpt (else it trains into RUN-1), no old log
        assert not (run / "best.ckpt").exists() and not (run / "training_log.csv").exists()
        (run / "training_log.csv").write_text(HEADER + "2,0.7,0.8\n3,0.6,0.7\n")
        (run / "last.ckpt").write_bytes(b"epoch 3")
        argv = adapter.argv(list(ARGV))
        await adapter.close()
        return argv

    argv = asyncio.run(resumed())
    last = run / "last.ckpt"
    assert argv[-1] == f'++trainer_config.resume_ckpt_path="{last}"'
    log = (run / "training_log.csv").read_text()
    assert log == HEADER + "0,1.0,1.1\n1,0.8,0.9\n2,0.7,0.8\n3,0.6,0.7\n"
    assert (run / "best.ckpt").read_bytes() == b"best of epochs 0-1"  # none better written
    assert sorted(p.name for p in run.iterdir()) == ["best.ckpt", "last.ckpt", "training_log.csv"]


def test_an_attempt_killed_while_resumed_is_joined_on_the_next(tmp_path: Path) -> None:
    """Killed while resumed, the folder the next attempt finds holds the earlier log and
    best model set aside, and the killed attempt's own: nothing of either is lost."""
    run = _restored(tmp_path, HEADER + "2,0.7,0.8\n")
    (run / EARLIER_LOG).write_text(HEADER + "0,1.0,1.1\n1,0.8,0.9\n2,0.75,0.85\n")
    (run / EARLIER_BEST).write_bytes(b"older best")
    adapter = _adapter(tmp_path, kept=RUN, resumed=True)

    async def resumed() -> None:
        await adapter.open()
        (run / "best.ckpt").write_bytes(b"best of epoch 3")
        (run / "training_log.csv").write_text(HEADER + "3,0.6,0.7\n")
        await adapter.close()

    asyncio.run(resumed())
    log = (run / "training_log.csv").read_text()
    assert log == HEADER + "0,1.0,1.1\n1,0.8,0.9\n2,0.7,0.8\n3,0.6,0.7\n"
    assert (run / "best.ckpt").read_bytes() == b"best of epoch 3"
    assert not (run / EARLIER_LOG).exists() and not (run / EARLIER_BEST).exists()


def test_a_restore_without_a_last_checkpoint_starts_over_in_the_same_folder(
    tmp_path: Path,
) -> None:
    run = _restored(tmp_path, HEADER + "0,1.0,1.1\n", last=False)
    adapter = _adapter(tmp_path, kept=RUN, resumed=True)

    async def started_over() -> list[str]:
        await adapter.open()
        assert not (run / "best.ckpt").exists()  # so not into RUN-1
        argv = adapter.argv(list(ARGV))
        (run / "training_log.csv").write_text(HEADER + "0,0.9,1.0\n")
        await adapter.close()
        return argv

    argv = asyncio.run(started_over())
    assert not any(sleap.RESUME in a for a in argv)
    assert (run / "training_log.csv").read_text() == HEADER + "0,0.9,1.0\n"  # not twice
    assert (run / "best.ckpt").read_bytes() == b"best of epochs 0-1"


def test_the_run_folder_is_the_commands_when_it_lies_in_the_kept_folder(tmp_path: Path) -> None:
    assert run_folder(ARGV, tmp_path, tmp_path / RUN) == tmp_path / RUN
    assert run_folder(ARGV, tmp_path, tmp_path / "models") == tmp_path / RUN
    assert run_folder(ARGV, tmp_path, tmp_path / "elsewhere") is None
    assert run_folder(["sleap-nn", "train", "-c", "s.yaml"], tmp_path, tmp_path) is None


def test_logs_join_at_the_resumed_epoch() -> None:
    earlier = HEADER + "0,1,1\n1,2,2\n2,3,3\n"
    assert sleap.merged_log(earlier, HEADER + "2,9,9\n") == HEADER + "0,1,1\n1,2,2\n2,9,9\n"
    assert sleap.merged_log(earlier, "") == earlier  # killed before its first epoch
    assert sleap.merged_log(earlier, HEADER) == earlier
    wider = "epoch,train/loss,val/loss,lr\n2,9,9,0.1\n"
    assert (
        sleap.merged_log(earlier, wider)
        == "epoch,train/loss,val/loss,lr\n0,1,1,\n1,2,2,\n2,9,9,0.1\n"
    )


def test_batches_of_a_resumed_run_say_the_epoch_under_way() -> None:
    progress = sleap.TrainProgress(epochs=6)
    record = progress.record({"event": "batch_end", "epoch": 3, "batch": 0}, now=0.0)
    assert record == {"epoch": 3, "epochs": 6, "step": 1, "message": "epoch 4/6, batch 1"}
