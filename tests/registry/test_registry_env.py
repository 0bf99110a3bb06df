"""A real build from the registry: a job pins a scikit-learn other than the worker's own,
its worker's uv resolves and installs it from PyPI, and the demo's training script
(examples/train_digits.py, sent as a package) runs in that environment."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

from tests.e2e.conftest import Fleet
from tests.registry.conftest import BUILD_TIMEOUT, UV_CACHE

#: A scikit-learn with wheels for CPython 3.11, other than the worker's own (1.9.1).
SKLEARN = "1.8.0"
TRAIN = Path(__file__).parents[2] / "examples" / "train_digits.py"
#: The job says which scikit-learn it imported, then trains as the demo does.
COMMAND = (
    "python -c 'import sklearn; print(\"SKLEARN\", sklearn.__version__)' && "
    "python train_digits.py --model logreg --mode quick"
)


def test_a_job_trains_with_the_scikit_learn_it_pinned_built_from_the_registry(
    fleet: Fleet, tmp_path: Path
) -> None:
    ours = version("scikit-learn")
    assert ours != SKLEARN  # else the test would prove nothing
    fleet.env["UV_CACHE_DIR"] = str(UV_CACHE)  # kept between runs: only the first downloads
    fleet.start_server(lease_timeout=30.0)
    fleet.start_worker("lab", "--env-cache-dir", str(tmp_path / "envs"))  # no wheel folder: PyPI

    out = fleet.cli(
        "submit",
        "--with",
        f"scikit-learn=={SKLEARN}",
        "--package",
        str(TRAIN),
        "--max-attempts",
        "1",
        "--shell",
        "--",
        COMMAND,
    )
    job = out.stdout.strip().splitlines()[-1]
    detail = fleet.wait_status(job, "succeeded", "failed", timeout=BUILD_TIMEOUT)
    logs = fleet.cli("logs", job).stdout
    assert detail["status"] == "succeeded", logs

    used = detail["history"][-1]["environment"]
    assert used["built"] is True
    assert used["versions"]["scikit-learn"] == SKLEARN
    assert f"SKLEARN {SKLEARN}" in logs.splitlines()  # what the job itself imported
    result = json.loads(logs.strip().splitlines()[-1])["result"]
    assert result["accuracy"] > 0.9  # the digits, learnt
    shown = fleet.cli("show", job).stdout
    assert f"scikit-learn=={SKLEARN}" in shown  # the versions the attempt ran with
