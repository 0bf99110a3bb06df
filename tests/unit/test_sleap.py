"""SLEAP packages' scripts and configs, and sleap-nn's progress, read by pure code."""

from __future__ import annotations

import pytest

from gpufleet.domain import sleap
from gpufleet.domain.sleap import TrainProgress, parse_train_script
from gpufleet.errors import PackageError

GUI_SCRIPT = """#!/bin/bash
sleap train --config-name centroid.yaml --config-dir . 'trainer_config.ckpt_dir="models"' \
'trainer_config.run_name="260825_115048.centroid.n=145"'
sleap train --config-name centered_instance.yaml --config-dir . \\
    'trainer_config.ckpt_dir="models"' \\
    'trainer_config.run_name="260825_115048.centered_instance.n=145"'
"""


def test_the_gui_script_gives_one_line_per_model_with_its_config_and_run() -> None:
    lines = parse_train_script(GUI_SCRIPT)
    assert [ln.config for ln in lines] == ["centroid.yaml", "centered_instance.yaml"]
    assert [ln.number for ln in lines] == [2, 3]  # a continued line keeps its first number
    assert [ln.value(sleap.RUN_NAME) for ln in lines] == [
        "260825_115048.centroid.n=145",
        "260825_115048.centered_instance.n=145",
    ]
    assert lines[0].value(sleap.CKPT_DIR) == "models"
    assert lines[0].args[:4] == ("--config-name", "centroid.yaml", "--config-dir", ".")


@pytest.mark.parametrize(
    ("line", "config"),
    [
        ("sleap-nn train --config-name bottomup.yaml --config-dir cfg", "cfg/bottomup.yaml"),
        ("sleap-train bottomup.json labels.pkg.slp", "bottomup.json"),
        ("sleap train --config ./models/../bottomup.yaml", "bottomup.yaml"),
        ("sleap-nn train -c bottomup.yaml -d . trainer_config.max_epochs=3", "bottomup.yaml"),
        ("sleap train --config-name=bottomup.yaml --config-dir=sub/", "sub/bottomup.yaml"),
        # an option's value, or an override's, is never read as the config
        ("sleap train --video-paths v.yaml --config-name b.yaml", "b.yaml"),
        ("sleap train --config-name b.yaml data_config.x=x.json", "b.yaml"),
        ("CUDA_VISIBLE_DEVICES=0 sleap train -c b.yaml", "b.yaml"),
        ("  sleap train --config-name b.yaml  # the bottom-up model", "b.yaml"),
    ],
)
def test_every_accepted_form_of_a_train_line_names_its_config(line: str, config: str) -> None:
    (parsed,) = parse_train_script(f"set -e\n{line}\n")
    assert parsed.config == config


@pytest.mark.parametrize(
    ("script", "said"),
    [
        ("#!/bin/bash\necho hello\n", "train-script.sh: no train line"),
        ("", "train-script.sh: no train line"),
        ("sleap train 'trainer_config.max_epochs=3'\n", "line 1: names no config"),
        ("\nsleap train --config-name 'b.yaml\n", "line 2: cannot be read"),
        ("sleap train --config-name\n", "line 1: --config-name has no value"),
        ("sleap train --config /etc/b.yaml\n", "line 1: /etc/b.yaml is not inside the package"),
        ("sleap train --config-name b.yaml --config-dir ..\n", "is not inside the package"),
        ("sleap train -c b.yaml && echo done\n", "line 1: && makes it more than one command"),
        ("sleap train -c b.yaml > log.txt\n", "line 1: > makes it more than one command"),
        ("python -m sleap_nn.cli train -c b.yaml\n", "line 1: a train command gpufleet does not"),
    ],
)
def test_a_script_gpufleet_cannot_run_is_refused_naming_the_line(script: str, said: str) -> None:
    with pytest.raises(PackageError, match=said):
        parse_train_script(script)


def test_overrides_are_read_unquoted_and_replaced_once() -> None:
    args = ["-c", "b.yaml", "trainer_config.max_epochs=100", '+trainer_config.run_name="a b"']
    assert sleap.override_value(args, sleap.RUN_NAME) == "a b"
    assert sleap.override_value(args, sleap.MAX_EPOCHS) == "100"
    assert sleap.override_value(["x='it\\'s'"], "x") == "it's"
    changed = sleap.with_override(args, sleap.MAX_EPOCHS, "5")
    assert changed == [
        "-c",
        "b.yaml",
        '+trainer_config.run_name="a b"',
        "++trainer_config.max_epochs=5",
    ]
    assert sleap.hydra_quoted('run "1" \\ n=2') == '"run \\"1\\" \\\\ n=2"'


def config(head: str = "centroid", **data: object) -> dict[str, object]:
    heads = {k: None for k in sleap.MODEL_TYPES} | {head: {"confmaps": {"sigma": 2.5}}}
    return {
        "data_config": {"train_labels_path": ["labels.pkg.slp"], "val_labels_path": None, **data},
        "model_config": {"head_configs": heads},
        "trainer_config": {"max_epochs": 50, "ckpt_dir": None, "run_name": "None"},
    }


