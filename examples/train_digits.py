"""A real, small training job: fit a scikit-learn model on the digits data set.

The data ships inside scikit-learn, so nothing is downloaded. gpufleet passes the job's
hyperparameters as ``--key value``; the last line is a JSON result the demo reads. The
fitted model and its metrics go to ``outputs/``, which gpufleet keeps as the job's artifact.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from pathlib import Path

from sklearn.datasets import load_digits
from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsClassifier
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC


def build(model: str, hp: dict[str, str], seed: int) -> object:
    if model == "logreg":
        return make_pipeline(
            StandardScaler(), LogisticRegression(C=float(hp.get("C", 1.0)), max_iter=2000)
        )
    if model == "knn":
        return KNeighborsClassifier(n_neighbors=int(hp.get("k", 5)))
    if model == "rf":
        return RandomForestClassifier(
            n_estimators=int(hp.get("n_estimators", 100)), random_state=seed
        )
    if model == "gbt":
        return GradientBoostingClassifier(
            n_estimators=int(hp.get("n_estimators", 50)), random_state=seed
        )
    if model == "svm":
        return SVC(gamma=float(hp.get("gamma", 0.001)), C=float(hp.get("C", 10.0)))
    if model == "mlp":
        hidden = int(hp.get("hidden", 64))
        return make_pipeline(
            StandardScaler(),
            MLPClassifier((hidden,), max_iter=int(hp.get("epochs", 200)), random_state=seed),
        )
    raise SystemExit(f"unknown model {model!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default="realistic")
    parser.add_argument("--seed", type=int, default=0)
    args, rest = parser.parse_known_args()
    hp = dict(zip((k.lstrip("-") for k in rest[::2]), rest[1::2], strict=False))
    print(
        f"training {args.model} ({args.mode}) with {hp or 'defaults'}; "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}",
        flush=True,
    )
    x, y = load_digits(return_X_y=True)
    test_size = 0.5 if args.mode == "quick" else 0.25
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=test_size, random_state=args.seed, stratify=y
    )
    started = time.perf_counter()
    clf = build(args.model, hp, args.seed)
    clf.fit(xtr, ytr)  # type: ignore[attr-defined]
    accuracy = float(clf.score(xte, yte))  # type: ignore[attr-defined]
    result = {
        "accuracy": round(accuracy, 4),
        "fit_seconds": round(time.perf_counter() - started, 2),
    }
    outputs = Path("outputs")
    outputs.mkdir(exist_ok=True)
    (outputs / "model.pkl").write_bytes(pickle.dumps(clf))
    (outputs / "metrics.json").write_text(json.dumps({"model": args.model, **result}))
    print(json.dumps({"result": result}))


if __name__ == "__main__":
    main()
