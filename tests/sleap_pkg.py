"""SLEAP training packages for the tests, laid out as SLEAP 1.6's GUI exports them (files
at the zip's root) or as older tools did (in one folder). The fast tests' configs are
small sleap-nn configs that the fake ``sleap-nn`` (tests/fake_sleap) reads; the real-run
test writes full ones of its own."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import yaml

FAKE_SLEAP = Path(__file__).parent / "fake_sleap"
HEADS = (
    "single_instance",
    "centroid",
    "centered_instance",
    "bottomup",
    "multi_class_bottomup",
    "multi_class_topdown",
)


def config(head: str, epochs: int = 3, labels: str = "labels.pkg.slp") -> dict[str, Any]:
    return {
        "data_config": {"train_labels_path": [labels], "val_labels_path": None},
        "model_config": {
            "backbone_config": {"unet": {"filters": 4}},
            "head_configs": {
                h: ({"confmaps": {"sigma": 2.5}} if h == head else None) for h in HEADS
            },
        },
        "trainer_config": {"max_epochs": epochs, "ckpt_dir": None, "run_name": None},
    }


def script_line(head: str, stamp: str = "260825_115048") -> str:
    return (
        f"sleap train --config-name {head}.yaml --config-dir . "
        "'trainer_config.ckpt_dir=\"models\"' "
        f"'trainer_config.run_name=\"{stamp}.{head}.n=4\"'"
    )


def make_package(
    path: Path,
    heads: tuple[str, ...] = ("centroid", "centered_instance"),
    *,
    folder: str = "",
    epochs: int = 3,
    stamp: str = "260825_115048",
    files: dict[str, bytes] | None = None,
    skip: tuple[str, ...] = (),
) -> Path:
    """A package at ``path``: labels, one config per head, train-script.sh,
    inference-script.sh and jobs.yaml (inside ``folder`` when given). ``files`` adds or
    replaces entries; ``skip`` leaves entries out."""
    entries: dict[str, bytes] = {
        "labels.pkg.slp": b"not really HDF5: the fake sleap-nn never opens it",
        "train-script.sh": ("\n".join(script_line(h, stamp) for h in heads) + "\n").encode(),
        "inference-script.sh": b"sleap track labels.pkg.slp -m models/x\n",
        "jobs.yaml": yaml.safe_dump({"jobs": [f"{h}.yaml" for h in heads]}).encode(),
    }
    for head in heads:
        entries[f"{head}.yaml"] = yaml.safe_dump(config(head, epochs)).encode()
    entries.update(files or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            if name not in skip:
                zf.writestr(f"{folder}/{name}" if folder else name, data)
    return path


def run_name(head: str, stamp: str = "260825_115048") -> str:
    return f"{stamp}.{head}.n=4"