def test_a_config_says_its_model_type_epochs_and_labels() -> None:
    facts = sleap.config_facts(config("centered_instance"), "c.yaml")
    assert facts.model_type == "centered_instance"
    assert facts.max_epochs == 50
    assert facts.train_labels == ("labels.pkg.slp",)
    assert facts.val_labels == ()
    assert facts.ckpt_dir is None and facts.run_name is None
    one = sleap.config_facts(config(train_labels_path="a.slp", val_labels_path=["v.slp"]), "c")
    assert one.train_labels == ("a.slp",) and one.val_labels == ("v.slp",)
    assert sleap.model_type_of("x/bottomup.yaml") == "bottomup"
    assert sleap.model_type_of("mine.yaml", facts) == "centered_instance"
    assert sleap.model_type_of("mine.yaml") == "model"


@pytest.mark.parametrize("cfg", [[1, 2], {"model_config": {}}, {"data_config": {}}, "text"])
def test_a_file_that_is_not_a_sleap_nn_config_is_refused(cfg: object) -> None:
    with pytest.raises(PackageError, match=r"c\.yaml: not a sleap-nn config"):
        sleap.config_facts(cfg, "c.yaml")


def test_training_messages_become_records_with_batches_sampled() -> None:
    p = TrainProgress(epochs=3, every=1.0)
    assert p.record({"event": "train_begin", "wandb_url": None}, 0.0) == {
        "message": "training started",
        "epochs": 3,
    }
    assert p.record({"event": "epoch_begin", "epoch": 0}, 0.1) is None
    first = p.record({"event": "batch_end", "epoch": 0, "batch": 0, "logs": {}}, 0.2)
    assert first == {"epoch": 0, "epochs": 3, "step": 1, "message": "epoch 1/3, batch 1"}
    assert p.record({"event": "batch_end", "epoch": 0, "batch": 1}, 0.9) is None  # < 1 s
    assert p.record({"event": "batch_end", "epoch": 0, "batch": 7}, 1.3) is not None
    logs = {"loss": 0.5, "val/loss": 0.75, "train/lr": 1e-4, "epoch": 0.0, "note": "x"}
    assert p.record({"event": "epoch_end", "epoch": 0, "logs": logs}, 1.4) == {
        "epoch": 1,
        "epochs": 3,
        "loss": 0.5,
        "val_loss": 0.75,
        "train/lr": 1e-4,
    }
    nan = p.record({"event": "epoch_end", "epoch": 1, "logs": {"loss": float("nan")}}, 2.0)
    assert nan == {"epoch": 2, "epochs": 3, "loss": None}
    assert p.record({"event": "train_end"}, 3.0) == {"message": "training ended", "epoch": 2}
    assert p.record({"event": "what is this"}, 4.0) is None
    assert sleap.message(b'{"event": "train_end"}') == {"event": "train_end"}
    assert sleap.message("[1]") is None and sleap.message("{") is None


def test_unknown_epochs_still_count_and_plot() -> None:
    p = TrainProgress(epochs=None)
    record = p.record({"event": "epoch_end", "logs": {"train/loss": 2.0}}, 0.0)
    assert record == {"epoch": 1, "loss": 2.0}


def test_track_progress_lines_become_records_and_other_lines_do_not() -> None:
    line = '{"n_processed": 25, "n_total": 100, "rate": 12.5, "eta": 6.0}'
    assert sleap.track_record(line) == {
        "step": 25,
        "steps": 100,
        "progress": 0.25,
        "eta_s": 6.0,
        "frames_per_s": 12.5,
    }
    assert sleap.track_record('{"n_processed": 3, "n_total": null, "rate": 1.0, "eta": 0}') == {
        "step": 3,
        "eta_s": 0.0,
        "frames_per_s": 1.0,
    }
    assert (
        sleap.track_record('{"error": true, "type": "OSError", "message": "n_processed"}') is None
    )
    assert sleap.track_record("Predicting frames 25%") is None
    assert sleap.track_record('{"n_processed": -1}') is None


def test_a_line_keeps_the_environment_it_sets() -> None:
    (line,) = parse_train_script("OMP_NUM_THREADS=2 FOO='a b' sleap-nn train -c b.yaml\n")
    assert line.env == (("OMP_NUM_THREADS", "2"), ("FOO", "a b"))
    assert line.args == ("-c", "b.yaml")


def test_numbers_too_big_for_a_float_are_not_metrics_and_break_nothing() -> None:
    from gpufleet.domain import progress

    p = TrainProgress(epochs=2)
    huge = {"event": "epoch_end", "epoch": 0, "logs": {"loss": 10**400, "val/loss": 0.5}}
    assert p.record(huge, 0.0) == {"epoch": 1, "epochs": 2, "val_loss": 0.5}
    assert sleap.track_record('{"n_processed": 1, "n_total": 2, "rate": 1%s}' % ("0" * 400)) == {
        "step": 1,
        "steps": 2,
        "progress": 0.5,
    }
    assert progress.parse('{"loss": 1%s, "acc": 0.5}' % ("0" * 400)) == {"acc": 0.5}
    with pytest.raises(progress.BadProgress, match="'epoch' must be a whole number"):
        progress.parse('{"epoch": 1%s}' % ("0" * 400))
