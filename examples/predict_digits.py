"""A real inference job: load a model another job trained and predict the held-out digits.

gpufleet unpacks the training job's artifact into ``--model-dir`` (a ``job:NAME`` input),
so this job never sees the training machine. Predictions go to ``outputs/``.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True, help="where the trained model landed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_file = Path(args.model_dir) / "outputs" / "model.pkl"
    clf = pickle.loads(model_file.read_bytes())
    x, y = load_digits(return_X_y=True)
    _, xte, _, yte = train_test_split(x, y, test_size=0.25, random_state=args.seed, stratify=y)
    predicted = clf.predict(xte)
    outputs = Path("outputs")
    outputs.mkdir(exist_ok=True)
    rows = ["index,label,predicted"] + [
        f"{i},{t},{p}" for i, (t, p) in enumerate(zip(yte, predicted, strict=True))
    ]
    (outputs / "predictions.csv").write_text("\n".join(rows) + "\n")
    accuracy = float((predicted == yte).mean())
    print(f"predicted {len(yte)} digits with {model_file}")
    print(json.dumps({"result": {"accuracy": round(accuracy, 4), "fit_seconds": 0}}))


if __name__ == "__main__":
    main()
