"""A real, small training job: fit a scikit-learn model on the digits data set.

The data ships inside scikit-learn, so nothing is downloaded. gpufleet passes the job's
hyperparameters as flags the way argparse scripts expect them (``hyper.n_estimators = 200``
arrives as ``--n-estimators 200``); the last line is a JSON result the demo reads. The
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


def build(model: str, hp: argparse.Namespace, seed: int) -> object:
    if model == "logreg":
        return make_pipeline(StandardScaler(), LogisticRegression(C=hp.C or 1.0, max_iter=2000))
    if model == "knn":
        return KNeighborsClassifier(n_neighbors=hp.k)
    if model == "rf":
        return RandomForestClassifier(n_estimators=hp.n_estimators or 100, random_state=seed)
    if model == "gbt":
        return GradientBoostingClassifier(n_estimators=hp.n_estimators or 50, random_state=seed)
    if model == "svm":
        return SVC(gamma=hp.gamma, C=hp.C or 10.0)
    if model == "mlp":
        return make_pipeline(
            StandardScaler(),
            MLPClassifier((hp.hidden,), max_iter=hp.epochs, random_state=seed),
        )
    raise SystemExit(f"unknown model {model!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default="realistic")
    parser.add_argument("--seed", type=int, default=0)
    # Hyperparameters: each model reads the ones it has.
    parser.add_argument("--C", type=float, default=None)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--n-estimators", type=int, default=None)
    parser.add_argument("--gamma", type=float, default=0.001)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=200)
    args = parser.parse_args()
    hp = {k: v for k, v in vars(args).items() if k not in ("model", "mode", "seed")}
    print(
        f"training {args.model} ({args.mode}) with {hp}; "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}",
        flush=True,
    )
    x, y = load_digits(return_X_y=True)
    test_size = 0.5 if args.mode == "quick" else 0.25
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=test_size, random_state=args.seed, stratify=y
    )
    started = time.perf_counter()
    clf = build(args.model, args, args.seed)
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
