"""Make a tiny SLEAP training package, laid out as SLEAP's GUI exports one, from
synthetic frames: no third-party data needed.

Run it with a Python that has sleap-io (the environment sleap-nn is installed in has it):

    python examples/sleap/make_package.py OUT_DIR [--frames 12] [--epochs 3] [--steps 3]

OUT_DIR gets ``tiny.pkg.slp`` (the labels, frames embedded: 64x64 grayscale images of a
bright "head" and a dimmer "tail" on a dark background, one animal a frame, a 2-node
skeleton) and ``tiny.slp.training_job.zip`` with, at its root, the labels, one small
sleap-nn config (``single_instance.yaml``: a U-Net of 4 filters, a few thousand
parameters), ``train-script.sh``, ``inference-script.sh`` and ``jobs.yaml``. It prints the
package's path and the run name its script gives. Then:

    gpufleet sleap train OUT_DIR/tiny.slp.training_job.zip --cpu --wait
    gpufleet sleap track --data OUT_DIR/tiny.pkg.slp --model OUT_DIR/models/RUN --cpu --wait
"""

from __future__ import annotations

import argparse
import json
import tempfile
import zipfile
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import sleap_io as sio
import yaml

SIZE = 64
HEAD, TAIL = 255, 150  # brightness of the two body parts


def frames(n: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``n`` images and the (head, tail) points in each: the animal drifts and turns."""
    rng = np.random.default_rng(seed)
    images, points = [], []
    for i in range(n):
        head = np.array([16 + 32 * (i / max(1, n - 1)), 20 + rng.uniform(0, 24)])
        angle = rng.uniform(0, 2 * np.pi)
        tail = np.clip(head + 10 * np.array([np.cos(angle), np.sin(angle)]), 4, SIZE - 5)
        image = np.full((SIZE, SIZE, 1), 20, dtype=np.uint8)
        for (x, y), value in ((tail, TAIL), (head, HEAD)):
            xi, yi = int(x + 0.5), int(y + 0.5)
            image[yi - 2 : yi + 3, xi - 2 : xi + 3, 0] = value
        images.append(image)
        points.append(np.stack([head, tail]))
    return images, points


def labels_file(out: Path, n: int) -> Path:
    """The labels, frames embedded (what SLEAP's export names ``*.pkg.slp``)."""
    images, points = frames(n)
    skeleton = sio.Skeleton(nodes=["head", "tail"], edges=[("head", "tail")])
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, image in enumerate(images):
            paths.append(Path(tmp) / f"frame{i:03d}.png")
            iio.imwrite(paths[-1], image[:, :, 0])
        video = sio.Video.from_filename([str(p) for p in paths], grayscale=True)
        lfs = [
            sio.LabeledFrame(
                video=video, frame_idx=i, instances=[sio.Instance.from_numpy(p, skeleton)]
            )
            for i, p in enumerate(points)
        ]
        labels = sio.Labels(labeled_frames=lfs, videos=[video], skeletons=[skeleton])
        path = out / "tiny.pkg.slp"
        sio.save_slp(labels, str(path), embed="all")
    return path


def config(labels: str, epochs: int, steps: int) -> dict[str, object]:
    """A small sleap-nn config; sleap-nn fills in the rest with its defaults."""
    return {
        "data_config": {
            "train_labels_path": [labels],
            "val_labels_path": None,
            "validation_fraction": 0.25,
            "use_augmentations_train": False,
            "preprocessing": {"ensure_grayscale": True, "scale": 1.0},
        },
        "model_config": {
            "backbone_config": {
                "unet": {"in_channels": 1, "filters": 4, "filters_rate": 1.5, "max_stride": 8}
            },
            "head_configs": {
                "single_instance": {"confmaps": {"sigma": 2.5, "output_stride": 1}},
            },
        },
        "trainer_config": {
            "train_data_loader": {"batch_size": 2, "num_workers": 0},
            "val_data_loader": {"batch_size": 2, "num_workers": 0},
            "max_epochs": epochs,
            "train_steps_per_epoch": steps,
            "min_train_steps_per_epoch": 1,
            "trainer_accelerator": "auto",
            "enable_progress_bar": False,
            "save_ckpt": True,
            "use_wandb": False,
            # as in the configs SLEAP exports: the script's overrides set them
            "ckpt_dir": ".",
            "run_name": None,
        },
    }


def package(out: Path, labels: Path, epochs: int, steps: int) -> tuple[Path, str]:
    run = f"260101_000000.single_instance.n={len(sio.load_slp(str(labels)))}"
    script = (
        "#!/bin/bash\n"
        "sleap train --config-name single_instance.yaml --config-dir . "
        f"'trainer_config.ckpt_dir=\"models\"' 'trainer_config.run_name=\"{run}\"'\n"
    )
    inference = f"#!/bin/bash\nsleap track {labels.name} -m models/{run}\n"
    path = out / "tiny.slp.training_job.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(labels, labels.name)
        zf.writestr("single_instance.yaml", yaml.safe_dump(config(labels.name, epochs, steps)))
        zf.writestr("train-script.sh", script)
        zf.writestr("inference-script.sh", inference)
        zf.writestr("jobs.yaml", yaml.safe_dump({"jobs": ["single_instance.yaml"]}))
    return path, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--frames", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="training steps an epoch")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    labels = labels_file(args.out, args.frames)
    path, run = package(args.out, labels, args.epochs, args.steps)
    print(json.dumps({"package": str(path), "labels": str(labels), "run_name": run}))


if __name__ == "__main__":
    main()
